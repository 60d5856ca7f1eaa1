"""``torch.logspace(..., device="tpu")`` against CPU: the factory kernel and its lowering."""

from __future__ import annotations

import pytest
import torch

import tpurec  # noqa: F401

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
