"""Losses read behind the device: a handle taken when a step is issued, its values read a call later.

A training loop that reads each step's loss (``loss.item()``) right after issuing the step waits
for the device at every step, and the device then waits for the host to issue the next one. The
benchmarks instead take a :func:`handle` on the loss when a call is issued and read it with
:func:`values` after issuing the next call: the host runs at most one call ahead.

Example::

    unread = None
    for batch in batches:
        current = handle(step(batch))
        if unread is not None:
            print(values(unread))
        unread = current
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

import numpy as np
import torch

from tpurec.core import TpuTensor

__all__ = ["OneCallBehind", "handle", "values"]


def handle(loss: object) -> object:
    """What :func:`values` reads later: a tpu loss's values as they are now, a CPU loss, or an array.

    A replay of a captured step refills its loss tensor, so the values are taken now (no copy,
    no wait: the array the tensor holds). In fused mode this ends the step's window, as
    ``loss.item()`` would, without waiting for its result. A ``jax.Array`` (never changed in
    place) or a number is kept as it is.
    """
    if isinstance(loss, TpuTensor):
        return loss.to_jax()
    return loss.detach() if isinstance(loss, torch.Tensor) else loss


def values(taken: object) -> list[float]:
    """The losses behind ``taken`` (one per step), waiting for the device if needed."""
    return np.asarray(taken, dtype=np.float64).reshape(-1).tolist()


Batches = TypeVar("Batches")


class OneCallBehind(Generic[Batches]):
    """A step function returning its loss, as a loop that reads each loss once the next step is issued.

    Args:
        step: one training step on the next batch of its argument; returns the step's loss (a
            tensor, an array or a number).

    Example::

        loop = OneCallBehind(step)
        for _ in range(steps):
            loop.issue(batches)
            print(loop.collect())  # the previous step's loss: no wait on the step just issued
        print(loop.collect(wait=True))  # the last one's
    """

    def __init__(self, step: Callable[[Batches], object]) -> None:
        self.step = step
        self.unread: list[object] = []

    def issue(self, batches: Batches) -> int:
        """Runs one step; returns the number of steps it ran (1)."""
        self.unread.append(handle(self.step(batches)))
        return 1

    def collect(self, wait: bool = False) -> list[float]:
        """The losses of every step issued but the last (``wait``: of every one), each once."""
        ready = self.unread if wait else self.unread[:-1]
        self.unread = [] if wait else self.unread[-1:]
        return [value for taken in ready for value in values(taken)]
