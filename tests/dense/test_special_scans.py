"""Float32 special functions scanned over their whole float32 range, against float64 on CPU.

The functions whose float32 lowerings have tails far outside float32's range (``erf``, ``erfc``,
``erfcx``, ``ndtr``, ``log_ndtr``; tpurec/dense/error_functions.py), the inverse ones (``ndtri``,
``erfinv``; tpurec/dense/inverse_error_functions.py), ``lgamma`` and ``digamma`` with their zeros
on the negative axis (tpurec/dense/gamma_functions.py) and the Bessel functions J, Y, K of orders 0
and 1 and Airy's Ai (tpurec/dense/bessel.py), the modified Bessel functions I of orders 0 and 1 (plain and
scaled), the spherical J_0, ``entr`` and ``exp2`` (tpurec/dense/transcendental.py), through the tpu device on
XLA:CPU, at every 8192nd float32 bit pattern (1024 values in each
binade, both signs, about 520,000 inputs). Where float64's answer is a normal float32 number,
each value's relative error from it is at most twice PyTorch CPU's float32 error at that input
plus 8 float32 epsilons (2^-23, so about 1e-6: PyTorch's own float32 erfcx, the algorithm
tpurec follows, errs by up to 4.4 epsilons in this scan, where glibc's erfc, which CPU's
``erfc`` calls, is nearly exact); elsewhere NaN and infinities fall where CPU's do. Inputs and
results below float32's smallest normal number are left out: the device flushes them to zero
(docs/device-semantics.md). The two-argument functions ``zeta`` (in float32), ``igamma`` and
``igammac`` (in float32, tpurec/dense/incomplete_gamma.py) are checked the same way on grids over
their domains, edges included, ``polygamma`` (n >= 1, in float32) over the positive range and
against mpmath below 0, and ``igammac`` of a small shape, where PyTorch's own float64 errs,
against mpmath; ``pow`` on a grid with every edge.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tpurec.dense.registry import get_lowering

aten = torch.ops.aten

_TINY = float(np.finfo(np.float32).tiny)
_MAX = float(np.finfo(np.float32).max)
_EPS = 2.0**-23


def _every_float32(stride: int = 2**13) -> torch.Tensor:
    """Every ``stride``-th float32 bit pattern that is finite and normal (or zero), with both infinities and NaN."""
    values = np.arange(0, 2**32, stride, dtype=np.uint64).astype(np.uint32).view(np.float32)
    values = values[np.isfinite(values) & ((np.abs(values) >= _TINY) | (values == 0))]
    edges = np.array([np.inf, -np.inf, np.nan, -0.0], dtype=np.float32)
    return torch.from_numpy(np.concatenate([values, edges]))


def assert_as_accurate_as_cpu(function: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> None:
    """``function`` on the tpu device within twice CPU's float32 error plus 8 epsilons of float64, pointwise."""
    exact = function(*(x.double() for x in inputs))
    cpu = function(*inputs)
    ours = function(*(x.to("tpu") for x in inputs)).cpu()
    assert ours.dtype == torch.float32
    normal = exact.isfinite() & (exact.abs() >= _TINY) & (exact.abs() <= _MAX)
    with np.errstate(all="ignore"):
        ours_error = ((ours.double() - exact).abs() / exact.abs())[normal]
        cpu_error = ((cpu.double() - exact).abs() / exact.abs())[normal]
    bound = 2 * cpu_error + 8 * _EPS
    wrong = ~(ours_error <= bound)  # NaN errors count as wrong
    if wrong.any():
        at = torch.nonzero(normal).flatten()[wrong]
        worst = at[torch.argmax(torch.where(ours_error[wrong].isnan(), torch.inf, ours_error[wrong]))]
        raise AssertionError(
            f"{int(wrong.sum())} of {int(normal.sum())} values off; worst at input "
            f"{[x[worst].item() for x in inputs]}: tpu {ours[worst].item()!r}, cpu {cpu[worst].item()!r}, "
            f"float64 {exact[worst].item()!r}"
        )
    # Outside float32's normal range: NaN and infinities where CPU has them (results that
    # underflow may be 0 or CPU's subnormal).
    rest = ~normal
    for kind in (torch.isnan, torch.isposinf, torch.isneginf):
        mismatch = rest & (kind(ours) != kind(cpu))
        assert not mismatch.any(), (kind.__name__, [x[mismatch][:5].tolist() for x in inputs], ours[mismatch][:5])


