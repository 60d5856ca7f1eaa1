"""Order statistics, searching and scattered reductions: median / nanmedian,
kthvalue, searchsorted, histc, index_reduce, put, cdist, and backward ops that
used to run on the host (hardshrink / softshrink, replication pad,
masked_scatter).

Order statistics sort along the dim (NaNs sort last, as torch's comparisons
place them) and pick a position, so values and indices come from one sort and
agree with each other.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tpurec.dense._util import norm_dim
from tpurec.dense.registry import lower

aten = torch.ops.aten


# --- median, nanmedian, kthvalue -------------------------------------------------------


def _pick_sorted(x, dim: int, position, keepdim: bool):
    """(value, original index) at sorted ``position`` (an array broadcast over the other dims)."""
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    d = norm_dim(dim, x.ndim)
    order = jnp.argsort(x, axis=d, stable=True)  # NaN last
    pos = jnp.expand_dims(position, d).astype(order.dtype)
    index = jnp.take_along_axis(order, pos, axis=d)
    value = jnp.take_along_axis(x, index, axis=d)
    if not keepdim:
        index, value = jnp.squeeze(index, d), jnp.squeeze(value, d)
    return value, index.astype(jnp.int64)


def _median_position(x, d: int, ignore_nan: bool):
    n = x.shape[d]
    if not ignore_nan:
        has_nan = jnp.any(jnp.isnan(x), axis=d) if jnp.issubdtype(x.dtype, jnp.floating) else False
        lower_median = jnp.full(x.shape[:d] + x.shape[d + 1 :], (n - 1) // 2)
        # torch returns NaN (the first NaN in sorted order) when a row holds one
        first_nan = n - jnp.sum(jnp.isnan(x), axis=d) if jnp.issubdtype(x.dtype, jnp.floating) else 0
        return jnp.where(has_nan, first_nan, lower_median)
    valid = n - jnp.sum(jnp.isnan(x), axis=d)
    return jnp.maximum((valid - 1) // 2, 0)


@lower(aten.median.dim)
def median_dim(x, dim: int, keepdim: bool = False):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    d = norm_dim(dim, x.ndim)
    return _pick_sorted(x, d, _median_position(x, d, ignore_nan=False), keepdim)


@lower(aten.nanmedian.dim)
def nanmedian_dim(x, dim: int, keepdim: bool = False):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    d = norm_dim(dim, x.ndim)
    return _pick_sorted(x, d, _median_position(x, d, ignore_nan=True), keepdim)


@lower(aten.median.default)
def median(x):
    if x.size == 0:
        return jnp.array(jnp.nan, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.zeros((), x.dtype)
    return median_dim(x.reshape(-1), 0)[0]


@lower(aten.nanmedian.default)
def nanmedian(x):
    if x.size == 0:
        return jnp.array(jnp.nan, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.zeros((), x.dtype)
    return nanmedian_dim(x.reshape(-1), 0)[0]


@lower(aten.kthvalue.default)
def kthvalue(x, k: int, dim: int = -1, keepdim: bool = False):
    n = x.shape[norm_dim(dim, x.ndim)] if x.ndim else 1
    if not 1 <= k <= n:
        raise ValueError(f"kthvalue: k ({k}) must be between 1 and the size of dim {dim} ({n})")
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    d = norm_dim(dim, x.ndim)
    return _pick_sorted(x, d, jnp.full(x.shape[:d] + x.shape[d + 1 :], k - 1), keepdim)


# --- searchsorted, histc -------------------------------------------------------------


def _searchsorted(seq, values, out_int32: bool, right: bool, side, sorter):
    if side is not None:
        if side not in ("left", "right"):
            raise ValueError(f"searchsorted: side must be 'left' or 'right', got {side!r}")
        right = side == "right"
    if sorter is not None:
        seq = jnp.take_along_axis(seq, sorter, axis=-1)
    how = "right" if right else "left"
    out_dtype = jnp.int32 if out_int32 else jnp.int64
    values = jnp.asarray(values)
    if seq.ndim == 1:
        return jnp.searchsorted(seq, values, side=how).astype(out_dtype)
    lead = seq.shape[:-1]
    flat_seq = seq.reshape((math.prod(lead), seq.shape[-1]))
    flat_values = values.reshape((math.prod(lead), values.shape[-1]))
    out = jax.vmap(lambda s, v: jnp.searchsorted(s, v, side=how))(flat_seq, flat_values)
    return out.reshape(values.shape).astype(out_dtype)


@lower(aten.searchsorted.Tensor)
def searchsorted(seq, values, *, out_int32: bool = False, right: bool = False, side=None, sorter=None):
    return _searchsorted(seq, values, out_int32, right, side, sorter)


@lower(aten.searchsorted.Scalar)
def searchsorted_scalar(seq, value, *, out_int32: bool = False, right: bool = False, side=None, sorter=None):
    if seq.ndim != 1:
        raise ValueError("searchsorted: a scalar value needs a 1-d sorted_sequence")
    return _searchsorted(seq, jnp.asarray(value, seq.dtype), out_int32, right, side, sorter)


@lower(aten.histc.default)
def histc(x, bins: int = 100, min=0, max=0):
    if bins <= 0:
        raise ValueError(f"histc: bins must be positive, got {bins}")
    acc = jnp.promote_types(x.dtype, jnp.float32)
    xf = x.reshape(-1).astype(acc)
    lo, hi = jnp.asarray(min, acc), jnp.asarray(max, acc)
    # min == max means "use the data's range"; an empty range widens by 1 each side
    data_range = lo == hi
    lo = jnp.where(data_range, jnp.min(xf, initial=jnp.inf), lo) if xf.size else lo
    hi = jnp.where(data_range, jnp.max(xf, initial=-jnp.inf), hi) if xf.size else hi
    same = lo == hi
    lo, hi = jnp.where(same, lo - 1, lo), jnp.where(same, hi + 1, hi)
    inside = (xf >= lo) & (xf <= hi)
    idx = jnp.floor((xf - lo) * bins / (hi - lo)).astype(jnp.int64)
    idx = jnp.where(xf == hi, bins - 1, idx)
    counts = jnp.zeros((bins,), acc).at[jnp.where(inside, idx, bins)].add(1, mode="drop")
    return counts.astype(x.dtype)


# --- index_reduce, put, masked_scatter backward ---------------------------------------


@lower(aten.index_reduce.default)
def index_reduce(x, dim: int, index, source, reduce: str, *, include_self: bool = True):
    if reduce not in ("prod", "mean", "amax", "amin"):
        raise ValueError(f"index_reduce: reduce must be 'prod', 'mean', 'amax' or 'amin', got {reduce!r}")
    if x.ndim == 0:
        x1, s1 = x.reshape(1), source.reshape(1)
        return index_reduce(x1, 0, index.reshape(-1), s1, reduce, include_self=include_self).reshape(())
    d = norm_dim(dim, x.ndim)
    xt = jnp.moveaxis(x, d, 0)
    st = jnp.moveaxis(source, d, 0).astype(x.dtype)
    idx = index.reshape(-1)
    touched = jnp.zeros((xt.shape[0],), bool).at[idx].set(True)
    touched = touched.reshape((-1,) + (1,) * (xt.ndim - 1))
    if reduce == "prod":
        base = xt if include_self else jnp.where(touched, jnp.ones((), x.dtype), xt)
        out = base.at[idx].multiply(st)
    elif reduce in ("amax", "amin"):
        if jnp.issubdtype(x.dtype, jnp.floating):
            fill = jnp.array(-jnp.inf if reduce == "amax" else jnp.inf, x.dtype)
        else:
            info = jnp.iinfo(x.dtype)
            fill = jnp.array(info.min if reduce == "amax" else info.max, x.dtype)
        base = xt if include_self else jnp.where(touched, fill, xt)
        out = base.at[idx].max(st) if reduce == "amax" else base.at[idx].min(st)
    else:
        acc = jnp.promote_types(x.dtype, jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
        base = xt.astype(acc) if include_self else jnp.where(touched, jnp.zeros((), acc), xt.astype(acc))
        total = base.at[idx].add(st.astype(acc))
        count = jnp.zeros((xt.shape[0],), acc).at[idx].add(1)
        count = count + (1 if include_self else 0)
        count = jnp.where(count == 0, 1, count).reshape((-1,) + (1,) * (xt.ndim - 1))
        mean = total / count if jnp.issubdtype(acc, jnp.floating) else jnp.floor_divide(total, count)
        out = jnp.where(touched, mean, xt.astype(acc)).astype(x.dtype)
    return jnp.moveaxis(out, 0, d)


@lower(aten.put.default)
def put(x, index, source, accumulate: bool = False):
    flat = x.reshape(-1)
    idx = index.reshape(-1)
    idx = jnp.where(idx < 0, idx + flat.shape[0], idx)
    src = source.reshape(-1).astype(x.dtype)
    out = flat.at[idx].add(src) if accumulate else flat.at[idx].set(src)
    return out.reshape(x.shape)


@lower(aten.masked_scatter_backward.default)
def masked_scatter_backward(grad, mask, sizes: Sequence[int]):
    """The source's gradient: the masked elements of ``grad`` in order, zero-padded to ``sizes``."""
    numel = math.prod(sizes)
    m = jnp.broadcast_to(mask, grad.shape).reshape(-1)
    g = grad.reshape(-1)
    slot = jnp.cumsum(m) - 1
    out = jnp.zeros((numel,), grad.dtype).at[jnp.where(m, slot, numel)].set(g, mode="drop")
    return out.reshape(tuple(sizes))


