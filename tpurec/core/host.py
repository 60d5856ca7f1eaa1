"""Ops that run on the host: data-dependent output shapes, indexing across devices.

The ``DATA_DEPENDENT`` entries of the one lowering table run on CPU copies of
their inputs (a sync point in fused mode) and their results come back.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_map

from tpurec.core import profiler
from tpurec.core.device import jax_device
from tpurec.core.kernels import _copy_
from tpurec.core.mutating import _mutated
from tpurec.core.programs import value_of
from tpurec.core.mirrors import attach, mirror_of
from tpurec.core.tensor import TpuTensor, host_to_jax, jax_to_host, wrap
from tpurec.dense.registry import TABLE, Kind, mark

aten = torch.ops.aten

__all__: list[str] = []


# --- ops that run on the host ----------------------------------------------


# Ops whose output shape depends on input values: XLA needs static shapes, so
# they run on the host (a sync point in fused mode) and their result comes back.
mark(
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten._unique.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.bincount.default,
    aten.repeat_interleave.Tensor,
    kind=Kind.DATA_DEPENDENT,
)
_DATA_DEPENDENT = TABLE[Kind.DATA_DEPENDENT]


# --- index tensors on another device -------------------------------------------
# ATen's advanced indexing (make_info) moves index tensors to the indexed tensor's device,
# so CUDA takes ``t[cpu_idx]``, ``t[cpu_idx] = v`` and their backward; as there, a 0-dim
# value moves with them. Every other op keeps refusing a CPU tensor with dimensions.
_INDEXING = {
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl.default,
    aten._index_put_impl_.default,
}


def _indexing_across_devices(func, args):
    """``(args, None)`` with CPU indices of a tpu tensor moved to it, or ``(None, result)``
    for a CPU tensor indexed by tpu indices (run on CPU, as ATen moves them there)."""
    if func not in _INDEXING or len(args) < 2 or not isinstance(args[1], (list, tuple)):
        return args, None
    self, indices = args[0], args[1]
    if isinstance(self, TpuTensor):
        index = self._storage.index
        move = lambda t: wrap(host_to_jax(t, jax_device(index)), index)  # noqa: E731
        foreign = lambda t: isinstance(t, torch.Tensor) and not isinstance(t, TpuTensor) and t.device.type == "cpu"  # noqa: E731
    elif isinstance(self, torch.Tensor) and self.device.type == "cpu":
        move = lambda t: jax_to_host(value_of(t, "indexing a CPU tensor"))  # noqa: E731
        foreign = lambda t: isinstance(t, TpuTensor)  # noqa: E731
    else:
        return args, None
    if not any(foreign(i) for i in indices):
        return args, None
    rest = list(args[2:])
    if rest and foreign(rest[0]) and rest[0].dim() == 0:
        rest[0] = move(rest[0])
    args = (self, [move(i) if foreign(i) else i for i in indices], *rest)
    if isinstance(self, TpuTensor):
        return args, None
    return None, func(*args)


def _has_bool_index(func, args) -> bool:
    """Reading through a boolean mask, or writing per-element values through one."""
    if func is aten.index.Tensor:
        pass
    elif func in (aten.index_put.default, aten.index_put_.default):
        if args[2].numel() <= 1:  # a broadcast value: the lowering keeps shapes static (a where)
            return False
    else:
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (args[1] or ()))


def _masks_as_indices(func, args):
    """``args`` with each boolean mask index whose values are known on the host (a mirror) replaced
    by its nonzero positions, one int64 index tensor per mask dimension, moved to the device.

    That is how ATen itself indexes through a mask: the result is the same, but the op's shape is
    now known without reading the device, so it runs as a lowering (no sync point, and in fused
    mode no window cut in the middle of a step: a masked loss such as ELECTRA's discriminator's,
    ``logits[attention_mask == 1]``, stays in the step's one program). A mask not known on the
    host keeps the host path.
    """
    self, indices = args[0], list(args[1])
    changed = False
    dim = 0  # the dimension of ``self`` the index at k starts at
    for k, index in enumerate(indices):
        if not (isinstance(index, TpuTensor) and index.dtype in (torch.bool, torch.uint8)):
            dim += 1
            continue
        values = mirror_of(index)
        if values is None:
            return args
        covered = tuple(self.shape[dim : dim + index.dim()])
        if covered != tuple(index.shape):  # ATen's own check, which the positions would skip
            raise IndexError(
                f"The shape of the mask {list(index.shape)} at index {k} does not match the shape of the "
                f"indexed tensor {list(self.shape)} at index {dim}"
            )
        dim += index.dim()
        device = jax_device(self._storage.index)
        positions = []
        for column in values.nonzero().unbind(1):
            moved = wrap(host_to_jax(column.contiguous(), device), self._storage.index)
            attach(moved, column.contiguous())
            positions.append(moved)
        indices[k : k + 1] = [positions]
        changed = True
    if not changed:
        return args
    flat = []
    for index in indices:
        flat.extend(index if isinstance(index, list) else [index])
    return (self, flat, *args[2:])


def _on_host(func, args, kwargs):
    """Runs ``func`` on CPU copies of its tpu inputs and moves the results back."""
    with profiler.record(f"tpurec::host_fallback {func}"):  # tpurec.profiler hook
        return _on_host_run(func, args, kwargs)


def _on_host_run(func, args, kwargs):
    tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, TpuTensor)]
    index = tensors[0]._storage.index
    # Inputs whose values are known on the host (tpurec.core.mirrors) need no sync point; an
    # in-place op gets copies, since it writes its host arguments.
    known = {id(t): m for t in tensors if (m := mirror_of(t)) is not None}
    if known and func._schema.is_mutable:
        known = {k: m.clone() for k, m in known.items()}

    def to_host(x):
        if not isinstance(x, TpuTensor):
            return x
        values = known.get(id(x))
        return values if values is not None else jax_to_host(value_of(x, "data-dependent op"))

    host_args, host_kwargs = tree_map(to_host, (args, kwargs))
    out = func(*host_args, **host_kwargs)
    device = jax_device(index)
    mirrored = len(known) == len(tensors)  # every input known: so are the results (never written again)

    def back(x):
        if not isinstance(x, torch.Tensor):
            return x
        t = wrap(host_to_jax(x, device), index)
        if mirrored:
            attach(t, x)
        return t

    if func._schema.is_mutable:
        targets, returns = _mutated(func, args, kwargs)
        for t, h in zip(targets, _mutated(func, host_args, host_kwargs)[0]):
            _copy_(t, h)
        return returns
    return tree_map(back, out)
