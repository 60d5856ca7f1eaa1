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
``exp`` and ``log1p``; :func:`xlogy`, :func:`xlog1py` and :func:`entr` are written around ``log``;
:func:`power` computes the common exponents without XLA's ``power``, which has no accuracy request,
and the others as ``2 ** (y log2 x)`` in twice float32's precision (:func:`log_pair` gives a
logarithm in that precision too). The error function and its inverse, ``lgamma`` and ``digamma``
are :mod:`tpurec.dense.error_functions`, :mod:`tpurec.dense.inverse_error_functions` and
:mod:`tpurec.dense.gamma_functions`, in float32.

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
    "SPECIAL_EXPONENTS",
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
    "two_sum",
    "two_product",
    "log_pair",
    "power_pair_exponent",
    "power_of_two",
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


def _top_half(x):
    """Float32 ``x`` with the low 12 bits of its significand cleared: products of two such are exact."""
    return lax.bitcast_convert_type(lax.bitcast_convert_type(x, jnp.uint32) & np.uint32(0xFFFFF000), jnp.float32)


def _two_product(a, b):
    """Float32 ``a * b`` as its rounded value and the exact rounding error (Dekker). The barrier keeps
    XLA from fusing the rounded product into a multiply-add with what follows (XLA:CPU does)."""
    product = lax.optimization_barrier(a * b)
    a_high, b_high = _top_half(a), _top_half(b)
    a_low, b_low = a - a_high, b - b_high
    return product, ((a_high * b_high - product) + a_high * b_low + a_low * b_high) + a_low * b_low


def two_product(a, b):
    """Float32 ``a * b`` as its rounded value and the exact rounding error (for a product inside float32's normal range)."""
    return _two_product(a, b)


def two_sum(a, b):
    """Float32 ``a + b`` as its rounded value and the exact rounding error (Knuth)."""
    total = lax.optimization_barrier(a + b)
    b_virtual = total - a
    return total, (a - (total - b_virtual)) + (b - b_virtual)


_INV_LN2 = (np.float32(1 / math.log(2)), np.float32(1 / math.log(2) - float(np.float32(1 / math.log(2)))))


def _log2_pair(a):
    """``log2(a)`` for finite a > 0 (float32) as ``(exponent, high, low)``: ``a = m 2^exponent`` with m in
    [sqrt(1/2), sqrt(2)), and log2(m) = high + low to about 2^-40 (ln m = 2 atanh(s), s = (m - 1) / (m + 1)
    in two parts; the series' tail s^3 (2/3 + 2/5 s^2 + ...) is 1% of it, so float32 suffices there)."""
    bits = lax.bitcast_convert_type(a, jnp.int32)
    exponent = (bits >> 23) - 127
    m = lax.bitcast_convert_type((bits & 0x007FFFFF) | 0x3F800000, jnp.float32)  # [1, 2)
    big = m > np.float32(math.sqrt(2))
    m = jnp.where(big, m * 0.5, m)  # exact
    exponent = (exponent + big.astype(jnp.int32)).astype(jnp.float32)
    numerator = m - 1  # exact (Sterbenz)
    denominator, denominator_low = two_sum(m, jnp.ones_like(m))
    s = numerator / denominator
    product, product_error = _two_product(s, denominator)
    s_low = ((numerator - product) - product_error - s * denominator_low) / denominator
    s2 = s * s
    tail = jnp.zeros_like(s2)
    for k in (15, 13, 11, 9, 7, 5, 3):  # atanh(s) - s = s^3 / 3 + s^5 / 5 + ...: |s| <= 0.1716
        tail = tail * s2 + np.float32(2 / k)
    tail = tail * s2 * s
    ln_high, ln_low = two_sum(2 * s, 2 * s_low + tail)
    high, error = _two_product(ln_high, jnp.full_like(ln_high, _INV_LN2[0]))
    return exponent, high, error + ln_high * _INV_LN2[1] + ln_low * _INV_LN2[0]


