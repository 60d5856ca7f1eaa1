"""Fractional max pooling (2d, 3d) and its backward.

Each (batch, channel) plane has its own windows, placed by that plane's entries of
``random_samples`` (N, C, dims) in [0, 1), as ATen's ``generate_intervals`` places
them: with ``alpha = (input - kernel) / (output - 1)`` in the input's dtype, window i
starts at ``int((i + u) * alpha) - int(u * alpha)`` and the last one at
``input - kernel``. Sample order: 2d (width, height), 3d (time, height, width).
Maximum selection and the backward are the max pools' (``tpurec.dense.pooling``).
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import torch

from tpurec.dense.pooling import _scatter_to_indices, _select_max
from tpurec.dense.registry import lower

aten = torch.ops.aten


def _starts(u, input_size: int, output_size: int, kernel: int, dtype):
    """Window starts along one dim for one plane's sample ``u``."""
    last = jnp.full((1,), input_size - kernel, jnp.int32)
    if output_size == 1:
        return last
    alpha = jnp.asarray(input_size - kernel, dtype) / jnp.asarray(output_size - 1, dtype)
    u = u.astype(dtype)
    i = jnp.arange(output_size - 1, dtype=dtype)
    starts = ((i + u) * alpha).astype(jnp.int32) - (u * alpha).astype(jnp.int32)
    return jnp.concatenate([starts, last])


def _pool_plane(plane, samples, kernel: Sequence[int], output: Sequence[int]):
    """(values, flat indices) for one plane (``*spatial``) and its samples (one per dim, in dim order)."""
    n = len(kernel)
    spatial = plane.shape
    positions = [
        _starts(samples[d], spatial[d], output[d], kernel[d], plane.dtype)[:, None] + jnp.arange(kernel[d])[None, :]
        for d in range(n)
    ]
    # Broadcast dim d's (out_d, k_d) table into (o_1..o_n, k_1..k_n).
    index = []
    flat = 0
    for d, pos in enumerate(positions):
        shape = [1] * (2 * n)
        shape[d], shape[n + d] = pos.shape
        index.append(pos.reshape(shape))
        flat = flat * spatial[d] + pos.reshape(shape)
    windows = plane[tuple(index)]
    out_shape = tuple(output)
    size = math.prod(kernel)
    windows = windows.reshape(out_shape + (size,))
    flat = jnp.broadcast_to(flat, out_shape + tuple(kernel)).reshape(out_shape + (size,))
    return _select_max(windows, flat)


def _fractional_max_pool(x, kernel_size, output_size, random_samples, n: int, sample_order: Sequence[int]):
    unbatched = x.ndim == n + 1
    xb = x[None] if unbatched else x
    samples = random_samples.reshape(xb.shape[0], xb.shape[1], n)
    planes = xb.reshape((-1,) + xb.shape[2:])
    # samples[..., sample_order[d]] places the windows of spatial dim d.
    per_dim = samples.reshape(-1, n)[:, jnp.asarray(sample_order)]
    values, indices = jax.vmap(lambda p, s: _pool_plane(p, s, tuple(kernel_size), tuple(output_size)))(planes, per_dim)
    values = values.reshape(xb.shape[:2] + tuple(output_size))
    indices = indices.reshape(values.shape)
    return (values[0], indices[0]) if unbatched else (values, indices)


@lower(aten.fractional_max_pool2d.default)
def fractional_max_pool2d(x, kernel_size, output_size, random_samples):
    return _fractional_max_pool(x, kernel_size, output_size, random_samples, 2, sample_order=(1, 0))


@lower(aten.fractional_max_pool3d.default)
def fractional_max_pool3d(x, kernel_size, output_size, random_samples):
    return _fractional_max_pool(x, kernel_size, output_size, random_samples, 3, sample_order=(0, 1, 2))


@lower(aten.fractional_max_pool2d_backward.default)
def fractional_max_pool2d_backward(grad, x, kernel_size, output_size, indices):
    return _scatter_to_indices(grad, x.shape, indices, 2)


@lower(aten.fractional_max_pool3d_backward.default)
def fractional_max_pool3d_backward(grad, x, kernel_size, output_size, indices):
    return _scatter_to_indices(grad, x.shape, indices, 3)
