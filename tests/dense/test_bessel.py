"""Bessel functions and Airy Ai on the device (tpurec/dense/special.py): K_0, K_1 and their scaled forms
(quadrature) against CPU; J_0, J_1, Y_0, Y_1 and Ai (series / asymptotic expansions) against scipy and
CPU."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.special
import torch

from opinfo_device import check_opinfo

pytestmark = pytest.mark.usefixtures("no_host_fallback")

FUNCTIONS = [
    torch.special.modified_bessel_k0,
    torch.special.modified_bessel_k1,
    torch.special.scaled_modified_bessel_k0,
    torch.special.scaled_modified_bessel_k1,
]


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
def test_float64_across_thirty_orders_of_magnitude_and_the_edges(fn):
    x = torch.tensor(
        [1e-30, 1e-7, 1e-3, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 50.0, 87.0, 100.0, 1e3, 1e6, 1e30]
        + [0.0, -1.0, float("nan"), float("inf")],
        dtype=torch.float64,
    )
    torch.testing.assert_close(fn(x.to("tpu")).cpu(), fn(x), rtol=1e-13, atol=0, equal_nan=True)


@pytest.mark.parametrize(
    "name",
    [
        "special.modified_bessel_k0",
        "special.modified_bessel_k1",
        "special.scaled_modified_bessel_k0",
        "special.scaled_modified_bessel_k1",
        "special.bessel_j0",
        "special.bessel_j1",
        "special.bessel_y0",
        "special.bessel_y1",
        "special.airy_ai",
    ],
)
def test_opinfo_samples_float32(name):
    assert check_opinfo(name, max_samples=10) > 0


@pytest.mark.parametrize(
    "fn, reference", [(torch.special.bessel_y0, scipy.special.y0), (torch.special.bessel_y1, scipy.special.y1)]
)
def test_bessel_y_float64_against_scipy(fn, reference):
    # Both sides of the series/asymptotic switch at 20, tiny and huge arguments. (CPU's float64
    # Y_1 errs by up to ~1e-6 near x = 5, so scipy is the float64 reference here.)
    x = np.concatenate([[1e-30, 1e-7, 1e-3, 0.1, 19.99, 20.0, 20.01, 50.0, 1e3, 1e6], np.linspace(0.01, 40, 2001)])
    actual = fn(torch.tensor(x).to("tpu")).cpu().numpy()
    np.testing.assert_allclose(actual, reference(x), rtol=1e-7, atol=1e-8)


@pytest.mark.parametrize("fn", [torch.special.bessel_y0, torch.special.bessel_y1], ids=lambda f: f.__name__)
def test_bessel_y_edges_and_float32_as_cpu(fn):
    edges = torch.tensor([0.0, -1.0, float("nan"), float("inf")])
    torch.testing.assert_close(fn(edges.to("tpu")).cpu(), fn(edges), equal_nan=True)
    x = torch.linspace(0.05, 60, 500)
    torch.testing.assert_close(fn(x.to("tpu")).cpu(), fn(x), rtol=1e-4, atol=1e-5)


def test_airy_ai_float64_against_scipy_and_edges_as_cpu():
    # The three methods' ranges (K quadrature above 1.5, series down to -8, asymptotic below) and far out.
    x = np.concatenate([[-1e3, -100.0, -8.01, -8.0, -7.99, 0.0, 1.49, 1.5, 1.51, 100.0], np.linspace(-30, 30, 1201)])
    actual = torch.special.airy_ai(torch.tensor(x).to("tpu")).cpu().numpy()
    np.testing.assert_allclose(actual, scipy.special.airy(x)[0], rtol=1e-7, atol=1e-9)
    edges = torch.tensor([float("inf"), float("-inf"), float("nan")])
    torch.testing.assert_close(
        torch.special.airy_ai(edges.to("tpu")).cpu(), torch.special.airy_ai(edges), equal_nan=True
    )
    x32 = torch.linspace(-30, 30, 601)
    torch.testing.assert_close(
        torch.special.airy_ai(x32.to("tpu")).cpu(), torch.special.airy_ai(x32), rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize(
    "fn, reference", [(torch.special.bessel_j0, scipy.special.j0), (torch.special.bessel_j1, scipy.special.j1)]
)
def test_bessel_j_float64_against_scipy(fn, reference):
    # Both signs, both sides of the series/asymptotic switch at |x| = 20, tiny and huge arguments.
    # (JAX's bessel_jn, used before, erred by 1.5 at x = 100 and overflowed to NaN in float32.)
    x = np.concatenate([[1e-30, 1e-7, 1e-3, 0.1, 19.99, 20.0, 20.01, 50.0, 1e3, 1e6], np.linspace(-100, 100, 4001)])
    actual = fn(torch.tensor(x).to("tpu")).cpu().numpy()
    np.testing.assert_allclose(actual, reference(x), rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("fn", [torch.special.bessel_j0, torch.special.bessel_j1], ids=lambda f: f.__name__)
def test_bessel_j_float32_and_edges_as_cpu(fn):
    # float32 from 0.5 to 4, where JAX's recurrence overflowed (NaN on a TPU, whose float64 has
    # float32's exponent range), and the edges: 0, -0, +-inf and NaN (NaN, as CPU).
    x = torch.cat([torch.linspace(-60, 60, 1201), torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan")])])
    torch.testing.assert_close(fn(x.to("tpu")).cpu(), fn(x), rtol=0, atol=2e-6, equal_nan=True)
