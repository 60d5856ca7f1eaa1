"""Special-function lowerings through the tpu device: OpInfo samples vs CPU."""

from __future__ import annotations

import pytest
import torch

from opinfo_device import check_opinfo

# XLA's and Cephes' series / rational approximations differ by a few ulp; the
# recurrences (polygamma shift, polynomials of degree ~10) compound that.
TOL = dict(rtol=1e-4, atol=1e-5)

ENTRIES = [
    "polygamma.polygamma_n_0",
    "polygamma.polygamma_n_1",
    "polygamma.polygamma_n_2",
    "polygamma.polygamma_n_3",
    "polygamma.polygamma_n_4",
    "special.polygamma.special_polygamma_n_0",
    "special.bessel_j0",
    "special.bessel_j1",
    "special.erfcx",
    "special.i0e",
    "special.i1",
    "special.i1e",
    "special.modified_bessel_i0",
    "special.modified_bessel_i1",
    "special.log_ndtr",
    "special.ndtr",
    "special.ndtri",
    "special.spherical_bessel_j0",
    "special.zeta",
    "special.xlog1py",
    "special.entr",
    "special.chebyshev_polynomial_t",
    "special.chebyshev_polynomial_u",
    "special.chebyshev_polynomial_v",
    "special.chebyshev_polynomial_w",
    "special.shifted_chebyshev_polynomial_t",
    "special.shifted_chebyshev_polynomial_u",
    "special.shifted_chebyshev_polynomial_v",
    "special.shifted_chebyshev_polynomial_w",
    "special.hermite_polynomial_h",
    "special.hermite_polynomial_he",
    "special.laguerre_polynomial_l",
    "special.legendre_polynomial_p",
    "mvlgamma.mvlgamma_p_3",
    "igamma",
    "igammac",
]


@pytest.mark.parametrize("name", ENTRIES)
def test_opinfo_through_device(name):
    assert check_opinfo(name, max_samples=3, **TOL) > 0


def test_polygamma_negative_arguments_and_gradient():
    x = torch.tensor([-8.4784, -2.4005, -0.3, 0.7, 3.5], dtype=torch.float64, requires_grad=True)
    xt = x.detach().to("tpu").requires_grad_()
    for n in (1, 2, 3):
        torch.testing.assert_close(torch.polygamma(n, xt).cpu(), torch.polygamma(n, x).detach(), rtol=1e-9, atol=1e-9)
    torch.polygamma(1, x).sum().backward()
    torch.polygamma(1, xt).sum().backward()
    torch.testing.assert_close(xt.grad.cpu(), x.grad, rtol=1e-9, atol=1e-9)


def test_polygamma_negative_order_is_a_value_error():
    with pytest.raises((ValueError, RuntimeError), match="non-negative|order"):
        torch.polygamma(-1, torch.ones(3, device="tpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_digamma_at_signed_zeros_poles_and_infinities_as_cpu(dtype):
    # XLA gives NaN at 0; PyTorch the limit from the zero's side (-inf at +0, inf at -0).
    x = torch.tensor(
        [0.0, -0.0, -1.0, -2.0, float("inf"), -float("inf"), float("nan"), 1e-30, -1e-30, 2.5], dtype=dtype
    )
    for op in (torch.digamma, lambda t: torch.polygamma(0, t)):
        torch.testing.assert_close(op(x.to("tpu")).cpu(), op(x), equal_nan=True)
