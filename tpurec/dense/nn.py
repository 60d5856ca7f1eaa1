"""Neural-network ops: softmax family, layer norm, batch norm, dropout, losses,
embedding, glu, and their backward ops.

Low-precision inputs compute in float32 and round once (torch's CPU kernels
do the same). Loss ``reduction`` is torch's enum: 0 none, 1 mean, 2 sum.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import torch

from tpurec.dense._util import cast, norm_dim
from tpurec.dense._util import acc_dtype as _acc
from tpurec.dense.registry import lower, to_jax_dtype
from tpurec.dense import transcendental

aten = torch.ops.aten

NONE, MEAN, SUM = 0, 1, 2


def _reduce(loss, reduction: int):
    if reduction == MEAN:
        return jnp.mean(loss)
    if reduction == SUM:
        return jnp.sum(loss)
    return loss


def _grad_scale(grad, n: int, reduction: int):
    """The upstream gradient as seen by each element of an unreduced loss."""
    return grad / n if reduction == MEAN else grad


# --- softmax ----------------------------------------------------------------------


def _softmax_impl(fn, x, dim: int, half_to_float: bool):
    out = jnp.float32 if half_to_float else x.dtype
    if x.ndim == 0:
        return fn(x.astype(_acc(x.dtype)).reshape(1), axis=0).reshape(()).astype(out)
    return fn(x.astype(_acc(x.dtype)), axis=norm_dim(dim, x.ndim)).astype(out)


@lower(aten._softmax.default)
def softmax(x, dim: int, half_to_float: bool):
    return _softmax_impl(transcendental.softmax, x, dim, half_to_float)


@lower(aten._log_softmax.default)
def log_softmax(x, dim: int, half_to_float: bool):
    return _softmax_impl(transcendental.log_softmax, x, dim, half_to_float)


@lower(aten._safe_softmax.default)
def safe_softmax(x, dim: int, dtype=None):
    """Softmax whose fully-masked (all -inf) rows give 0, not NaN (attention)."""
    if dtype is not None:
        x = x.astype(to_jax_dtype(dtype))
    out = softmax(x, dim, False)
    if x.ndim == 0:
        return out
    d = norm_dim(dim, x.ndim)
    masked = jnp.all(x == -jnp.inf, axis=d, keepdims=True)
    return jnp.where(masked, jnp.zeros((), out.dtype), out)


@lower(aten._softmax_backward_data.default)
def softmax_backward(grad, output, dim: int, input_dtype):
    acc = _acc(grad.dtype)
    g, y = grad.astype(acc), output.astype(acc)
    d = norm_dim(dim, grad.ndim) if grad.ndim else None
    gi = y * (g - jnp.sum(g * y, axis=d, keepdims=True))
    return gi.astype(to_jax_dtype(input_dtype))


@lower(aten._log_softmax_backward_data.default)
def log_softmax_backward(grad, output, dim: int, input_dtype):
    acc = _acc(grad.dtype)
    g, y = grad.astype(acc), output.astype(acc)
    d = norm_dim(dim, grad.ndim) if grad.ndim else None
    gi = g - transcendental.exp(y) * jnp.sum(g, axis=d, keepdims=True)
    return gi.astype(to_jax_dtype(input_dtype))


# --- normalization -------------------------------------------------------------------


@lower(aten.native_layer_norm.default)
def native_layer_norm(x, normalized_shape: Sequence[int], weight, bias, eps):
    acc = _acc(x.dtype)
    axis = x.ndim - len(normalized_shape)
    axes = tuple(range(axis, x.ndim))
    xf = x.astype(acc)
    mean = jnp.mean(xf, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=axes, keepdims=True)
    rstd = jax.lax.rsqrt(var + cast(eps, acc))
    y = (xf - mean) * rstd
    if weight is not None:
        y = y * weight.astype(acc)
    if bias is not None:
        y = y + bias.astype(acc)
    return y.astype(x.dtype), mean.astype(x.dtype), rstd.astype(x.dtype)


@lower(aten.native_layer_norm_backward.default)
def native_layer_norm_backward(grad, x, normalized_shape: Sequence[int], mean, rstd, weight, bias, output_mask):
    acc = _acc(x.dtype)
    axis = x.ndim - len(normalized_shape)
    axes = tuple(range(axis, x.ndim))
    lead = tuple(range(axis))
    n = 1
    for s in normalized_shape:
        n *= s
    g, xf = grad.astype(acc), x.astype(acc)
    mean, rstd = mean.astype(acc), rstd.astype(acc)
    xhat = (xf - mean) * rstd
    gw = g * weight.astype(acc) if weight is not None else g
    gx = gw_sum = None
    if output_mask[0]:
        gw_sum = jnp.sum(gw, axis=axes, keepdims=True)
        gwx_sum = jnp.sum(gw * xhat, axis=axes, keepdims=True)
        gx = (rstd / n * (n * gw - gw_sum - xhat * gwx_sum)).astype(x.dtype)
    gweight = jnp.sum(g * xhat, axis=lead).astype(weight.dtype) if output_mask[1] and weight is not None else None
    gbias = jnp.sum(g, axis=lead).astype(bias.dtype) if output_mask[2] and bias is not None else None
    return gx, gweight, gbias


def _grouped(x, n: int, c: int, hxw: int, group: int):
    """``x`` (N, C, *) seen as (N, group, C // group, H*W): the axes group norm reduces are the last two."""
    return x.reshape(n, group, c // group, hxw)


@lower(aten.native_group_norm.default)
def native_group_norm(x, weight, bias, n: int, c: int, hxw: int, group: int, eps):
    acc = _acc(x.dtype)
    xf = _grouped(x.astype(acc), n, c, hxw, group)
    mean = jnp.mean(xf, axis=(2, 3), keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=(2, 3), keepdims=True)
    rstd = jax.lax.rsqrt(var + cast(eps, acc))
    y = ((xf - mean) * rstd).reshape(n, c, hxw)
    if weight is not None:
        y = y * weight.astype(acc).reshape(1, c, 1)
    if bias is not None:
        y = y + bias.astype(acc).reshape(1, c, 1)
    stats_shape = (n, group)
    return (
        y.reshape(x.shape).astype(x.dtype),
        mean.reshape(stats_shape).astype(x.dtype),
        rstd.reshape(stats_shape).astype(x.dtype),
    )


@lower(aten.native_group_norm_backward.default)
def native_group_norm_backward(grad, x, mean, rstd, weight, n: int, c: int, hxw: int, group: int, output_mask):
    acc = _acc(x.dtype)
    g = grad.astype(acc).reshape(n, c, hxw)
    mean = mean.astype(acc).reshape(n, group, 1, 1)
    rstd = rstd.astype(acc).reshape(n, group, 1, 1)
    xhat = ((_grouped(x.astype(acc), n, c, hxw, group) - mean) * rstd).reshape(n, c, hxw)
    gw = g * weight.astype(acc).reshape(1, c, 1) if weight is not None else g
    gx = None
    if output_mask[0]:
        count = (c // group) * hxw
        gw4 = _grouped(gw, n, c, hxw, group)
        xhat4 = _grouped(xhat, n, c, hxw, group)
        gw_sum = jnp.sum(gw4, axis=(2, 3), keepdims=True)
        gwx_sum = jnp.sum(gw4 * xhat4, axis=(2, 3), keepdims=True)
        gx = (rstd / count * (count * gw4 - gw_sum - xhat4 * gwx_sum)).reshape(x.shape).astype(x.dtype)
    gweight = jnp.sum(g * xhat, axis=(0, 2)).astype(weight.dtype) if output_mask[1] and weight is not None else None
    gbias = jnp.sum(g, axis=(0, 2)).astype(x.dtype) if output_mask[2] else None
    return gx, gweight, gbias


def _bn_shape(x, v):
    """A per-channel vector broadcast against NC... input."""
    return v.reshape((1, -1) + (1,) * (x.ndim - 2))


def _bn_apply(x, mean, invstd, weight, bias, acc):
    y = (x.astype(acc) - _bn_shape(x, mean)) * _bn_shape(x, invstd)
    if weight is not None:
        y = y * _bn_shape(x, weight.astype(acc))
    if bias is not None:
        y = y + _bn_shape(x, bias.astype(acc))
    return y.astype(x.dtype)


def _bn_stats(x, eps, acc):
    axes = (0,) + tuple(range(2, x.ndim))
    xf = x.astype(acc)
    mean = jnp.mean(xf, axis=axes)
    var = jnp.mean(jnp.square(xf - _bn_shape(x, mean)), axis=axes)
    return mean, var, jax.lax.rsqrt(var + cast(eps, acc)), x.size // x.shape[1]


@lower(aten._native_batch_norm_legit_functional.default)
def batch_norm_functional(x, weight, bias, running_mean, running_var, training: bool, momentum, eps):
    acc = _acc(x.dtype)
    if not training:
        invstd = jax.lax.rsqrt(running_var.astype(acc) + cast(eps, acc))
        out = _bn_apply(x, running_mean.astype(acc), invstd, weight, bias, acc)
        empty = jnp.zeros((0,), acc)
        return out, empty, empty, running_mean, running_var
    mean, var, invstd, n = _bn_stats(x, eps, acc)
    m = cast(momentum, acc)
    new_mean = ((1 - m) * running_mean.astype(acc) + m * mean).astype(running_mean.dtype)
    new_var = ((1 - m) * running_var.astype(acc) + m * var * (n / max(n - 1, 1))).astype(running_var.dtype)
    return _bn_apply(x, mean, invstd, weight, bias, acc), mean, invstd, new_mean, new_var


@lower(aten._native_batch_norm_legit.no_stats)
def batch_norm_no_stats(x, weight, bias, training: bool, momentum, eps):
    acc = _acc(x.dtype)
    mean, _, invstd, _ = _bn_stats(x, eps, acc)
    return _bn_apply(x, mean, invstd, weight, bias, acc), mean, invstd


@lower(aten._native_batch_norm_legit_no_training.default)
def batch_norm_no_training(x, weight, bias, running_mean, running_var, momentum, eps):
    acc = _acc(x.dtype)
    invstd = jax.lax.rsqrt(running_var.astype(acc) + cast(eps, acc))
    empty = jnp.zeros((0,), acc)
    return _bn_apply(x, running_mean.astype(acc), invstd, weight, bias, acc), empty, empty


@lower(aten.native_batch_norm_backward.default)
def batch_norm_backward(
    grad, x, weight, running_mean, running_var, save_mean, save_invstd, train: bool, eps, output_mask
):
    acc = _acc(x.dtype)
    axes = (0,) + tuple(range(2, x.ndim))
    g, xf = grad.astype(acc), x.astype(acc)
    if train:
        mean, invstd = save_mean.astype(acc), save_invstd.astype(acc)
    else:
        mean = running_mean.astype(acc)
        invstd = jax.lax.rsqrt(running_var.astype(acc) + cast(eps, acc))
    w = weight.astype(acc) if weight is not None else jnp.ones_like(mean)
    xhat = (xf - _bn_shape(x, mean)) * _bn_shape(x, invstd)
    sum_g = jnp.sum(g, axis=axes)
    sum_gx = jnp.sum(g * xhat, axis=axes)
    gx = None
    if output_mask[0]:
        if train:
            n = x.size // x.shape[1]
            gx = _bn_shape(x, w * invstd) * (g - _bn_shape(x, sum_g / n) - xhat * _bn_shape(x, sum_gx / n))
        else:
            gx = g * _bn_shape(x, w * invstd)
        gx = gx.astype(x.dtype)
    gw = sum_gx.astype(weight.dtype if weight is not None else x.dtype) if output_mask[1] else None
    gb = sum_g.astype(weight.dtype if weight is not None else x.dtype) if output_mask[2] else None
    return gx, gw, gb


# --- dropout -----------------------------------------------------------------------------


@lower(aten.native_dropout.default, random=True)
def native_dropout(x, p, train, *, key):
    if train is not None and not train:
        return x, jnp.ones(x.shape, jnp.bool_)
    acc = _acc(x.dtype)
    p = cast(p, acc)
    keep = jax.random.uniform(key, x.shape, acc) >= p
    scale = jnp.where(p >= 1, jnp.zeros((), acc), 1 / (1 - p))
    return (x.astype(acc) * keep * scale).astype(x.dtype), keep


@lower(aten.native_dropout_backward.default)
def native_dropout_backward(grad, mask, scale):
    acc = _acc(grad.dtype)
    return (grad.astype(acc) * mask.astype(acc) * cast(scale, acc)).astype(grad.dtype)


# --- losses ------------------------------------------------------------------------------------


@lower(aten.mse_loss.default)
def mse_loss(x, y, reduction: int = MEAN):
    acc = _acc(x.dtype)
    return _reduce(jnp.square(x.astype(acc) - y.astype(acc)), reduction).astype(x.dtype)


@lower(aten.mse_loss_backward.default)
def mse_loss_backward(grad, x, y, reduction: int):
    acc = _acc(x.dtype)
    g = _grad_scale(grad.astype(acc), x.size, reduction)
    return (2 * (x.astype(acc) - y.astype(acc)) * g).astype(x.dtype)


@lower(aten.smooth_l1_loss.default)
def smooth_l1_loss(x, y, reduction: int = MEAN, beta=1.0):
    acc = _acc(x.dtype)
    d = jnp.abs(x.astype(acc) - y.astype(acc))
    b = cast(beta, acc)
    loss = jnp.where(d < b, 0.5 * d * d / jnp.where(b == 0, 1, b), d - 0.5 * b)
    return _reduce(loss, reduction).astype(x.dtype)


@lower(aten.smooth_l1_loss_backward.default)
def smooth_l1_loss_backward(grad, x, y, reduction: int, beta):
    acc = _acc(x.dtype)
    d = x.astype(acc) - y.astype(acc)
    b = cast(beta, acc)
    g = _grad_scale(grad.astype(acc), x.size, reduction)
    inner = d / jnp.where(b == 0, 1, b)
    gi = jnp.where(d < -b, -g, jnp.where(d > b, g, g * inner))
    return gi.astype(x.dtype)


@lower(aten.huber_loss.default)
def huber_loss(x, y, reduction: int = MEAN, delta=1.0):
    acc = _acc(x.dtype)
    d = jnp.abs(x.astype(acc) - y.astype(acc))
    dl = cast(delta, acc)
    loss = jnp.where(d < dl, 0.5 * d * d, dl * (d - 0.5 * dl))
    return _reduce(loss, reduction).astype(x.dtype)


@lower(aten.huber_loss_backward.default)
def huber_loss_backward(grad, x, y, reduction: int, delta):
    acc = _acc(x.dtype)
    d = x.astype(acc) - y.astype(acc)
    dl = cast(delta, acc)
    g = _grad_scale(grad.astype(acc), x.size, reduction)
    gi = jnp.where(d < -dl, -g * dl, jnp.where(d > dl, g * dl, g * d))
    return gi.astype(x.dtype)


@lower(aten.binary_cross_entropy.default)
def binary_cross_entropy(x, y, weight=None, reduction: int = MEAN):
    acc = _acc(x.dtype)
    xf, yf = x.astype(acc), y.astype(acc)
    # torch clamps the logs at -100 so that x = 0 or 1 gives a finite loss.
    loss = -(yf * jnp.maximum(transcendental.log(xf), -100) + (1 - yf) * jnp.maximum(transcendental.log1p(-xf), -100))
    if weight is not None:
        loss = loss * weight.astype(acc)
    return _reduce(loss, reduction).astype(x.dtype)


@lower(aten.binary_cross_entropy_backward.default)
def binary_cross_entropy_backward(grad, x, y, weight=None, reduction: int = MEAN):
    acc = _acc(x.dtype)
    xf, yf = x.astype(acc), y.astype(acc)
    g = _grad_scale(grad.astype(acc), x.size, reduction)
    gi = g * (xf - yf) / jnp.maximum((1 - xf) * xf, 1e-12)
    if weight is not None:
        gi = gi * weight.astype(acc)
    return gi.astype(x.dtype)


@lower(aten.binary_cross_entropy_with_logits.default)
def binary_cross_entropy_with_logits(x, y, weight=None, pos_weight=None, reduction: int = MEAN):
    acc = _acc(x.dtype)
    xf, yf = x.astype(acc), y.astype(acc)
    sp = transcendental.softplus(-xf)  # log(1 + exp(-x)), computed stably
    if pos_weight is not None:
        loss = (1 - yf) * xf + ((pos_weight.astype(acc) - 1) * yf + 1) * sp
    else:
        loss = (1 - yf) * xf + sp
    if weight is not None:
        loss = loss * weight.astype(acc)
    return _reduce(loss, reduction).astype(x.dtype)


def _nll_layout(x, target):
    """Logits with the class dim last and matching flat targets."""
    if x.ndim == 1:
        return x[None, :], target.reshape(1)
    xm = jnp.moveaxis(x, 1, -1)
    return xm.reshape(-1, x.shape[1]), target.reshape(-1)


def _nll_weights(x, target, weight, ignore_index: int, acc):
    c = x.shape[-1] if x.ndim == 1 else x.shape[1]
    w = weight.astype(acc) if weight is not None else jnp.ones((c,), acc)
    valid = target != ignore_index
    safe = jnp.where(valid, target, 0)
    return safe, jnp.where(valid, w[safe], 0)


@lower(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def nll_loss_forward(x, target, weight, reduction: int, ignore_index: int):
    acc = _acc(x.dtype)
    flat, t = _nll_layout(x.astype(acc), target)
    safe, w = _nll_weights(x, t, weight, ignore_index, acc)
    picked = -jnp.take_along_axis(flat, safe[:, None], axis=1)[:, 0] * w
    total = jnp.sum(w)
    if reduction == NONE:
        out = picked.reshape(target.shape)
        return out.astype(x.dtype), jnp.zeros((), x.dtype)
    loss = jnp.sum(picked)
    if reduction == MEAN:
        loss = loss / total
    return loss.astype(x.dtype), total.astype(x.dtype)


@lower(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def nll_loss_backward(grad, x, target, weight, reduction: int, ignore_index: int, total_weight):
    acc = _acc(x.dtype)
    flat, t = _nll_layout(jnp.zeros(x.shape, acc), target)
    safe, w = _nll_weights(x, t, weight, ignore_index, acc)
    g = grad.astype(acc)
    if reduction == NONE:
        g = g.reshape(-1)
    elif reduction == MEAN:
        g = g / total_weight.astype(acc)
    vals = -w * g
    out = flat.at[jnp.arange(flat.shape[0]), safe].set(vals)
    if x.ndim == 1:
        out = out[0]
    else:
        shape = (x.shape[0],) + x.shape[2:] + (x.shape[1],)
        out = jnp.moveaxis(out.reshape(shape), -1, 1)
    return out.astype(x.dtype)


# --- embedding ------------------------------------------------------------------------------------


@lower(aten.embedding.default)
def embedding(weight, indices, padding_idx: int = -1, scale_grad_by_freq: bool = False, sparse: bool = False):
    return jnp.take(weight, indices, axis=0)


@lower(aten.embedding_dense_backward.default)
def embedding_dense_backward(grad, indices, num_weights: int, padding_idx: int, scale_grad_by_freq: bool):
    acc = _acc(grad.dtype)
    d = grad.shape[-1]
    idx = indices.reshape(-1)
    g = grad.reshape(-1, d).astype(acc)
    if padding_idx >= 0:
        g = jnp.where((idx == padding_idx)[:, None], 0, g)
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), acc).at[idx].add(1)
        g = g / counts[idx][:, None]
    return jnp.zeros((num_weights, d), acc).at[idx].add(g).astype(grad.dtype)


# --- gated linear unit --------------------------------------------------------------------------------


@lower(aten.glu.default)
def glu(x, dim: int = -1):
    acc = _acc(x.dtype)
    a, b = jnp.split(x.astype(acc), 2, axis=norm_dim(dim, x.ndim))
    return (a * transcendental.sigmoid(b)).astype(x.dtype)


@lower(aten.glu_backward.default)
def glu_backward(grad, x, dim: int):
    acc = _acc(x.dtype)
    d = norm_dim(dim, x.ndim)
    a, b = jnp.split(x.astype(acc), 2, axis=d)
    g = grad.astype(acc)
    s = transcendental.sigmoid(b)
    return jnp.concatenate([g * s, g * a * s * (1 - s)], axis=d).astype(x.dtype)


# --- embedding bags (nn.EmbeddingBag) ----------------------------------------------------------
#
# Shapes follow PyTorch's meta kernel: offset2bag [N], bag_size [len(offsets)],
# max_indices [B, D] in max mode and [0] otherwise. The backward recomputes bag
# membership from indices and offsets, so it does not depend on the CPU kernel's
# mode-specific auxiliary outputs.

_SUM, _MEAN, _MAX = 0, 1, 2


def _bags(indices, offsets, include_last_offset: bool, padding_idx: int):
    """(bag of each index, number of bags, which indices count)."""
    n = indices.shape[0]
    num_bags = offsets.shape[0] - 1 if include_last_offset else offsets.shape[0]
    offset2bag = jnp.searchsorted(offsets, jnp.arange(n, dtype=offsets.dtype), side="right") - 1
    valid = (offset2bag >= 0) & (offset2bag < num_bags)
    if padding_idx >= 0:
        valid = valid & (indices != padding_idx)
    return jnp.clip(offset2bag, 0, max(num_bags - 1, 0)), num_bags, valid


@lower(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
def embedding_bag(
    weight,
    indices,
    offsets,
    scale_grad_by_freq: bool = False,
    mode: int = 0,
    sparse: bool = False,
    per_sample_weights=None,
    include_last_offset: bool = False,
    padding_idx: int = -1,
):
    acc = _acc(weight.dtype)
    bag, num_bags, valid = _bags(indices, offsets, include_last_offset, padding_idx)
    rows = jnp.take(weight, indices, axis=0).astype(acc)
    counts = jax.ops.segment_sum(valid.astype(jnp.int64), bag, num_segments=num_bags)
    bag_size = jnp.zeros((offsets.shape[0],), jnp.int64).at[:num_bags].set(counts)
    if mode == _MAX:
        masked = jnp.where(valid[:, None], rows, -jnp.inf)
        best = jax.ops.segment_max(masked, bag, num_segments=num_bags)
        # The first index reaching the maximum, per bag and column (as the CPU kernel picks).
        position = jnp.where(
            valid[:, None] & (masked == best[bag]), jnp.arange(indices.shape[0])[:, None], indices.shape[0]
        )
        first = jax.ops.segment_min(position, bag, num_segments=num_bags)
        empty = (counts == 0)[:, None]
        max_indices = jnp.where(empty, -1, jnp.take(indices, jnp.clip(first, 0, max(indices.shape[0] - 1, 0))))
        out = jnp.where(empty, 0, best)
        return out.astype(weight.dtype), bag, bag_size, max_indices.astype(jnp.int64)
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.astype(acc)[:, None]
    out = jax.ops.segment_sum(jnp.where(valid[:, None], rows, 0), bag, num_segments=num_bags)
    if mode == _MEAN:
        out = out / jnp.maximum(counts, 1).astype(acc)[:, None]
    return out.astype(weight.dtype), bag, bag_size, jnp.zeros((0,), jnp.int64)


@lower(aten._embedding_bag_backward.default)
def embedding_bag_backward(
    grad,
    indices,
    offsets,
    offset2bag,
    bag_size,
    maximum_indices,
    num_weights: int,
    scale_grad_by_freq: bool,
    mode: int,
    sparse: bool,
    per_sample_weights=None,
    padding_idx: int = -1,
):
    acc = _acc(grad.dtype)
    g = grad.astype(acc)
    d = g.shape[-1]
    num_bags = g.shape[0]
    include_last_offset = offsets.shape[0] == num_bags + 1
    if mode == _MAX:
        idx = maximum_indices.reshape(-1)
        cols = jnp.tile(jnp.arange(d), num_bags)
        keep = idx >= 0
        out = jnp.zeros((num_weights, d), acc).at[jnp.where(keep, idx, 0), cols].add(jnp.where(keep, g.reshape(-1), 0))
        return out.astype(grad.dtype)
    bag, _, valid = _bags(indices, offsets, include_last_offset, padding_idx)
    rows = g[bag]
    if mode == _MEAN:
        counts = jax.ops.segment_sum(valid.astype(acc), bag, num_segments=num_bags)
        rows = rows / jnp.maximum(counts, 1)[bag][:, None]
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.astype(acc)[:, None]
    if scale_grad_by_freq:
        freq = jnp.zeros((num_weights,), acc).at[indices].add(valid.astype(acc))
        rows = rows / jnp.maximum(freq[indices], 1)[:, None]
    rows = jnp.where(valid[:, None], rows, 0)
    return jnp.zeros((num_weights, d), acc).at[indices].add(rows).astype(grad.dtype)


@lower(aten._embedding_bag_per_sample_weights_backward.default)
def embedding_bag_per_sample_weights_backward(
    grad, weight, indices, offsets, offset2bag, mode: int, padding_idx: int = -1
):
    acc = _acc(grad.dtype)
    include_last_offset = offsets.shape[0] == grad.shape[0] + 1
    bag, _, valid = _bags(indices, offsets, include_last_offset, padding_idx)
    dots = jnp.sum(grad.astype(acc)[bag] * jnp.take(weight, indices, axis=0).astype(acc), axis=-1)
    return jnp.where(valid, dots, 0).astype(grad.dtype)


@lower(aten._trilinear.default)
def _trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim: int = 1):
    """``nn.functional.bilinear``'s core: the three inputs, each with size-1 dims inserted at its
    ``expand`` positions, multiplied (broadcasting) and summed over ``sumdim`` (those dims removed)."""

    def expanded(x, dims):
        for d in sorted(dims):
            x = jnp.expand_dims(x, d)
        return x

    product = expanded(i1, expand1) * expanded(i2, expand2) * expanded(i3, expand3)
    return product.sum(axis=tuple(sumdim)) if sumdim else product
