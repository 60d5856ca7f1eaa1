"""Host mirrors: the values of small integer and boolean tpu tensors, known on the host.

Model code branches on small integer tensors that came from the host: Hugging Face
models ask ``attention_mask.all()`` to skip an all-ones mask, and position ids,
lengths and masks are checked with ``.item()`` or ``.tolist()``. On the device each
such read is a sync point: eager mode waits for the device, and fused mode runs the
window recorded so far as a program of its own, so a step becomes two programs (and
a model fed several sequence lengths compiles two per length).

A tpu tensor copied from a CPU tensor of an integer or boolean dtype with at most
``TPUREC_HOST_MIRRORS`` elements keeps a copy of its values on the host: its
*mirror*. Exact integer and boolean ops on mirrored tensors (comparisons, logical
ops, ``all``/``any``, integer arithmetic, casts between integer and boolean dtypes,
views, concatenation, small integer factories) run on the device as always and, in
addition, on the mirrors with PyTorch's CPU kernels, so their results are mirrored
too. ``.item()``, ``bool(t)`` and copies to the CPU of a mirrored tensor then read the
mirror: no sync point. The values are PyTorch CPU's own, which the device's lowerings
are tested against; no float value is ever mirrored.

A mirror holds only while the tensor's storage keeps the array it had when the mirror
was made, and the tensor its metadata: an in-place write, ``set_``, ``resize_`` or an
in-place view op on the tensor or any tensor sharing its storage drops it.

Example::

    mask = torch.ones(2, 8, dtype=torch.long).to("tpu")
    with tpurec.mode("fused"):
        if (mask == 1).all():  # read from the mirror: nothing runs on the device yet
            ...
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from tpurec import config
from tpurec.core.fused import Pending
from tpurec.core.tensor import TpuTensor

__all__ = ["MIRRORED_OPS", "attach", "from_host", "mirror_of", "mirrored_ops", "run_mirrored"]

# Whether any tensor was mirrored yet: until then the dispatcher skips the test per op.
live = False

aten = torch.ops.aten

# Ops whose result on integer and boolean inputs is exact, so PyTorch CPU's result is the device's.
MIRRORED_OPS = (
    # comparisons, logical and bitwise ops
    aten.eq.Tensor,
    aten.eq.Scalar,
    aten.ne.Tensor,
    aten.ne.Scalar,
    aten.lt.Tensor,
    aten.lt.Scalar,
    aten.le.Tensor,
    aten.le.Scalar,
    aten.gt.Tensor,
    aten.gt.Scalar,
    aten.ge.Tensor,
    aten.ge.Scalar,
    aten.logical_and.default,
    aten.logical_or.default,
    aten.logical_xor.default,
    aten.logical_not.default,
    aten.bitwise_and.Tensor,
    aten.bitwise_and.Scalar,
    aten.bitwise_or.Tensor,
    aten.bitwise_or.Scalar,
    aten.bitwise_xor.Tensor,
    aten.bitwise_not.default,
    aten.where.self,
    # reductions
    aten.all.default,
    aten.all.dim,
    aten.all.dims,
    aten.any.default,
    aten.any.dim,
    aten.any.dims,
    aten.sum.default,
    aten.sum.dim_IntList,
    aten.cumsum.default,
    aten.amax.default,
    aten.amin.default,
    aten.max.default,
    aten.min.default,
    # integer arithmetic (wraps on overflow on both sides)
    aten.add.Tensor,
    aten.add.Scalar,
    aten.sub.Tensor,
    aten.sub.Scalar,
    aten.rsub.Scalar,
    aten.mul.Tensor,
    aten.mul.Scalar,
    aten.neg.default,
    aten.abs.default,
    aten.clamp.default,
    aten.maximum.default,
    aten.minimum.default,
    # copies, casts and views
    aten._to_copy.default,
    aten.clone.default,
    aten.alias.default,
    aten.detach.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.slice.Tensor,
    aten.select.int,
    aten.expand.default,
    aten.unsqueeze.default,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.t.default,
    aten.transpose.int,
    aten.permute.default,
    aten.flip.default,
    aten.cat.default,
    aten.stack.default,
    aten.repeat.default,
    aten.gather.default,
    aten.index_select.default,
    # factories (integer and boolean results only)
    aten.arange.default,
    aten.arange.start,
    aten.arange.start_step,
    aten.full.default,
    aten.zeros.default,
    aten.ones.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.full_like.default,
)

# id(op) of each op above: the dispatcher's test per op (an OpOverload's own hash is Python code).
mirrored_ops: frozenset[int] = frozenset(id(op) for op in MIRRORED_OPS)

_EXACT_DTYPES = frozenset(
    (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32)
)


def _limit() -> int:
    return config.get("TPUREC_HOST_MIRRORS")


def mirror_of(t: TpuTensor) -> torch.Tensor | None:
    """``t``'s values on the host, if they are known and still hold (and mirrors are on); else None."""
    if t._mirror is None or not _limit():  # none, or mirrors turned off since
        return None
    return _held(t)


