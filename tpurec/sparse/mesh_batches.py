"""Batches and the device mesh they go to: the leaf the training pipeline and the sharded models share.

:func:`map_batch` rebuilds a batch piece by piece, its tensors one way, its KeyedJaggedTensors
another: the training pipeline moves a batch to the device ahead of the step with it, the
sharded models split a batch over their mesh.

tpurec's embedding collections that take a batch's KeyedJaggedTensor ahead of
the step follow :class:`Prefetching`; the sharded ones also follow
:class:`OnMesh`: they live on a ``jax.sharding.Mesh`` and the batch of the
model holding them is split over that mesh. :func:`mesh_of` asks a model's
modules through these protocols, so a caller (the training pipeline) never
relies on attributes set on the user's own model.

Example::

    on_device = map_batch(batch, lambda t: t.to("tpu"), lambda kjt: kjt)
    mesh = mesh_of(model)  # None for a model tpurec.shard did not shard
    if mesh is not None:
        array = batch_sharded_array(host_batch, mesh)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol, runtime_checkable

import jax
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = [
    "OnDevice",
    "OnMesh",
    "Prefetching",
    "batch_sharded_array",
    "local_device_count",
    "map_batch",
    "mesh_of",
]


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


@runtime_checkable
class Prefetching(Protocol):
    """An embedding collection that can take a batch's KeyedJaggedTensor ahead of the step."""

    @property
    def feature_names(self) -> list[str]:
        """The features (KJT keys) it looks up."""
        ...

    def prefetch(self, kjt: KeyedJaggedTensor) -> None:
        """Prepares ``kjt`` (the next step's ids) while the current step runs."""
        ...

    def clear_prefetched(self) -> None:
        """Drops what :meth:`prefetch` prepared."""
        ...


@runtime_checkable
class OnMesh(Protocol):
    """A module whose state lives on a device mesh; the batch of the model holding it is split over the mesh."""

    @property
    def mesh(self) -> Mesh:
        """The ``jax.sharding.Mesh`` (plan rank ``r`` is ``mesh.devices.flat[r]``)."""
        ...


def mesh_of(model: nn.Module) -> Mesh | None:
    """The mesh ``model``'s batches are split over: that of its sharded embedding collections.

    Args:
        model: any module.

    Returns:
        The mesh of the first module that is both :class:`Prefetching` and
        :class:`OnMesh` (``tpurec.shard`` puts every collection of a model on
        one mesh), or None when there is none.
    """
    for module in model.modules():
        if isinstance(module, Prefetching) and isinstance(module, OnMesh) and isinstance(module.mesh, Mesh):
            return module.mesh
    return None


def local_device_count(mesh: Mesh) -> int:
    """How many of ``mesh``'s devices belong to this process (its batch splits over them)."""
    return sum(d.process_index == jax.process_index() for d in mesh.devices.flat)


def batch_sharded_array(host: np.ndarray, mesh: Mesh) -> jax.Array:
    """This process's ``[local batch, ...]`` samples as a global array sharded on its first dim.

    Starts the host-to-device copies and returns without waiting for them
    (safe on a worker thread, e.g. ``TrainPipeline``'s).

    Args:
        host: this process's samples; the first dim splits evenly over its devices.
        mesh: the mesh the model was sharded on.
    """
    sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    if jax.process_count() == 1:
        return jax.device_put(host, sharding)
    return jax.make_array_from_process_local_data(sharding, host)
