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
from tpurec.dense.registry import lower, to_jax_dtype

aten = torch.ops.aten

NONE, MEAN, SUM = 0, 1, 2


def _acc(dtype) -> jnp.dtype:
    dt = jnp.dtype(dtype)
    if dt in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return jnp.dtype(jnp.float32)
    return dt


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
    return _softmax_impl(jax.nn.softmax, x, dim, half_to_float)


@lower(aten._log_softmax.default)
def log_softmax(x, dim: int, half_to_float: bool):
    return _softmax_impl(jax.nn.log_softmax, x, dim, half_to_float)


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
    gi = g - jnp.exp(y) * jnp.sum(g, axis=d, keepdims=True)
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
def batch_norm_backward(grad, x, weight, running_mean, running_var, save_mean, save_invstd, train: bool, eps, output_mask):
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
    loss = -(yf * jnp.maximum(jnp.log(xf), -100) + (1 - yf) * jnp.maximum(jnp.log1p(-xf), -100))
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
    # softplus(-x) = log(1 + exp(-x)), computed stably.
    sp = jnp.log1p(jnp.exp(-jnp.abs(xf))) + jnp.maximum(-xf, 0)
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
    return (a * jax.nn.sigmoid(b)).astype(x.dtype)


@lower(aten.glu_backward.default)
def glu_backward(grad, x, dim: int):
    acc = _acc(x.dtype)
    d = norm_dim(dim, x.ndim)
    a, b = jnp.split(x.astype(acc), 2, axis=d)
    g = grad.astype(acc)
    s = jax.nn.sigmoid(b)
    return jnp.concatenate([g * s, g * a * s * (1 - s)], axis=d).astype(x.dtype)
