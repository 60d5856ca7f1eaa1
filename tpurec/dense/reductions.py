"""Reductions: sum/mean/prod, min/max family, arg-reductions, var/std,
logsumexp, norms, boolean reductions (and ``_assert_async``), scans.

Like torch's CPU kernels, low-precision floats accumulate in float32 and are
rounded once at the end; integer/bool sums and products accumulate in int64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from tpurec.dense._util import dims, float_for, is_float, jdtype, norm_dim
from tpurec.dense._util import acc_dtype as _acc_dtype
from tpurec.dense.registry import lower
from tpurec.dense import transcendental

aten = torch.ops.aten


def _int_sum_dtype(x, dtype) -> jnp.dtype:
    """Result dtype of sum/prod: explicit dtype, else int64 for ints/bool."""
    if dtype is not None:
        return jdtype(dtype)
    return jnp.dtype(x.dtype) if is_float(x.dtype) else jnp.dtype(jnp.int64)


def _reduce(fn, x, dim, keepdim: bool, out_dtype):
    axes = dims(dim, x.ndim)
    acc = _acc_dtype(out_dtype)
    return fn(x.astype(acc), axis=axes, keepdims=keepdim).astype(out_dtype)


@lower(aten.sum.default)
def sum_default(x, *, dtype=None):
    return _reduce(jnp.sum, x, None, False, _int_sum_dtype(x, dtype))


@lower(aten.sum.dim_IntList)
def sum_dim(x, dim=None, keepdim: bool = False, *, dtype=None):
    return _reduce(jnp.sum, x, dim, keepdim, _int_sum_dtype(x, dtype))


@lower(aten.prod.default)
def prod_default(x, *, dtype=None):
    return _reduce(jnp.prod, x, None, False, _int_sum_dtype(x, dtype))


@lower(aten.prod.dim_int)
def prod_dim(x, dim: int, keepdim: bool = False, *, dtype=None):
    return _reduce(jnp.prod, x, [dim], keepdim, _int_sum_dtype(x, dtype))


@lower(aten.mean.default)
def mean_default(x, *, dtype=None):
    return _reduce(jnp.mean, x, None, False, jdtype(dtype, x.dtype))


@lower(aten.mean.dim)
def mean_dim(x, dim=None, keepdim: bool = False, *, dtype=None):
    return _reduce(jnp.mean, x, dim, keepdim, jdtype(dtype, x.dtype))


@lower(aten.amax.default)
def amax(x, dim=(), keepdim: bool = False):
    return jnp.max(x, axis=dims(dim, x.ndim), keepdims=keepdim)


@lower(aten.amin.default)
def amin(x, dim=(), keepdim: bool = False):
    return jnp.min(x, axis=dims(dim, x.ndim), keepdims=keepdim)


@lower(aten.max.default)
def max_default(x):
    return jnp.max(x)


@lower(aten.min.default)
def min_default(x):
    return jnp.min(x)


def _arg(fn, x, dim, keepdim):
    if dim is None:
        out = fn(x.reshape(-1))
        return out.reshape((1,) * x.ndim) if keepdim else out
    if x.ndim == 0:
        norm_dim(dim, 0)
        return jnp.zeros((), jnp.int64)
    return fn(x, axis=norm_dim(dim, x.ndim), keepdims=keepdim)


@lower(aten.argmax.default)
def argmax(x, dim=None, keepdim: bool = False):
    return _arg(jnp.argmax, x, dim, keepdim).astype(jnp.int64)


@lower(aten.argmin.default)
def argmin(x, dim=None, keepdim: bool = False):
    return _arg(jnp.argmin, x, dim, keepdim).astype(jnp.int64)


def _extreme_along(arg, x, dim: int, keepdim: bool):
    """(values, indices) of max/min along ``dim``, from the matching arg-function."""
    idx = arg(x, dim, True)
    d = norm_dim(dim, x.ndim)
    vals = jnp.take_along_axis(x, idx, axis=d) if x.ndim else x
    if not keepdim and x.ndim:
        vals, idx = jnp.squeeze(vals, d), jnp.squeeze(idx, d)
    return vals, idx


@lower(aten.max.dim)
def max_dim(x, dim: int, keepdim: bool = False):
    return _extreme_along(argmax, x, dim, keepdim)


@lower(aten.min.dim)
def min_dim(x, dim: int, keepdim: bool = False):
    return _extreme_along(argmin, x, dim, keepdim)


def _var(x, dim, correction, keepdim):
    """(var, mean) with torch's ``correction`` (a traced Scalar, default 1)."""
    axes = dims(dim, x.ndim)
    out = float_for(x.dtype)
    xf = x.astype(_acc_dtype(out))
    n = 1
    for a in axes:
        n *= x.shape[a]
    mean = jnp.mean(xf, axis=axes, keepdims=True)
    ssq = jnp.sum(jnp.square(xf - mean), axis=axes, keepdims=keepdim)
    c = 1 if correction is None else correction
    var = ssq / jnp.maximum(n - c, 0)
    if not keepdim:
        mean = jnp.squeeze(mean, axes)
    return var, mean, out


