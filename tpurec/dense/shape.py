"""Data movement: concatenation, gather/scatter, advanced indexing, flips and
rolls, padding, triangular masks, sorting, and the functional "scatter back"
ops autograd emits for views (select_backward, slice_backward, ...).

View ops themselves (view, permute, select, slice, expand...) are the runtime
core's; only ops that produce new values live here. Output shapes must be
static, so data-dependent ops (boolean-mask indexing with an unknown count,
one_hot with num_classes=-1) raise ``NotImplementedError``.
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from tpurec.dense._util import DEFAULT, cast, norm_dim, promote
from tpurec.dense.registry import lower

aten = torch.ops.aten


def _promote_list(tensors) -> jnp.dtype:
    _, res = promote(*tensors, kind=DEFAULT)
    return res


@lower(aten.cat.default)
def cat(tensors, dim: int = 0):
    dt = _promote_list(tensors)
    # torch skips legacy empty 1-d tensors of shape (0,) whatever `dim` is.
    kept = [t.astype(dt) for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]
    if not kept:
        return jnp.zeros((0,), dt)
    return jnp.concatenate(kept, axis=norm_dim(dim, kept[0].ndim))


@lower(aten.stack.default)
def stack(tensors, dim: int = 0):
    dt = _promote_list(tensors)
    return jnp.stack([t.astype(dt) for t in tensors], axis=norm_dim(dim, tensors[0].ndim + 1))


def _dim_index(index, dim: int):
    """Full coordinate tuple for gather/scatter: iota everywhere, ``index`` on ``dim``."""
    coords = list(jnp.indices(index.shape, sparse=True)) if index.ndim else []
    if index.ndim:
        coords[dim] = index
        return tuple(coords)
    return ()


@lower(aten.gather.default)
def gather(x, dim: int, index, *, sparse_grad: bool = False):
    if x.ndim == 0:
        return x.reshape(index.shape)
    d = norm_dim(dim, x.ndim)
    return x[_dim_index(index, d)]


def _src_like_index(src, index):
    if jnp.ndim(src) == 0:
        return src
    return src[tuple(slice(0, n) for n in index.shape)]


def _scatter(x, dim, index, src, mode: str):
    if x.ndim == 0:
        idx = ()
        src = jnp.reshape(src, ()) if jnp.ndim(src) else src
    else:
        idx = _dim_index(index, norm_dim(dim, x.ndim))
        src = _src_like_index(src, index)
    src = cast(src, x.dtype)
    at = x.at[idx]
    return {"set": at.set, "add": at.add, "multiply": at.multiply, "max": at.max, "min": at.min}[mode](src)


@lower(aten.scatter.src, aten.scatter.value)
def scatter(x, dim: int, index, src):
    return _scatter(x, dim, index, src, "set")


@lower(aten.scatter.reduce, aten.scatter.value_reduce)
def scatter_reduce_legacy(x, dim: int, index, src, *, reduce: str):
    return _scatter(x, dim, index, src, {"add": "add", "multiply": "multiply"}[reduce])


@lower(aten.scatter_add.default)
def scatter_add(x, dim: int, index, src):
    return _scatter(x, dim, index, src, "add")


@lower(aten.scatter_reduce.two)
def scatter_reduce(x, dim: int, index, src, reduce: str, *, include_self: bool = True):
    dt = x.dtype
    if reduce in ("sum", "mean"):
        base = x if include_self else _scatter(x, dim, index, jnp.zeros((), dt), "set")
        total = _scatter(base, dim, index, src, "add")
        if reduce == "sum":
            return total
        ones = jnp.ones(x.shape, jnp.int64)
        start = ones if include_self else _scatter(ones, dim, index, jnp.zeros((), jnp.int64), "set")
        count = _scatter(start, dim, index, jnp.ones(index.shape, jnp.int64), "add")
        count = jnp.maximum(count, 1).astype(dt)
        return total // count if not jnp.issubdtype(dt, jnp.inexact) else total / count
    if reduce == "prod":
        base = x if include_self else _scatter(x, dim, index, jnp.ones((), dt), "set")
        return _scatter(base, dim, index, src, "multiply")
    if reduce in ("amax", "amin"):
        if jnp.issubdtype(dt, jnp.inexact):
            fill = -jnp.inf if reduce == "amax" else jnp.inf
        else:
            info = jnp.iinfo(dt) if dt != jnp.bool_ else None
            fill = (info.min if reduce == "amax" else info.max) if info else (reduce == "amin")
        base = x if include_self else _scatter(x, dim, index, jnp.asarray(fill, dt), "set")
        return _scatter(base, dim, index, src, "max" if reduce == "amax" else "min")
    raise ValueError(f"scatter_reduce: unknown reduce {reduce!r}")


@lower(aten.index_select.default)
def index_select(x, dim: int, index):
    if x.ndim == 0:
        return jnp.take(x.reshape(1), index.reshape(-1)).reshape(())
    return jnp.take(x, index.reshape(-1), axis=norm_dim(dim, x.ndim))


def _along(x, dim: int):
    """x with ``dim`` moved to the front, and the inverse move."""
    d = norm_dim(dim, x.ndim)
    return jnp.moveaxis(x, d, 0), (lambda y: jnp.moveaxis(y, 0, d))


@lower(aten.index_add.default)
def index_add(x, dim: int, index, source, *, alpha=1):
    if x.ndim == 0:
        return x + cast(alpha, x.dtype) * source.reshape(()).astype(x.dtype)
    xm, back = _along(x, dim)
    sm, _ = _along(source, dim)
    return back(xm.at[index.reshape(-1)].add(cast(alpha, x.dtype) * sm.astype(x.dtype)))


@lower(aten.index_copy.default)
def index_copy(x, dim: int, index, source):
    if x.ndim == 0:
        return source.reshape(()).astype(x.dtype)
    xm, back = _along(x, dim)
    sm, _ = _along(source, dim)
    return back(xm.at[index.reshape(-1)].set(sm.astype(x.dtype)))


@lower(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor)
def index_fill(x, dim: int, index, value):
    if x.ndim == 0:
        return jnp.full((), cast(value, x.dtype))
    xm, back = _along(x, dim)
    return back(xm.at[index.reshape(-1)].set(cast(value, x.dtype)))


def _index_tuple(x, indices, op: str):
    """torch advanced indices (None = full slice) as a jax index tuple."""
    out = []
    for i in indices:
        if i is None:
            out.append(slice(None))
        elif i.dtype == jnp.bool_ or i.dtype == jnp.uint8:
            raise NotImplementedError(f"{op} with a boolean mask has a data-dependent shape on the tpu device")
        else:
            out.append(i)
    return tuple(out)


@lower(aten.index.Tensor, aten._unsafe_index.Tensor)
def index(x, indices):
    return x[_index_tuple(x, indices, "index")]


def _masked_put(x, mask, values, accumulate: bool):
    """``x[mask] = values`` when ``values`` broadcasts over the selected rows:
    a where, not a scatter, so the shape stays static."""
    k = mask.ndim
    rest = x.shape[k:]
    v = values.astype(x.dtype)
    if v.ndim > len(rest):
        if any(s != 1 for s in v.shape[: v.ndim - len(rest)]):
            raise NotImplementedError("index_put with a boolean mask and per-element values is data-dependent")
        v = v.reshape(v.shape[v.ndim - len(rest) :])
    m = mask.reshape(mask.shape + (1,) * len(rest))
    v = jnp.broadcast_to(v, rest)
    if accumulate:
        return x + jnp.where(m, v, jnp.zeros((), x.dtype))
    return jnp.where(m, v, x)


@lower(aten.index_put.default, aten._unsafe_index_put.default)
def index_put(x, indices, values, accumulate: bool = False):
    real = [i for i in indices if i is not None]
    if len(real) == 1 and indices[0] is not None and real[0].dtype in (jnp.bool_, jnp.uint8):
        return _masked_put(x, real[0] != 0, values, accumulate)
    idx = _index_tuple(x, indices, "index_put")
    v = values.astype(x.dtype)
    return x.at[idx].add(v) if accumulate else x.at[idx].set(v)


@lower(aten.masked_scatter.default)
def masked_scatter(x, mask, source):
    shape = jnp.broadcast_shapes(x.shape, mask.shape)
    mask, x = jnp.broadcast_to(mask, shape), jnp.broadcast_to(x, shape)
    flat = mask.reshape(-1)
    # The k-th selected element (row-major) takes source.flat[k].
    pos = jnp.cumsum(flat.astype(jnp.int64)) - 1
    src = source.reshape(-1).astype(x.dtype)
    picked = src[jnp.clip(pos, 0, max(src.shape[0] - 1, 0))] if src.shape[0] else jnp.zeros_like(x.reshape(-1))
    return jnp.where(flat, picked, x.reshape(-1)).reshape(x.shape)


@lower(aten.flip.default)
def flip(x, dims: Sequence[int]):
    if x.ndim == 0:
        return x
    return jnp.flip(x, axis=tuple(norm_dim(d, x.ndim) for d in dims))


@lower(aten.roll.default)
def roll(x, shifts: Sequence[int], dims: Sequence[int] = ()):
    if not dims:
        return jnp.roll(x.reshape(-1), shifts[0]).reshape(x.shape)
    return jnp.roll(x, tuple(shifts), axis=tuple(norm_dim(d, x.ndim) for d in dims))


@lower(aten.repeat.default)
def repeat(x, repeats: Sequence[int]):
    return jnp.tile(x, tuple(repeats))


@lower(aten.repeat_interleave.self_int)
def repeat_interleave(x, repeats: int, dim=None, *, output_size=None):
    if dim is None:
        return jnp.repeat(x.reshape(-1), repeats)
    return jnp.repeat(x, repeats, axis=norm_dim(dim, x.ndim))


@lower(aten.repeat_interleave.self_Tensor)
def repeat_interleave_tensor(x, repeats, dim=None, *, output_size=None):
    if output_size is None:
        raise NotImplementedError("repeat_interleave with tensor repeats needs output_size on the tpu device")
    if dim is None:
        x, dim = x.reshape(-1), 0
    return jnp.repeat(x, repeats.reshape(-1), axis=norm_dim(dim, x.ndim), total_repeat_length=output_size)


@lower(aten.constant_pad_nd.default)
def constant_pad_nd(x, pad: Sequence[int], value=0):
    cfg = [(0, 0, 0)] * x.ndim
    for i in range(len(pad) // 2):
        cfg[x.ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1], 0)  # negative entries crop
    return lax.pad(x, cast(value, x.dtype), cfg)


@lower(aten.tril.default)
def tril(x, diagonal: int = 0):
    return jnp.tril(x, diagonal)


@lower(aten.triu.default)
def triu(x, diagonal: int = 0):
    return jnp.triu(x, diagonal)


def _sort(x, dim: int, descending: bool, stable: bool):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    d = norm_dim(dim, x.ndim)
    idx = jnp.argsort(x, axis=d, stable=True, descending=descending)
    return jnp.take_along_axis(x, idx, axis=d), idx.astype(jnp.int64)


@lower(aten.sort.default)
def sort(x, dim: int = -1, descending: bool = False):
    return _sort(x, dim, descending, False)


@lower(aten.sort.stable)
def sort_stable(x, *, stable=None, dim: int = -1, descending: bool = False):
    return _sort(x, dim, descending, bool(stable))


@lower(aten.topk.default)
def topk(x, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    d = norm_dim(dim, x.ndim)
    xm = jnp.moveaxis(x, d, -1)
    # argsort is stable: ties resolve to the lower index, like torch's CPU topk.
    idx = jnp.argsort(xm, axis=-1, stable=True, descending=largest)[..., :k]
    vals = jnp.take_along_axis(xm, idx, axis=-1)
    return jnp.moveaxis(vals, -1, d), jnp.moveaxis(idx, -1, d).astype(jnp.int64)


# --- functional scatters autograd emits for views ------------------------------------


def _dim_slices(ndim: int, dim: int, sl) -> tuple:
    return tuple(sl if i == dim else slice(None) for i in range(ndim))


@lower(aten.select_backward.default)
def select_backward(grad, input_sizes: Sequence[int], dim: int, index: int):
    return select_scatter(jnp.zeros(tuple(input_sizes), grad.dtype), grad, dim, index)


@lower(aten.select_scatter.default)
def select_scatter(x, src, dim: int, index: int):
    d = norm_dim(dim, x.ndim)
    i = index + x.shape[d] if index < 0 else index
    return x.at[_dim_slices(x.ndim, d, i)].set(src.astype(x.dtype))


@lower(aten.slice_backward.default)
def slice_backward(grad, input_sizes: Sequence[int], dim: int, start: int, end: int, step: int):
    return slice_scatter(jnp.zeros(tuple(input_sizes), grad.dtype), grad, dim, start, end, step)


@lower(aten.slice_scatter.default)
def slice_scatter(x, src, dim: int = 0, start=None, end=None, step: int = 1):
    d = norm_dim(dim, x.ndim)
    return x.at[_dim_slices(x.ndim, d, slice(start, end, step))].set(src.astype(x.dtype))


@lower(aten.as_strided_scatter.default, torch.ops.prims.as_strided_scatter.default)
def as_strided_scatter(x, src, size: Sequence[int], stride: Sequence[int], storage_offset=None):
    """``x`` (read in its contiguous layout) with the view (size, stride, offset) of it replaced by ``src``.

    As PyTorch's reference: a contiguous clone of ``x``, then ``src`` copied into its
    ``as_strided`` view.
    """
    positions = np.full((), storage_offset or 0, dtype=np.int64)
    for n, step in zip(size, stride):
        positions = positions[..., None] + np.arange(n, dtype=np.int64) * step
    flat = x.reshape(-1).at[positions.reshape(-1)].set(jnp.broadcast_to(src, tuple(size)).reshape(-1).astype(x.dtype))
    return flat.reshape(x.shape)


@lower(aten.diagonal_scatter.default)
def diagonal_scatter(x, src, offset: int = 0, dim1: int = 0, dim2: int = 1):
    d1, d2 = norm_dim(dim1, x.ndim), norm_dim(dim2, x.ndim)
    xm = jnp.moveaxis(x, (d1, d2), (-2, -1))
    rows, cols = xm.shape[-2], xm.shape[-1]
    n = max(0, min(rows + min(offset, 0), cols - max(offset, 0)))
    i = np.arange(n)
    r, c = i + max(-offset, 0), i + max(offset, 0)
    xm = xm.at[..., r, c].set(src.astype(x.dtype))
    return jnp.moveaxis(xm, (-2, -1), (d1, d2))


@lower(aten.diagonal_backward.default)
def diagonal_backward(grad, input_sizes: Sequence[int], offset: int, dim1: int, dim2: int):
    return diagonal_scatter(jnp.zeros(tuple(input_sizes), grad.dtype), grad, offset, dim1, dim2)


@lower(aten.unfold_backward.default)
def unfold_backward(grad_in, input_sizes: Sequence[int], dim: int, size: int, step: int):
    sizes = tuple(input_sizes)
    d = norm_dim(dim, len(sizes))
    if len(sizes) == 0:
        return grad_in.reshape(())
    n = grad_in.shape[d] if grad_in.ndim > d else 1
    # window w, element j lands on position w * step + j of `dim`.
    pos = np.arange(n)[:, None] * step + np.arange(size)[None, :]
    g = jnp.moveaxis(jnp.moveaxis(grad_in, d, 0), -1, 1)  # (n, size, ...rest)
    rest = sizes[:d] + sizes[d + 1 :]
    out = jnp.zeros((sizes[d],) + rest, grad_in.dtype).at[pos].add(g)
    return jnp.moveaxis(out, 0, d)


@lower(aten.one_hot.default)
def one_hot(x, num_classes: int = -1):
    if num_classes < 0:
        raise NotImplementedError("one_hot needs an explicit num_classes on the tpu device")
    return (x[..., None] == jnp.arange(num_classes, dtype=x.dtype)).astype(jnp.int64)
