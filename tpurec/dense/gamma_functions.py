"""``lgamma`` and ``digamma`` in float32, without float64.

A TPU emulates float64 slowly and with float32's exponent range, and XLA's float32 ``lgamma`` takes
logarithms that cannot ask for accuracy (it erred by 2.8e-4 on a TPU v5e, PyTorch CPU 3.8e-7).
Where ``log |Gamma(x)|`` or ``psi(x)`` is near one of its zeros on the negative axis, the terms that
make it up cancel by more digits than float32 keeps; there the computation carries pairs of float32
numbers (a value and its rounding error, to about 1e-11):

* ``lgamma`` for -16.5 <= x < 8.5: ``t = x - round(x)`` (exact), ``lgamma(2 + t)`` by its Taylor
  series (coefficients ``(-1)^k (zeta(k) - 1) / k``; |t| <= 1/2), and the recurrence
  ``Gamma(x + 1) = x Gamma(x)`` as the logarithm of a product of the factors ``t + j``, all in pairs.
  From 8.5 on, Stirling's series in float32 (no cancellation there); below -16.5, the reflection
  ``log(pi / |x sin(pi x)|) - lgamma(-x)`` in float32 (every value there is below -17, so its terms
  cancel by less than a factor of 3).
* ``digamma`` for -16.5 <= x < 8.5 the same way: ``psi(2 + t)`` by its Taylor series and the
  recurrence's sum of ``1 / (t + j)``, in pairs; below -16.5, the reflection
  ``psi(1 - x) - pi cot(pi x)``, with ``psi(1 - x)`` by its asymptotic series around a logarithm in
  pairs and ``pi cot(pi f)`` (f = x - round(x), exact) as ``1 / f`` times ``1 - 2 sum zeta(2n) f^2n``,
  in pairs (PyTorch's float32 kernel takes the cotangent in double precision, ``psi(1 - x)`` in
  float32). From 8.5 on, PyTorch's algorithm (Cephes' ``psi``): the recurrence up to 10 and the
  asymptotic series.

Logarithms and exponentials are :mod:`tpurec.dense.transcendental`'s accurate ones. Other dtypes
keep XLA's algorithms.

Example::

    y = jax.jit(gamma_functions.lgamma)(jnp.linspace(-3.5, 10, 8, dtype=jnp.float32))
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tpurec.dense import transcendental
from tpurec.dense.transcendental import two_product, two_sum

__all__ = ["lgamma", "digamma", "lgamma_pair", "lgamma1p_pair", "Pair", "pair_add", "pair_mul", "pair_reciprocal"]

Pair = tuple[jax.Array, jax.Array]

# lgamma(2 + t) = sum_k c_k t^k: c_1 = 1 - euler_gamma, c_k = (-1)^k (zeta(k) - 1) / k (mpmath, 22 digits).
_LGAMMA_AT_2 = (
    0.0,
    0.4227843350984671393935,
    0.3224670334241132182362,
    -0.06735230105319809513325,
    0.020580808427784547879,
    -0.007385551028673985266273,
    0.002890510330741523285753,
    -0.001192753911703260977114,
    0.0005096695247430424223357,
    -0.0002231547584535793797614,
    0.0000994575127818085337146,
    -0.00004492623673813314170021,
    0.00002050721277567069155317,
    -0.000009439488275268395903987,
    0.000004374866789907487804182,
    -0.000002039215753801366236782,
    9.551412130407419832857e-7,
    -4.492469198764566043294e-7,
    2.120718480555466586923e-7,
    -1.004322482396809960872e-7,
    4.76981016936398056576e-8,
    -2.271109460894316491032e-8,
    1.083865921489695409107e-8,
)
# psi(2 + t), the series' derivative: k c_k t^(k - 1).
_DIGAMMA_AT_2 = tuple(k * c for k, c in enumerate(_LGAMMA_AT_2))[1:]
# The first terms in pairs: the rest is below 1e-5 of the value at |t| = 1/2 (its float32 error below 1e-12).
_PAIR_TERMS = 7
# The range of the recurrence: round(x) in [_LOWEST, _HIGHEST].
_LOWEST, _HIGHEST = -16, 8
_HALF_LOG_TWO_PI = np.float32(0.5 * math.log(2 * math.pi))
_PI = np.float32(math.pi)
# Stirling: lgamma(z) - ((z - 1/2) log z - z + log(2 pi) / 2) = sum_k B_2k / (2k (2k - 1) z^(2k - 1)).
_STIRLING = tuple(np.float32(c) for c in (-1 / 1680, 1 / 1260, -1 / 360, 1 / 12))
_STIRLING_FROM = 8.5
# pi f cot(pi f) = 1 - 2 sum_n zeta(2n) f^2n (mpmath, 22 digits): to 7e-15 at |f| = 1/2.
_PI_COT = (
    1.0,
    -3.289868133696452872945,
    -2.164646467422276383032,
    -2.034686123968898279429,
    -2.008154712395888678757,
    -2.001989150255636170674,
    -2.000492173106616096597,
    -2.000122496270117409659,
    -2.000030564518817303743,
    -2.00000763458652999968,
    -2.000001907924067745592,
    -2.000000476901005455466,
    -2.000000119216378102519,
    -2.00000002980310965673,
    -2.000000007450668049577,
    -2.000000001862654864839,
    -2.000000000465662366735,
    -2.000000000116415441758,
    -2.000000000029103843782,
    -2.000000000007275959095,
    -2.000000000001818989568,
    -2.000000000000454747369,
    -2.00000000000011368684,
    -2.00000000000002842171,
    -2.000000000000007105427,
)
_PI_COT_PAIR_TERMS = 10  # the rest is below 3e-6 at |f| = 1/2


def _split(value: float) -> tuple[np.float32, np.float32]:
    high = np.float32(value)
    return high, np.float32(value - float(high))


def _mul(a: Pair, b: Pair) -> Pair:
    product, error = two_product(a[0], b[0])
    return two_sum(product, error + (a[0] * b[1] + a[1] * b[0]))


def _add(a: Pair, b: Pair) -> Pair:
    total, error = two_sum(a[0], b[0])
    return two_sum(total, error + a[1] + b[1])


def _series(t: jax.Array | Pair, coefficients: Sequence[float], pair_terms: int = _PAIR_TERMS) -> Pair:
    """``sum_k coefficients[k] t^k`` for a float32 t or a pair, the first ``pair_terms`` terms in pairs."""
    if not isinstance(t, tuple):
        t = (t, jnp.zeros_like(t))
    rest = jnp.zeros_like(t[0])
    for c in reversed(coefficients[pair_terms:]):
        rest = rest * t[0] + np.float32(c)
    total: Pair = (rest, jnp.zeros_like(rest))
    for c in reversed(coefficients[:pair_terms]):
        high, low = _split(c)
        total = _add(_mul(total, t), (jnp.full_like(rest, high), jnp.full_like(rest, low)))
    return total


def _shift(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``t = x - round(x)`` (exact), ``round(x)`` and the recurrence's sign: -1 where x < 1.5 (the
    factors ``x ... 1 + t`` lie below 2 + t), else 1 (``2 + t ... x - 1`` above)."""
    r = jnp.floor(x + 0.5)
    return x - r, r, jnp.where(r <= 1, -jnp.ones_like(x), jnp.ones_like(x))


