"""Upsampling backward (and antialiased bilinear) on the device (tpurec/dense/upsample.py), against CPU.

Every OpInfo sample of each entry (both align_corners settings, explicit scale
factors, 1d/2d/3d), not just the first 3 the sweep runs; no host fallback.
"""

from __future__ import annotations

import pytest
import torch

from opinfo_device import check_opinfo

pytestmark = pytest.mark.usefixtures("no_host_fallback")

ENTRIES = [
    "nn.functional.interpolate.nearest",
    "nn.functional.interpolate.nearest-exact",
    "nn.functional.interpolate.linear",
    "nn.functional.interpolate.bilinear",
    "nn.functional.interpolate.bicubic",
    "nn.functional.interpolate.trilinear",
    "nn.functional.upsample_bilinear",
    "nn.functional.upsample_nearest",
]


@pytest.mark.parametrize("name", ENTRIES)
def test_every_sample_forward_and_backward_through_device(name):
    assert check_opinfo(name, max_samples=1000) > 3


@pytest.mark.parametrize(
    "mode, kwargs",
    [
        ("nearest", {}),
        ("nearest-exact", {}),
        ("bilinear", {"align_corners": False}),
        ("bilinear", {"align_corners": True}),
        ("bicubic", {"align_corners": False}),
        ("bicubic", {"align_corners": True}),
    ],
)
def test_scale_factor_that_does_not_divide(mode, kwargs):
    # 5 -> 12 with scale 2.4: source indices that float32 rounding puts on either side of an integer.
    torch.manual_seed(0)
    host = torch.randn(2, 3, 5, 7, requires_grad=True)
    dev = host.detach().to("tpu").requires_grad_()
    cotangent = torch.randn(2, 3, 12, 9)
    torch.nn.functional.interpolate(host, scale_factor=(2.4, 1.3), mode=mode, **kwargs).backward(cotangent)
    torch.nn.functional.interpolate(dev, scale_factor=(2.4, 1.3), mode=mode, **kwargs).backward(cotangent.to("tpu"))
    torch.testing.assert_close(dev.grad.cpu(), host.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("size", [(3, 11), (17, 4), (8, 8)])
@pytest.mark.parametrize("align_corners", [False, True])
def test_antialiased_bilinear_forward_and_backward(size, align_corners):
    # Shrinking (the filter widens with the scale), growing, and both at once.
    torch.manual_seed(1)
    host = torch.randn(2, 3, 9, 7, requires_grad=True)
    dev = host.detach().to("tpu").requires_grad_()
    kwargs = dict(size=size, mode="bilinear", align_corners=align_corners, antialias=True)
    expected, actual = torch.nn.functional.interpolate(host, **kwargs), torch.nn.functional.interpolate(dev, **kwargs)
    torch.testing.assert_close(actual.detach().cpu(), expected.detach(), rtol=1e-5, atol=1e-5)
    cotangent = torch.randn_like(expected)
    expected.backward(cotangent)
    actual.backward(cotangent.to("tpu"))
    torch.testing.assert_close(dev.grad.cpu(), host.grad, rtol=1e-5, atol=1e-5)