_LN2 = (np.float32(math.log(2)), np.float32(math.log(2) - float(np.float32(math.log(2)))))
_TWO_THIRDS = (np.float32(2 / 3), np.float32(2 / 3 - float(np.float32(2 / 3))))


def log_pair(a):
    """``ln(a)`` for finite float32 a > 0 as a pair ``(high, low)`` of float32 numbers, to about 2e-11
    relative: ``a = m 2^e`` as in :func:`_log2_pair` and ``ln m = 2 atanh(s)``, with ``2s + (2/3) s^3``
    in pairs (:func:`_log2_pair` keeps the cubic term in float32, about 2^-32 of ``ln m``)."""
    bits = lax.bitcast_convert_type(a, jnp.int32)
    exponent = (bits >> 23) - 127
    m = lax.bitcast_convert_type((bits & 0x007FFFFF) | 0x3F800000, jnp.float32)  # [1, 2)
    big = m > np.float32(math.sqrt(2))
    m = jnp.where(big, m * 0.5, m)  # exact
    exponent = (exponent + big.astype(jnp.int32)).astype(jnp.float32)
    numerator = m - 1  # exact (Sterbenz)
    denominator, denominator_low = two_sum(m, jnp.ones_like(m))
    s = numerator / denominator
    product, product_error = _two_product(s, denominator)
    s_low = ((numerator - product) - product_error - s * denominator_low) / denominator
    s2 = s * s
    rest = jnp.zeros_like(s2)
    for k in (17, 15, 13, 11, 9, 7, 5):  # (atanh(s) - s - s^3 / 3) / s^5 = 1/5 + s^2 / 7 + ...: |s| <= 0.1716
        rest = rest * s2 + np.float32(2 / k)
    q_high, q_low = two_sum(jnp.full_like(s, _TWO_THIRDS[0]), s2 * rest)  # 2/3 + (2/5) s^2 + ...
    q_low = q_low + _TWO_THIRDS[1]
    square, square_error = _two_product(s, s)
    cube, cube_error = _two_product(square, s)
    cube_error = cube_error + square_error * s
    tail, tail_error = _two_product(cube, q_high)
    tail_error = tail_error + cube * q_low + cube_error * q_high
    ln_high, ln_low = two_sum(2 * s, tail)
    ln_low = ln_low + 2 * s_low / (1 - s2) + tail_error  # (d/ds 2 atanh(s) = 2 / (1 - s^2))
    scaled, scaled_error = _two_product(exponent, jnp.full_like(exponent, _LN2[0]))
    high, low = two_sum(scaled, ln_high)
    return two_sum(high, low + ln_low + scaled_error + exponent * _LN2[1])


def _power_float32(x, y, y_low, scale: float | jax.Array = 0.0):
    """``|x| ** (y + y_low)`` for finite nonzero x and finite y (float32; y_low is the rest of a float64
    exponent, else 0): ``2 ** t`` with ``t = y log2|x|`` in twice float32's precision, so that the
    result keeps float32's accuracy up to t = +-150 (float32's whole range)."""
    exponent, log_high, log_low = _log2_pair(jnp.abs(x))
    p1, e1 = _two_product(y, exponent)
    p2, e2 = _two_product(y, log_high)
    t_high, t_low = two_sum(p1, p2)
    t_low = t_low + e1 + e2 + y * log_low + y_low * (exponent + log_high)
    if not isinstance(scale, float) or scale != 0.0:  # times 2 ** scale (an integer)
        t_high, error = two_sum(t_high, scale)
        t_low = t_low + error
    clipped = jnp.clip(t_high, -200.0, 200.0)
    n = jnp.round(clipped)
    f = (clipped - n) + jnp.where(clipped == t_high, t_low, 0.0)  # (clipped - n: exact)
    scale = exp(f * np.float32(math.log(2)))
    half = jnp.floor(n / 2)  # 2^n as two exact factors inside float32's range
    return scale * power_of_two(half) * power_of_two(n - half)


