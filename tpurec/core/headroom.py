"""Memory-mapping headroom: a long process drops its compiled programs before the kernel refuses it more mappings."""

from __future__ import annotations

import gc
import logging
from typing import Callable

import jax
from jax._src import core as jax_core

from tpurec import config

__all__ = ["drop_programs_with", "keep_mapping_headroom", "mapping_budget", "mapping_count", "release_programs"]

log = logging.getLogger("tpurec.runtime")

# --- memory mappings: a long process must not run out of them ---------------------------
# XLA:CPU maps each loaded executable's code and data (3 mappings per program, measured), and
# tpurec keeps every program it builds. Linux refuses new mappings past vm.max_map_count
# (65,530 by default); XLA then fails inside LLVM and the process dies (SIGSEGV while the C++
# exception unwinds), so a long eager process or test session over thousands of shapes must
# drop programs before that. Dropping only costs compiling them again.

_droppers: list[Callable[[], int]] = []
_CHECK_EVERY = 256  # programs built between two readings of /proc/self/maps
_programs_built = 0  # by tpurec in this process, never reset: the check's clock
_checked_at = 0


def drop_programs_with(drop: Callable[[], int]) -> None:
    """Registers another cache of compiled programs that :func:`release_programs` empties.

    Args:
        drop: empties the cache; returns how many programs it held.
    """
    _droppers.append(drop)


def release_programs() -> int:
    """Drops every compiled program tpurec and JAX keep; each is built again when next used.

    Tensors, modules and optimizer state are untouched. Programs that Dynamo keeps for
    ``torch.compile`` graphs are Dynamo's (``torch._dynamo.reset()`` drops them).

    Returns:
        How many tpurec programs were dropped.
    """
    dropped = sum(drop() for drop in _droppers)
    jax.clear_caches()
    gc.collect()
    return dropped


def mapping_count() -> int | None:
    """How many memory mappings this process holds (None where ``/proc`` does not say)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: maps.read(1 << 20), b""))
    except OSError:
        return None


def mapping_budget() -> int | None:
    """``TPUREC_MAPPING_BUDGET``, or 3/4 of the kernel's ``vm.max_map_count`` (None if unknown)."""
    budget = config.get("TPUREC_MAPPING_BUDGET")
    if budget is not None:
        return budget
    try:
        with open("/proc/sys/vm/max_map_count") as limit:
            return int(limit.read()) * 3 // 4
    except (OSError, ValueError):
        return None


def keep_mapping_headroom() -> None:
    """Drops the compiled programs when the process holds more mappings than its budget.

    Called where tpurec builds a program (an op's or a fused window's). It reads
    ``/proc/self/maps`` once per 256 programs built, outside any trace, so a warm loop
    never pays for it.
    """
    global _programs_built, _checked_at
    _programs_built += 1
    if _programs_built - _checked_at < _CHECK_EVERY or not jax_core.trace_state_clean():
        return
    _checked_at = _programs_built
    budget = mapping_budget()
    held = mapping_count()
    if budget is None or held is None or held <= budget:
        return
    dropped = release_programs()
    log.warning(
        "tpurec: this process held %d memory mappings, over its budget of %d (TPUREC_MAPPING_BUDGET; the "
        "kernel refuses more than vm.max_map_count); dropped %d compiled programs, now %s mappings. "
        "They compile again when used.",
        held,
        budget,
        dropped,
        mapping_count(),
    )
