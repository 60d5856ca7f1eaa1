"""View ops of compiled graphs, as functional JAX ops.

Eager execution never lowers a view: it makes a new (size, stride, offset)
over the same storage. A compiled graph is functional (AOTAutograd's
functionalization already turned writes through views into ``*_scatter``
ops), so a view is just a value computed from its input, and each view op is a
reshape, transpose, slice... of that value. All size arguments arrive here as
concrete Python ints (symbolic sizes are resolved before tracing).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import jax.numpy as jnp
import torch
from jax import lax

from tpurec.dense.registry import TABLE, Kind, entry, lower, to_jax_dtype
from tpurec.core import read_view, write_view
from tpurec.dense.trace_context import transpose as _transpose

aten = torch.ops.aten

__all__ = ["VIEWS", "view_lowering"]


def _dim(d: int, ndim: int) -> int:
    return d + max(ndim, 1) if d < 0 else d


def _shape(x, size: Sequence[int]) -> tuple[int, ...]:
    """``size`` with a single -1 inferred from ``x``'s element count."""
    size = [int(s) for s in size]
    if -1 in size:
        known = math.prod(s for s in size if s != -1)
        size[size.index(-1)] = x.size // known if known else 0
    return tuple(size)


@lower(
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten._reshape_alias.default,
    aten.view_copy.default,
    kind=Kind.VIEW,
)
def reshape(x, size, *_):
    return jnp.reshape(x, _shape(x, size))


@lower(aten.permute.default, kind=Kind.VIEW)
def permute(x, dims):
    return _transpose(x, [_dim(d, x.ndim) for d in dims])


@lower(aten.t.default, kind=Kind.VIEW)
def t(x):
    return x.T if x.ndim == 2 else x


@lower(aten.transpose.int, kind=Kind.VIEW)
def transpose(x, dim0: int, dim1: int):
    if not x.ndim:
        return x
    perm = list(range(x.ndim))
    d0, d1 = _dim(dim0, x.ndim), _dim(dim1, x.ndim)
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return _transpose(x, perm)


@lower(aten.unsqueeze.default, kind=Kind.VIEW)
def unsqueeze(x, dim: int):
    return jnp.expand_dims(x, _dim(dim, x.ndim + 1))


@lower(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, kind=Kind.VIEW)
def squeeze(x, dim=None):
    if dim is None:
        return jnp.squeeze(x)
    dims = [dim] if isinstance(dim, int) else list(dim)
    # torch ignores dims that are not of size 1; jnp.squeeze would fail on them.
    keep = tuple(d for d in {_dim(d, x.ndim) for d in dims} if x.ndim and x.shape[d] == 1)
    return jnp.squeeze(x, keep) if keep else x


@lower(aten.expand.default, aten.expand_copy.default, kind=Kind.VIEW)
def expand(x, size, implicit: bool = False):
    size = list(size)
    lead = len(size) - x.ndim
    shape = tuple(x.shape[i - lead] if s == -1 else s for i, s in enumerate(size))
    return jnp.broadcast_to(x, shape)


@lower(aten.slice.Tensor, kind=Kind.VIEW)
def slice_(x, dim: int = 0, start=None, end=None, step: int = 1):
    d = _dim(dim, x.ndim)
    n = x.shape[d]
    start, end, step = slice(start, end, step).indices(n)
    end = max(end, start)
    return lax.slice_in_dim(x, start, end, step, axis=d)


@lower(aten.select.int, kind=Kind.VIEW)
def select(x, dim: int, index: int):
    d = _dim(dim, x.ndim)
    index = index + x.shape[d] if index < 0 else index
    return lax.index_in_dim(x, index, axis=d, keepdims=False)


@lower(aten.narrow.default, kind=Kind.VIEW)
def narrow(x, dim: int, start: int, length: int):
    return slice_(x, dim, start, start + length if start >= 0 else start + x.shape[_dim(dim, x.ndim)] + length)


@lower(aten.split.Tensor, kind=Kind.VIEW)
def split(x, split_size: int, dim: int = 0):
    d = _dim(dim, x.ndim)
    n = x.shape[d]
    sizes = [min(split_size, n - s) for s in range(0, n, split_size)] or [0]
    return split_with_sizes(x, sizes, dim)