def power_pair_exponent(x, y, y_low, scale: float | jax.Array = 0.0):
    """``x ** (y + y_low) * 2 ** scale`` for finite float32 x > 0, finite y (y_low: the exponent's low
    part) and integer-valued ``scale``, as :func:`power` computes its general case."""
    return _power_float32(x, y, y_low, scale)


def exp2(x):
    """``2 ** x``; for float32 ``2 ** n * 2 ** f`` with ``n = round(x)`` and ``f = x - n`` (exact), ``2 ** f``
    by the accurate :func:`exp` and ``2 ** n`` as two exact factors, so an integer ``x`` gives its power of two
    exactly. (XLA:CPU's ``exp2``, ``exp(x ln 2)`` in float32 whatever the accuracy request, erred by 9 units in
    the last place at x = 50 and 18 at x = 100, where PyTorch CPU's is exact.) Other dtypes keep jax.numpy's."""
    x = jnp.asarray(x)
    if x.dtype != jnp.float32:
        return jnp.exp2(x)
    clipped = jnp.clip(x, -200.0, 200.0)  # (infinities: 2^200 overflows, 2^-200 underflows, as they should)
    n = jnp.round(clipped)
    half = jnp.floor(n / 2)
    return exp((clipped - n) * np.float32(math.log(2))) * power_of_two(half) * power_of_two(n - half)


def power_of_two(k):
    """``2 ** k`` for integer-valued float32 k in [-126, 127], exactly (from its bits)."""
    return lax.bitcast_convert_type((k.astype(jnp.int32) + 127) << 23, jnp.float32)


def _power_edges(x, y, odd):
    """IEEE ``pow`` (C's, PyTorch's) where x is 0, 1, infinite or NaN or y is 0, infinite or NaN;
    ``odd``: y is an odd integer."""
    one, zero, inf = jnp.ones_like(x), jnp.zeros_like(x), jnp.full_like(x, jnp.inf)
    # x = +-0: 0 for y > 0, inf for y < 0, signed as x for odd y
    at_zero = jnp.where(y > 0, zero, inf)
    at_zero = jnp.where(odd & jnp.signbit(x), -at_zero, at_zero)
    # x = +-inf: inf for y > 0, 0 for y < 0, signed for odd y
    at_inf = jnp.where(y > 0, inf, zero)
    at_inf = jnp.where(odd & (x < 0), -at_inf, at_inf)
    # y = +-inf (x finite, nonzero): 1 at |x| = 1, else 0 or inf by which side of 1 |x| is
    grows = (jnp.abs(x) > 1) == (y > 0)
    at_infinite_y = jnp.where(jnp.abs(x) == 1, one, jnp.where(grows, inf, zero))
    out = jnp.where(jnp.isinf(y), at_infinite_y, jnp.full_like(x, jnp.nan))
    out = jnp.where(jnp.isinf(x), at_inf, out)
    out = jnp.where(x == 0, at_zero, out)
    out = jnp.where(jnp.isnan(x) | jnp.isnan(y), jnp.nan, out)
    return jnp.where((y == 0) | (x == 1), one, out)


# The exponents :func:`power` computes as products, reciprocals and roots (PyTorch's CPU kernel
# special-cases the same ones). An op whose exponent is a Python number equal to one of them gets it
# as a static value (``tpurec.dense.registry.lower(special_scalars=...)``), and its program holds only
# that case: the general case costs a float32 program about 400 operations per ``pow``, which an
# RMSNorm's ``x.pow(2)`` and its backward's ``x.pow(1)`` would pay in every layer.
SPECIAL_EXPONENTS = (1.0, 2.0, 3.0, -1.0, -2.0, 0.5, -0.5)