UNARY = {
    "erf": torch.erf,
    "erfc": torch.erfc,
    "erfcx": torch.special.erfcx,
    "ndtr": torch.special.ndtr,
    "log_ndtr": torch.special.log_ndtr,
    "ndtri": torch.special.ndtri,
    "erfinv": torch.erfinv,
    "lgamma": torch.lgamma,
    "digamma": torch.digamma,
    "bessel_j0": torch.special.bessel_j0,
    "bessel_j1": torch.special.bessel_j1,
    "bessel_y0": torch.special.bessel_y0,
    "bessel_y1": torch.special.bessel_y1,
    "modified_bessel_k0": torch.special.modified_bessel_k0,
    "modified_bessel_k1": torch.special.modified_bessel_k1,
    "scaled_modified_bessel_k0": torch.special.scaled_modified_bessel_k0,
    "scaled_modified_bessel_k1": torch.special.scaled_modified_bessel_k1,
    "modified_bessel_i0": torch.special.modified_bessel_i0,
    "modified_bessel_i1": torch.special.modified_bessel_i1,
    "i0": torch.special.i0,
    "i0e": torch.special.i0e,
    "i1": torch.special.i1,
    "i1e": torch.special.i1e,
    "spherical_bessel_j0": torch.special.spherical_bessel_j0,
    "entr": torch.special.entr,
    "exp2": torch.special.exp2,
}


# Each unit interval below -2 holds zeros of lgamma and digamma, where the terms of the recurrence or
# the reflection cancel (tpurec carries them in pairs of float32 numbers): densely on [-20, 3], where
# CPU's float32 lgamma errs up to 7.6e-6 relative, and on digamma's reflection range further down.
# (Scanned with the whole range, so that each program compiles once.)
DENSE = {
    "lgamma": torch.linspace(-20.0, 3.0, 100_001),
    "digamma": torch.cat([torch.linspace(-20.0, 3.0, 100_001), torch.linspace(-300.0, -16.0, 50_001)]),
}


@pytest.mark.parametrize("name", list(UNARY))
def test_unary_special_function_over_the_whole_float32_range(name: str) -> None:
    x = _every_float32()
    if name in DENSE:
        x = torch.cat([x, DENSE[name]])
    assert_as_accurate_as_cpu(UNARY[name], x)


def test_exp2_of_an_integer_is_its_power_of_two_exactly() -> None:
    # PyTorch CPU's exp2 is exact there; exp(x ln 2) in float32 erred by 18 units in the last place at x = 100.
    k = torch.arange(-126, 128, dtype=torch.float32)
    assert torch.equal(torch.exp2(k.to("tpu")).cpu(), torch.exp2(k))
    assert torch.equal(torch.exp2(k), torch.exp2(k.double()).float())


def test_gelu_over_the_whole_float32_range_and_its_backward_below_minus_one() -> None:
    # Phi(x) as erfc(-x / sqrt 2) / 2: 1 + erf(x / sqrt 2) cancels below about -3 (it gave 0 from -5.3 on, where
    # gelu is -3e-7; CPU's float32 errs 1.2e-2 there, and its backward alike). Infinities left out: CPU's float32
    # gelu gives NaN at +inf, where the function and CPU's float64 give inf (as tpurec does).
    x = _every_float32()
    x = x[x.isfinite()]
    assert_as_accurate_as_cpu(torch.nn.functional.gelu, x)
    # The backward cdf + x pdf cancels near its zero at -0.7518 in any float32 form: scanned below -1.
    assert_as_accurate_as_cpu(lambda t: torch.ops.aten.gelu_backward(torch.ones_like(t), t), x[x < -1])


