"""CTC loss forward and backward on the device (tpurec/dense/ctc.py), against CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from opinfo_device import check_opinfo

pytestmark = pytest.mark.usefixtures("no_host_fallback")


def test_every_opinfo_sample():
    # Padded (N, S) targets, int-list and tensor lengths, zero_infinity on and off.
    assert check_opinfo("nn.functional.ctc_loss", max_samples=1000) == 12


def _both(log_probs, targets, input_lengths, target_lengths, **kwargs):
    host = log_probs.clone().requires_grad_()
    dev = log_probs.to("tpu").requires_grad_()
    move = lambda t: t.to("tpu") if isinstance(t, torch.Tensor) else t  # noqa: E731
    expected = F.ctc_loss(host, targets, input_lengths, target_lengths, **kwargs)
    actual = F.ctc_loss(dev, move(targets), move(input_lengths), move(target_lengths), **kwargs)
    torch.testing.assert_close(actual.detach().cpu(), expected.detach(), rtol=1e-5, atol=1e-5)
    cotangent = torch.randn_like(expected)
    expected.backward(cotangent)
    actual.backward(cotangent.to("tpu"))
    torch.testing.assert_close(dev.grad.cpu(), host.grad, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_concatenated_targets_and_uneven_lengths(reduction):
    torch.manual_seed(0)
    log_probs = torch.randn(12, 3, 5).log_softmax(-1)
    target_lengths = torch.tensor([3, 0, 4])  # one empty target
    targets = torch.tensor([1, 2, 2, 4, 1, 3, 3])  # 1-D, concatenated; repeated labels need a blank
    _both(log_probs, targets, torch.tensor([12, 7, 10]), target_lengths, blank=0, reduction=reduction)


def test_unbatched_input_and_another_blank():
    torch.manual_seed(1)
    log_probs = torch.randn(9, 6).log_softmax(-1)
    _both(log_probs, torch.tensor([1, 1, 2]), torch.tensor(9), torch.tensor(3), blank=5, reduction="sum")


@pytest.mark.parametrize("zero_infinity", [False, True])
def test_an_impossible_alignment(zero_infinity):
    # 4 labels with repeats need at least 6 steps; 5 are given: the loss is infinite.
    torch.manual_seed(2)
    log_probs = torch.randn(5, 2, 4).log_softmax(-1)
    targets = torch.tensor([[1, 1, 2, 2], [1, 2, 3, 1]])
    _both(log_probs, targets, [5, 5], [4, 2], zero_infinity=zero_infinity, reduction="none")