# --- backward ops of shrink activations and replication padding ---------------------


@lower(aten.hardshrink_backward.default, aten.softshrink_backward.default)
def shrink_backward(grad, x, lambd):
    inside = (x >= -lambd) & (x <= lambd)
    return jnp.where(inside, jnp.zeros((), grad.dtype), grad)


def _replication_pad(x, padding: Sequence[int]):
    """torch's replication pad on the last len(padding)//2 dims: output position j
    reads input position clamp(j - left, 0, size - 1) (negative amounts crop)."""
    n = len(padding) // 2
    # torch lists (left, right) pairs from the last dim backwards
    pairs = [(padding[2 * i], padding[2 * i + 1]) for i in range(n)][::-1]
    lead = x.ndim - n
    for i, (lo, hi) in enumerate(pairs):
        size = x.shape[lead + i]
        source = np.clip(np.arange(size + lo + hi) - lo, 0, size - 1)
        x = jnp.take(x, jnp.asarray(source), axis=lead + i)
    return x


@lower(
    aten.replication_pad1d_backward.default,
    aten.replication_pad2d_backward.default,
    aten.replication_pad3d_backward.default,
)
def replication_pad_backward(grad, x, padding: Sequence[int]):
    _, vjp = jax.vjp(lambda v: _replication_pad(v, padding), x)
    return vjp(grad.astype(x.dtype))[0]