def _held(t: TpuTensor) -> torch.Tensor | None:
    """``t``'s mirror if it still holds (not checking whether mirrors are on)."""
    entry = t._mirror
    if entry is None:
        return None
    values, storage, array, key = entry
    current = storage._array
    if t._storage is storage and t._key == key:
        if current is array or (type(array) is Pending and array.value is current):
            return values
    t._mirror = None  # written or re-pointed since: it never holds again
    return None


def attach(t: TpuTensor, values: torch.Tensor) -> None:
    """Makes ``values`` (a CPU tensor of ``t``'s shape and dtype, never written later) ``t``'s mirror.

    Only integer and boolean tensors of at most ``TPUREC_HOST_MIRRORS`` elements get one.
    """
    if (
        t.dtype in _EXACT_DTYPES
        and values.dtype == t.dtype
        and tuple(values.shape) == t._key[2]
        and values.device.type == "cpu"
        and t.numel() <= _limit()
    ):
        _attach(t, values)


def _attach(t: TpuTensor, values: torch.Tensor) -> None:
    global live
    t._mirror = (values, t._storage, t._storage._array, t._key)
    live = True


def from_host(t: TpuTensor, source: torch.Tensor) -> None:
    """Mirrors ``t``, just filled with a copy of the whole CPU tensor ``source``."""
    # The caller copied the whole of ``source`` into ``t``: shape, dtype and device already agree.
    if source.dtype in _EXACT_DTYPES and source.numel() <= _limit():
        _attach(t, source.clone())  # the source is the caller's: it may be written later


class _NotMirrored(Exception):
    """An argument that keeps an op from running on the mirrors."""


_CPU = torch.device("cpu")


def _host_argument(x: Any) -> Any:
    """``x`` for the host copy of an op: a tensor's mirror, a tpu device as cpu. Raises _NotMirrored
    for a tpu tensor without one, a host tensor, or a float (mirrored ops are integer ops)."""
    kind = type(x)
    if kind is TpuTensor:
        values = _held(x)
        if values is None:
            raise _NotMirrored
        return values
    if kind is int or kind is bool or x is None:
        return x
    if kind is list or kind is tuple:
        return kind(_host_argument(v) for v in x)
    if isinstance(x, torch.Tensor) or kind is float or kind is complex:
        raise _NotMirrored
    if kind is torch.device:
        return _CPU if x.type == "tpu" else x
    return x  # a dtype, layout, memory format...


def run_mirrored(func, args: tuple, kwargs: dict, out: Any) -> None:
    """After ``func(*args, **kwargs)`` ran on the device with result ``out``: when every tpu tensor
    argument is mirrored (so an integer or boolean tensor), no argument is a float and every output
    is a small integer or boolean tensor, runs ``func`` on the mirrors on the host and mirrors ``out``
    with the result."""
    outs = out if type(out) is list or type(out) is tuple else (out,)
    for o in outs:
        if type(o) is not TpuTensor or o.dtype not in _EXACT_DTYPES:
            return
    limit = _limit()
    for o in outs:
        if o.numel() > limit:
            return
    if _get_current_dispatch_mode() is not None:
        return  # a mode (fake tensors while compiling, a user's mode) sees every op: leave it alone
    try:
        host_args = _host_argument(args)
        host_kwargs = {k: _host_argument(v) for k, v in kwargs.items()} if kwargs else kwargs
    except _NotMirrored:
        return
    host_out = func._op(*host_args, **host_kwargs)  # no dispatch mode is active: plain CPU tensors
    host_outs = host_out if type(host_out) is list or type(host_out) is tuple else (host_out,)
    if len(host_outs) != len(outs):
        return
    for o, h in zip(outs, host_outs):
        if h.dtype == o.dtype and tuple(h.shape) == o._key[2]:
            _attach(o, h)
