"""Sync points: the deferred work a layer above keeps, and :func:`synchronize`.

``tpurec.core.fused`` imports this module, so it reaches the fused window through a slot
that ``fused`` fills at import (:func:`flush_pending_work_with`).
"""

from __future__ import annotations

from typing import Callable

import jax

from tpurec.core import profiler as _profiler

__all__ = ["flush_pending_work", "flush_pending_work_with", "synchronize"]


def _no_pending_work(reason: str) -> None:
    return None


_flush_pending_work: Callable[[str], object] = _no_pending_work


def flush_pending_work_with(flush: Callable[[str], object]) -> None:
    """Sets what :func:`synchronize` runs before it waits (``tpurec.core.fused.flush``).

    Args:
        flush: called with the sync reason; runs deferred work.
    """
    global _flush_pending_work
    _flush_pending_work = flush


def flush_pending_work(reason: str) -> object:
    """Runs the deferred work (the fused mode's window), counted under ``reason``."""
    return _flush_pending_work(reason)


def synchronize() -> None:
    """Runs pending fused work and waits for every computation on the tpu devices."""
    with _profiler.record("tpurec::sync (synchronize)"):  # tpurec.profiler hook
        _flush_pending_work("synchronize")
        for device in jax.local_devices():
            jax.device_put(0, device).block_until_ready()
        jax.effects_barrier()