def _over_factors(
    t: jax.Array, r: jax.Array, update: Callable[[Pair, Pair], Pair], start: Pair, lowest: int = _LOWEST
) -> Pair:
    """``start`` updated by each factor ``t + j`` (a pair) between x and 2 + t, for j in
    [lowest, _HIGHEST]: j from round(x) to 1 where x < 1.5, from 2 to round(x) - 1 above. (Unrolled:
    one elementwise program, which a TPU runs in one pass over the data.)"""
    total = start
    for j in range(lowest, _HIGHEST + 1):
        active = ((r <= j) & (j <= 1)) | ((j >= 2) & (j < r))
        high, low = two_sum(t, jnp.full_like(t, np.float32(j)))
        updated = update(total, (jnp.where(active, high, 1.0), jnp.where(active, low, 0.0)))
        total = jnp.where(active, updated[0], total[0]), jnp.where(active, updated[1], total[1])
    return total


def _stirling(z: jax.Array) -> jax.Array:
    """``lgamma(z)`` for z >= 8.5 (float32), as ``(z - 1/2)(log z - 1) + log(2 pi) / 2 - 1/2 + series``
    (the product does not overflow before lgamma does)."""
    u = 1 / z
    u2 = u * u
    series = jnp.zeros_like(z)
    for c in _STIRLING:
        series = series * u2 + c
    return (z - 0.5) * (transcendental.log(z) - 1) + ((_HALF_LOG_TWO_PI - 0.5) + series * u)


def _sin_pi(x: jax.Array) -> jax.Array:
    """``|sin(pi x)|`` for finite x, from the distance to the nearest integer (exact)."""
    f = x - jnp.floor(x)
    return jnp.sin(_PI * jnp.minimum(f, 1 - f))


