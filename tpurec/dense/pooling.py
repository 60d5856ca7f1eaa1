"""Pooling, 1-3d: max (with indices), average, adaptive average, adaptive max,
max-unpool, and their backward ops.

Every pool is written the same way: per spatial dim, a static table of the
input positions each output window reads (``(out, k)`` positions plus a
validity mask for padding / ragged adaptive windows); the windows are gathered
with those tables and reduced. The tables are NumPy constants computed from the
shapes, so the program has static shapes and no host work at run time.

Max pools return torch's indices (flat positions in each input plane); their
backward scatters the gradient to those positions, which is exactly what
PyTorch does (ties and all). Average pools follow torch's divisor rules
(``count_include_pad``, ``ceil_mode`` windows clipped at the padded edge,
``divisor_override``); their backward is the vector-Jacobian product of the
forward lowering. Unbatched inputs (``(C, *spatial)``) are accepted as torch does.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from tpurec.dense._util import acc_dtype as _acc
from tpurec.dense.registry import lower

aten = torch.ops.aten


def _expand(values, n: int, default: Sequence[int] | None = None) -> tuple[int, ...]:
    """An int-list argument as one value per spatial dim (one value, or empty = ``default``)."""
    if values is None or (isinstance(values, (list, tuple)) and len(values) == 0):
        return tuple(default)
    if isinstance(values, int):
        return (values,) * n
    values = tuple(values)
    return values * n if len(values) == 1 else values


def _output_size(size: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """torch's ``pooling_output_shape``."""
    out = (size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    return out


def _sliding_positions(size, k, s, p, d, ceil_mode) -> tuple[np.ndarray, np.ndarray]:
    """(positions ``(out, k)``, valid mask) of a strided, padded, dilated window."""
    out = _output_size(size, k, s, p, d, ceil_mode)
    pos = np.arange(out)[:, None] * s - p + np.arange(k)[None, :] * d
    return pos, (pos >= 0) & (pos < size)


def _adaptive_positions(size: int, out: int) -> tuple[np.ndarray, np.ndarray]:
    """torch's adaptive windows: ``[floor(i*size/out), ceil((i+1)*size/out))``."""
    starts = np.array([(i * size) // out for i in range(out)])
    ends = np.array([-((-(i + 1) * size) // out) for i in range(out)])
    k = int((ends - starts).max()) if out else 1
    pos = starts[:, None] + np.arange(k)[None, :]
    return pos, pos < ends[:, None]


def _gather_windows(x, tables: list[tuple[np.ndarray, np.ndarray]]):
    """Windows of ``x`` (``(lead..., *spatial)``) read through per-dim position tables.

    Returns (windows ``(lead..., *out, K)``, valid ``(*out, K)``, flat input
    index of each window element ``(*out, K)``), K the product of window sizes.
    """
    n = len(tables)
    lead = x.ndim - n
    spatial = x.shape[lead:]
    w = x
    # Gather one spatial dim at a time: axis lead+2*i holds that dim's input positions.
    for i, (pos, _) in enumerate(tables):
        axis = lead + 2 * i
        w = jnp.take(w, jnp.asarray(np.clip(pos, 0, spatial[i] - 1).reshape(-1).astype(np.int32)), axis=axis)
        w = w.reshape(w.shape[:axis] + pos.shape + w.shape[axis + 1 :])
    # (lead, o1, k1, o2, k2, ...) -> (lead, o1, o2, ..., k1, k2, ...)
    order = list(range(lead)) + [lead + 2 * i for i in range(n)] + [lead + 2 * i + 1 for i in range(n)]
    w = jnp.transpose(w, order)
    out_shape = tuple(p.shape[0] for p, _ in tables)
    window = math.prod(p.shape[1] for p, _ in tables)
    w = w.reshape(w.shape[:lead] + out_shape + (window,))
    valid = np.ones((), bool)
    flat = np.zeros((), np.int64)
    plane_strides = [int(np.prod(spatial[i + 1 :])) for i in range(n)]
    for i, (pos, ok) in enumerate(tables):
        # broadcast dim i's (o_i, k_i) into (o1..on, k1..kn)
        shape = [1] * (2 * n)
        shape[i], shape[n + i] = pos.shape
        valid = valid & ok.reshape(shape)
        flat = flat + pos.reshape(shape) * plane_strides[i]
    valid = np.broadcast_to(valid, out_shape + tuple(p.shape[1] for p, _ in tables)).reshape(out_shape + (window,))
    flat = np.broadcast_to(flat, valid.shape[:-1] + tuple(p.shape[1] for p, _ in tables)).reshape(valid.shape)
    return w, valid, flat


def _lowest(dtype):
    dt = jnp.dtype(dtype)
    if jnp.issubdtype(dt, jnp.floating):
        return jnp.array(-jnp.inf, dt)
    return jnp.array(jnp.iinfo(dt).min, dt)


def _batched(x, n: int):
    """``x`` with a batch dim (unbatched pools take ``(C, *spatial)``), and whether one was added."""
    if x.ndim == n + 1:
        return x[None], True
    if x.ndim != n + 2:
        raise ValueError(f"expected a {n + 1}d or {n + 2}d input to a {n}d pool, got shape {tuple(x.shape)}")
    return x, False


def _max_over_windows(x, tables):
    """(max values, torch-style flat indices) over each window; first maximum wins, NaN propagates."""
    w, valid, flat = _gather_windows(x, tables)
    w = jnp.where(jnp.asarray(valid), w, _lowest(w.dtype))
    return _select_max(w, flat)


def _select_max(w, flat):
    """(max over the last axis of ``w``, the matching entry of ``flat``): first maximum wins, NaN propagates.

    Positions are computed in int32 and the indices returned as int64 (PyTorch's dtype): a TPU emulates
    int64, and int64 gathers and argmaxes made a ResNet's 3x3 max pool take 7.5 s of XLA:TPU compile time
    (v5e), 3.3 s in int32.
    """
    if jnp.issubdtype(w.dtype, jnp.floating):
        # torch's kernel takes a value when it is greater than the running
        # maximum or NaN: the first maximum wins, but the last NaN does.
        is_nan = jnp.isnan(w)
        peak = w == jnp.max(jnp.where(is_nan, -jnp.inf, w), axis=-1, keepdims=True)
        first_max = lax.argmax(peak, w.ndim - 1, jnp.int32)
        last_nan = w.shape[-1] - 1 - lax.argmax(jnp.flip(is_nan, axis=-1), w.ndim - 1, jnp.int32)
        k = jnp.where(jnp.any(is_nan, axis=-1), last_nan, first_max)
    else:
        k = lax.argmax(w, w.ndim - 1, jnp.int32)
    values = jnp.take_along_axis(w, k[..., None], axis=-1)[..., 0]
    if isinstance(flat, np.ndarray) and flat.size and np.abs(flat).max() < 2**31:
        flat = flat.astype(np.int32)  # (int64 indices, which a TPU emulates, only for the result)
    flat_b = jnp.broadcast_to(jnp.asarray(flat), w.shape)
    indices = jnp.take_along_axis(flat_b, k[..., None], axis=-1)[..., 0]
    return values, indices.astype(jnp.int64)


def _scatter_to_indices(grad, x_shape, indices, n: int):
    """The max-pool backward: ``grad`` summed into the input positions ``indices`` picked."""
    grad_b, unbatched = _batched(grad, n)
    idx_b, _ = _batched(indices, n)
    lead = grad_b.shape[:2]
    spatial = tuple(x_shape[-n:])
    g = grad_b.reshape(lead[0] * lead[1], math.prod(grad_b.shape[2:]))
    i = idx_b.reshape(g.shape)
    acc = _acc(g.dtype)
    out = jax.vmap(lambda gi, ii: jnp.zeros((math.prod(spatial),), acc).at[ii].add(gi.astype(acc)))(g, i)
    out = out.reshape(lead + spatial).astype(grad.dtype)
    return out[0] if unbatched else out


# --- max pools ----------------------------------------------------------------------


def _max_pool(x, n, kernel_size, stride, padding, dilation, ceil_mode):
    kernel = _expand(kernel_size, n)
    stride = _expand(stride, n, default=kernel)
    padding, dilation = _expand(padding, n), _expand(dilation, n)
    xb, unbatched = _batched(x, n)
    tables = [
        _sliding_positions(xb.shape[2 + i], kernel[i], stride[i], padding[i], dilation[i], ceil_mode) for i in range(n)
    ]
    values, indices = _max_over_windows(xb, tables)
    if unbatched:
        return values[0], indices[0]
    return values, indices


@lower(aten.max_pool2d_with_indices.default)
def max_pool2d_with_indices(x, kernel_size, stride=(), padding=(0,), dilation=(1,), ceil_mode: bool = False):
    return _max_pool(x, 2, kernel_size, stride, padding, dilation, ceil_mode)


@lower(aten.max_pool3d_with_indices.default)
def max_pool3d_with_indices(x, kernel_size, stride=(), padding=(0,), dilation=(1,), ceil_mode: bool = False):
    return _max_pool(x, 3, kernel_size, stride, padding, dilation, ceil_mode)


@lower(aten.max_pool2d_with_indices_backward.default)
def max_pool2d_with_indices_backward(grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    return _scatter_to_indices(grad, x.shape, indices, 2)


@lower(aten.max_pool3d_with_indices_backward.default)
def max_pool3d_with_indices_backward(grad, x, kernel_size, stride, padding, dilation, ceil_mode, indices):
    return _scatter_to_indices(grad, x.shape, indices, 3)


def _adaptive_max(x, n, output_size):
    output_size = _expand(output_size, n)
    xb, unbatched = _batched(x, n)
    tables = [_adaptive_positions(xb.shape[2 + i], output_size[i]) for i in range(n)]
    values, indices = _max_over_windows(xb, tables)
    if unbatched:
        return values[0], indices[0]
    return values, indices


@lower(aten.adaptive_max_pool2d.default)
def adaptive_max_pool2d(x, output_size):
    return _adaptive_max(x, 2, output_size)


@lower(aten.adaptive_max_pool3d.default)
def adaptive_max_pool3d(x, output_size):
    return _adaptive_max(x, 3, output_size)


@lower(aten.adaptive_max_pool2d_backward.default)
def adaptive_max_pool2d_backward(grad, x, indices):
    return _scatter_to_indices(grad, x.shape, indices, 2)


@lower(aten.adaptive_max_pool3d_backward.default)
def adaptive_max_pool3d_backward(grad, x, indices):
    return _scatter_to_indices(grad, x.shape, indices, 3)


# --- max unpool: the scatter of a max pool's values back to their indices -----------


def _max_unpool(x, indices, output_size, n):
    xb, unbatched = _batched(x, n)
    ib, _ = _batched(indices, n)
    lead = xb.shape[:2]
    out_elems = math.prod(output_size)
    v = xb.reshape(lead[0] * lead[1], math.prod(xb.shape[2:]))
    i = ib.reshape(v.shape)
    out = jax.vmap(lambda vi, ii: jnp.zeros((out_elems,), vi.dtype).at[ii].set(vi, mode="drop"))(v, i)
    out = out.reshape(lead + tuple(output_size))
    return out[0] if unbatched else out


@lower(aten.max_unpool2d.default)
def max_unpool2d(x, indices, output_size):
    return _max_unpool(x, indices, tuple(output_size), 2)


@lower(aten.max_unpool3d.default)
def max_unpool3d(x, indices, output_size, stride, padding):
    return _max_unpool(x, indices, tuple(output_size), 3)


# --- average pools -------------------------------------------------------------------


def _avg_divisor(size, k, s, p, ceil_mode, count_include_pad) -> np.ndarray:
    """torch's per-window element count along one dim."""
    out = _output_size(size, k, s, p, 1, ceil_mode)
    start = np.arange(out) * s - p
    end = np.minimum(start + k, size + p)
    pool = end - start
    if count_include_pad:
        return pool
    return np.minimum(end, size) - np.maximum(start, 0)


def _avg_pool(x, n, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    kernel = _expand(kernel_size, n)
    stride = _expand(stride, n, default=kernel)
    padding = _expand(padding, n)
    xb, unbatched = _batched(x, n)
    spatial = xb.shape[2:]
    tables = [_sliding_positions(spatial[i], kernel[i], stride[i], padding[i], 1, ceil_mode) for i in range(n)]
    acc = _acc(xb.dtype)
    w, valid, _ = _gather_windows(xb.astype(acc), tables)
    total = jnp.sum(jnp.where(jnp.asarray(valid), w, jnp.zeros((), acc)), axis=-1)
    if divisor_override:
        out = total / jnp.asarray(divisor_override, acc)
    else:
        divisor = np.ones((), np.int64)
        for i in range(n):
            d = _avg_divisor(spatial[i], kernel[i], stride[i], padding[i], ceil_mode, count_include_pad)
            shape = [1] * n
            shape[i] = d.shape[0]
            divisor = divisor * d.reshape(shape)
        out = total / jnp.asarray(divisor, acc)
    out = out.astype(x.dtype)
    return out[0] if unbatched else out


@lower(aten.avg_pool2d.default)
def avg_pool2d(x, kernel_size, stride=(), padding=(0,), ceil_mode=False, count_include_pad=True, divisor_override=None):
    return _avg_pool(x, 2, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


@lower(aten.avg_pool3d.default)
def avg_pool3d(x, kernel_size, stride=(), padding=(0,), ceil_mode=False, count_include_pad=True, divisor_override=None):
    return _avg_pool(x, 3, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


def _vjp(forward, x, grad):
    _, vjp = jax.vjp(forward, x)
    return vjp(grad.astype(x.dtype))[0]


@lower(aten.avg_pool2d_backward.default)
def avg_pool2d_backward(grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    forward = lambda x_: _avg_pool(x_, 2, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)  # noqa: E731
    return _vjp(forward, x, grad)


@lower(aten.avg_pool3d_backward.default)
def avg_pool3d_backward(grad, x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    forward = lambda x_: _avg_pool(x_, 3, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)  # noqa: E731
    return _vjp(forward, x, grad)


def _adaptive_avg(x, n, output_size):
    output_size = _expand(output_size, n)
    xb, unbatched = _batched(x, n)
    tables = [_adaptive_positions(xb.shape[2 + i], output_size[i]) for i in range(n)]
    acc = _acc(xb.dtype)
    w, valid, _ = _gather_windows(xb.astype(acc), tables)
    valid = jnp.asarray(valid)
    total = jnp.sum(jnp.where(valid, w, jnp.zeros((), acc)), axis=-1)
    out = (total / jnp.sum(valid, axis=-1).astype(acc)).astype(x.dtype)
    return out[0] if unbatched else out


@lower(aten._adaptive_avg_pool2d.default)
def adaptive_avg_pool2d(x, output_size):
    return _adaptive_avg(x, 2, output_size)


@lower(aten._adaptive_avg_pool3d.default)
def adaptive_avg_pool3d(x, output_size):
    return _adaptive_avg(x, 3, output_size)


@lower(aten._adaptive_avg_pool2d_backward.default)
def adaptive_avg_pool2d_backward(grad, x):
    return _vjp(lambda x_: _adaptive_avg(x_, 2, grad.shape[-2:]), x, grad)


@lower(aten._adaptive_avg_pool3d_backward.default)
def adaptive_avg_pool3d_backward(grad, x):
    return _vjp(lambda x_: _adaptive_avg(x_, 3, grad.shape[-3:]), x, grad)