def test_erfcx_and_log_ndtr_where_float64_underflows_or_loses_digits() -> None:
    # erfcx read 0.0 for x in [26.543, 26.642] (exp(x^2) erfc(x) in float64, whose subnormal
    # erfc XLA flushes); log_ndtr erred 7.7e-2 for x in (6, 8] (log(ndtr(x)) of a float64 ndtr
    # near 1).
    x = torch.cat([torch.linspace(26.5, 26.7, 4001), torch.linspace(5.0, 9.0, 4001)])
    assert_as_accurate_as_cpu(torch.special.erfcx, x)
    assert_as_accurate_as_cpu(torch.special.log_ndtr, x)


def test_airy_ai_over_the_float32_range_its_phase_fits() -> None:
    # Below -2.09 Ai oscillates with phase (2/3) |x|^(3/2) + pi / 4, which tpurec carries in twice
    # float32's precision (PyTorch rounds it to float32, off by radians from x = -1e5 on): its error
    # grows with |x|^(3/2), to a median of 0.6% of Ai at x = -2^28, where the scan stops. Below, no
    # float32 algorithm without a many-word argument reduction gets the phase right, and PyTorch's
    # float32 result is no better (NaN below -4.9e25). On [-2.6, -2.09) PyTorch's float64 errs by up
    # to 1.7e-5 (its asymptotic form's corrections): the next test judges there by mpmath.
    x = _every_float32()
    keep = (x >= -(2.0**28)) & ~((x >= -2.6) & (x < -2.09))
    assert_as_accurate_as_cpu(torch.special.airy_ai, x[keep | x.isnan()])


def test_airy_ai_near_its_first_zero_against_mpmath() -> None:
    # Within 8 float32 epsilons of mpmath (PyTorch's float32 errs by up to 0.12 there, its float64 by
    # 4e-3 relative at the zero -2.3381).
    mpmath = pytest.importorskip("mpmath")
    x = torch.linspace(-2.7, -2.0, 1001)
    ours = torch.special.airy_ai(x.to("tpu")).cpu().double()
    exact = torch.tensor([float(mpmath.airyai(float(v))) for v in x], dtype=torch.float64)
    error = (ours - exact).abs() / exact.abs()
    assert error.max().item() <= 8 * _EPS, (x[error.argmax()].item(), error.max().item())


