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

from tpurec.dense.trace_context import transpose

__all__ = [
    "REAL",
    "COMPLEX",
    "contiguous_strides",
    "is_full",
    "read_view",
    "reinterpretation",
    "view_capacity",
    "write_view",
]

# How a view reads a storage of another dtype (``view_as_real``, ``view_as_complex``,
# ``view(dtype)`` between a complex dtype and its real counterpart). Sizes, strides and
# offsets of such a view count elements of the view's dtype, as in PyTorch.
REAL = "real"  # a real view of a complex storage: element 2k is real(storage[k]), 2k+1 its imaginary part
COMPLEX = "complex"  # a complex view of a real storage: element k is storage[2k] + i * storage[2k + 1]

# The (storage dtype, view dtype) pairs that share a memory layout, as PyTorch's
# view_as_real/view_as_complex define it; other byte reinterpretations are not views on tpu.
_REINTERPRETABLE = {
    ("complex64", "float32"): REAL,
    ("complex128", "float64"): REAL,
    ("float32", "complex64"): COMPLEX,
    ("float64", "complex128"): COMPLEX,
}


def contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, running = [], 1
    for n in reversed(size):
        strides.append(running)
        running *= max(n, 1)
    return tuple(reversed(strides))


def reinterpretation(storage_dtype, view_dtype) -> str | None:
    """How a view of dtype ``view_dtype`` reads a storage of ``storage_dtype`` (torch dtypes).

    Returns:
        None when the dtypes are the same (a plain view), ``REAL`` or ``COMPLEX``.

    Raises:
        NotImplementedError: the pair does not share a layout that tpurec can view
            (a bitcast such as float32 -> int32).
    """
    if storage_dtype == view_dtype:
        return None
    name = lambda dtype: str(dtype).replace("torch.", "")  # noqa: E731
    found = _REINTERPRETABLE.get((name(storage_dtype), name(view_dtype)))
    if found is None:
        raise NotImplementedError(
            f"tpurec: a {view_dtype} view of a {storage_dtype} storage reinterprets its bytes, which the tpu device "
            "supports only between a complex dtype and its real counterpart (view_as_real, view_as_complex). "
            "Use .to(dtype) to convert the values instead."
        )
    return found


def view_capacity(storage_shape, reinterpret: str | None) -> int:
    """How many elements of the view's dtype the storage holds."""
    numel = math.prod(storage_shape)
    if reinterpret == REAL:
        return 2 * numel
    if reinterpret == COMPLEX:
        return numel // 2
    return numel


