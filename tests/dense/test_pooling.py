"""Pooling lowerings through the tpu device: OpInfo samples (forward and input
gradients) vs CPU, and the cases the issue reported wrong or on the host."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from opinfo_device import check_opinfo

TOL = dict(rtol=1e-5, atol=1e-5)

ENTRIES = [
    "nn.functional.max_pool1d",
    "nn.functional.max_pool2d",
    "nn.functional.max_pool3d",
    "max_pool2d_with_indices_backward",
    "nn.functional.avg_pool1d",
    "nn.functional.avg_pool2d",
    "nn.functional.avg_pool3d",
    "nn.functional.adaptive_avg_pool1d",
    "nn.functional.adaptive_avg_pool2d",
    "nn.functional.adaptive_avg_pool3d",
    "nn.functional.adaptive_max_pool1d",
    "nn.functional.adaptive_max_pool2d",
    "nn.functional.adaptive_max_pool3d",
    "nn.functional.max_unpool1d",
    "nn.functional.max_unpool2d",
    "nn.functional.max_unpool3d",
]


@pytest.mark.parametrize("name", ENTRIES)
def test_opinfo_through_device(name):
    assert check_opinfo(name, max_samples=4, **TOL) > 0


def test_max_pool2d_values_and_indices_of_issue_example():
    x = torch.arange(16.0).reshape(1, 1, 4, 4)
    out, idx = F.max_pool2d(x.to("tpu"), 2, return_indices=True)
    assert out.cpu().flatten().tolist() == [5.0, 7.0, 13.0, 15.0]
    assert idx.cpu().flatten().tolist() == [5, 7, 13, 15]


@pytest.mark.parametrize("ceil_mode", [False, True])
@pytest.mark.parametrize("count_include_pad", [False, True])
def test_avg_pool2d_divisors(ceil_mode, count_include_pad):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 6, requires_grad=True)
    kwargs = dict(kernel_size=3, stride=2, padding=1, ceil_mode=ceil_mode, count_include_pad=count_include_pad)
    ref = F.avg_pool2d(x, **kwargs)
    ref.sum().backward()
    xt = x.detach().to("tpu").requires_grad_()
    out = F.avg_pool2d(xt, **kwargs)
    out.sum().backward()
    torch.testing.assert_close(out.cpu(), ref, **TOL)
    torch.testing.assert_close(xt.grad.cpu(), x.grad, **TOL)


def test_max_pool_ties_and_nan_pick_torchs_index():
    x = torch.tensor([[[[1.0, 1.0, 2.0, 2.0], [1.0, 1.0, float("nan"), 2.0]]]])
    out, idx = F.max_pool2d(x.to("tpu"), 2, return_indices=True)
    ref_out, ref_idx = F.max_pool2d(x, 2, return_indices=True)
    torch.testing.assert_close(out.cpu(), ref_out, equal_nan=True)
    assert idx.cpu().tolist() == ref_idx.tolist()


@pytest.mark.parametrize("pool", ["max3d", "adaptive_avg2d"])
def test_backward_stays_on_device(pool):
    x = torch.randn(1, 2, 6, 6, 6) if pool == "max3d" else torch.randn(2, 3, 7, 5)
    xt = x.to("tpu").requires_grad_()
    with warnings.catch_warnings(record=True) as caught:  # raising inside backward would abort
        warnings.simplefilter("always", RuntimeWarning)
        out = F.max_pool3d(xt, 2) if pool == "max3d" else F.adaptive_avg_pool2d(xt, 3)
        out.sum().backward()
    assert not [w for w in caught if "ran on the host" in str(w.message)]
    assert xt.grad.shape == x.shape
