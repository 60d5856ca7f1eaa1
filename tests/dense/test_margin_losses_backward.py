"""Backward of multi_margin_loss / multilabel_margin_loss on the device, against CPU (no host fallback)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from opinfo_device import check_opinfo

pytestmark = pytest.mark.usefixtures("no_host_fallback")


@pytest.mark.parametrize("name", ["nn.functional.multi_margin_loss", "nn.functional.multilabel_margin_loss"])
def test_every_opinfo_sample_forward_and_backward(name):
    assert check_opinfo(name, max_samples=1000) > 3


def _grads(loss_fn, x):
    host = x.clone().requires_grad_()
    dev = x.to("tpu").requires_grad_()
    loss_fn(host).sum().backward()
    loss_fn(dev).sum().backward()
    return dev.grad.cpu(), host.grad


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_multi_margin_hinges_at_exactly_zero_give_no_gradient(p, reduction):
    # Row 0: margin - x[y] + x[j] is exactly 0 for j = 1 (no gradient there on CPU), > 0 for j = 2.
    x = torch.tensor([[2.0, 1.0, 1.5, -3.0], [0.1, 0.2, 0.3, 0.4]])
    target = torch.tensor([0, 3])
    weight = torch.tensor([0.5, 1.0, 2.0, 3.0])
    loss = lambda t: F.multi_margin_loss(  # noqa: E731
        t, target.to(t.device), p=p, margin=1.0, weight=weight.to(t.device), reduction=reduction
    )
    dev, host = _grads(loss, x)
    torch.testing.assert_close(dev, host, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_multilabel_margin_targets_end_at_minus_one(reduction):
    x = torch.tensor([[0.1, 0.2, 0.4, 0.8], [1.0, -1.0, 0.0, 2.0], [0.5, 0.5, 0.5, 0.5]])
    target = torch.tensor([[3, 0, -1, 1], [1, 2, 3, 0], [-1, 1, 2, 3]])  # row 2: no targets at all
    dev, host = _grads(lambda t: F.multilabel_margin_loss(t, target.to(t.device), reduction=reduction), x)
    torch.testing.assert_close(dev, host, rtol=1e-6, atol=1e-7)
