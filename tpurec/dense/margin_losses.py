"""Backward of the multi-class margin losses (their forwards run through torch's decompositions).

Written out rather than derived with ``jax.vjp``: ATen's CPU kernels count a hinge
only where it is strictly positive (a margin of exactly zero gives no gradient),
where autodiff of ``maximum(0, z)`` would give half.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch

from tpurec.dense.registry import lower

aten = torch.ops.aten

_MEAN, _NONE = 1, 0  # at::Reduction


def _as_matrix(x):
    """Inputs are (C,) or (N, C); the kernels treat (C,) as one row."""
    return x.reshape(1, -1) if x.ndim <= 1 else x


def _one_hot(index, classes: int, dtype):
    """(N,) indices -> (N, C) one-hot."""
    return (index[:, None] == jnp.arange(classes)[None, :]).astype(dtype)


def _one_hot_rows(index, classes: int, dtype):
    """(N, K) indices -> (N, K, C) one-hot."""
    return (index[:, :, None] == jnp.arange(classes)[None, None, :]).astype(dtype)


def _scaled_by_grad_output(grad_rows, grad_output, reduction: int, shape):
    """Each row times its element of ``grad_output`` (reduction none), or all times the scalar."""
    if reduction == _NONE and grad_output.ndim > 0:
        grad_rows = grad_rows * grad_output.reshape(-1, 1).astype(grad_rows.dtype)
    else:
        grad_rows = grad_rows * grad_output.reshape(()).astype(grad_rows.dtype)
    return grad_rows.reshape(shape)


@lower(aten.multi_margin_loss_backward.default, static_scalars=True)
def multi_margin_loss_backward(grad_output, x, target, p, margin, weight=None, reduction: int = _MEAN):
    """d/dx of ``sum_{j != y} max(0, margin - x[y] + x[j])^p * w[y] / C`` (averaged over rows for mean)."""
    rows = _as_matrix(x)
    n, classes = rows.shape
    target = target.reshape(-1).astype(jnp.int32)
    g = 1.0 / (n * classes) if reduction == _MEAN else 1.0 / classes
    x_target = jnp.take_along_axis(rows, target[:, None], axis=1)
    z = margin - x_target + rows
    others = jnp.arange(classes)[None, :] != target[:, None]
    slope = jnp.full_like(z, g) if p == 1 else 2 * g * z
    h = jnp.where(others & (z > 0), slope, 0)
    if weight is not None:
        h = h * weight.astype(h.dtype)[target][:, None]
    # x[y] enters every hinge with the opposite sign.
    grad = h - _one_hot(target, classes, h.dtype) * h.sum(axis=1, keepdims=True)
    return _scaled_by_grad_output(grad, grad_output, reduction, x.shape)


@lower(aten.multilabel_margin_loss_backward.default)
def multilabel_margin_loss_backward(grad_output, x, target, reduction: int, is_target):
    """d/dx of ``sum_{k, j not a target} max(0, 1 - (x[t_k] - x[j])) / C``; targets end at the first -1."""
    rows = _as_matrix(x)
    n, classes = rows.shape
    target = _as_matrix(target)
    is_target = _as_matrix(is_target).astype(bool)
    g = 1.0 / (n * classes) if reduction == _MEAN else 1.0 / classes
    valid = jnp.cumprod(target != -1, axis=1).astype(bool)  # (N, K)
    safe_target = jnp.where(valid, target, 0).astype(jnp.int32)
    x_target = jnp.take_along_axis(rows, safe_target, axis=1)  # (N, K)
    hinge = (1 - x_target[:, :, None] + rows[:, None, :]) > 0  # (N, K, C)
    active = valid[:, :, None] & ~is_target[:, None, :] & hinge
    count = active.astype(rows.dtype) * g
    grad = count.sum(axis=1)  # + g for each (target, non-target) pair that is active
    per_target = count.sum(axis=2)  # - g at the target, per active pair
    grad = grad - (_one_hot_rows(safe_target, classes, rows.dtype) * per_target[:, :, None]).sum(axis=1)
    return _scaled_by_grad_output(grad, grad_output, reduction, x.shape)
