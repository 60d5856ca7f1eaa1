"""Fractional max pooling on the device (tpurec/dense/fractional_pooling.py) against CPU.

OpInfo treats the ops as random (their samples come from torch.rand), so the sweep
compares shapes only; here the same ``random_samples`` go to both, and values,
indices and input gradients must be equal.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.usefixtures("no_host_fallback")

CASES = [
    (2, (2, 3, 9, 11), (2, 3), (4, 5)),
    (2, (3, 7, 7), (3, 3), (3, 2)),  # unbatched
    (2, (1, 1, 5, 5), (2, 2), (1, 4)),  # a single window along one dim
    (3, (2, 2, 6, 7, 8), (2, 3, 2), (3, 2, 4)),
    (3, (2, 5, 6, 7), (2, 2, 2), (2, 3, 3)),  # unbatched
]


@pytest.mark.parametrize("n, shape, kernel, output", CASES)
def test_same_samples_give_the_same_pooling_and_gradient(n, shape, kernel, output):
    torch.manual_seed(0)
    x = torch.randn(*shape)
    batch, channels = (shape[0], shape[1]) if len(shape) == n + 2 else (1, shape[0])
    samples = torch.rand(batch, channels, n)
    op = torch.ops.aten.fractional_max_pool2d if n == 2 else torch.ops.aten.fractional_max_pool3d
    host, dev = x.clone().requires_grad_(), x.to("tpu").requires_grad_()
    expected_values, expected_indices = op(host, list(kernel), list(output), samples)
    values, indices = op(dev, list(kernel), list(output), samples.to("tpu"))
    assert torch.equal(values.detach().cpu(), expected_values.detach())
    assert torch.equal(indices.cpu(), expected_indices)
    cotangent = torch.randn_like(expected_values)
    expected_values.backward(cotangent)
    values.backward(cotangent.to("tpu"))
    torch.testing.assert_close(dev.grad.cpu(), host.grad, rtol=1e-6, atol=1e-6)


def test_module_runs_on_the_device():
    pool = torch.nn.FractionalMaxPool2d(2, output_ratio=0.5)
    out = pool(torch.randn(2, 3, 8, 8).to("tpu"))
    assert out.device.type == "tpu" and out.shape == (2, 3, 4, 4)