def _lgamma_middle(x: jax.Array, lowest: int = _LOWEST) -> Pair:
    """``lgamma(x)`` for float32 x in [lowest - 0.5, 8.5), not a pole, as a pair (see the module docstring)."""
    t, r, sign = _shift(x)
    product = _over_factors(t, r, _mul, (jnp.ones_like(t), jnp.zeros_like(t)), lowest)
    flip = product[0] < 0
    magnitude = jnp.where(flip, -product[0], product[0]), jnp.where(flip, -product[1], product[1])
    log_high, log_low = transcendental.log_pair(jnp.where(magnitude[0] > 0, magnitude[0], 1.0))
    log_product = (log_high, log_low + magnitude[1] / magnitude[0])
    return _add(_series(t, _LGAMMA_AT_2), (sign * log_product[0], sign * log_product[1]))


def _stirling_pair(z: jax.Array) -> Pair:
    """``lgamma(z)`` for float32 z >= 8.5 (below 1e36) as a pair: :func:`_stirling` with ``z - 1/2``,
    ``log z - 1`` and their product in pairs."""
    u = 1 / z
    u2 = u * u
    series = jnp.zeros_like(z)
    for c in _STIRLING:
        series = series * u2 + c
    log_high, log_low = transcendental.log_pair(z)
    product = _mul(
        two_sum(z, jnp.full_like(z, -0.5)), _add((log_high, log_low), (-jnp.ones_like(z), jnp.zeros_like(z)))
    )
    high, low = _split(0.5 * math.log(2 * math.pi) - 0.5)
    return _add(product, (jnp.full_like(z, high), low + series * u))


def lgamma_pair(x: jax.Array) -> Pair:
    """``lgamma(x)`` for finite float32 x in (0, 1e36) as a pair of float32 numbers (to about 1e-11 of
    the terms that make it up)."""
    middle = x < _STIRLING_FROM
    low = _lgamma_middle(jnp.where(middle, x, 2.0), lowest=0)
    high = _stirling_pair(jnp.where(middle, _STIRLING_FROM, x))
    return jnp.where(middle, low[0], high[0]), jnp.where(middle, low[1], high[1])


def lgamma1p_pair(a: jax.Array) -> Pair:
    """``lgamma(1 + a)`` for float32 a in [0, 1.5] without rounding ``1 + a``, as a pair: the series at 2
    in ``a - 1`` (exact) from 1/2 on, below it ``lgamma(2 + a) - log(1 + a)`` with ``1 + a`` as a pair."""
    upper = a >= 0.5
    shifted = _series(jnp.where(upper, a - 1, 0.0), _LGAMMA_AT_2)
    one_plus = two_sum(jnp.ones_like(a), jnp.where(upper, 0.0, a))
    log_high, log_low = transcendental.log_pair(one_plus[0])
    below = _add(_series(jnp.where(upper, 0.0, a), _LGAMMA_AT_2), (-log_high, -(log_low + one_plus[1] / one_plus[0])))
    return jnp.where(upper, shifted[0], below[0]), jnp.where(upper, shifted[1], below[1])


def _lgamma_float32(x: jax.Array) -> jax.Array:
    finite = jnp.isfinite(x)
    middle = finite & (x >= _LOWEST - 0.5) & (x < _STIRLING_FROM)
    total = _lgamma_middle(jnp.where(middle, x, 2.0))
    middle_value = total[0] + total[1]
    # x >= 8.5: Stirling; x < -16.5: the reflection, with Stirling for lgamma(-x).
    high = _stirling(jnp.where(finite & (x >= _STIRLING_FROM), x, _STIRLING_FROM))
    left = jnp.where(finite & (x < _LOWEST - 0.5), x, _LOWEST - 1.0)
    reflected = transcendental.log(_PI / (-left * _sin_pi(left))) - _stirling(-left)
    out = jnp.where(x >= _STIRLING_FROM, high, jnp.where(x < _LOWEST - 0.5, reflected, middle_value))
    # The poles (0 and the negative integers, all of x <= -2^23) and +-inf: inf; NaN stays.
    pole = (x <= 0) & (x == jnp.floor(x))
    return jnp.where(pole | jnp.isinf(x), jnp.inf, jnp.where(jnp.isnan(x), x, out))


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


def _digamma_float32(x):
    """psi(x) for float32 x >= 8.5, as PyTorch's ``calc_digamma(float)`` (Cephes' psi): the recurrence
    psi(x) = psi(x + 1) - 1/x up to 10, then the asymptotic series above."""
    y = x
    total = jnp.zeros_like(y)
    for _ in range(2):  # (8.5 to [10, 11) in at most 2 steps)
        below = y < 10
        total = total - jnp.where(below, 1 / jnp.where(below, y, 1.0), 0.0)
        y = jnp.where(below, y + 1, y)
    big = jnp.where(y < 1e17, y, 1e17)
    z = 1 / (big * big)
    series = jnp.zeros_like(z)
    for c in _DIGAMMA_ASYMPTOTIC:
        series = series * z + c
    series = jnp.where(y < 1e17, z * series, 0.0)
    out = total + transcendental.log(y) - 0.5 / y - series
    out = jnp.where(y == 10, total + _PSI_10, out)
    return jnp.where(x == jnp.inf, x, out)


