"""Interleaved timing: configurations take turns, so a change in the machine's load hits all alike."""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

__all__ = ["run_in_rounds"]

Config = TypeVar("Config")


def run_in_rounds(
    configs: Sequence[Config], run: Callable[[Config, int, bool], None], steps: int, round_steps: int
) -> None:
    """Calls ``run(config, count, True)``: rounds of ``round_steps`` steps of every config in turn, ``steps`` in all.

    Example::

        run_in_rounds([a, b], lambda c, count, record: c.run(count, record), steps=20, round_steps=5)
    """
    done = 0
    while done < steps:
        count = min(round_steps, steps - done)
        for config in configs:
            run(config, count, True)
        done += count