# --- cdist ----------------------------------------------------------------------------


def _cdist_diff(x1, x2):
    return x1[..., :, None, :] - x2[..., None, :, :]


@lower(aten._cdist_forward.default, static_scalars=True)
def cdist_forward(x1, x2, p: float, compute_mode=None):
    if p < 0:
        raise ValueError(f"cdist: p must be non-negative, got {p}")
    diff = jnp.abs(_cdist_diff(x1, x2))
    if p == 0:
        return jnp.sum(diff != 0, axis=-1).astype(x1.dtype)
    if p == 1:
        return jnp.sum(diff, axis=-1)
    if p == 2:
        return jnp.sqrt(jnp.sum(diff * diff, axis=-1))
    if math.isinf(p):
        return jnp.max(diff, axis=-1, initial=0.0).astype(x1.dtype)
    return jnp.sum(diff**p, axis=-1) ** (1.0 / p)


@lower(aten._cdist_backward.default, static_scalars=True)
def cdist_backward(grad, x1, x2, p: float, dist):
    """d dist_ij / d x1_i, as torch defines it (0 where the distance is 0)."""
    diff = _cdist_diff(x1, x2)
    d = dist[..., None]
    zero = jnp.zeros((), x1.dtype)
    if p == 0:
        per_pair = jnp.zeros_like(diff)
    elif p == 1:
        per_pair = jnp.sign(diff)
    elif p == 2:
        per_pair = jnp.where(d == 0, zero, diff / jnp.where(d == 0, 1, d))
    elif math.isinf(p):
        per_pair = jnp.sign(diff) * (jnp.abs(diff) == d)
    else:
        safe_d = jnp.where(d == 0, 1, d)
        safe_abs = jnp.where(diff == 0, 1, jnp.abs(diff))
        per_pair = jnp.where((d == 0) | (diff == 0), zero, jnp.sign(diff) * safe_abs ** (p - 1) / safe_d ** (p - 1))
    return jnp.sum(grad[..., None] * per_pair, axis=-2).astype(x1.dtype)


# --- segment_reduce ---------------------------------------------------------------------


