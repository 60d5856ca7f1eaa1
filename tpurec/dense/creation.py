"""Factories: full/zeros/ones (and their *_like / new_* forms), arange,
linspace, logspace, eye, scalar_tensor.

``empty*`` belong to the runtime core. Device/layout/pin_memory kwargs are
accepted and ignored (the core places the result). A ``dtype`` of None means
torch's inference: bool/int/float fill values give bool/int64/default float.
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np
import torch

from tpurec.dense._util import cast, default_float
from tpurec.dense.registry import lower, to_jax_dtype

aten = torch.ops.aten


def _infer(value) -> jnp.dtype:
    """torch's dtype for a Scalar: bool, int64, default float (or complex)."""
    if isinstance(value, bool):
        return jnp.dtype(jnp.bool_)
    if isinstance(value, int):
        return jnp.dtype(jnp.int64)
    if isinstance(value, float):
        return default_float()
    kind = jnp.dtype(value.dtype).kind
    if kind == "b":
        return jnp.dtype(jnp.bool_)
    if kind in "iu":
        return jnp.dtype(jnp.int64)
    if kind == "c":
        return jnp.dtype(jnp.complex128 if default_float() == jnp.float64 else jnp.complex64)
    return default_float()


def _dt(dtype, fallback) -> jnp.dtype:
    return to_jax_dtype(dtype) if dtype is not None else jnp.dtype(fallback)


def _ignored(**_kwargs) -> None:
    """Placement kwargs (layout, device, pin_memory, memory_format) are the core's."""


@lower(aten.full.default)
def full(size: Sequence[int], fill_value, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.full(tuple(size), cast(fill_value, _dt(dtype, _infer(fill_value))))


@lower(aten.zeros.default)
def zeros(size: Sequence[int], *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(tuple(size), _dt(dtype, default_float()))


@lower(aten.ones.default)
def ones(size: Sequence[int], *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.ones(tuple(size), _dt(dtype, default_float()))


@lower(aten.scalar_tensor.default)
def scalar_tensor(s, *, dtype=None, layout=None, device=None, pin_memory=None):
    # torch.scalar_tensor defaults to the default float dtype whatever s is.
    return cast(s, _dt(dtype, default_float()))


@lower(aten.zeros_like.default)
def zeros_like(x, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.zeros(x.shape, _dt(dtype, x.dtype))


@lower(aten.ones_like.default)
def ones_like(x, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.ones(x.shape, _dt(dtype, x.dtype))


@lower(aten.full_like.default)
def full_like(x, fill_value, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.full(x.shape, cast(fill_value, _dt(dtype, x.dtype)))


@lower(aten.new_zeros.default)
def new_zeros(x, size: Sequence[int], *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(tuple(size), _dt(dtype, x.dtype))


@lower(aten.new_ones.default)
def new_ones(x, size: Sequence[int], *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.ones(tuple(size), _dt(dtype, x.dtype))


@lower(aten.new_full.default)
def new_full(x, size: Sequence[int], fill_value, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.full(tuple(size), cast(fill_value, _dt(dtype, x.dtype)))


def _arange(start, end, step, dtype):
    """torch.arange: length ceil((end - start) / step) computed in double, values
    start + i * step computed in double (int64 for integer results)."""
    if step == 0:
        raise ValueError("arange: step must be nonzero")
    if dtype is None:
        dt = default_float() if any(isinstance(v, float) for v in (start, end, step)) else jnp.dtype(jnp.int64)
    else:
        dt = to_jax_dtype(dtype)
    n = max(0, int(np.ceil((float(end) - float(start)) / float(step))))
    if jnp.issubdtype(dt, jnp.integer) and all(isinstance(v, int) for v in (start, step)):
        return (start + jnp.arange(n, dtype=jnp.int64) * step).astype(dt)
    return (start + jnp.arange(n, dtype=jnp.float64) * step).astype(dt)


@lower(aten.arange.default, static_scalars=True)
def arange(end, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _arange(0, end, 1, dtype)


@lower(aten.arange.start, static_scalars=True)
def arange_start(start, end, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _arange(start, end, 1, dtype)


@lower(aten.arange.start_step, static_scalars=True)
def arange_start_step(start, end, step=1, *, dtype=None, layout=None, device=None, pin_memory=None):
    return _arange(start, end, step, dtype)


@lower(aten.linspace.default, aten.linspace.Tensor_Tensor, aten.linspace.Tensor_Scalar, aten.linspace.Scalar_Tensor)
def linspace(start, end, steps: int, *, dtype=None, layout=None, device=None, pin_memory=None):
    dt = _dt(dtype, default_float())
    # torch fills the first half from start and the second half from end, so
    # both endpoints are exact.
    s = jnp.asarray(start, jnp.float64).reshape(())
    e = jnp.asarray(end, jnp.float64).reshape(())
    if steps == 1:
        return s.reshape(1).astype(dt)
    i = jnp.arange(steps, dtype=jnp.float64)
    step = (e - s) / (steps - 1)
    vals = jnp.where(i < steps // 2, s + i * step, e - (steps - 1 - i) * step)
    if jnp.issubdtype(dt, jnp.integer):
        vals = jnp.trunc(vals)
    return vals.astype(dt)


@lower(aten.logspace.default, aten.logspace.Tensor_Tensor, aten.logspace.Tensor_Scalar, aten.logspace.Scalar_Tensor)
def logspace(start, end, steps: int, base: float = 10.0, *, dtype=None, layout=None, device=None, pin_memory=None):
    """``base ** linspace(start, end, steps)`` as ATen's CPU kernel computes it.

    The endpoints are first converted to the result dtype (an int dtype truncates
    them), the exponents and powers are computed in float64 (complex128), filling
    the first half from ``start`` and the second from ``end``, and only the powers
    are converted to the result dtype.
    """
    dt = _dt(dtype, default_float())
    wide = jnp.complex128 if jnp.issubdtype(dt, jnp.complexfloating) else jnp.float64
    base = jnp.asarray(base, wide)
    if steps == 1:  # ATen: base ** start, the start not converted to the result dtype first
        return (base ** jnp.asarray(start, wide).reshape(1)).astype(dt)
    s = jnp.asarray(start).reshape(()).astype(dt).astype(wide)
    e = jnp.asarray(end).reshape(()).astype(dt).astype(wide)
    i = jnp.arange(steps, dtype=jnp.float64)
    step = (e - s) / max(steps - 1, 1)
    exponents = jnp.where(i < steps // 2, s + step * i, e - step * (steps - 1 - i))
    return (base**exponents).astype(dt)


@lower(aten.eye.default, aten.eye.m)
def eye(n: int, m: int | None = None, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.eye(n, n if m is None else m, dtype=_dt(dtype, default_float()))
