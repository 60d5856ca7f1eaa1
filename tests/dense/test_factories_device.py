"""Factories that reach tpu's PrivateUse1 kernels (``logspace``, ``_efficientzerotensor``), against CPU."""

from __future__ import annotations

import pytest
import torch

import tpurec  # noqa: F401

pytestmark = pytest.mark.usefixtures("no_host_fallback")

CASES = [
    ((0, 3, 5), {}),
    ((-1.5, 2.25, 7), {"base": 2.0}),
    ((-2, 1.1, 9), {"dtype": torch.float64, "base": 0.5}),
    ((1, 3, 4), {"dtype": torch.int64}),  # powers truncated to int, as on CPU
    ((0.3, 4.7, 6), {"dtype": torch.int32, "base": 3}),  # endpoints truncated first
    ((2, 2, 1), {}),
    ((0, 1, 0), {}),
]


@pytest.mark.parametrize("args, kwargs", CASES, ids=[str(i) for i in range(len(CASES))])
def test_logspace_matches_cpu_exactly(args, kwargs):
    expected = torch.logspace(*args, **kwargs)
    actual = torch.logspace(*args, device="tpu", **kwargs)
    assert actual.device.type == "tpu"
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.equal(actual.cpu(), expected)


def test_logspace_with_tensor_endpoints():
    start = torch.tensor(-1.0)
    expected = torch.logspace(start, 2.0, 4)
    actual = torch.logspace(start.to("tpu"), 2.0, 4)
    assert actual.device.type == "tpu"
    torch.testing.assert_close(actual.cpu(), expected, rtol=1e-6, atol=0)


def test_sgn_backward_makes_its_zero_gradient_on_the_device():
    # sgn's derivative is a "known zero" (aten._efficientzerotensor): a factory on the tpu device.
    host = torch.tensor([1.5, -2.0, 0.0], requires_grad=True)
    dev = host.detach().to("tpu").requires_grad_()
    torch.sgn(host).sum().backward()
    torch.sgn(dev).sum().backward()
    assert dev.grad.device.type == "tpu"
    assert torch.equal(dev.grad.cpu(), host.grad)
    zeros = torch._efficientzerotensor((2, 3), dtype=torch.float64, device="tpu")
    assert zeros.device.type == "tpu" and torch.equal(zeros.cpu(), torch.zeros(2, 3, dtype=torch.float64))
