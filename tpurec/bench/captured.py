"""The benchmarks' captured configurations: a training step run plainly, captured, then replayed."""

from __future__ import annotations

from typing import Callable

import torch

import tpurec

WARMUP = 2
"""Plain steps before the capture: the first makes the optimizer's state, the second is steady."""


def captured_step(train: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``train`` (one step over static inputs, returning its loss) as a step that runs plainly for
    :data:`WARMUP` calls, is captured by :func:`tpurec.graph` on the next and replayed from then on.

    Every call returns the step's loss tensor (from the capture on, the captured one, which each
    replay refills). The caller reads it after each plain step (a sync point ends the step's
    window) and runs the calls in fused mode.

    Example::

        step = captured_step(train)
        for _ in range(steps):
            loss = step().item()
    """
    graph = tpurec.TpuGraph()
    calls = [0]
    captured: list[torch.Tensor] = []

    def step() -> torch.Tensor:
        if captured:
            graph.replay()
            return captured[0]
        calls[0] += 1
        if calls[0] <= WARMUP:
            return train()
        with tpurec.graph(graph):
            captured.append(train())
        return captured[0]

    return step
