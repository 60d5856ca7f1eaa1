"""The Hurwitz zeta function in float32, without float64.

A TPU emulates float64 with float32's exponent range: computed through float64, ``zeta(1.28, 1.3e-30)``
read inf on a v5e (the answer is 2.4e38). PyTorch's CPU kernel (Cephes' ``zeta``) sums
``(q + k)^-x`` for k < 9 and adds the Euler-Maclaurin tail at ``w = q + 9``, in double precision even
for float32. Here the same sum in float32, with what double precision gave it kept by other means:

* ``q + k`` is a pair of float32 numbers (its rounding error kept), and ``(q + k)^-x`` is
  ``transcendental``'s float32 power of the rounded base times ``1 - x e / (q + k)`` (e the error);
  rounding the base would cost ``x`` times its relative error (7e-6 at x = 120);
* the sum is compensated (each addition's rounding error carried along);
* for q >= 2^20, where ``q + 1`` is no longer exact enough to sum, the first terms of the asymptotic
  expansion ``q^(1-x) / (x - 1) (1 + (x - 1) / (2q) + x (x - 1) / (12 q^2))`` (the next is below 1e-19).

Example::

    y = jax.jit(hurwitz_zeta.zeta)(jnp.float32(2.0), jnp.linspace(0.5, 4, 8, dtype=jnp.float32))
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tpurec.dense import gamma_functions, transcendental

__all__ = ["zeta", "polygamma", "power_of_pair"]

# Euler-Maclaurin: B_2k / (2k)! as 1 / _BERNOULLI[k] (Cephes' A[]).
_BERNOULLI = (
    12.0,
    -720.0,
    30240.0,
    -1209600.0,
    47900160.0,
    -1.8924375803183791606e9,
    7.47242496e10,
    -2.950130727918164224e12,
    1.1646782814350067249e14,
    -4.5979787224074726105e15,
    1.8152105401943546773e17,
    -7.1661652561756670113e18,
)
_DIRECT_TERMS = 9
_ASYMPTOTIC_FROM = 2.0**20


def power_of_pair(high: jax.Array, low: jax.Array, exponent: jax.Array) -> jax.Array:
    """``(high + low) ** exponent`` for |low| far below |high| (float32), to first order in low."""
    return transcendental.power(high, exponent) * (1 + exponent * (low / high))


def _scaled_power_of_pair(high: jax.Array, low: jax.Array, exponent: jax.Array, scale: jax.Array) -> jax.Array:
    """``(high + low) ** exponent * 2 ** scale`` for finite high > 0, finite exponent."""
    return transcendental.power_pair_exponent(high, exponent, jnp.zeros_like(high), scale) * (
        1 + exponent * (low / high)
    )


def _rough_log2(q: jax.Array) -> jax.Array:
    """log2(q) within 0.09 for float32 q >= 1, from its bits: exponent + (significand - 1)."""
    bits = jax.lax.bitcast_convert_type(q, jnp.int32)
    significand = jax.lax.bitcast_convert_type((bits & 0x007FFFFF) | 0x3F800000, jnp.float32)
    return ((bits >> 23) - 127).astype(jnp.float32) + (significand - 1)


def _add(total: tuple[jax.Array, jax.Array], value: jax.Array) -> tuple[jax.Array, jax.Array]:
    high, error = transcendental.two_sum(total[0], value)
    return high, total[1] + error


def zeta(x: jax.Array, q_high: jax.Array, q_low: jax.Array | None = None, factor: float = 1.0) -> jax.Array:
    """factor * zeta(x, q) for float32 x > 1 and q = q_high + q_low > 0 (q_low: a rounding error carried in).

    Args:
        x: the exponent, float32, > 1 (other values give meaningless numbers: the caller selects).
        q_high: the shift, float32, > 0.
        q_low: a small correction to ``q_high`` (default 0).
        factor: a positive constant the sum is multiplied by before it leaves its scaled range, so
            that a product in float32's normal range is not lost to a sum below it (polygamma's n!).

    Returns:
        factor * sum_{k >= 0} (q + k)^-x, float32.
    """
    mantissa, exponent = math.frexp(factor)
    if q_low is None:
        q_low = jnp.zeros_like(q_high)
    x, q_high, q_low = jnp.broadcast_arrays(x, q_high, q_low)
    large = q_high >= _ASYMPTOTIC_FROM
    q = jnp.where(large, 1.0, q_high)
    q_low_small = jnp.where(large, 0.0, q_low)
    # The terms times 2^scale, 2^scale about q^(x - 1): each term (about q^-x) can fall below float32's
    # range where the sum (about q^(1 - x) / (x - 1)) does not. (An exact power of two, from a rough log2.)
    scale = jnp.clip(jnp.round((x - 1) * _rough_log2(jnp.maximum(q, 1.0))), 0.0, 125.0)
    total = (_scaled_power_of_pair(q, q_low_small, -x, scale), jnp.zeros_like(q))
    term = total[0]
    a_high, a_low = q, q_low_small
    for k in range(1, _DIRECT_TERMS + 1):
        a_high, error = transcendental.two_sum(q, jnp.full_like(q, float(k)))
        a_low = error + q_low_small
        term = _scaled_power_of_pair(a_high, a_low, -x, scale)
        total = _add(total, term)
    w = a_high + a_low
    x_minus_1, x_minus_1_low = transcendental.two_sum(x, jnp.full_like(x, -1.0))  # (exact for x <= 2)
    total = _add(total, term * w / x_minus_1 * (1 - x_minus_1_low / x_minus_1))
    total = _add(total, -0.5 * term)
    # The Euler-Maclaurin terms x (x+1) ... (x+2i) / w^(2i+1) * term / B[i], their product kept in one
    # number (the rising factorial alone overflows float32).
    product = term
    k = 0.0
    tail = jnp.zeros_like(q)
    for bernoulli in _BERNOULLI:
        product = product * ((x + k) / w)
        tail = tail + product / np.float32(bernoulli)
        product = product * ((x + k + 1) / w)
        k += 2.0
    total = _add(total, tail)
    # (an infinite first term, q^-x past float32's range, makes the carried errors NaN)
    total = (total[0], jnp.where(jnp.isinf(total[0]), 0.0, total[1]))
    # times 2^(exponent - scale) in two steps, each power of two in range; the partial product lies
    # between the scaled sum and the result, so it neither overflows nor underflows where they do not
    shift = exponent - scale
    half_shift = jnp.floor(shift / 2)
    summed = (
        (total[0] + total[1])
        * np.float32(mantissa)
        * transcendental.power_of_two(half_shift)
        * transcendental.power_of_two(shift - half_shift)
    )
    # q >= 2^20: the asymptotic expansion
    big_q = jnp.where(large, q_high, _ASYMPTOTIC_FROM)
    y, y_low = transcendental.two_sum(jnp.ones_like(x), -x)  # 1 - x as a pair
    leading = transcendental.power_pair_exponent(big_q, y, y_low, float(exponent)) * np.float32(mantissa) / x_minus_1
    leading = leading * (1 - x_minus_1_low / x_minus_1)
    correction = 1 + x_minus_1 / (2 * big_q) + x * x_minus_1 / (12 * big_q * big_q)
    return jnp.where(large, leading * correction, summed)


def _integer_power_pair(base: gamma_functions.Pair, exponent: int) -> gamma_functions.Pair:
    """``base ** exponent`` for a pair and a positive Python integer, by squaring, in pairs."""
    result: gamma_functions.Pair | None = None
    square = base
    while exponent:
        if exponent & 1:
            result = square if result is None else gamma_functions.pair_mul(result, square)
        exponent >>= 1
        if exponent:
            square = gamma_functions.pair_mul(square, square)
    assert result is not None
    return result


def polygamma(n: int, x: jax.Array) -> jax.Array:
    """psi^(n)(x) = (-1)^(n+1) n! zeta(n + 1, x) for n >= 1 and float32 x, as ``torch.polygamma``.

    x > 0: :func:`zeta` with n! joined to the sum before it is unscaled (a result in float32's range
    is not lost to a zeta below it). x < 0, not an integer: the ``m = 2 ceil(-x) + 1`` terms
    ``(x + k)^-(n+1)`` of the recurrence summed in pairs of float32 numbers, then
    ``zeta(n + 1, x + m)``: the terms on both sides of 0, which cancel (exactly at the half-integers
    for odd n + 1), are all in the pairs' sum. x = 0 and the negative integers (every x <= -2^23) are
    poles: (-1)^(n+1) inf, as CPU's zeta; at +inf, 0 for n = 1 and NaN above (CPU's trigamma and zeta).

    Args:
        n: the order, a Python int >= 1.
        x: a float32 array.

    Returns:
        float32 array of psi^(n)(x).
    """
    factorial = float(math.factorial(n))
    sign = 1.0 if n % 2 == 1 else -1.0
    order = jnp.full_like(x, float(n + 1))
    positive = x > 0
    pole = (x <= 0) & (x == jnp.floor(x))
    negative = (x < 0) & ~pole
    # x < 0: walk k = 0 .. m - 1 (the loop runs to the largest m present)
    steps = jnp.where(negative, 2 * jnp.ceil(-x) + 1, 0.0)

    def body(carry):
        k, total, rough = carry
        inside = k < steps
        base = transcendental.two_sum(jnp.where(inside, x, 1.0), jnp.where(inside, k, 0.0))  # exact
        term = _integer_power_pair(gamma_functions.pair_reciprocal(base), n + 1)
        term = (jnp.where(inside, term[0], 0.0), jnp.where(inside, term[1], 0.0))
        return k + 1, gamma_functions.pair_add(total, term), rough + term[0]

    zeros = jnp.zeros_like(x)
    _, total, rough = lax.while_loop(
        lambda c: c[0] < jnp.max(steps, initial=0.0), body, (jnp.zeros((), x.dtype), (zeros, zeros), zeros)
    )
    shifted = transcendental.two_sum(jnp.where(negative, x, 1.0), steps)  # x + m > -x, exact
    q_high = jnp.where(positive, x, jnp.where(negative, shifted[0], 1.0))
    q_low = jnp.where(negative, shifted[1], 0.0)
    rest = zeta(order, q_high, q_low, factor=factorial)
    summed = (total[0] + (total[1] + rest / np.float32(factorial))) * np.float32(factorial)
    # a term past float32's range (x within 2^(-128 / (n + 1)) of a pole) makes the pairs NaN
    out = jnp.where(negative, jnp.where(jnp.isinf(rough), rough, summed), rest)
    out = jnp.where(pole, jnp.inf, out)
    at_inf = jnp.full_like(x, 0.0 if n == 1 else jnp.nan)
    return sign * jnp.where(x == jnp.inf, at_inf, jnp.where(jnp.isnan(x), jnp.nan, out))
