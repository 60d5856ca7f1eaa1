"""``grid_sampler_2d_backward`` on the device (tpurec/dense/grid_sample.py), against CPU, no host fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from opinfo_device import check_opinfo

pytestmark = pytest.mark.usefixtures("no_host_fallback")


def test_every_2d_opinfo_sample_forward_and_backward():
    # All 18 combinations of mode (bilinear, nearest, bicubic), padding and align_corners
    # (nn.functional.grid_sample's 2d samples are the same 18 through the same op).
    assert check_opinfo("grid_sampler_2d", max_samples=1000) == 18


@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("align_corners", [False, True])
def test_grid_points_on_the_borders_and_outside(mode, padding_mode, align_corners):
    # Coordinates exactly on -1/1 (clipping and reflection kinks) and beyond, where ATen's
    # hand-written gradient picks a side.
    torch.manual_seed(0)
    x = torch.randn(1, 2, 4, 5)
    grid = torch.tensor([[-1.0, -1.0], [1.0, 1.0], [1.0, -0.3], [-1.7, 0.4], [2.3, 1.2], [0.25, 0.5]]).reshape(1, 2, 3, 2)
    host_x, host_grid = x.clone().requires_grad_(), grid.clone().requires_grad_()
    dev_x, dev_grid = x.to("tpu").requires_grad_(), grid.to("tpu").requires_grad_()
    cotangent = torch.randn(1, 2, 2, 3)
    kwargs = dict(mode=mode, padding_mode=padding_mode, align_corners=align_corners)
    F.grid_sample(host_x, host_grid, **kwargs).backward(cotangent)
    F.grid_sample(dev_x, dev_grid, **kwargs).backward(cotangent.to("tpu"))
    torch.testing.assert_close(dev_x.grad.cpu(), host_x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dev_grid.grad.cpu(), host_grid.grad, rtol=1e-5, atol=1e-5)