@lower(aten.var.correction)
def var(x, dim=None, *, correction=None, keepdim: bool = False):
    v, _, out = _var(x, dim, correction, keepdim)
    return v.astype(out)


@lower(aten.std.correction)
def std(x, dim=None, *, correction=None, keepdim: bool = False):
    v, _, out = _var(x, dim, correction, keepdim)
    return jnp.sqrt(v).astype(out)


@lower(aten.var_mean.correction)
def var_mean(x, dim=None, *, correction=None, keepdim: bool = False):
    v, m, out = _var(x, dim, correction, keepdim)
    return v.astype(out), m.astype(out)


@lower(aten.std_mean.correction)
def std_mean(x, dim=None, *, correction=None, keepdim: bool = False):
    v, m, out = _var(x, dim, correction, keepdim)
    return jnp.sqrt(v).astype(out), m.astype(out)


@lower(aten.logsumexp.default)
def logsumexp(x, dim, keepdim: bool = False):
    out = float_for(x.dtype)
    xf = x.astype(_acc_dtype(out))
    return transcendental.logsumexp(xf, axis=dims(dim, x.ndim), keepdims=keepdim).astype(out)


def vector_norm(x, ord, axes, keepdim: bool, out_dtype):
    """The ``ord``-norm over ``axes``; ``ord`` may be a traced scalar, so the
    special orders (inf, -inf, 0, 2) are selected with ``where``, not ``if``."""
    a = jnp.abs(x.astype(_acc_dtype(out_dtype)))

    def red(fn, v):
        return fn(v, axis=axes, keepdims=keepdim)

    if isinstance(ord, (int, float)):  # static order: pick the kernel in Python
        o = float(ord)
        if o == 2:
            r = jnp.sqrt(red(jnp.sum, a * a))
        elif o == jnp.inf:
            r = red(jnp.max, a)
        elif o == -jnp.inf:
            r = red(jnp.min, a)
        elif o == 0:
            r = red(jnp.sum, (a != 0).astype(a.dtype))
        elif o == 1:
            r = red(jnp.sum, a)
        else:
            r = transcendental.power(red(jnp.sum, transcendental.power(a, o)), 1 / o)
        return r.astype(out_dtype)
    o = jnp.asarray(ord, a.dtype)
    safe = jnp.where((o == 0) | jnp.isinf(o), jnp.ones_like(o), o)
    general = transcendental.power(red(jnp.sum, transcendental.power(a, safe)), 1 / safe)
    r = jnp.where(
        o == 2,
        jnp.sqrt(red(jnp.sum, a * a)),
        jnp.where(
            o == jnp.inf,
            red(jnp.max, a),
            jnp.where(
                o == -jnp.inf, red(jnp.min, a), jnp.where(o == 0, red(jnp.sum, (a != 0).astype(a.dtype)), general)
            ),
        ),
    )
    return r.astype(out_dtype)


@lower(aten.linalg_vector_norm.default)
def linalg_vector_norm(x, ord=2, dim=None, keepdim: bool = False, *, dtype=None):
    out = jdtype(dtype, float_for(x.dtype))
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        raise NotImplementedError("linalg_vector_norm: complex inputs")
    return vector_norm(x, ord, dims(dim, x.ndim), keepdim, out)


@lower(aten.norm.Scalar, aten.norm.ScalarOpt_dtype)
def norm_all(x, p=2, *, dtype=None):
    return vector_norm(x, 2 if p is None else p, dims(None, x.ndim), False, jdtype(dtype, float_for(x.dtype)))


@lower(aten.norm.ScalarOpt_dim, aten.norm.ScalarOpt_dim_dtype)
def norm_dim_(x, p, dim, keepdim: bool = False, *, dtype=None):
    return vector_norm(x, 2 if p is None else p, dims(dim, x.ndim), keepdim, jdtype(dtype, float_for(x.dtype)))


def _bool_reduce(fn, x, dim, keepdim):
    out = jnp.uint8 if x.dtype == jnp.uint8 else jnp.bool_  # torch keeps uint8
    return fn(x != 0, axis=dims(dim, x.ndim), keepdims=keepdim).astype(out)


@lower(aten.any.default)
def any_default(x):
    return _bool_reduce(jnp.any, x, None, False)


@lower(aten.any.dim, aten.any.dims)
def any_dim(x, dim=None, keepdim: bool = False):
    return _bool_reduce(jnp.any, x, dim, keepdim)


@lower(aten.all.default)
def all_default(x):
    return _bool_reduce(jnp.all, x, None, False)


@lower(aten.all.dim, aten.all.dims)
def all_dim(x, dim=None, keepdim: bool = False):
    return _bool_reduce(jnp.all, x, dim, keepdim)


# The boolean reduction of a check (F.one_hot's decomposition asserts all(0 <= x < n) with it):
# a no-op inside a program. An XLA program cannot raise, and PyTorch's CUDA kernel does
# not stop the host either (its device assert is asynchronous); eager execution checks the
# value on the host instead, as the CPU kernel does (tpurec/core/dispatch.py).
@lower(aten._assert_async.default, aten._assert_async.msg)
def assert_async(x, assert_msg: str | None = None):
    return ()


