"""Free TCP ports for the tests that start several processes (torchrun's store, JAX's coordinator).

The ports are picked outside the kernel's ephemeral range. A port inside it (what binding port 0 gives) can be
taken between the check and the launch by any outgoing connection of another process: gloo's pairs, torchrun's
store clients, a second test run on the machine. A port outside it is taken only by a program that binds it by
number, so a pair found free here stays free for the launch.

Under pytest-xdist each worker picks from its own slice of that range, so two workers never pick the
same pair between their check and their launch.
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

LOWEST = 10_000  # below this, well-known and registered services are more likely to listen
# Not the global random state: a test that seeds it would make every run on the machine pick the same ports.
_pick = random.SystemRandom().choice


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ephemeral ports (Linux default 32768-60999)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _all_candidates() -> range:
    """The ports below the ephemeral range (or above it where the range starts too low), as pair starts."""
    low, high = ephemeral_range()
    if low - LOWEST > 1000:
        return range(LOWEST, low - 1)
    return range(high + 1, 65535 - 1)


def _xdist_worker() -> tuple[int, int]:
    """This process's pytest-xdist worker index and the number of workers ((0, 1) outside xdist)."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not name.startswith("gw") or count < 2:
        return 0, 1
    return int(name[2:]) % count, count


def candidate_ports() -> range:
    """The pair starts this process may pick: outside the ephemeral range, this xdist worker's slice of it."""
    ports = _all_candidates()
    index, count = _xdist_worker()
    size = len(ports) // count
    # A worker's last pair start leaves its second port inside the slice.
    return range(ports.start + index * size, ports.start + (index + 1) * size - 1)


def _free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_pair() -> int:
    """A port p with p and p + 1 free on 127.0.0.1 (torchrun's store listens on p, JAX's coordinator on p + 1).

    Both lie outside the ephemeral range, so no other process's outgoing connection can take them before the
    launch binds them.

    Raises:
        RuntimeError: no two consecutive free ports were found in 200 tries.
    """
    ports = candidate_ports()
    for _ in range(200):
        port = _pick(ports)
        if _free(port) and _free(port + 1):
            return port
    raise RuntimeError(f"no two consecutive free ports in {ports.start}..{ports.stop}")
