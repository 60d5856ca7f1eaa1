"""Free TCP ports for the tests that start several processes (torchrun's store, JAX's coordinator)."""

from __future__ import annotations

import socket


def free_port_pair() -> int:
    """A port p with p and p + 1 free on 127.0.0.1 (torchrun's store listens on p, JAX's coordinator on p + 1).

    Raises:
        RuntimeError: no two consecutive free ports were found in 50 tries.
    """
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")
