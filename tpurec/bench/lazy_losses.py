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

import numpy as np
import torch

from tpurec.core.tensor import TpuTensor

__all__ = ["handle", "values"]


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