def _segment_reduce(data, reduce: str, lengths, offsets, axis: int, initial):
    """torch's ``segment_reduce`` over 1-d ``lengths`` (or ``offsets``) along ``axis``."""
    if reduce not in ("sum", "mean", "max", "min", "prod"):
        raise ValueError(f"segment_reduce: reduce must be sum, mean, max, min or prod, got {reduce!r}")
    bounds = lengths if lengths is not None else offsets
    if bounds is None:
        raise ValueError("segment_reduce: pass lengths or offsets")
    if bounds.ndim != 1:
        raise NotImplementedError("segment_reduce on the tpu device supports 1-d lengths/offsets only")
    d = norm_dim(axis, data.ndim)
    x = jnp.moveaxis(data, d, 0)
    if lengths is not None:
        ends = jnp.cumsum(lengths)
        starts = ends - lengths
    else:
        starts, ends = offsets[:-1], offsets[1:]
    segments = ends.shape[0]
    pos = jnp.arange(x.shape[0])
    seg = jnp.searchsorted(ends, pos, side="right")
    seg = jnp.where((pos >= starts[jnp.clip(seg, 0, segments - 1)]) & (seg < segments), seg, segments)
    counts = (ends - starts).reshape((segments,) + (1,) * (x.ndim - 1))
    acc = jnp.promote_types(x.dtype, jnp.float32)
    xa = x.astype(acc)
    if reduce in ("sum", "mean"):
        out = jax.ops.segment_sum(xa, seg, num_segments=segments)
        if initial is not None:
            out = out + jnp.asarray(initial, acc)
        if reduce == "mean":
            empty_value = jnp.asarray(initial, acc) if initial is not None else jnp.asarray(jnp.nan, acc)
            out = jnp.where(counts > 0, out / jnp.where(counts > 0, counts, 1), empty_value)
    elif reduce == "prod":
        out = jax.ops.segment_prod(xa, seg, num_segments=segments)
        if initial is not None:
            out = out * jnp.asarray(initial, acc)
    else:
        fn = jax.ops.segment_max if reduce == "max" else jax.ops.segment_min
        out = fn(xa, seg, num_segments=segments)  # empty segments: -inf / +inf
        if initial is not None:
            init = jnp.asarray(initial, acc)
            out = jnp.maximum(out, init) if reduce == "max" else jnp.minimum(out, init)
    return jnp.moveaxis(out.astype(data.dtype), 0, d)


@lower(aten.segment_reduce.default)
def segment_reduce(
    data, reduce: str, *, lengths=None, indices=None, offsets=None, axis: int = 0, unsafe: bool = False, initial=None
):
    if indices is not None:
        raise NotImplementedError("segment_reduce with indices is not supported (nor by PyTorch's CPU kernel)")
    return _segment_reduce(data, reduce, lengths, offsets, axis, initial)


@lower(aten._segment_reduce_backward.default)
def segment_reduce_backward(
    grad, output, data, reduce: str, *, lengths=None, offsets=None, axis: int = 0, initial=None
):
    _, vjp = jax.vjp(lambda v: _segment_reduce(v, reduce, lengths, offsets, axis, initial), data)
    return vjp(grad.astype(data.dtype))[0]


@lower(aten.mode.default)
def mode(x, dim: int = -1, keepdim: bool = False):
    """The most frequent value along ``dim`` (the smallest one among ties) and the
    index of its last occurrence, as torch's CPU kernel returns them. Counts come
    from an all-pairs comparison along the dim: O(n^2) in its length."""
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    d = norm_dim(dim, x.ndim)
    v = jnp.moveaxis(x, d, -1)
    n = v.shape[-1]
    equal = v[..., :, None] == v[..., None, :]
    counts = jnp.sum(equal, axis=-1)
    best = jnp.max(counts, axis=-1, keepdims=True)
    if jnp.issubdtype(v.dtype, jnp.floating):
        high = jnp.array(jnp.inf, v.dtype)
    else:
        high = jnp.array(jnp.iinfo(v.dtype).max if v.dtype != jnp.bool_ else True, v.dtype)
    value = jnp.min(jnp.where(counts == best, v, high), axis=-1)
    positions = jnp.arange(n)
    index = jnp.max(jnp.where(v == value[..., None], positions, -1), axis=-1).astype(jnp.int64)
    if keepdim:
        value, index = jnp.expand_dims(value, d), jnp.expand_dims(index, d)
    return value, index


@lower(aten.nonzero_static.default)
def nonzero_static(x, *, size: int, fill_value: int = -1):
    """The first ``size`` indices of nonzero elements (row-major), rows past the count filled with ``fill_value``.

    Unlike ``nonzero`` its shape is static, so it runs on the device.
    """
    if x.ndim == 0:
        return jnp.zeros((size, 0), jnp.int64)
    if x.size == 0:  # jnp.nonzero ignores fill_value for an empty input
        return jnp.full((size, x.ndim), fill_value, jnp.int64)
    indices = jnp.nonzero(x, size=size, fill_value=fill_value)
    return jnp.stack(indices, axis=1).astype(jnp.int64)
