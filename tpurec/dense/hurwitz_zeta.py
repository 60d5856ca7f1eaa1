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

import jax
import jax.numpy as jnp
import numpy as np

from tpurec.dense import transcendental

__all__ = ["zeta", "power_of_pair"]

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


def zeta(x: jax.Array, q_high: jax.Array, q_low: jax.Array | None = None) -> jax.Array:
    """zeta(x, q) for float32 x > 1 and q = q_high + q_low > 0 (q_low: a rounding error carried in).

    Args:
        x: the exponent, float32, > 1 (other values give meaningless numbers: the caller selects).
        q_high: the shift, float32, > 0.
        q_low: a small correction to ``q_high`` (default 0).

    Returns:
        sum_{k >= 0} (q + k)^-x, float32.
    """
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
    half_scale = jnp.floor(scale / 2)
    summed = (
        (total[0] + total[1])
        * transcendental.power_of_two(-half_scale)
        * transcendental.power_of_two(half_scale - scale)
    )
    # q >= 2^20: the asymptotic expansion
    big_q = jnp.where(large, q_high, _ASYMPTOTIC_FROM)
    y, y_low = transcendental.two_sum(jnp.ones_like(x), -x)  # 1 - x as a pair
    leading = transcendental.power_pair_exponent(big_q, y, y_low) / x_minus_1
    leading = leading * (1 - x_minus_1_low / x_minus_1)
    correction = 1 + x_minus_1 / (2 * big_q) + x * x_minus_1 / (12 * big_q * big_q)
    return jnp.where(large, leading * correction, summed)
