"""Lowerings added for OpInfo entries that had none: every sample of each entry through the device vs CPU."""

from __future__ import annotations

import pytest

from opinfo_device import check_opinfo

pytestmark = pytest.mark.usefixtures("no_host_fallback")


@pytest.mark.parametrize(
    "name",
    [
        "nonzero_static",  # static-size nonzero (fill past the count, empty inputs)
        "nn.functional.bilinear",  # aten._trilinear
        "geqrf",
        "linalg.householder_product",
        "ormqr",
    ],
)
def test_every_sample_through_the_device(name):
    # ormqr has 144 samples: the first 24 cover every left/transpose combination.
    assert check_opinfo(name, max_samples=24 if name == "ormqr" else 1000) > 3