def _grid(first: np.ndarray, second: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = np.meshgrid(first.astype(np.float32), second.astype(np.float32), indexing="ij")
    return torch.from_numpy(a.ravel().copy()), torch.from_numpy(b.ravel().copy())


def _log_spaced(low: float, high: float, n: int) -> np.ndarray:
    return np.concatenate([10 ** np.linspace(low, high, n), [0.0, np.inf, np.nan]])


def test_pow_over_its_domain() -> None:
    # float32 bases and exponents (2 ** (y log2 x) in twice float32's precision), results up to
    # float32's largest (float64 on a TPU gave inf for 1.6e-29 ** -1.33 = 2.48e38), every edge; and
    # Python number exponents, which stay in double precision as on CPU.
    base = np.concatenate(
        [10 ** np.linspace(-30, 30, 300), -(10 ** np.linspace(-30, 30, 41)), [0.0, -0.0, 1.0, -1.0, 0.5, 2.0]]
    )
    base = np.concatenate([base, [np.inf, -np.inf, np.nan, 1.0000001, 0.9999999]])
    exponent = np.concatenate([np.linspace(-20, 20, 301), np.arange(-5, 6), [0.5, -0.5, 1e-8, -1e-8, 2.0**24 + 2]])
    exponent = np.concatenate([exponent, [2.0**23 + 1, 1e10, -1e10, np.inf, -np.inf, np.nan, 150.5, -150.5]])
    assert_as_accurate_as_cpu(torch.pow, *_grid(base, exponent))
    x = torch.from_numpy((10 ** np.linspace(-30, 30, 3001)).astype(np.float32))
    for p in (0.3, 2.5, -1.3333333333, 1 / 3, 7.0, 1e-7):
        assert_as_accurate_as_cpu(lambda t: t**p, x)


def test_zeta_over_its_domain_negative_q_included() -> None:
    # For q < 0 and an integer x, PyTorch sums (q + k)^-x: zeta(2, -10.005) is 40001.36 (tpurec gave
    # inf); a non-positive integer q is a pole (inf), a non-integer x there NaN; x = 1 is inf.
    x = np.concatenate([[0.5, 1.0], 1 + 10 ** np.linspace(-6, 0, 40), np.arange(2, 40), [100.0, np.inf]])
    q = np.concatenate([10 ** np.linspace(-30, 7, 60), -np.linspace(0.01, 20, 45), -np.arange(0, 5), [np.inf]])
    assert_as_accurate_as_cpu(torch.special.zeta, *_grid(x, q))


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_polygamma_over_the_positive_float32_range(n: int) -> None:
    # psi^(n)(x) = (-1)^(n+1) n! zeta(n + 1, x) in float32 (it went through float64, which a TPU
    # emulates with float32's exponent range); n! joins the sum before it is unscaled.
    x = _every_float32()
    assert_as_accurate_as_cpu(lambda t: torch.polygamma(n, t), x[(x >= 0) | x.isnan()])


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_polygamma_of_negative_arguments_against_mpmath(n: int) -> None:
    # Below 0 the recurrence's terms on both sides of 0 cancel (exactly at the half-integers for odd
    # n + 1); tpurec sums them in pairs of float32 numbers. PyTorch's float64 is not exact enough to
    # judge (its float32 trigamma errs by 3.9e-4 here): mpmath, within 8 float32 epsilons.
    mpmath = pytest.importorskip("mpmath")
    x = torch.linspace(-30.0, 0.0, 1201)
    x = x[x != x.floor()]
    ours = torch.polygamma(n, x.to("tpu")).cpu().double()
    with mpmath.workdps(30):
        exact = torch.tensor([float(mpmath.polygamma(n, float(v))) for v in x], dtype=torch.float64)
    keep = exact.abs() <= _MAX  # (within 2^(-128 / (n + 1)) of a pole: inf, as on CPU)
    error = ((ours - exact).abs() / exact.abs())[keep]
    assert error.max().item() <= 8 * _EPS, (x[keep][error.argmax()].item(), error.max().item())
    assert (ours[~keep].isinf() & (ours[~keep].sign() == exact[~keep].sign())).all()


@pytest.mark.parametrize("function", [torch.special.gammainc, torch.special.gammaincc])
def test_incomplete_gamma_over_its_domain(function: Callable[..., torch.Tensor]) -> None:
    # Where PyTorch's own float64 is exact enough to judge: a >= 1e-6 (its upper function rounds
    # 1 + a below; see the next test), and every edge (a = 0, x = 0, infinities, NaN).
    a = np.concatenate([[0.0], 10 ** np.linspace(-6, 7, 70), [np.inf, np.nan, -1.0]])
    assert_as_accurate_as_cpu(function, *_grid(a, _log_spaced(-30, 7, 80)))


def test_upper_incomplete_gamma_of_a_small_shape_against_mpmath() -> None:
    # Q(a, x) for small a and x <= 1.1 is about a E1(x): PyTorch's series (DLMF 8.7.3) takes
    # lgamma(1 + a), and 1 + a rounds, so CPU errs there (a = 1.7e-18, x = 0.9: 1.5e-18 for 4.6e-19);
    # tpurec takes lgamma(1 + a) from its series, as Cephes' lgam1p. (It gave 1 - P(a, x), 7.5e-15
    # for 8.4e-31 at a = 1e-30.) Judged by mpmath, within 8 float32 epsilons.
    mpmath = pytest.importorskip("mpmath")
    a, x = _grid(10 ** np.linspace(-30, 0, 31), 10 ** np.linspace(-3, np.log10(1.1), 12))
    ours = torch.special.gammaincc(a.to("tpu"), x.to("tpu")).cpu().double()
    with mpmath.workdps(40):
        exact = torch.tensor(
            [float(mpmath.gammainc(float(s), float(t), mpmath.inf, regularized=True)) for s, t in zip(a, x)],
            dtype=torch.float64,
        )
    error = (ours - exact).abs() / exact.abs()
    assert error.max().item() <= 8 * _EPS, (a[error.argmax()].item(), x[error.argmax()].item(), error.max().item())


# Float32 lowerings computed in float32 alone: a TPU emulates float64 with float32's exponent range
# (and XLA flushes its subnormals), so a float32 function computed "through float64" can fail
# there where XLA:CPU is right (tpurec/dense/bessel.py; ``pow``: tpurec/dense/transcendental.py;
# ``zeta``: tpurec/dense/hurwitz_zeta.py; ``ndtri``, ``erfinv``, ``lgamma``, ``digamma``, ``igamma``,
# ``igammac``: tpurec/dense/inverse_error_functions.py, gamma_functions.py, incomplete_gamma.py).
# ``torch.special.ndtr`` reaches the device as ``erf`` (PyTorch decomposes it).
FLOAT32_ONLY = {
    "erf": aten.erf.default,
    "erfc": aten.erfc.default,
    "erfcx": aten.special_erfcx.default,
    "log_ndtr": aten.special_log_ndtr.default,
    "ndtri": aten.special_ndtri.default,
    "erfinv": aten.erfinv.default,
    "lgamma": aten.lgamma.default,
    "digamma": aten.digamma.default,
    "bessel_j0": aten.special_bessel_j0.default,
    "bessel_j1": aten.special_bessel_j1.default,
    "bessel_y0": aten.special_bessel_y0.default,
    "bessel_y1": aten.special_bessel_y1.default,
    "modified_bessel_k0": aten.special_modified_bessel_k0.default,
    "modified_bessel_k1": aten.special_modified_bessel_k1.default,
    "scaled_modified_bessel_k0": aten.special_scaled_modified_bessel_k0.default,
    "scaled_modified_bessel_k1": aten.special_scaled_modified_bessel_k1.default,
    "airy_ai": aten.special_airy_ai.default,
    "exp2": aten.exp2.default,
}


BINARY_FLOAT32_ONLY = {
    "pow": aten.pow.Tensor_Tensor,
    "zeta": aten.special_zeta.default,
    "igamma": aten.igamma.default,
    "igammac": aten.igammac.default,
}


@pytest.mark.parametrize("name", [*FLOAT32_ONLY, *BINARY_FLOAT32_ONLY, "polygamma_1", "polygamma_3"])
def test_float32_lowering_has_no_float64_op(name: str) -> None:
    if name.startswith("polygamma"):
        lowering = get_lowering(aten.polygamma.default)
        assert lowering is not None
        fn = functools.partial(lowering.fn, int(name.rsplit("_", 1)[1]))
    else:
        lowering = get_lowering(FLOAT32_ONLY.get(name) or BINARY_FLOAT32_ONLY[name])
        assert lowering is not None, name
        fn = lowering.fn
    arguments = [jnp.ones((8,), jnp.float32)] * (2 if name in BINARY_FLOAT32_ONLY else 1)
    # The optimized program XLA runs (Python scalars enter the traced program as float64 constants
    # that XLA folds into float32 ones; a float64 computation stays).
    text = jax.jit(fn).lower(*arguments).compile().as_text()
    assert text is not None, name
    lines = [line.strip() for line in text.splitlines() if "f64" in line]
    assert not lines, f"{name}: {len(lines)} float64 lines in its float32 program, e.g. {lines[:3]}"
