"""Rebuilding a batch piece by piece: its tensors one way, its KeyedJaggedTensors another.

Both the training pipeline (which moves a batch to the device ahead of the
step) and the sharded models (which split a batch over their mesh) walk
batches with :func:`map_batch`.

Example::

    on_device = map_batch(batch, lambda t: t.to("tpu"), lambda kjt: kjt)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["OnDevice", "map_batch"]


@dataclasses.dataclass
class OnDevice:
    """A tensor whose host-to-device transfer has started (wrapped as a tpu tensor later).

    Args:
        array: the ``jax.Array`` being filled.
        index: the tpu device index the tensor is wrapped on.
        dtype: the tensor's dtype.
    """

    array: Any
    index: int
    dtype: torch.dtype


def map_batch(batch: Any, fn_tensor: Callable[[Any], Any], fn_kjt: Callable[[KeyedJaggedTensor], Any]) -> Any:
    """Rebuilds ``batch`` with ``fn_tensor`` applied to its tensors and ``fn_kjt`` to its KJTs.

    A batch is a tensor (or an :class:`OnDevice` transfer), a KJT, or a
    dataclass, (named) tuple, list or dict of batches (TorchRec's ``Batch``
    among them); anything else is kept as it is.

    Args:
        batch: the batch.
        fn_tensor: applied to every tensor (and :class:`OnDevice`).
        fn_kjt: applied to every ``KeyedJaggedTensor``.

    Returns:
        The rebuilt batch, of the same structure.
    """
    if isinstance(batch, KeyedJaggedTensor):
        return fn_kjt(batch)
    if isinstance(batch, (torch.Tensor, OnDevice)):
        return fn_tensor(batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(
            batch,
            **{
                f.name: map_batch(getattr(batch, f.name), fn_tensor, fn_kjt)
                for f in dataclasses.fields(batch)
                if f.init
            },
        )
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(map_batch(x, fn_tensor, fn_kjt) for x in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_batch(x, fn_tensor, fn_kjt) for x in batch)
    if isinstance(batch, dict):
        return {k: map_batch(v, fn_tensor, fn_kjt) for k, v in batch.items()}
    return batch
