"""Execution modes of the tpu device: eager, fused (DeferAndFuse) and debug.

* ``eager``: each op runs at once as its own cached compiled program.
* ``fused``: ops are recorded with known shapes and dtypes; at a sync point
  (``.cpu()``, ``.item()``, printing, ``torch.tpu.synchronize()``, a size
  limit) the recorded graph runs as one cached XLA program.
* ``debug``: synchronous; each op's result is checked against PyTorch's meta
  shape and dtype, and with ``TPUREC_CHECK_NAN=1`` against NaN/Inf.

Example::

    tpurec.set_mode("fused")
    with tpurec.mode("debug"):
        loss = model(x).sum()
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from tpurec import config
from tpurec.core import fused

__all__ = ["MODES", "set_mode", "get_mode", "mode"]

MODES = ("eager", "fused", "debug")


def _initial() -> str:
    return config.get("TPUREC_MODE")


_current = _initial()


def get_mode() -> str:
    """The current execution mode."""
    return _current


def set_mode(name: str) -> None:
    """Switches the execution mode (pending fused work runs first).

    Args:
        name: ``"eager"``, ``"fused"`` or ``"debug"``.
    """
    global _current
    if name not in MODES:
        raise ValueError(f"{name!r} is not a tpurec mode; use one of {', '.join(MODES)}")
    if name != _current:
        fused.flush("mode switch")
    _current = name


@contextlib.contextmanager
def mode(name: str) -> Iterator[None]:
    """Runs the block in execution mode ``name``, then restores the previous one."""
    previous = get_mode()
    set_mode(name)
    try:
        yield
    finally:
        set_mode(previous)


HOST_FALLBACK_POLICIES = ("warn", "error")


def host_fallback_policy() -> str:
    """What an op that fails on the device during backward does (``TPUREC_HOST_FALLBACK``).

    ``warn`` (default): it runs on the host with a RuntimeWarning. ``error``: it
    still runs on the host (an exception cannot cross the autograd engine
    without aborting the process), and the next tpu op outside the engine
    raises a RuntimeError naming it.
    """
    return config.get("TPUREC_HOST_FALLBACK")


def check_nan() -> bool:
    """Whether debug mode checks results for NaN/Inf (``TPUREC_CHECK_NAN``)."""
    return config.get("TPUREC_CHECK_NAN")
