"""The inverse error function and the normal quantile in float32, without float64.

``erfinv`` and ``ndtri`` (the inverse of the standard normal CDF) are computed for float32 inputs in
float32: a TPU emulates float64 slowly and with float32's exponent range, and XLA's own float32
``erf_inv`` takes a logarithm that cannot ask for accuracy (it erred by 2.5e-5 on a TPU v5e, PyTorch
CPU about 1e-7). Both come from one solver for ``t >= 0`` with ``erf(t) = a`` and ``erfc(t) = w``,
told which of ``a`` or ``w = 1 - a`` is exact (the other would have lost its digits to rounding):

* a first guess by Cephes' ``ndtri`` (PyTorch's ``calc_ndtri``; its rational functions, rounded to
  float32): a rational function of the distance from the median, else of ``1 / sqrt(-2 log y)`` in
  the tail ``y`` below e^-2;
* one Newton step on what is exact: ``erf(t) - a`` up to a = 0.7 (``erf`` by its series of positive
  terms: XLA's float32 ``erf`` erred by 2.4e-7 at 0.0071 on XLA:CPU), else ``log erfc(t) - log w``
  (as ``log erfcx(t) - t^2 - log w`` with :mod:`tpurec.dense.error_functions`' float32 ``erfcx``,
  which neither underflows nor loses the tail's relative accuracy).

``erfinv(y)`` is ``sign(y) t`` with ``a = |y|`` (``w = 1 - |y|`` is exact from 1/2 on); ``ndtri(p)``
is ``sign(p - 1/2) sqrt(2) t`` with ``a = |2p - 1|`` (kept exactly as a pair of float32 numbers) and
``w = 2 min(p, 1 - p)`` (exact: ``1 - p`` is from 1/2 on). Other dtypes keep XLA's (float64) algorithms.

Example::

    y = jax.jit(inverse_error_functions.erfinv)(jnp.linspace(-1, 1, 9, dtype=jnp.float32))
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import jax.scipy.special as jss
import numpy as np
from jax import lax

from tpurec.dense import error_functions, transcendental

__all__ = ["erfinv", "ndtri"]


def _float32(*coefficients: float) -> tuple[np.float32, ...]:
    return tuple(np.float32(c) for c in coefficients)


# Cephes' ndtri (PyTorch's calc_ndtri), highest degree first: |y - 1/2| <= 3/8, ...
# fmt: off
_P0 = _float32(-5.99633501014107895267e1, 9.80010754185999661536e1, -5.66762857469070293439e1,
               1.39312609387279679503e1, -1.23916583867381258016e0)
_Q0 = _float32(1.0, 1.95448858338141759834e0, 4.67627912898881538453e0, 8.63602421390890590575e1,
               -2.25462687854119370527e2, 2.00260212380060660359e2, -8.20372256168333339912e1,
               1.59056225126211695515e1, -1.18331621121330003142e0)
# ... sqrt(-2 log y) in [2, 8) ...
_P1 = _float32(4.05544892305962419923e0, 3.15251094599893866154e1, 5.71628192246421288162e1,
               4.40805073893200834700e1, 1.46849561928858024014e1, 2.18663306850790267539e0,
               -1.40256079171354495875e-1, -3.50424626827848203418e-2, -8.57456785154685413611e-4)
_Q1 = _float32(1.0, 1.57799883256466749731e1, 4.53907635128879210584e1, 4.13172038254672030440e1,
               1.50425385692907503408e1, 2.50464946208309415979e0, -1.42182922854787788574e-1,
               -3.80806407691578277194e-2, -9.33259480895457427372e-4)
# ... and in [8, 64).
_P2 = _float32(3.23774891776946035970e0, 6.91522889068984211695e0, 3.93881025292474443415e0,
               1.33303460815807542389e0, 2.01485389549179081538e-1, 1.23716634817820021358e-2,
               3.01581553508235416007e-4, 2.65806974686737550832e-6, 6.23974539184983293730e-9)
_Q2 = _float32(1.0, 6.02427039364742014255e0, 3.67983563856160859403e0, 1.37702099489081330271e0,
               2.16236993594496635890e-1, 1.34204006088543189037e-2, 3.28014464682127739104e-4,
               2.89247864745380683936e-6, 6.79019408009981274425e-9)
# fmt: on
_EXP_MINUS_2 = np.float32(math.exp(-2))
_SQRT_PI = np.float32(math.sqrt(math.pi))
_HALF_SQRT_PI = np.float32(math.sqrt(math.pi) / 2)
_TWO_OVER_SQRT_PI = np.float32(2 / math.sqrt(math.pi))
_SQRT_2 = _float32(math.sqrt(2), math.sqrt(2) - float(np.float32(math.sqrt(2))))


def _horner(t: jax.Array, coefficients: Sequence[np.float32]) -> jax.Array:
    out = jnp.zeros_like(t)
    for c in coefficients:
        out = out * t + c
    return out


def _first_guess(y: jax.Array, d: jax.Array) -> jax.Array:
    """Cephes' ``|ndtri(y)| / sqrt(2)`` for a lower tail probability y in (0, 1/2], ``d = 1/2 - y``."""
    central = y > _EXP_MINUS_2
    d = jnp.where(central, d, 0.0)
    d2 = d * d
    near = (d + d * (d2 * _horner(d2, _P0) / _horner(d2, _Q0))) * _SQRT_PI  # sqrt(2 pi) / sqrt(2)
    x = jnp.sqrt(-2 * transcendental.log(jnp.where(central, 0.5, y)))
    z = 1 / x
    x1 = jnp.where(x < 8, z * _horner(z, _P1) / _horner(z, _Q1), z * _horner(z, _P2) / _horner(z, _Q2))
    far = (x - transcendental.log(x) / x - x1) * np.float32(math.sqrt(0.5))
    return jnp.where(central, near, far)