@lower(aten.split_with_sizes.default, kind=Kind.VIEW)
def split_with_sizes(x, split_sizes, dim: int = 0):
    d = _dim(dim, x.ndim)
    out, start = [], 0
    for s in split_sizes:
        out.append(lax.slice_in_dim(x, start, start + s, axis=d))
        start += s
    return out


@lower(aten.unbind.int, kind=Kind.VIEW)
def unbind(x, dim: int = 0):
    d = _dim(dim, x.ndim)
    return [lax.index_in_dim(x, i, axis=d, keepdims=False) for i in range(x.shape[d])]


@lower(aten.diagonal.default, kind=Kind.VIEW)
def diagonal(x, offset: int = 0, dim1: int = 0, dim2: int = 1):
    return jnp.diagonal(x, offset, _dim(dim1, x.ndim), _dim(dim2, x.ndim))


@lower(aten.unfold.default, kind=Kind.VIEW)
def unfold(x, dimension: int, size: int, step: int):
    d = _dim(dimension, x.ndim)
    if x.ndim == 0:
        return x.reshape(1)
    count = (x.shape[d] - size) // step + 1
    starts = [i * step for i in range(count)]
    windows = [lax.slice_in_dim(x, s, s + size, axis=d) for s in starts]
    # torch puts the window as a new last dim, the window index at ``dimension``.
    return jnp.moveaxis(jnp.stack(windows, axis=d), d + 1, -1)


@lower(aten.as_strided.default, kind=Kind.VIEW)
def as_strided(x, size, stride, storage_offset=None):
    """``as_strided`` over the value's contiguous layout (how functionalization emits it)."""
    return read_view(x.reshape(-1), tuple(size), tuple(stride), storage_offset or 0)


@lower(aten.as_strided_scatter.default, kind=Kind.VIEW)
def as_strided_scatter(x, src, size, stride, storage_offset=None):
    flat = write_view(x.reshape(-1), src, tuple(size), tuple(stride), storage_offset or 0)
    return flat.reshape(x.shape)


@lower(aten.view_as_real.default, kind=Kind.VIEW)
def view_as_real(x):
    """Complex (..., n) -> real (..., n, 2): real and imaginary parts side by side, as in memory."""
    return jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)


@lower(aten.view_as_complex.default, kind=Kind.VIEW)
def view_as_complex(x):
    """Real (..., n, 2) -> complex (..., n)."""
    return lax.complex(x[..., 0], x[..., 1])


@lower(aten.view.dtype, kind=Kind.VIEW)
def view_dtype(x, dtype: torch.dtype):
    target = to_jax_dtype(dtype)
    if jnp.issubdtype(x.dtype, jnp.complexfloating) and target == jnp.finfo(x.dtype).dtype:
        # complex (..., n) -> real (..., 2n), the eager device's REAL view (tpurec.core.views)
        return view_as_real(x).reshape(x.shape[:-1] + (2 * x.shape[-1],)) if x.ndim else view_as_real(x)
    if jnp.issubdtype(target, jnp.complexfloating) and x.dtype == jnp.finfo(target).dtype:
        # real (..., 2n) -> complex (..., n)
        return view_as_complex(x.reshape(x.shape[:-1] + (x.shape[-1] // 2, 2)))
    if target.itemsize != x.dtype.itemsize:
        raise NotImplementedError("view(dtype) between dtypes of different sizes is not supported on tpu")
    return lax.bitcast_convert_type(x, target)


@lower(aten.alias.default, aten.detach.default, aten.lift_fresh.default, aten.lift_fresh_copy.default, kind=Kind.VIEW)
def identity(x, *_, **__):
    return x


@lower(aten.numpy_T.default, kind=Kind.VIEW)
def numpy_T(x):
    return jnp.transpose(x)


@lower(aten._assert_tensor_metadata.default, kind=Kind.VIEW)
def assert_tensor_metadata(*_, **__):
    """Dynamo's metadata assertion: nothing to compute."""


# op -> entry (callable like its function): the VIEW part of the one lowering table.
VIEWS = TABLE[Kind.VIEW]


def view_lowering(op) -> Callable | None:
    """The functional form of view op ``op`` (also covers a few value-preserving ops)."""
    found = entry(op, Kind.VIEW)
    return None if found is None else found.fn
