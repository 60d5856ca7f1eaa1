"""Order statistics, searching, scattered reductions, cdist and the backward ops
that used to run on the host: OpInfo samples through the tpu device vs CPU."""

from __future__ import annotations

import pytest
import torch

from opinfo_device import check_opinfo

TOL = dict(rtol=1e-5, atol=1e-5)

ENTRIES = [
    "median",
    "nanmedian",
    "searchsorted",
    "histc",
    "index_reduce.prod",
    "index_reduce.mean",
    "index_reduce.amax",
    "index_reduce.amin",
    "put",
    "masked_scatter",
    "nn.functional.hardshrink",
    "nn.functional.softshrink",
    "nn.functional.pad.replicate",
    "nn.functional.pad.replicate_negative",
    "cdist",
    "_segment_reduce.lengths",
    "_segment_reduce.offsets",
]


@pytest.mark.parametrize("name", ENTRIES)
def test_opinfo_through_device(name):
    assert check_opinfo(name, max_samples=3, **TOL) > 0


@pytest.mark.parametrize("name", ["kthvalue", "mode"])
def test_values_and_indices_through_device(name):
    assert check_opinfo(name, max_samples=3, **TOL) > 0


def test_mode_ties_pick_smallest_value_last_index():
    x = torch.tensor([[3.0, 1.0, 3.0, 1.0, 2.0], [5.0, 5.0, 4.0, 4.0, 4.0]])
    values, indices = torch.mode(x.to("tpu"), 1)
    ref = torch.mode(x, 1)
    assert values.cpu().tolist() == ref.values.tolist() and indices.cpu().tolist() == ref.indices.tolist()


@pytest.mark.parametrize("p", [0.0, 0.5, 1.0, 2.0, 3.0, float("inf")])
def test_cdist_values_and_gradient_with_coincident_points(p):
    torch.manual_seed(0)
    x1 = torch.randn(2, 4, 3, dtype=torch.float64)
    x2 = torch.cat([x1[:, :2], torch.randn(2, 3, 3, dtype=torch.float64)], dim=1)  # zero distances too
    a, b = x1.clone().requires_grad_(), x2.clone().requires_grad_()
    at, bt = x1.to("tpu").requires_grad_(), x2.to("tpu").requires_grad_()
    ref = torch.cdist(a, b, p=p, compute_mode="donot_use_mm_for_euclid_dist")
    out = torch.cdist(at, bt, p=p, compute_mode="donot_use_mm_for_euclid_dist")
    torch.testing.assert_close(out.cpu(), ref.detach(), rtol=1e-9, atol=1e-9)
    ref.sum().backward()
    out.sum().backward()
    torch.testing.assert_close(at.grad.cpu(), a.grad, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(bt.grad.cpu(), b.grad, rtol=1e-9, atol=1e-9)


def test_median_with_nan_rows():
    x = torch.tensor([[1.0, float("nan"), 3.0, 0.5], [4.0, 2.0, 1.0, 3.0]])
    for fn in (torch.median, torch.nanmedian):
        ref_v, ref_i = fn(x, dim=1)
        got_v, got_i = fn(x.to("tpu"), dim=1)
        torch.testing.assert_close(got_v.cpu(), ref_v, equal_nan=True)
        assert got_i.cpu().tolist() == ref_i.tolist()