# Where a = erf(t) is exact, Newton's step on erf(t) - a up to a = _CENTRAL (t = 0.733); from there
# on the one on log erfc(t), which is better conditioned than erf's rounding near 1.
_CENTRAL = 0.7
_ERF_SERIES_TERMS = 14  # t <= 0.733: the 14th term is below 1e-14 of the sum


def _erf_series(t: jax.Array) -> jax.Array:
    """``erf(t)`` for 0 <= t <= 0.733 to a few float32 rounding errors (XLA's float32 ``erf`` erred by
    2.4e-7 relative at 0.0071 on XLA:CPU): ``2 t / sqrt(pi) exp(-t^2) sum_n (2 t^2)^n / (2n + 1)!!``,
    whose terms are all positive, with ``exp(-t^2)`` from t^2 split into its rounded value and error."""
    square, square_error = transcendental.two_product(t, t)
    total = jnp.ones_like(t)
    for n in range(_ERF_SERIES_TERMS, 0, -1):
        total = 1 + total * (2 * square) / np.float32(2 * n + 1)
    gauss = transcendental.exp(-square) * (1 - square_error)
    return (_TWO_OVER_SQRT_PI * t) * gauss * total


def _solve(a: jax.Array, a_low: jax.Array, w: jax.Array, tail: jax.Array) -> jax.Array:
    """``t >= 0`` with ``erf(t) = a + a_low``, ``erfc(t) = w`` for a in [0, 1): ``a + a_low`` is exact
    where ``tail`` is false (there a <= _CENTRAL), ``w`` where it is true (there 0 < w < 1/2)."""
    a = jnp.where(tail, 0.0, a)
    a_low = jnp.where(tail, 0.0, a_low)
    w = jnp.where(tail, w, 0.5)
    y = jnp.where(tail, 0.5 * w, 0.5 - 0.5 * a)  # the normal lower tail probability
    t = _first_guess(y, jnp.where(tail, 0.5 - y, 0.5 * a))
    # Newton on erf(t) - a near the center, where the derivative 2 / sqrt(pi) exp(-t^2) is not small.
    central_t = jnp.where(tail, 0.0, t)
    central = central_t - ((_erf_series(central_t) - a) - a_low) / (
        _TWO_OVER_SQRT_PI * transcendental.exp(-central_t * central_t)
    )
    # Newton on log erfc(t) - log w in the tail: its derivative is -2 / (sqrt(pi) erfcx(t)).
    tail_t = jnp.where(tail, t, 1.0)
    scaled = error_functions.erfcx(tail_t)
    square, square_error = transcendental.two_product(tail_t, tail_t)
    residual = (transcendental.log(scaled) - transcendental.log(w)) - square - square_error
    far = tail_t + residual * (_HALF_SQRT_PI * scaled)
    return jnp.where(tail, far, central)


def erfinv(y: jax.Array) -> jax.Array:
    """The inverse of ``erf`` on [-1, 1], as ``torch.erfinv``: +-inf at +-1, NaN outside and for NaN.

    Args:
        y: a floating-point array (float32 as described in the module; others by XLA).

    Returns:
        erfinv(y), of ``y``'s dtype.
    """
    y = jnp.asarray(y)
    if y.dtype != jnp.float32:
        return lax.erf_inv(y)
    a = jnp.abs(y)
    inside = a < 1
    safe = jnp.where(inside, a, 0.0)
    t = _solve(safe, jnp.zeros_like(a), 1 - safe, inside & (a > _CENTRAL))  # (1 - a: exact from 1/2 on)
    t = jnp.where(a == 1, jnp.inf, jnp.where(inside, t, jnp.nan))  # (NaN: neither)
    return jnp.copysign(t, y)


def ndtri(p: jax.Array) -> jax.Array:
    """The standard normal quantile (the inverse of ``ndtr``) on [0, 1], as ``torch.special.ndtri``:
    -inf at 0, inf at 1, NaN outside and for NaN.

    Args:
        p: a floating-point array (float32 as described in the module; others by jax.scipy).

    Returns:
        ndtri(p), of ``p``'s dtype.
    """
    p = jnp.asarray(p)
    if p.dtype != jnp.float32:
        return jss.ndtri(p)
    inside = (p > 0) & (p < 1)
    safe = jnp.where(inside, p, 0.5)
    # |2p - 1| exactly as a pair (2p - 1 is exact from 1/2 on), and 2 min(p, 1 - p) (1 - p: the same)
    a, a_low = transcendental.two_sum(jnp.ones_like(safe), -2 * jnp.minimum(safe, 1 - safe))
    w = 2 * jnp.minimum(safe, 1 - safe)
    t = _solve(a, a_low, w, a > _CENTRAL)
    z = t * _SQRT_2[0] + t * _SQRT_2[1]
    z = jnp.where(safe < 0.5, -z, z)
    z = jnp.where(p == 0, -jnp.inf, jnp.where(p == 1, jnp.inf, z))
    return jnp.where(inside | (p == 0) | (p == 1), z, jnp.nan)
