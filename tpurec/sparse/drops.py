"""Entries dropped by ``overflow="drop"``: per module and process-wide in ``tpurec.stats()``.

A collection built with ``overflow="drop"`` leaves out the entries of a batch
that do not fit its fixed capacities. Each collection counts them per feature
(``dropped_entries()``); the process-wide sum since the last
``tpurec.reset_stats()`` is ``tpurec.stats()["dropped_entries"]``. The core's
counters know nothing of sparse: this module registers the entry with
``tpurec.core.register_stats_source`` at import.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Mapping

from tpurec.core import register_stats_source

__all__ = ["DropCounter", "totals"]

_lock = threading.Lock()
_totals: collections.Counter[str] = collections.Counter()


class DropCounter:
    """One collection's dropped entries per feature (the step's thread adds, anyone reads)."""

    def __init__(self) -> None:
        self._by_feature: collections.Counter[str] = collections.Counter()

    def add(self, by_feature: Mapping[str, int]) -> None:
        """Counts one batch's dropped entries, here and in ``tpurec.stats()``."""
        kept = {f: int(n) for f, n in by_feature.items() if n}
        if not kept:
            return
        with _lock:
            self._by_feature.update(kept)
            _totals.update(kept)

    def by_feature(self) -> dict[str, int]:
        """Feature -> entries dropped since the module was built."""
        with _lock:
            return dict(self._by_feature)

    def total(self) -> int:
        """All entries dropped since the module was built."""
        with _lock:
            return sum(self._by_feature.values())


def totals() -> dict[str, int]:
    """Feature -> entries every collection of this process dropped since the last ``tpurec.reset_stats()``."""
    with _lock:
        return dict(_totals)


def _reset() -> None:
    with _lock:
        _totals.clear()


register_stats_source("dropped_entries", totals, _reset)