def special_power(x, exponent: float):
    """``x ** exponent`` for float32 ``x`` and an ``exponent`` of :data:`SPECIAL_EXPONENTS`, as :func:`power`
    computes it (IEEE ``pow`` at zeros and infinities)."""
    if exponent == 1.0:
        return x
    if exponent == 2.0:
        return x * x
    if exponent == 3.0:
        return x * x * x
    if exponent == -1.0:
        return 1 / x
    if exponent == -2.0:
        return (1 / x) * (1 / x)  # (1 / x^2 would leave float32's range for x below 1.1e-19)
    inf = jnp.full_like(x, jnp.inf)
    if exponent == 0.5:  # pow(-inf, 0.5) is inf where sqrt gives NaN
        return jnp.where(x == -jnp.inf, inf, jnp.sqrt(x))
    if exponent == -0.5:  # pow(-inf, -0.5) is 0, pow(-0, -0.5) inf where rsqrt gives -inf
        return jnp.where(x == -jnp.inf, jnp.zeros_like(x), jnp.where(x == 0, inf, lax.rsqrt(x)))
    raise ValueError(f"special_power: {exponent} is not one of {SPECIAL_EXPONENTS}")


def power(x, y):
    """``x ** y``; float32 exponents 1, 2, 3, -1, -2, 0.5 and -0.5 as products, reciprocals and roots,
    others as ``2 ** (y log2 x)`` with the logarithm and the product in twice float32's precision.

    PyTorch's CPU kernel special-cases the same exponents, and they are the common ones (squares,
    inverse square roots). XLA's TPU ``power`` goes through approximate logarithms: ``x ** 2.5`` erred
    by 2.6e-6 relative on a TPU v5e (35 times CPU's error), and ``1 - x ** 2`` in ``atanh``'s backward
    by 0.18 near 1; float64 (a TPU emulates it with float32's exponent range) gave inf for
    ``1.6e-29 ** -1.33``, 2.48e38. A traced exponent is a runtime value, so the choice is a select,
    not a branch (a Python number exponent of ``SPECIAL_EXPONENTS`` takes :func:`special_power` alone).
    A float64 exponent (a Python number, kept in double precision as on CPU) is split into two float32
    parts (a scalar's conversion: exact on every platform). Zeros, infinities, NaN and the sign of a negative base as IEEE ``pow`` (C's and PyTorch's), without XLA's ``power``.
    """
    x, y = jnp.asarray(x), jnp.asarray(y)
    if x.dtype != jnp.float32:
        return jnp.power(x, y)
    if y.dtype == jnp.float64:
        y_high = y.astype(jnp.float32)
        y_low = (y - y_high.astype(jnp.float64)).astype(jnp.float32)
    else:
        y_high, y_low = y.astype(jnp.float32), jnp.zeros((), jnp.float32)
    x, y_high, y_low = jnp.broadcast_arrays(x, y_high, y_low)
    regular = jnp.isfinite(x) & (x != 0) & jnp.isfinite(y_high) & (y_high != 0) & (x != 1)
    safe_x = jnp.where(regular, x, 2.0)
    safe_y = jnp.where(regular, y_high, 1.0)
    magnitude = _power_float32(safe_x, safe_y, jnp.where(regular, y_low, 0.0))
    # x < 0: defined for integer exponents, negative for odd ones (every float32 above 2^24 is even).
    integer = y_high == jnp.floor(y_high)
    odd = integer & (jnp.abs(y_high) < 2.0**24) & (jnp.fmod(y_high, 2.0) != 0)
    signed = jnp.where(x < 0, jnp.where(integer, jnp.where(odd, -magnitude, magnitude), jnp.nan), magnitude)
    general = jnp.where(regular, signed, _power_edges(x, y_high, odd))
    out = general
    for exponent in SPECIAL_EXPONENTS:
        out = jnp.where((y_high == exponent) & (y_low == 0), special_power(x, exponent), out)
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