def _elements(storage: jnp.ndarray, reinterpret: str | None) -> jnp.ndarray:
    """The storage as a flat array of the view's element type (``reinterpret`` is not None)."""
    flat = storage.reshape(-1)
    if reinterpret == REAL:
        return jnp.stack([jnp.real(flat), jnp.imag(flat)], axis=-1).reshape(-1)
    # COMPLEX: pairs of reals; an odd last real belongs to no complex element.
    pairs = flat[: 2 * (flat.shape[0] // 2)].reshape(-1, 2)
    return lax.complex(pairs[:, 0], pairs[:, 1])


def _from_elements(elements: jnp.ndarray, storage: jnp.ndarray, reinterpret: str | None) -> jnp.ndarray:
    """Inverse of :func:`_elements`: ``storage`` (same shape and dtype) holding ``elements``."""
    if reinterpret == REAL:
        pairs = elements.reshape(-1, 2)
        return lax.complex(pairs[:, 0], pairs[:, 1]).reshape(storage.shape)
    flat = storage.reshape(-1)
    interleaved = jnp.stack([jnp.real(elements), jnp.imag(elements)], axis=-1).reshape(-1)
    return flat.at[: interleaved.shape[0]].set(interleaved).reshape(storage.shape)


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
def _box(storage_shape, size, stride, offset) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(starts, sizes)`` over the storage's dims when the view is a box of the storage
    array in its own layout, with some dims possibly selected away
    (``storage[a0:a0+n0, k, a2:a2+n2]``: narrow, select, split, unbind), else None.

    Such a view is read with ``lax.slice`` and written with ``dynamic_update_slice``:
    XLA fuses those into their users and folds a concatenation of adjacent boxes
    back into the array, which it does not do for a gather of flat indices.
    """
    dense = contiguous_strides(storage_shape)
    sizes = [1] * len(storage_shape)
    e = 0
    for n, s in zip(size, stride):
        if n == 1:
            continue
        while e < len(storage_shape) and (dense[e] != s or storage_shape[e] < n):
            e += 1
        if e == len(storage_shape):
            return None
        sizes[e] = n
        e += 1
    starts, rest = [], offset
    for d in dense:
        start, rest = divmod(rest, d)
        starts.append(start)
    if rest or any(a + n > m for a, n, m in zip(starts, sizes, storage_shape)):
        return None
    return tuple(starts), tuple(sizes)


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


def read_view(storage: jnp.ndarray, size, stride, offset, reinterpret: str | None = None) -> jnp.ndarray:
    """The values of the view (size, stride, offset) of ``storage``.

    ``reinterpret`` (``REAL``/``COMPLEX``, see :func:`reinterpretation`) reads a
    storage of another dtype; size, stride and offset then count view elements.
    """
    if reinterpret is not None:
        storage = _elements(storage, reinterpret)
    size, stride = tuple(size), tuple(stride)
    if is_full(storage.shape, size, stride, offset):
        return storage
    flat = storage.reshape(-1)
    numel = math.prod(size)
    if numel == 0:
        return jnp.zeros(size, storage.dtype)
    if _is_contiguous(size, stride):
        return lax.slice(flat, (offset,), (offset + numel,)).reshape(size)
    box = _box(tuple(storage.shape), size, stride, offset)
    if box is not None:
        starts, sizes = box
        return lax.slice(storage, starts, tuple(a + n for a, n in zip(starts, sizes))).reshape(size)
    plan = _strided_plan(size, stride)
    if plan is None:
        return flat[_flat_indices(size, stride, offset)]
    order, sizes, region_shape = plan
    if (
        offset == 0
        and tuple(storage.shape) == tuple(sizes)
        and tuple(stride[d] for d in order) == contiguous_strides(sizes)
    ):
        # A permutation of the whole storage: transpose the storage itself, which a
        # kernel's output may know how to do without a copy (trace_context.transpose).
        region = storage
    else:
        length = math.prod(region_shape)
        region = flat[offset : offset + length]
        if region.shape[0] < length:  # the last row of a strided slice ends before the padding
            region = jnp.pad(region, (0, length - region.shape[0]))
        region = region.reshape(region_shape)
        region = region[(slice(None),) + tuple(slice(0, n) for n in sizes[1:]) + (0,)]
    # ``region`` is laid out by decreasing stride; put the dims back in view order.
    inverse = sorted(range(len(order)), key=lambda i: order[i])
    region = transpose(region, inverse)
    if len(order) == len(size):  # every dim kept: the transpose is the view
        return region
    kept = set(order)
    shape_with_ones = tuple(n if d in kept else 1 for d, n in enumerate(size))
    return jnp.broadcast_to(region.reshape(shape_with_ones), size)


def write_view(
    storage: jnp.ndarray, value: jnp.ndarray, size, stride, offset, reinterpret: str | None = None
) -> jnp.ndarray:
    """``storage`` with the view (size, stride, offset) replaced by ``value``.

    With ``reinterpret``, the view has the other dtype of a complex/real pair (see
    :func:`read_view`); the result keeps ``storage``'s shape and dtype.
    """
    if reinterpret is not None:
        elements = write_view(_elements(storage, reinterpret), value, size, stride, offset)
        return _from_elements(elements, storage, reinterpret)
    size, stride = tuple(size), tuple(stride)
    value = jnp.broadcast_to(value.astype(storage.dtype), size)
    if is_full(storage.shape, size, stride, offset):
        return value
    numel = math.prod(size)
    if numel == 0:
        return storage
    box = _box(tuple(storage.shape), size, stride, offset)
    if box is not None and not _is_contiguous(size, stride):
        starts, sizes = box
        return lax.dynamic_update_slice(storage, value.reshape(sizes), starts)
    flat = storage.reshape(-1)
    if _is_contiguous(size, stride):
        flat = lax.dynamic_update_slice(flat, value.reshape(-1), (offset,))
    else:
        flat = flat.at[_flat_indices(size, stride, offset).reshape(-1)].set(value.reshape(-1))
    return flat.reshape(storage.shape)
