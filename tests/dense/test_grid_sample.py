"""Grid sampling on the device (tpurec/dense/grid_sample.py): 2d backward, 3d forward and backward, against CPU."""

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
    grid = torch.tensor([[-1.0, -1.0], [1.0, 1.0], [1.0, -0.3], [-1.7, 0.4], [2.3, 1.2], [0.25, 0.5]]).reshape(
        1, 2, 3, 2
    )
    host_x, host_grid = x.clone().requires_grad_(), grid.clone().requires_grad_()
    dev_x, dev_grid = x.to("tpu").requires_grad_(), grid.to("tpu").requires_grad_()
    cotangent = torch.randn(1, 2, 2, 3)
    kwargs = dict(mode=mode, padding_mode=padding_mode, align_corners=align_corners)
    F.grid_sample(host_x, host_grid, **kwargs).backward(cotangent)
    F.grid_sample(dev_x, dev_grid, **kwargs).backward(cotangent.to("tpu"))
    torch.testing.assert_close(dev_x.grad.cpu(), host_x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dev_grid.grad.cpu(), host_grid.grad, rtol=1e-5, atol=1e-5)


def test_every_small_3d_opinfo_sample_forward_and_backward():
    # grid_sampler_3d's samples are trilinear only: every padding mode x align_corners on the
    # (1, 1, 2, 2, 2) input (the sweep checks the first 3, larger ones).
    assert check_opinfo("grid_sampler_3d", max_samples=1000, sample_filter=lambda s: s.input.numel() <= 8) == 6


@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
def test_3d_modes_with_points_on_and_past_the_borders(mode, padding_mode):
    torch.manual_seed(1)
    x = torch.randn(1, 2, 3, 4, 5)
    grid = torch.tensor([[-1.0, -1.0, 1.0], [1.0, 0.3, -0.2], [1.6, -1.4, 0.5], [0.1, 0.7, -0.9]]).reshape(
        1, 1, 2, 2, 3
    )
    host_x, host_grid = x.clone().requires_grad_(), grid.clone().requires_grad_()
    dev_x, dev_grid = x.to("tpu").requires_grad_(), grid.to("tpu").requires_grad_()
    cotangent = torch.randn(1, 2, 1, 2, 2)
    F.grid_sample(host_x, host_grid, mode=mode, padding_mode=padding_mode, align_corners=False).backward(cotangent)
    F.grid_sample(dev_x, dev_grid, mode=mode, padding_mode=padding_mode, align_corners=False).backward(
        cotangent.to("tpu")
    )
    torch.testing.assert_close(dev_x.grad.cpu(), host_x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dev_grid.grad.cpu(), host_grid.grad, rtol=1e-5, atol=1e-5)
