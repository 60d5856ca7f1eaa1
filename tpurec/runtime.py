"""Counters and the in-memory cache of compiled programs, shared by all modes."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable

import jax

__all__ = ["Stats", "stats", "reset_stats", "ProgramCache", "programs", "synchronize"]


@dataclasses.dataclass
class Stats:
    """What the runtime did since the last :func:`reset_stats`.

    Attributes:
        compilations: programs traced and compiled.
        cache_hits: calls served by an already compiled program.
        executions: compiled programs run.
        compile_seconds: time spent tracing and compiling.
        ops_by_name: ATen ops dispatched to the tpu device, by overload name.
    """

    compilations: int = 0
    cache_hits: int = 0
    executions: int = 0
    compile_seconds: float = 0.0
    ops_by_name: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["ops_by_name"] = dict(self.ops_by_name)
        return d


_stats = Stats()


def stats() -> dict[str, Any]:
    """A snapshot of the runtime counters (compilations, cache_hits, executions, ...).

    Example::

        tpurec.reset_stats()
        train_step()
        assert tpurec.stats()["compilations"] == 0
    """
    return _stats.as_dict()


def reset_stats() -> None:
    """Sets every counter of :func:`stats` back to zero."""
    global _stats
    _stats = Stats()


def counters() -> Stats:
    return _stats


class ProgramCache:
    """Compiled programs keyed by structure: op, shapes, dtypes, static arguments."""

    def __init__(self) -> None:
        self._programs: dict[Any, Any] = {}

    def get(self, key, build: Callable[[], Any]):
        entry = self._programs.get(key)
        if entry is None:
            entry = self._programs[key] = build()
        else:
            _stats.cache_hits += 1
        return entry

    def __len__(self) -> int:
        return len(self._programs)

    def clear(self) -> None:
        self._programs.clear()


programs = ProgramCache()


def synchronize() -> None:
    """Waits for every computation queued on the tpu devices."""
    for device in jax.devices():
        jax.device_put(0, device).block_until_ready()
    jax.effects_barrier()
