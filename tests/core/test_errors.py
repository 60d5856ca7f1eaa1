"""Unsupported ops and bad calls raise clear Python errors."""

import pytest
import torch

import tpurec  # noqa: F401


def test_op_without_lowering_names_the_overload():
    x = torch.ones(4, device="tpu")
    with pytest.raises(NotImplementedError, match=r"aten::_fft_r2c.*not supported on the tpu device.*report"):
        torch.ops.aten._fft_r2c(x, [0], 0, True)


def test_numpy_refuses_like_cuda():
    with pytest.raises(TypeError, match="can't convert tpu:0 device type tensor to numpy"):
        torch.ones(2, device="tpu").numpy()


def test_error_leaves_state_unchanged():
    x = torch.arange(4.0).to("tpu")
    before = x.cpu().clone()
    with pytest.raises(NotImplementedError):
        torch.ops.aten._fft_r2c(x, [0], 0, True)
    assert torch.equal(x.cpu(), before)
