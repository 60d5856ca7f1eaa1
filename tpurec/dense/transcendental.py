"""Exponentials, logarithms and what is built from them, at PyTorch's float32 accuracy on every platform.

XLA's TPU backend computes float32 ``exp``, ``log``, ``log1p``, ``expm1`` and ``tanh`` with fast
approximations unless an op asks for accuracy. Measured on a TPU v5e against float64 (65,536
inputs): ``log`` and ``log1p`` are off by up to about 4,000 units in the last place, ``expm1``
1,600, ``tanh`` 1,300, ``exp`` 59 and ``sigmoid`` 78, where PyTorch's CPU kernels stay within
a few. With ``accuracy=lax.AccuracyMode.HIGHEST`` (StableHLO's ``result_accuracy``) the same
ops are within 1-6 units, at the same speed; XLA:CPU has one implementation and ignores the
request (XLA:GPU was not tried). So every lowering of tpurec that needs one of these functions on
float32 values takes it from here. ``lax.logistic`` lowers to an ``exp`` without the request, so
:func:`sigmoid` is written out around an accurate ``exp``; XLA expands ``asinh`` and ``atanh``
with an approximate ``log`` (errors of 9e-5 on the TPU), so :func:`asinh` and :func:`atanh` are
written out around ``log1p``, and :func:`sinh`, :func:`cosh`, :func:`acosh` (up to 2.6e-4) around
``exp`` and ``log1p``; :func:`erfinv` is computed in float64 (``erfc`` and its relatives are
:mod:`tpurec.dense.error_functions`, in float32); :func:`xlogy`,
:func:`xlog1py` and :func:`entr` are written around ``log``; :func:`power` computes the common
exponents without XLA's ``power``, which has no accuracy request, and the others in float64, as
:func:`lgamma` (XLA's float32 expansion erred by 2.8e-4 on the TPU).

Other dtypes keep XLA's defaults (not measured on a TPU).

Example::

    y = jax.jit(lambda x: transcendental.log1p(x))(jnp.ones(4, jnp.float32))
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "acosh",
    "asinh",
    "atanh",
    "cosh",
    "exp",
    "exp2",
    "expm1",
    "log",
    "log10",
    "log1p",
    "log2",
    "log_softmax",
    "logsumexp",
    "power",
    "sigmoid",
    "sinh",
    "softmax",
    "softplus",
    "tanh",
    "xlog1py",
    "xlogy",
    "entr",
    "erfinv",
    "lgamma",
    "digamma",
    "through_float64",
]

_HIGHEST = lax.AccuracyMode.HIGHEST


def _accurate(precise: Callable, default: Callable) -> Callable:
    """``precise(x, accuracy=HIGHEST)`` for float32 ``x``, else ``default(x)`` (jax.numpy's dtype rules)."""

    def apply(x):
        x = jnp.asarray(x)
        if x.dtype == jnp.float32:
            return precise(x, accuracy=_HIGHEST)
        return default(x)

    apply.__name__ = default.__name__
    return apply


exp = _accurate(lax.exp, jnp.exp)
exp2 = _accurate(lax.exp2, jnp.exp2)
expm1 = _accurate(lax.expm1, jnp.expm1)
log = _accurate(lax.log, jnp.log)
log1p = _accurate(lax.log1p, jnp.log1p)
tanh = _accurate(lax.tanh, jnp.tanh)


def xlogy(x, y):
    """``x * log(y)``, 0 where ``x`` is 0 (unless ``y`` is NaN), as ``torch.xlogy``."""
    x, y = jnp.asarray(x), jnp.asarray(y)
    return x * log(jnp.where((x == 0) & ~jnp.isnan(y), jnp.ones_like(y), y))


def xlog1py(x, y):
    """``x * log1p(y)``, 0 where ``x`` is 0 (unless ``y`` is NaN), as ``torch.special.xlog1py``."""
    x, y = jnp.asarray(x), jnp.asarray(y)
    return x * log1p(jnp.where((x == 0) & ~jnp.isnan(y), jnp.zeros_like(y), y))


def entr(x):
    """``-x * log(x)`` for x > 0, 0 at 0, -inf below, as ``torch.special.entr``."""
    x = jnp.asarray(x)
    positive = x > 0
    inside = -x * log(jnp.where(positive, x, jnp.ones_like(x)))
    outside = jnp.where(x == 0, jnp.zeros_like(x), jnp.where(jnp.isnan(x), x, -jnp.inf))
    return jnp.where(positive, inside, outside)


def through_float64(fn: Callable) -> Callable:
    """``fn`` computed in float64 and rounded once when its arguments are float32 (other dtypes as they
    are): for functions whose float32 expansion takes logarithms or exponentials that cannot carry
    the accuracy request (``lgamma``, ``digamma``, jax.scipy's special functions, ``zeta``)."""

    def wide(*args) -> jax.Array:
        args = [jnp.asarray(x) for x in args]
        if all(x.dtype == jnp.float32 for x in args):
            return fn(*(x.astype(jnp.float64) for x in args)).astype(jnp.float32)
        return fn(*args)

    wide.__name__ = getattr(fn, "__name__", "through_float64")
    return wide


# log |gamma(x)|: XLA's float32 expansion erred by 2.8e-4 from float64 on a v5e (CPU 3.1e-7).
lgamma = through_float64(lax.lgamma)
# XLA's float32 expansion erred by 2.5e-5 on a v5e (5.7e-6 on XLA:CPU; PyTorch CPU about 1e-7).
erfinv = through_float64(lax.erf_inv)
# psi(x) on [10, inf): the asymptotic series log x - 1/(2x) - sum B_2k / (2k x^2k), Cephes' psi.
_DIGAMMA_ASYMPTOTIC = tuple(
    np.float32(c)
    for c in (
        8.33333333333333333333e-2,
        -2.10927960927960927961e-2,
        7.57575757575757575758e-3,
        -4.16666666666666666667e-3,
        3.96825396825396825397e-3,
        -8.33333333333333333333e-3,
        8.33333333333333333333e-2,
    )
)
_PSI_10 = np.float32(2.25175258906672110764)  # psi(10)
_DIGAMMA_ROOT = 1.4616321449683623  # the positive zero of psi
# psi(x0 + h) = sum_k psi^(k)(x0) h^k / k! around _DIGAMMA_ROOT: the coefficients psi^(k)(x0) / k!
# for k = 1..14 (k = 0 is 0), by scipy.special.polygamma in float64.
_DIGAMMA_AT_ROOT = (
    0.9676722454476214,
    -0.44276316898359214,
    0.2584997609556512,
    -0.16394270544240658,
    0.10782405069126239,
    -0.07219956125645476,
    0.048804288164143145,
    -0.033161126474847376,
    0.022597648232218125,
    -0.015424765904948968,
    0.010538791616612182,
    -0.007204534386356875,
    0.004926781395729858,
    -0.0033698016554393312,
)


_digamma_float64 = through_float64(lax.digamma)


def _digamma_float32(x):
    """psi(x) for float32 x >= 0, as PyTorch's ``calc_digamma(float)`` (Cephes' psi): the recurrence
    psi(x) = psi(x + 1) - 1/x up to 10, the asymptotic series above; and the Taylor series around
    its positive zero for |x - 1.4616| < 0.25, where the recurrence's sum cancels."""
    y = x
    total = jnp.zeros_like(y)
    for _ in range(10):  # at most 10 steps take 0 < y < 10 to [10, 11)
        below = y < 10
        total = total - jnp.where(below, 1 / jnp.where(below, y, 1.0), 0.0)
        y = jnp.where(below, y + 1, y)
    big = jnp.where(y < 1e17, y, 1e17)
    z = 1 / (big * big)
    series = jnp.zeros_like(z)
    for c in _DIGAMMA_ASYMPTOTIC:
        series = series * z + c
    series = jnp.where(y < 1e17, z * series, 0.0)
    out = total + log(y) - 0.5 / y - series
    out = jnp.where(y == 10, total + _PSI_10, out)
    # (the root's float32 rounding error, 1.5e-8, added back: psi' there is about 1; the barrier
    # keeps XLA from folding the two constants into one, which drops it)
    h = lax.optimization_barrier(x - np.float32(_DIGAMMA_ROOT))
    h = h - np.float32(_DIGAMMA_ROOT - float(np.float32(_DIGAMMA_ROOT)))
    near_root = jnp.abs(h) < 0.25
    taylor = jnp.zeros_like(h)
    for c in reversed(_DIGAMMA_AT_ROOT):
        taylor = (taylor + np.float32(c)) * h
    out = jnp.where(near_root, taylor, out)
    return jnp.where(x == jnp.inf, x, out)


def digamma(x):
    """``d/dx log gamma(x)`` (``lgamma``'s derivative); other dtypes than float32 by XLA.

    Float32 x >= 0 in float32 (float64 gave NaN from 1.8e19 on a TPU, which emulates it with
    float32's exponent range). Negative non-integers are below 2^23 in magnitude, where every
    intermediate of XLA's float64 expansion stays inside float32's exponent range too, so float64
    is as exact on a TPU as elsewhere; there psi(1 - x) and pi / tan(pi x) cancel near psi's zeros,
    by more digits than float32 keeps (PyTorch's own float32 kernel takes the second in float64).
    """
    x = jnp.asarray(x)
    if x.dtype == jnp.float32:
        reflected = jnp.where((x < 0) & (x > -(2.0**23)), x, -0.5)
        out = jnp.where(x < 0, _digamma_float64(reflected), _digamma_float32(x))
        out = jnp.where((x < 0) & (x == jnp.floor(x)), jnp.nan, out)  # the poles (all of x <= -2^23)
    else:
        out = lax.digamma(x)
    # At zero, the limit from the zero's side (XLA gives NaN): -inf at +0, inf at -0, as PyTorch.
    return jnp.where(x == 0, jnp.where(jnp.signbit(x), jnp.inf, -jnp.inf).astype(out.dtype), out)


def log2(x):
    x = jnp.asarray(x)
    return log(x) / np.float32(math.log(2)) if x.dtype == jnp.float32 else jnp.log2(x)


def log10(x):
    x = jnp.asarray(x)
    return log(x) / np.float32(math.log(10)) if x.dtype == jnp.float32 else jnp.log10(x)


def asinh(x):
    """``sign(x) * log1p(|x| + x^2 / (1 + sqrt(1 + x^2)))``; ``sign(x) * (log|x| + log 2)`` past 2^26, where x^2 would overflow."""
    x = jnp.asarray(x)
    if x.dtype != jnp.float32:
        return jnp.arcsinh(x)
    a = jnp.abs(x)
    small = a <= 2.0**26
    safe = jnp.where(small, a, 1.0)
    near = log1p(safe + safe * safe / (1 + jnp.sqrt(1 + safe * safe)))
    far = log(jnp.where(small, 1.0, a)) + np.float32(math.log(2))
    return jnp.copysign(jnp.where(small, near, far), x)


def sinh(x):
    """``sinh``: below 1 in magnitude its Taylor series through x^15 (the rest is below float32's
    precision there; no cancellation as in ``(e^x - e^-x) / 2``), else ``h * h / 2 - 1 / (2 h h)``
    with ``h = exp(|x| / 2)``, which overflows no earlier than sinh itself."""
    x = jnp.asarray(x)
    if x.dtype != jnp.float32:
        return jnp.sinh(x)
    a = jnp.abs(x)
    small = a < 1
    x2 = jnp.where(small, x * x, 0.0)
    series = jnp.ones_like(x2)
    for k in (14, 12, 10, 8, 6, 4, 2):  # 1 + x^2/(2*3) (1 + x^2/(4*5) (1 + ...))
        series = 1 + x2 / np.float32(k * (k + 1)) * series
    near = x * series
    h = exp(0.5 * jnp.where(small, 1.0, a))
    far = jnp.copysign((0.5 * h) * h - (0.5 / h) / h, x)
    return jnp.where(small, near, far)


def cosh(x):
    """``cosh``: ``h * h / 2 + 1 / (2 h h)`` with ``h = exp(|x| / 2)`` (no overflow before cosh's own)."""
    x = jnp.asarray(x)
    if x.dtype != jnp.float32:
        return jnp.cosh(x)
    h = exp(0.5 * jnp.abs(x))
    return (0.5 * h) * h + (0.5 / h) / h


def acosh(x):
    """``log1p(t + sqrt(2t + t^2))`` with ``t = x - 1`` (exact) up to 2, ``log(x + sqrt(x^2 - 1))`` above,
    ``log x + log 2`` past 2^26; NaN below 1."""
    x = jnp.asarray(x)
    if x.dtype != jnp.float32:
        return jnp.arccosh(x)
    near_one = x < 2
    t = jnp.where(near_one, x - 1, 0.0)
    near = log1p(t + jnp.sqrt(2 * t + t * t))
    huge = x > 2.0**26
    middle = jnp.where(near_one | huge, 2.0, x)
    mid = log(middle + jnp.sqrt(middle * middle - 1))
    far = log(jnp.where(huge, x, 1.0)) + np.float32(math.log(2))
    out = jnp.where(near_one, near, jnp.where(huge, far, mid))
    return jnp.where(x < 1, jnp.nan, out)  # (NaN stays NaN through every branch)


def atanh(x):
    """``log1p(2x / (1 - x)) / 2``: exact at 0, +-inf at +-1, NaN past them."""
    x = jnp.asarray(x)
    if x.dtype != jnp.float32:
        return jnp.arctanh(x)
    a = jnp.abs(x)
    return jnp.copysign(0.5 * log1p(2 * a / (1 - a)), x)


def power(x, y):
    """``x ** y``; float32 exponents 1, 2, 3, -1, -2, 0.5 and -0.5 as products, reciprocals and roots,
    others through float64.

    PyTorch's CPU kernel special-cases the same exponents, and they are the common ones (squares,
    inverse square roots). XLA's TPU ``power`` goes through approximate logarithms: ``x ** 2.5`` erred
    by 2.6e-6 relative on a TPU v5e (35 times CPU's error), and ``1 - x ** 2`` in ``atanh``'s backward
    by 0.18 near 1. The exponent is usually a runtime value, so the choice is a select, not a branch.
    """
    x, y = jnp.asarray(x), jnp.asarray(y)
    if x.dtype != jnp.float32:
        return jnp.power(x, y)
    # Other exponents in float64, rounded once (within half an ulp of CPU's float32 result);
    # XLA's float32 power has no accuracy request.
    general = jnp.power(x.astype(jnp.float64), y.astype(jnp.float64)).astype(jnp.float32)
    square = x * x
    out = general
    for exponent, value in (
        (1.0, x),
        (2.0, square),
        (3.0, square * x),
        (-1.0, 1 / x),
        (-2.0, 1 / square),
        (0.5, jnp.sqrt(x)),
        (-0.5, lax.rsqrt(x)),
    ):
        out = jnp.where(y == exponent, value, out)
    return out


def sigmoid(x):
    """``1 / (1 + exp(-x))``, from ``exp(-|x|)`` so that neither side overflows or loses its tail."""
    x = jnp.asarray(x)
    if x.dtype != jnp.float32:
        return lax.logistic(x)
    e = exp(-jnp.abs(x))
    s = 1 / (1 + e)
    return jnp.where(x >= 0, s, e * s)


def softplus(x):
    """``log(1 + exp(x))`` without overflow: ``max(x, 0) + log1p(exp(-|x|))``."""
    x = jnp.asarray(x)
    return jnp.maximum(x, 0) + log1p(exp(-jnp.abs(x)))


def logsumexp(x, axis, keepdims: bool = False):
    """``log(sum(exp(x)))`` over ``axis``, shifted by the finite maximum (an all ``-inf`` slice gives ``-inf``)."""
    top = jnp.max(x, axis=axis, keepdims=True)
    top = lax.stop_gradient(jnp.where(jnp.isfinite(top), top, jnp.zeros_like(top)))
    out = log(jnp.sum(exp(x - top), axis=axis, keepdims=True)) + top
    return out if keepdims else jnp.squeeze(out, axis=axis)


def log_softmax(x, axis: int):
    """``x - logsumexp(x)`` over ``axis``, computed from the shifted values (an all ``-inf`` slice gives NaN, as in PyTorch)."""
    shifted = x - lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True))
    return shifted - log(jnp.sum(exp(shifted), axis=axis, keepdims=True))


def softmax(x, axis: int):
    """``exp(x) / sum(exp(x))`` over ``axis``, shifted by the maximum."""
    unnormalized = exp(x - lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True)))
    return unnormalized / jnp.sum(unnormalized, axis=axis, keepdims=True)
