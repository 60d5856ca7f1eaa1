"""Special functions through ``jax.scipy.special``: polygamma, erfcx (``error_functions``), Bessel
functions of order 0/1 (K_0/K_1 by quadrature, J_0/J_1 and Y_0/Y_1 by series and asymptotic expansion), Airy Ai,
ndtr/ndtri (``inverse_error_functions``)/log_ndtr, zeta, entr, xlog1py, igamma(c) (``incomplete_gamma``
for float32), and the orthogonal polynomial families.

Integer inputs compute in the default float dtype (torch's INT_TO_FLOAT
promotion); bfloat16/float16 compute in float32 and round once. Their
gradients are torch's own formulas over ops that have lowerings, so they stay
on the device too.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import jax.scipy.special as jss
import numpy as np
import torch
from jax import lax

from tpurec.dense._util import Kind, promote
from tpurec.dense.registry import lower
from tpurec.dense import (
    bessel,
    error_functions,
    gamma_functions,
    hurwitz_zeta,
    incomplete_gamma,
    inverse_error_functions,
    transcendental,
)

aten = torch.ops.aten


def _unary(fn):
    """An INT_TO_FLOAT unary op computing ``fn`` in float32 or wider."""

    def lowering(x):
        comp, res = promote(x, kind=Kind.INT_TO_FLOAT)
        wide = jnp.promote_types(comp, jnp.float32)
        return fn(x.astype(wide)).astype(res)

    return lowering


def _binary(fn):
    """An INT_TO_FLOAT binary op (Tensor/Scalar overloads) computing ``fn`` in float32 or wider."""

    def lowering(x, y):
        comp, res = promote(x, y, kind=Kind.INT_TO_FLOAT)
        wide = jnp.promote_types(comp, jnp.float32)
        return fn(jnp.asarray(x).astype(wide), jnp.asarray(y).astype(wide)).astype(res)

    return lowering


def _float32_by(float32_fn, other_fn):
    """``float32_fn`` for float32 arrays (tpurec.dense.bessel: no float64, which a TPU emulates with
    float32's exponent range), ``other_fn`` (float64 here) for the rest."""

    def fn(x):
        return float32_fn(x) if x.dtype == jnp.float32 else other_fn(x)

    return fn


def _spherical_j0(x):
    # sin(x)/x with the series 1 - x^2/6 near 0, where the quotient loses accuracy; 0 at +-inf, as
    # PyTorch's (sin(inf) is NaN)
    small = jnp.abs(x) < 1e-3
    finite = jnp.isfinite(x) | jnp.isnan(x)
    safe = jnp.where(small | ~finite, jnp.ones_like(x), x)
    return jnp.where(small, 1 - x * x / 6, jnp.where(finite, jnp.sin(safe) / safe, 0.0))


def _bessel_j(order: int):
    def fn(x):
        # J_n(-x) = (-1)^n J_n(x). float64, as Y_n below and from the same two expansions:
        # JAX's bessel_jn (Miller's backward recurrence from 1e-16) overflows to NaN in float32
        # and in a TPU's float64, which has float32's exponent range (measured on a v5e: NaN
        # for |x| of 0.6 to 3.3), and its fixed 50 steps lose accuracy for large |x|.
        wide = jnp.abs(x.astype(jnp.float64))
        finite = wide < jnp.inf
        small = jnp.where(finite & (wide < _BESSEL_SWITCH), wide, 0.0)
        large = jnp.where(finite & (wide >= _BESSEL_SWITCH), wide, _BESSEL_SWITCH)
        out = jnp.where(wide < _BESSEL_SWITCH, _bessel_j_series(small, order), _hankel(large, order)[0])
        out = jnp.where(finite, out, jnp.nan)  # +-inf and NaN: NaN, as PyTorch CPU gives
        return (out if order % 2 == 0 else jnp.sign(x).astype(jnp.float64) * out).astype(x.dtype)

    return fn


def _i0(x):
    return transcendental.exp(jnp.abs(x)) * lax.bessel_i0e(x)


def _i1(x):
    return transcendental.exp(jnp.abs(x)) * lax.bessel_i1e(x)


_UNARY = {
    aten.i0.default: _i0,
    aten.special_i0e.default: jss.i0e,
    aten.special_i1.default: _i1,
    aten.special_i1e.default: jss.i1e,
    aten.special_modified_bessel_i0.default: _i0,
    aten.special_modified_bessel_i1.default: _i1,
    aten.special_erfcx.default: error_functions.erfcx,
    aten.special_ndtri.default: inverse_error_functions.ndtri,
    aten.special_ndtr.default: jss.ndtr,
    aten.special_log_ndtr.default: error_functions.log_ndtr,
    aten.special_entr.default: transcendental.entr,
    aten.special_spherical_bessel_j0.default: _spherical_j0,
    aten.special_bessel_j0.default: _float32_by(bessel.bessel_j0, _bessel_j(0)),
    aten.special_bessel_j1.default: _float32_by(bessel.bessel_j1, _bessel_j(1)),
}

# Modified Bessel functions of the second kind, K_0 and K_1 (and e^x K_n), which
# jax.scipy.special lacks: from the integral K_n(x) = int_0^inf exp(-x cosh t) cosh(n t) dt,
# written as e^-x int_0^T exp(-2 x sinh(t/2)^2) cosh(n t) dt. The integrand is analytic and
# decays double-exponentially, so the trapezoidal rule converges geometrically; T puts the
# cut where the integrand is below e^-60 (so K_n keeps float64's digits that float32 needs),
# and each element gets its own step T / _BESSEL_K_STEPS, fine enough for the integrand's
# width at every x (about 1 for small x, 1/sqrt(x) for large x). float64 throughout.
_BESSEL_K_STEPS = 1024
_BESSEL_K_CUTOFF = 60.0


def _bessel_k_scaled(x, order: float):
    """e^x K_order(x) for x > 0 (float64)."""
    end = 2 * jnp.arcsinh(jnp.sqrt(_BESSEL_K_CUTOFF / (2 * x)))
    step = end / _BESSEL_K_STEPS

    def add_point(k, total):
        t = k * step
        value = jnp.exp(-2 * x * jnp.sinh(t / 2) ** 2) * (jnp.cosh(order * t) if order else 1.0)  # any real order
        return total + jnp.where((k == 0) | (k == _BESSEL_K_STEPS), 0.5, 1.0) * value

    return step * lax.fori_loop(0, _BESSEL_K_STEPS + 1, add_point, jnp.zeros_like(x))


def _bessel_k(order: int, scaled: bool):
    def fn(x):
        wide = x.astype(jnp.float64)
        positive = jnp.where((wide > 0) & (wide < jnp.inf), wide, 1.0)
        out = _bessel_k_scaled(positive, order)
        if not scaled:
            out = out * jnp.exp(-positive)
        # K_n(0) = inf and K_n(inf) = 0 (e^x K_n too); K_n is not real for x < 0 (CPU: NaN, as for NaN).
        out = jnp.where(wide == jnp.inf, 0.0, out)
        out = jnp.where(wide == 0, jnp.inf, jnp.where(wide > 0, out, jnp.nan))
        return out.astype(x.dtype)

    return fn


# Bessel functions of the first and second kind J_0, J_1, Y_0, Y_1, float64 (jax.scipy.special
# has no Y, and its J overflows: see _bessel_j): below _BESSEL_SWITCH the power series (A&S 9.1.10;
# 9.1.11 for Y, with psi(k + 1) = -gamma + H_k), whose terms peak near e^x / (pi x) so that at the switch
# float64 still leaves ~1e-7 absolute accuracy; above it Hankel's asymptotic expansion
# (A&S 9.2.5-9.2.10), whose terms keep shrinking up to k ~ 2x, far beyond the ones used.
_BESSEL_SWITCH = 20.0
_BESSEL_SERIES_TERMS = 60
_BESSEL_ASYMPTOTIC_TERMS = 16


def _bessel_y_series(x, order: int):
    quarter_sq = x * x / 4
    term = jnp.ones_like(x) if order == 0 else x / 2  # (x/2)^n (-x^2/4)^k / (k! (n + k)!) at k = 0
    bessel_j = jnp.zeros_like(x)
    psi_sum = jnp.zeros_like(x)  # sum of (psi(k + 1) + psi(n + k + 1)) * term
    harmonic = 0.0  # H_k
    for k in range(_BESSEL_SERIES_TERMS):
        if k:
            term = term * (-quarter_sq) / (k * (order + k))
            harmonic += 1.0 / k
        psi = 2 * (harmonic - np.euler_gamma) + (1.0 / (k + 1) if order == 1 else 0.0)
        bessel_j = bessel_j + term
        psi_sum = psi_sum + psi * term
    out = (2 / np.pi) * jnp.log(x / 2) * bessel_j - psi_sum / np.pi
    return out - 2 / (np.pi * x) if order == 1 else out


def _bessel_j_series(x, order: int):
    """J_0 or J_1 by the power series (A&S 9.1.10), float64, for 0 <= x < _BESSEL_SWITCH."""
    quarter_sq = x * x / 4
    term = jnp.ones_like(x) if order == 0 else x / 2
    total = term
    for k in range(1, _BESSEL_SERIES_TERMS):
        term = term * (-quarter_sq) / (k * (order + k))
        total = total + term
    return total


def _hankel(x, order: int):
    """(J_n(x), Y_n(x)) by Hankel's asymptotic expansion (A&S 9.2.5-9.2.10), for x >= _BESSEL_SWITCH."""
    mu = 4.0 * order * order
    p, q = jnp.zeros_like(x), jnp.zeros_like(x)
    coefficient = jnp.ones_like(x)  # a_k(order) / x^k
    for k in range(_BESSEL_ASYMPTOTIC_TERMS):
        if k:
            coefficient = coefficient * (mu - (2 * k - 1) ** 2) / (k * 8 * x)
        sign = -1.0 if (k // 2) % 2 else 1.0
        if k % 2 == 0:
            p = p + sign * coefficient
        else:
            q = q + sign * coefficient
    omega = x - (2 * order + 1) * np.pi / 4
    scale = jnp.sqrt(2 / (np.pi * x))
    cos, sin = jnp.cos(omega), jnp.sin(omega)
    return scale * (p * cos - q * sin), scale * (p * sin + q * cos)


def _bessel_y(order: int):
    def fn(x):
        wide = x.astype(jnp.float64)
        finite = (wide > 0) & (wide < jnp.inf)
        small = jnp.where(finite & (wide < _BESSEL_SWITCH), wide, 1.0)
        large = jnp.where(finite & (wide >= _BESSEL_SWITCH), wide, _BESSEL_SWITCH)
        out = jnp.where(wide < _BESSEL_SWITCH, _bessel_y_series(small, order), _hankel(large, order)[1])
        # Y_n(0) = -inf; not real for x < 0 (NaN, as for NaN). At +inf the limit is 0, but CPU
        # gives NaN: matched.
        out = jnp.where(wide == jnp.inf, jnp.nan, out)
        out = jnp.where(wide == 0, -jnp.inf, jnp.where(wide > 0, out, jnp.nan))
        return out.astype(x.dtype)

    return fn


# Airy function Ai (float64): for x > _AIRY_K_FROM, (1/pi) sqrt(x/3) K_{1/3}(2/3 x^{3/2}) by the
# K quadrature above (Ai decays like e^{-zeta} there, which the Maclaurin series would lose to
# cancellation); for x < _AIRY_ASYMPTOTIC_BELOW, the oscillating asymptotic expansion
# (A&S 10.4.60); between, the Maclaurin series Ai = c1 f - c2 g (A&S 10.4.2-10.4.3), whose
# terms stay below ~e^{zeta} = e^15 there.
_AIRY_K_FROM = 1.5
_AIRY_ASYMPTOTIC_BELOW = -8.0
_AIRY_C1 = 1 / (3 ** (2 / 3) * math.gamma(2 / 3))  # Ai(0)
_AIRY_C2 = 1 / (3 ** (1 / 3) * math.gamma(1 / 3))  # -Ai'(0)


def _airy_series(x):
    cube = x**3
    f_term, g_term = jnp.ones_like(x), x
    f, g = f_term, g_term
    for k in range(1, 60):
        f_term = f_term * cube / ((3 * k - 1) * (3 * k))
        g_term = g_term * cube / ((3 * k) * (3 * k + 1))
        f, g = f + f_term, g + g_term
    return _AIRY_C1 * f - _AIRY_C2 * g


def _airy_oscillating(x):
    z = -x
    zeta = 2 / 3 * z**1.5
    p, q = jnp.zeros_like(x), jnp.zeros_like(x)
    u = 1.0
    power = jnp.ones_like(x)  # zeta^-k
    for k in range(16):
        if k:
            u = u * (6 * k - 5) * (6 * k - 3) * (6 * k - 1) / ((2 * k - 1) * 216 * k)
            power = power / zeta
        sign = -1.0 if (k // 2) % 2 else 1.0
        if k % 2 == 0:
            p = p + sign * u * power
        else:
            q = q + sign * u * power
    phase = zeta + np.pi / 4
    return (jnp.sin(phase) * p - jnp.cos(phase) * q) / (np.sqrt(np.pi) * z**0.25)


def _airy_ai(x):
    wide = x.astype(jnp.float64)
    finite = jnp.isfinite(wide)
    right = jnp.where(finite & (wide > _AIRY_K_FROM), wide, 2.0)
    zeta = 2 / 3 * right**1.5
    decaying = jnp.sqrt(right / 3) / np.pi * _bessel_k_scaled(zeta, 1 / 3) * jnp.exp(-zeta)
    middle = _airy_series(jnp.where(finite & (wide >= _AIRY_ASYMPTOTIC_BELOW) & (wide <= _AIRY_K_FROM), wide, 0.0))
    left = _airy_oscillating(jnp.where(finite & (wide < _AIRY_ASYMPTOTIC_BELOW), wide, -10.0))
    out = jnp.where(wide > _AIRY_K_FROM, decaying, jnp.where(wide < _AIRY_ASYMPTOTIC_BELOW, left, middle))
    # The limits at +-inf are 0, but CPU gives NaN there: matched.
    return jnp.where(finite, out, jnp.nan).astype(x.dtype)


_UNARY.update(
    {
        aten.special_airy_ai.default: _float32_by(bessel.airy_ai, _airy_ai),
        aten.special_bessel_y0.default: _float32_by(bessel.bessel_y0, _bessel_y(0)),
        aten.special_bessel_y1.default: _float32_by(bessel.bessel_y1, _bessel_y(1)),
        aten.special_modified_bessel_k0.default: _float32_by(bessel.modified_bessel_k0, _bessel_k(0, scaled=False)),
        aten.special_modified_bessel_k1.default: _float32_by(bessel.modified_bessel_k1, _bessel_k(1, scaled=False)),
        aten.special_scaled_modified_bessel_k0.default: _float32_by(
            bessel.scaled_modified_bessel_k0, _bessel_k(0, scaled=True)
        ),
        aten.special_scaled_modified_bessel_k1.default: _float32_by(
            bessel.scaled_modified_bessel_k1, _bessel_k(1, scaled=True)
        ),
    }
)

for _op, _fn in _UNARY.items():
    lower(_op)(_unary(_fn))


def _zeta_any_q(x, q):
    """The Hurwitz zeta function with PyTorch's (Cephes') domain: negative ``q`` included.

    ``jss.zeta`` is inf for every q <= 0. PyTorch sums the terms (q + k)^-x directly when x is an
    integer (q^-x is then defined for negative q): inf at q a non-positive integer (a pole), NaN
    for q < 0 and x not an integer; inf at x = 1 and NaN below, for any q. Here each negative q is
    shifted by m = ceil(-q) steps with zeta(x, q) = sum_{k < m} (q + k)^-x + zeta(x, q + m), as
    polygamma's negative arguments below (as many steps as CPU's own loop takes).
    """
    integer_x = x == jnp.floor(x)
    negative = q <= 0
    pole = negative & (q == jnp.floor(q))
    shift = jnp.where(negative & ~pole & integer_x, jnp.ceil(-q), 0.0)
    top = jnp.max(shift, initial=0.0)

    float32 = q.dtype == jnp.float32

    def body(carry):
        k, total = carry
        inside = k < shift
        if float32:  # q + k as a pair of float32 numbers (see tpurec.dense.hurwitz_zeta)
            high, low = transcendental.two_sum(jnp.where(inside, q, 1.0), jnp.where(inside, k, 0.0))
            term = hurwitz_zeta.power_of_pair(high, low, -x)
        else:
            term = jnp.power(jnp.where(inside, q + k, 1.0), -x)
        return k + 1, total + jnp.where(inside, term, 0.0)

    _, total = lax.while_loop(lambda c: c[0] < top, body, (jnp.zeros((), q.dtype), jnp.zeros_like(q + x)))
    if float32:
        valid = (x > 1) & (x < jnp.inf)
        high, low = transcendental.two_sum(q, shift)
        positive = valid & (high > 0)
        rest = hurwitz_zeta.zeta(
            jnp.where(valid, x, 2.0), jnp.where(positive, high, 1.0), jnp.where(positive, low, 0.0)
        )
        # (q = inf: CPU's sum reaches 0 * inf, NaN; x = inf: set below)
        out = jnp.where(jnp.isnan(x) | jnp.isnan(q) | (q == jnp.inf) | (x == jnp.inf), jnp.nan, rest + total)
    else:
        out = jss.zeta(x, q + shift) + total
    out = jnp.where(negative & ~pole & ~integer_x, jnp.nan, jnp.where(pole, jnp.inf, out))
    # x = inf: the first term below 1 in magnitude is inf (q < 1), or q^-x = 1 (q = 1); CPU's NaN above.
    out = jnp.where(x == jnp.inf, jnp.where(q < 1, jnp.inf, jnp.where(q == 1, 1.0, out)), out)
    return jnp.where(x == 1, jnp.inf, jnp.where(x < 1, jnp.nan, out))


def _zeta(x, q):
    """float32 in float32 (tpurec.dense.hurwitz_zeta: XLA's float32 expansion erred by 6.6e-6 on a
    v5e, PyTorch CPU 1.1e-7, and float64 there has float32's exponent range); others by jax.scipy."""
    x, q = jnp.asarray(x), jnp.asarray(q)
    return _zeta_any_q(x, q)


_IGAMC_SERIES_TERMS = 40  # x <= 1.1: the 40th term is below 1.1^40 / 40! ~ 1e-46 of the first


# lgamma(1 + a) = -euler_gamma a + sum_{k>=2} (-1)^k zeta(k) / k a^k for |a| < 1: the first terms.
_LGAMMA1P_SERIES = (-np.euler_gamma,) + tuple(
    (-1) ** k * float(mpmath_zeta) / k
    for k, mpmath_zeta in (
        (2, 1.6449340668482264),
        (3, 1.2020569031595942),
        (4, 1.0823232337111381),
        (5, 1.0369277551433699),
        (6, 1.0173430619844491),
        (7, 1.0083492773819228),
        (8, 1.0040773561979443),
    )
)


def _lgamma1p(a):
    """``lgamma(1 + a)`` without rounding ``1 + a`` for |a| < 0.01 (Cephes' lgam1p: its series)."""
    small = jnp.abs(a) < 0.01
    t = jnp.where(small, a, 0.0)
    series = jnp.zeros_like(t)
    for coefficient in reversed(_LGAMMA1P_SERIES):
        series = (series + coefficient) * t
    return jnp.where(small, series, lax.lgamma(1 + a))


def _igammac_small_x(a, x):
    """The upper regularized incomplete gamma Q(a, x), with PyTorch's series where x <= 1.1 and a is small.

    ``jss.gammaincc`` takes 1 - P(a, x) there, which loses every digit of a small Q (a = 1e-30,
    x = 0.9: 7.5e-15 for 8.4e-31). PyTorch (Cephes' ``igamc``) uses DLMF 8.7.3 in that region:
    Q = -expm1(a log x - lgamma(1 + a)) - x^a / Gamma(a) * sum_{n>=1} (-x)^n / (n! (a + n)).
    """
    series_region = (x > 0) & (x <= 1.1) & (a > 0) & jnp.where(x <= 0.5, a <= -0.4 / jnp.log(x), a <= 1.1 * x)
    sa = jnp.where(series_region, a, 1.0)
    sx = jnp.where(series_region, x, 0.5)
    factor = jnp.ones_like(sa + sx)
    total = jnp.zeros_like(factor)
    for n in range(1, _IGAMC_SERIES_TERMS + 1):
        factor = factor * (-sx / n)
        total = total + factor / (sa + n)
    log_x = jnp.log(sx)
    series = -jnp.expm1(sa * log_x - _lgamma1p(sa)) - jnp.exp(sa * log_x - lax.lgamma(sa)) * total
    return jnp.where(series_region, series, jss.gammaincc(a, x))


def _float32_pair_by(float32_fn, other_fn):
    """``float32_fn`` where both arguments are float32 arrays (no float64, which a TPU emulates with
    float32's exponent range), ``other_fn`` for the rest."""

    def fn(a, x):
        if a.dtype == jnp.float32 and x.dtype == jnp.float32:
            return float32_fn(a, x)
        return other_fn(a, x)

    return fn


def _incomplete_gamma_edges(fn, lower: bool):
    """``fn`` (regularized incomplete gamma) with PyTorch's values at the edges of its domain.

    ``calc_igamma``/``calc_igammac``: NaN for a < 0 or x < 0; at a = 0, 1 (lower) or 0 (upper) for
    x > 0 and NaN at x = 0 (jax.scipy gives NaN for every x); at x = 0, 0 (1); at a = inf, 0 (1)
    unless x = inf too (NaN); at x = inf, 1 (0).
    """

    def edged(a, x):
        out = fn(a, x)
        # the limits at x -> inf and at x = 0, and NaN, in the result's dtype (Python numbers in both
        # branches of a select would make it float64)
        low, high = (jnp.asarray(v, out.dtype) for v in ((1.0, 0.0) if lower else (0.0, 1.0)))
        nan = jnp.asarray(jnp.nan, out.dtype)
        out = jnp.where(jnp.isinf(x), low, out)
        out = jnp.where(jnp.isinf(a), jnp.where(jnp.isinf(x), nan, high), out)
        out = jnp.where(x == 0, high, out)
        out = jnp.where(a == 0, jnp.where(x > 0, low, nan), out)
        # (CPU's checks in its order: a NaN argument falls through to the ones after it.)
        return jnp.where((a < 0) | (x < 0), jnp.nan, out).astype(out.dtype)

    return edged


def _xlog1py(x, y):
    return transcendental.xlog1py(x, y)


for _packet, _fn in (
    (aten.special_zeta, _zeta),
    (aten.special_xlog1py, _xlog1py),
    # float32 in float32 (tpurec.dense.incomplete_gamma), others by jax.scipy with PyTorch's small-x series
    (aten.igamma, _incomplete_gamma_edges(_float32_pair_by(incomplete_gamma.gammainc, jss.gammainc), lower=True)),
    (
        aten.igammac,
        _incomplete_gamma_edges(_float32_pair_by(incomplete_gamma.gammaincc, _igammac_small_x), lower=False),
    ),
):
    for _name in ("default", "self_scalar", "other_scalar"):
        if _name in _packet.overloads():
            lower(getattr(_packet, _name))(_binary(_fn))


@lower(aten.polygamma.default)
def polygamma(n: int, x):
    if n < 0:
        raise ValueError(f"polygamma: the order n must be non-negative, got {n}")
    if n == 0:
        return _unary(gamma_functions.digamma)(x)
    comp, res = promote(x, kind=Kind.INT_TO_FLOAT)
    if comp == jnp.float32:  # in float32 (a TPU emulates float64 with float32's exponent range)
        return hurwitz_zeta.polygamma(n, x.astype(jnp.float32)).astype(res)
    # Near the poles (negative x) the shifted sum cancels badly in float32: other dtypes
    # evaluate in float64 and round once.
    return _polygamma_any_sign(n, x.astype(jnp.float64)).astype(res)


def _polygamma_any_sign(n: int, x):
    """psi^(n)(x) for n >= 1, negative x included.

    ``jss.polygamma`` goes through the Hurwitz zeta function, which is NaN or
    wrong for negative arguments; torch's is not. The recurrence
    psi^(n)(x) = psi^(n)(x + 1) + (-1)^(n+1) n! / x^(n+1) shifts each negative
    element by m = ceil(-x) steps to where the zeta form is accurate.
    """
    shift = jnp.where(x < 0, jnp.ceil(-x), 0.0)
    top = jnp.max(shift, initial=0.0)

    def body(carry):
        k, total = carry
        term = jnp.where(k < shift, (x + k) ** -(n + 1), 0.0)
        return k + 1, total + term

    _, total = lax.while_loop(lambda c: c[0] < top, body, (jnp.zeros((), x.dtype), jnp.zeros_like(x)))
    sign = 1.0 if n % 2 == 1 else -1.0  # (-1)^(n+1)
    return jss.polygamma(n, x + shift) + sign * float(np.prod(np.arange(1, n + 1))) * total


@lower(aten.mvlgamma.default)
def mvlgamma(x, p: int):
    comp, res = promote(x, kind=Kind.INT_TO_FLOAT)
    wide = jnp.promote_types(comp, jnp.float32)
    x = x.astype(wide)
    # log of the multivariate gamma: p (p - 1) / 4 log(pi) + sum_j lgamma(x - j / 2)
    total = gamma_functions.lgamma(x)
    for j in range(1, p):
        total = total + gamma_functions.lgamma(x - j / 2)
    return (total + p * (p - 1) / 4 * math.log(math.pi)).astype(res)


# --- orthogonal polynomials: three-term recurrences up to the largest degree -------
#
# The degree ``n`` is a tensor (it broadcasts with ``x``), so the recurrence runs
# to the largest degree present and each element keeps the term of its own
# degree. Negative degrees give 0, as in torch.


def _recurrence(x, n, p0, p1, step):
    """P_n(x) for P_0 = p0, P_1 = p1, P_{k+1} = step(k, x, P_k, P_{k-1})."""
    x, n = jnp.broadcast_arrays(x, n)
    degree = jnp.trunc(n).astype(jnp.int64)  # torch truncates a float degree toward zero
    top = jnp.max(degree, initial=1)

    def body(carry):
        k, prev, cur, out = carry
        nxt = step(k, x, cur, prev)
        out = jnp.where(degree == k + 1, nxt, out)
        return k + 1, cur, nxt, out

    out = jnp.where(degree == 0, p0, jnp.where(degree == 1, p1, jnp.zeros_like(x)))
    _, _, _, out = lax.while_loop(lambda c: c[0] < top, body, (jnp.ones((), jnp.int64), p0, p1, out))
    return jnp.where(degree < 0, jnp.zeros_like(x), out)


def _poly(p1_fn, step, shift: bool = False):
    def lowering(x, n):
        comp, res = promote(x, n, kind=Kind.INT_TO_FLOAT)
        wide = jnp.promote_types(comp, jnp.float32)
        xv = jnp.asarray(x).astype(wide)
        if shift:  # shifted polynomials: P*(x) = P(2x - 1)
            xv = 2 * xv - 1
        nv = jnp.asarray(n).astype(wide)
        ones = jnp.ones(jnp.broadcast_shapes(xv.shape, nv.shape), wide)
        xb = xv * ones
        return _recurrence(xb, nv, ones, p1_fn(xb), step).astype(res)

    return lowering


_chebyshev_step = lambda k, x, cur, prev: 2 * x * cur - prev  # noqa: E731
_POLYNOMIALS = {
    "chebyshev_polynomial_t": (lambda x: x, _chebyshev_step),
    "chebyshev_polynomial_u": (lambda x: 2 * x, _chebyshev_step),
    "chebyshev_polynomial_v": (lambda x: 2 * x - 1, _chebyshev_step),
    "chebyshev_polynomial_w": (lambda x: 2 * x + 1, _chebyshev_step),
    "hermite_polynomial_h": (lambda x: 2 * x, lambda k, x, cur, prev: 2 * x * cur - 2 * k * prev),
    "hermite_polynomial_he": (lambda x: x, lambda k, x, cur, prev: x * cur - k * prev),
    "laguerre_polynomial_l": (
        lambda x: 1 - x,
        lambda k, x, cur, prev: ((2 * k + 1 - x) * cur - k * prev) / (k + 1),
    ),
    "legendre_polynomial_p": (
        lambda x: x,
        lambda k, x, cur, prev: ((2 * k + 1) * x * cur - k * prev) / (k + 1),
    ),
}

for _name, (_p1, _step) in _POLYNOMIALS.items():
    _variants = [(_name, False)]
    if _name.startswith("chebyshev"):
        _variants.append(("shifted_" + _name, True))
    for _variant, _shift in _variants:
        _packet = getattr(aten, "special_" + _variant)
        for _overload in ("default", "x_scalar", "n_scalar"):
            if _overload in _packet.overloads():
                lower(getattr(_packet, _overload))(_poly(_p1, _step, _shift))

del jax