def _reciprocal(a: Pair) -> Pair:
    """``1 / (high + low)`` as a pair (the quotient's rounding error from its exact residual)."""
    quotient = 1 / a[0]
    product, error = two_product(quotient, a[0])
    return quotient, (((1 - product) - error) - quotient * a[1]) / a[0]


def _pi_cot_pi(f: jax.Array) -> Pair:
    """``pi cot(pi f)`` for float32 f in [-1/2, 1/2], f != 0, as a pair: ``(1 / f)`` times the series above."""
    return _mul(_reciprocal((f, jnp.zeros_like(f))), _series(two_product(f, f), _PI_COT, _PI_COT_PAIR_TERMS))


def _digamma_large_pair(z: jax.Array) -> Pair:
    """``psi(z + 1) = log z + 1 / (2z) - sum_k B_2k / (2k z^2k)`` for float32 z >= 16.5, as a pair."""
    u = 1 / (z * z)
    series = jnp.zeros_like(z)
    for c in _DIGAMMA_ASYMPTOTIC:
        series = series * u + c
    half = _reciprocal((2 * z, jnp.zeros_like(z)))
    return _add(transcendental.log_pair(z), (half[0], half[1] - series * u))


def _digamma_pairs(x: jax.Array) -> jax.Array:
    """psi(x) for float32 x in [-16.5, 8.5), not a pole: ``psi(2 + t)`` and the recurrence's
    ``1 / (t + j)``, in pairs."""
    t, r, sign = _shift(x)

    def add_reciprocal(total: Pair, factor: Pair) -> Pair:
        high, low = _reciprocal(factor)
        return _add(total, (sign * high, sign * low))

    total = _over_factors(t, r, add_reciprocal, _series(t, _DIGAMMA_AT_2))
    return total[0] + total[1]


def _digamma_reflected(x: jax.Array) -> jax.Array:
    """psi(x) for float32 -2^23 < x < -16.5, not a pole: ``psi(1 - x) - pi cot(pi x)``, in pairs."""
    f = x - jnp.round(x)  # in [-1/2, 1/2], exact
    cotangent = _pi_cot_pi(jnp.where(f == 0, 0.5, f))
    reflected = _add(_digamma_large_pair(-x), (-cotangent[0], -cotangent[1]))
    return reflected[0] + reflected[1]


pair_add, pair_mul, pair_reciprocal = _add, _mul, _reciprocal


def digamma(x):
    """``d/dx log Gamma(x)`` (``lgamma``'s derivative), as ``torch.digamma``: -inf at +0, inf at -0,
    NaN at the negative integers (all of x <= -2^23) and at -inf.

    Args:
        x: a floating-point array (float32 as described in the module; others by XLA).

    Returns:
        digamma(x), of ``x``'s dtype.
    """
    x = jnp.asarray(x)
    if x.dtype == jnp.float32:
        middle = (x >= _LOWEST - 0.5) & (x < _STIRLING_FROM)
        left = (x < _LOWEST - 0.5) & (x > -(2.0**23))
        out = _digamma_pairs(jnp.where(middle, x, 2.0))
        out = jnp.where(left, _digamma_reflected(jnp.where(left, x, _LOWEST - 1.5)), out)
        out = jnp.where(x >= _STIRLING_FROM, _digamma_float32(jnp.maximum(x, _STIRLING_FROM)), out)
        out = jnp.where((x < 0) & (x == jnp.floor(x)), jnp.nan, out)  # the poles and -inf
        out = jnp.where(jnp.isnan(x), x, out)
    else:
        out = lax.digamma(x)
    # At zero, the limit from the zero's side (XLA gives NaN): -inf at +0, inf at -0, as PyTorch.
    inf = jnp.full_like(out, jnp.inf)
    return jnp.where(x == 0, jnp.where(jnp.signbit(x), inf, -inf), out)


def lgamma(x):
    """``log |Gamma(x)|``, as ``torch.lgamma``: inf at the poles and at +-inf.

    Args:
        x: a floating-point array (float32 as described in the module; others by XLA).

    Returns:
        lgamma(x), of ``x``'s dtype.
    """
    x = jnp.asarray(x)
    if x.dtype != jnp.float32:
        return lax.lgamma(x)
    return _lgamma_float32(x)
