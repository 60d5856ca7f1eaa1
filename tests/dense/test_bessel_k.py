"""K_0, K_1 and their scaled forms on the device (quadrature in tpurec/dense/special.py) against CPU."""

from __future__ import annotations

import pytest
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
    ],
)
def test_opinfo_samples_float32(name):
    assert check_opinfo(name, max_samples=10) > 0
