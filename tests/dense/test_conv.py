"""Convolution lowerings through the tpu device: OpInfo samples (forward and
input gradients) vs CPU, plus the cases OpInfo samples do not reach."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from opinfo_device import check_opinfo

# float32 convolutions: XLA and oneDNN sum in different orders (weight gradients
# sum hundreds of products of magnitude ~10, hence the absolute term).
TOL = dict(rtol=1e-5, atol=5e-5)

ENTRIES = [
    "nn.functional.conv1d",
    "nn.functional.conv2d",
    "nn.functional.conv3d",
    "nn.functional.conv_transpose1d",
    "nn.functional.conv_transpose2d",
    "nn.functional.conv_transpose3d",
]


@pytest.mark.parametrize("name", ENTRIES)
def test_opinfo_through_device(name):
    assert check_opinfo(name, max_samples=4, **TOL) > 0


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(stride=2, padding=1, dilation=2, groups=2),
        dict(stride=(1, 2), padding="same", dilation=1, groups=1),
        dict(stride=1, padding="valid", dilation=(2, 1), groups=4),
    ],
)
def test_conv2d_options_and_grads(kwargs):
    torch.manual_seed(0)
    x = torch.randn(2, 4, 9, 8, requires_grad=True)
    w = torch.randn(6 if kwargs["groups"] != 4 else 8, 4 // kwargs["groups"], 3, 2, requires_grad=True)
    b = torch.randn(w.shape[0], requires_grad=True)
    if kwargs["padding"] == "same":
        kwargs = dict(kwargs, stride=1)
    ref = F.conv2d(x, w, b, **kwargs)
    ref.square().sum().backward()
    xt, wt, bt = (t.detach().to("tpu").requires_grad_() for t in (x, w, b))
    out = F.conv2d(xt, wt, bt, **kwargs)
    out.square().sum().backward()
    torch.testing.assert_close(out.cpu(), ref, **TOL)
    for got, want in ((xt.grad, x.grad), (wt.grad, w.grad), (bt.grad, b.grad)):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


def test_conv_transpose2d_output_padding_groups_dilation():
    torch.manual_seed(0)
    x = torch.randn(2, 4, 5, 6, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, requires_grad=True)
    kwargs = dict(stride=2, padding=2, output_padding=1, groups=2, dilation=2)
    ref = F.conv_transpose2d(x, w, **kwargs)
    ref.sum().backward()
    xt, wt = (t.detach().to("tpu").requires_grad_() for t in (x, w))
    out = F.conv_transpose2d(xt, wt, **kwargs)
    out.sum().backward()
    torch.testing.assert_close(out.cpu(), ref, **TOL)
    torch.testing.assert_close(xt.grad.cpu(), x.grad, **TOL)
    torch.testing.assert_close(wt.grad.cpu(), w.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
def test_conv_padding_modes(mode):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3, padding=1, padding_mode=mode)
    x = torch.randn(1, 3, 6, 5)
    ref = conv(x)
    out = conv.to("tpu")(x.to("tpu"))
    torch.testing.assert_close(out.cpu(), ref, **TOL)


# bfloat16: both sides accumulate in float32 and round once; one bf16 ulp is 2**-8
# relative, and sums of ~100 rounded products differ by a few ulp.
BF16_TOL = dict(rtol=1.6e-2, atol=2e-2)


def test_opinfo_through_device_bfloat16():
    assert check_opinfo("nn.functional.conv2d", dtype=torch.bfloat16, max_samples=3, **BF16_TOL) > 0


def test_conv_transpose2d_bfloat16_rounds_once():
    """Checked against float32 math on the same bf16 values: the tpu result is the
    float32 result rounded once (torch's CPU kernel rounds before adding the bias,
    so it is not the reference here)."""
    torch.manual_seed(0)
    x = torch.randn(2, 4, 5, 6).bfloat16()
    w = torch.randn(4, 3, 3, 3).bfloat16()
    b = torch.randn(6).bfloat16()
    kwargs = dict(stride=(3, 2), padding=(1, 2), output_padding=(2, 1), groups=2, dilation=2)
    exact = torch.nn.functional.conv_transpose2d(x.float(), w.float(), b.float(), **kwargs)
    out = torch.nn.functional.conv_transpose2d(x.to("tpu"), w.to("tpu"), b.to("tpu"), **kwargs)
    assert out.dtype == torch.bfloat16
    # one rounding to bf16: at most half an ulp (2**-9 relative), plus float32 summation order
    torch.testing.assert_close(out.cpu().float(), exact, rtol=2**-8, atol=1e-5)