@lower(aten.count_nonzero.dim_IntList, aten.count_nonzero.default)
def count_nonzero(x, dim=None):
    return jnp.sum(x != 0, axis=dims(dim, x.ndim)).astype(jnp.int64)


def _scan(fn, x, dim: int, dtype):
    out = _int_sum_dtype(x, dtype)
    if x.ndim == 0:
        return x.astype(out)
    return fn(x.astype(_acc_dtype(out)), axis=norm_dim(dim, x.ndim)).astype(out)


@lower(aten.cumsum.default)
def cumsum(x, dim: int, *, dtype=None):
    return _scan(jnp.cumsum, x, dim, dtype)


@lower(aten.cumprod.default)
def cumprod(x, dim: int, *, dtype=None):
    return _scan(jnp.cumprod, x, dim, dtype)


@lower(aten.logcumsumexp.default)
def logcumsumexp(x, dim: int):
    if x.ndim == 0:
        return x
    out = float_for(x.dtype)
    xf = x.astype(_acc_dtype(out))
    axis = norm_dim(dim, x.ndim)
    if jnp.iscomplexobj(xf):
        return jax.lax.cumlogsumexp(xf, axis=axis).astype(out)
    # An associative scan of log(e^a + e^b) written with accurate exp and log1p (lax.cumlogsumexp's
    # combiner has no accuracy request, which a TPU needs for float32).
    return jax.lax.associative_scan(_log_add_exp, xf, axis=axis).astype(out)


def _log_add_exp(a, b):
    """log(e^a + e^b) of real values, elementwise; equal infinities give themselves and NaN propagates."""
    larger = jnp.maximum(a, b)
    out = larger + transcendental.log1p(transcendental.exp(-jnp.abs(a - b)))
    return jnp.where(jnp.isinf(larger) & (a == b), larger, out)


@lower(torch.ops.prims.var.default)
def prims_var(x, dims_=None, correction=1, *, output_dtype=None):
    # None and [] both mean every dim, as torch's CPU kernel for the prim does.
    axes = dims(dims_, x.ndim)
    out = jdtype(output_dtype) if output_dtype is not None else float_for(x.dtype)
    xf = x.astype(_acc_dtype(float_for(x.dtype)) if not jnp.iscomplexobj(x) else x.dtype)
    n = 1
    for a in axes:
        n *= x.shape[a]
    mean = jnp.mean(xf, axis=axes, keepdims=True)
    ssq = jnp.sum(jnp.square(jnp.abs(xf - mean)), axis=axes)
    c = 1 if correction is None else correction
    return (ssq / jnp.maximum(n - c, 0)).astype(out)


def _cumulative_extreme(x, dim: int, later_wins):
    """(values, indices) of a running max/min along ``dim``.

    ``later_wins(earlier, later)`` says when the later element replaces the
    running one. As in torch, NaN beats every number and ties go to the later
    index; "greatest (NaN first, then value, then index)" is associative, so a
    parallel scan gives the same result as torch's sequential loop.
    """
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    d = norm_dim(dim, x.ndim)
    shape = [1] * x.ndim
    shape[d] = x.shape[d]
    idx = jnp.broadcast_to(jnp.arange(x.shape[d], dtype=jnp.int64).reshape(shape), x.shape)
    floating = is_float(x.dtype)

    def combine(a, b):
        av, ai = a
        bv, bi = b
        take = later_wins(av, bv)
        if floating:
            take = jnp.isnan(bv) | (~jnp.isnan(av) & take)
        return jnp.where(take, bv, av), jnp.where(take, bi, ai)

    return jax.lax.associative_scan(combine, (x, idx), axis=d)


@lower(aten.cummax.default)
def cummax(x, dim: int):
    return _cumulative_extreme(x, dim, lambda earlier, later: later >= earlier)


@lower(aten.cummin.default)
def cummin(x, dim: int):
    return _cumulative_extreme(x, dim, lambda earlier, later: later <= earlier)


@lower(aten.hash_tensor.default)
def hash_tensor(x, dim=(), *, keepdim: bool = False, mode: int = 0):
    """XOR of the elements' 64-bit patterns (floats widened to float64, integers and bools to int64) -> uint64."""
    if mode != 0:
        raise ValueError(f"hash_tensor: mode {mode} is not supported (only 0, xor reduction)")
    wide = x.astype(jnp.float64 if jnp.issubdtype(x.dtype, jnp.floating) else jnp.int64)
    bits = jax.lax.bitcast_convert_type(wide, jnp.uint64)
    axes = tuple(range(x.ndim)) if not dim else tuple(d % max(x.ndim, 1) for d in dim)
    out = jax.lax.reduce(bits, jnp.uint64(0), jax.lax.bitwise_xor, axes) if x.ndim else bits
    if keepdim and x.ndim:
        out = jnp.expand_dims(out, axes)
    return out
