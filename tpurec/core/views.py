"""Strided views over a storage array, as pure JAX functions.

A tpu tensor is PyTorch's (size, stride, storage_offset) over a storage that
holds one jax.Array. Reading a view or writing through one happens inside the
compiled program of the op that uses it, so a view costs no extra dispatch.
Every function here is called at trace time with static view specs.
"""

from __future__ import annotations

import math
from functools import lru_cache

import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["contiguous_strides", "is_full", "read_view", "write_view"]


def contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, running = [], 1
    for n in reversed(size):
        strides.append(running)
        running *= max(n, 1)
    return tuple(reversed(strides))


def _is_contiguous(size, stride) -> bool:
    return all(n == 1 or s == c for n, s, c in zip(size, stride, contiguous_strides(size)))


def is_full(storage_shape, size, stride, offset) -> bool:
    """True when the view is the whole storage, in the storage's own layout."""
    return offset == 0 and tuple(size) == tuple(storage_shape) and _is_contiguous(size, stride)


@lru_cache(maxsize=4096)
def _flat_indices(size, stride, offset) -> np.ndarray:
    idx = np.full((), offset, dtype=np.int64)
    for n, s in zip(size, stride):
        idx = idx[..., None] + np.arange(n, dtype=np.int64) * s
    return idx


@lru_cache(maxsize=4096)
def _strided_plan(size, stride):
    """A reshape/slice/transpose recipe for the view, or None when it overlaps itself."""
    dims = [d for d, (n, s) in enumerate(zip(size, stride)) if n != 1 and s != 0]
    if not dims:
        return None
    order = sorted(dims, key=lambda d: -stride[d])
    strides = [stride[d] for d in order]
    sizes = [size[d] for d in order]
    for i in range(len(order) - 1):
        if strides[i] % strides[i + 1] or strides[i] < strides[i + 1] * sizes[i + 1]:
            return None
    region_shape = [sizes[0]] + [strides[i] // strides[i + 1] for i in range(len(order) - 1)] + [strides[-1]]
    return order, sizes, region_shape


def read_view(storage: jnp.ndarray, size, stride, offset) -> jnp.ndarray:
    """The values of the view (size, stride, offset) of ``storage``."""
    size, stride = tuple(size), tuple(stride)
    if is_full(storage.shape, size, stride, offset):
        return storage
    flat = storage.reshape(-1)
    numel = math.prod(size)
    if numel == 0:
        return jnp.zeros(size, storage.dtype)
    if _is_contiguous(size, stride):
        return lax.slice(flat, (offset,), (offset + numel,)).reshape(size)
    plan = _strided_plan(size, stride)
    if plan is None:
        return flat[_flat_indices(size, stride, offset)]
    order, sizes, region_shape = plan
    length = math.prod(region_shape)
    region = flat[offset: offset + length]
    if region.shape[0] < length:  # the last row of a strided slice ends before the padding
        region = jnp.pad(region, (0, length - region.shape[0]))
    region = region.reshape(region_shape)
    region = region[(slice(None),) + tuple(slice(0, n) for n in sizes[1:]) + (0,)]
    # ``region`` is laid out by decreasing stride; put the dims back in view order.
    inverse = sorted(range(len(order)), key=lambda i: order[i])
    region = jnp.transpose(region, inverse)
    kept = set(order)
    shape_with_ones = tuple(n if d in kept else 1 for d, n in enumerate(size))
    return jnp.broadcast_to(region.reshape(shape_with_ones), size)


def write_view(storage: jnp.ndarray, value: jnp.ndarray, size, stride, offset) -> jnp.ndarray:
    """``storage`` with the view (size, stride, offset) replaced by ``value``."""
    size, stride = tuple(size), tuple(stride)
    value = jnp.broadcast_to(value.astype(storage.dtype), size)
    if is_full(storage.shape, size, stride, offset):
        return value
    numel = math.prod(size)
    if numel == 0:
        return storage
    flat = storage.reshape(-1)
    if _is_contiguous(size, stride):
        flat = lax.dynamic_update_slice(flat, value.reshape(-1), (offset,))
    else:
        flat = flat.at[_flat_indices(size, stride, offset).reshape(-1)].set(value.reshape(-1))
    return flat.reshape(storage.shape)
