"""Views between a complex dtype and its real counterpart on the tpu device.

``view_as_real``, ``view_as_complex``, ``.real``/``.imag`` and ``view(dtype)``
between complex64/float32 (complex128/float64) are real views: both tensors read
one storage, a write through either shows in the other, and autograd of complex
functions (whose formulas use ``view_as_real``) runs on the device, not the host.
Every check is against the same code on CPU tensors.
"""

from __future__ import annotations

import os

import pytest
import torch

import tpurec

pytestmark = pytest.mark.usefixtures("no_host_fallback")


def both(host: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return host.clone(), host.clone().to("tpu")


def assert_same(device_tensor: torch.Tensor, host_tensor: torch.Tensor) -> None:
    assert device_tensor.device.type == "tpu"
    assert device_tensor.dtype == host_tensor.dtype
    assert device_tensor.shape == host_tensor.shape
    assert device_tensor.stride() == host_tensor.stride()
    assert device_tensor.storage_offset() == host_tensor.storage_offset()
    assert torch.equal(device_tensor.cpu(), host_tensor)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_view_as_real_values_and_writes_both_ways(dtype):
    torch.manual_seed(0)
    host_z, z = both(torch.randn(3, 4, dtype=dtype))
    host_r, r = torch.view_as_real(host_z), torch.view_as_real(z)
    assert_same(r, host_r)
    # A write through the real view shows in the complex base...
    host_r[1, 2, 1] = 7.0
    r[1, 2, 1] = 7.0
    host_r[0].mul_(-3)
    r[0].mul_(-3)
    assert_same(z, host_z)
    # ...and a write to the base shows in the view.
    host_z[2, 3] = 1 - 2j
    z[2, 3] = 1 - 2j
    host_z[:, 0].add_(0.5j)
    z[:, 0].add_(0.5j)
    assert_same(r, host_r)


def test_view_as_real_of_a_strided_complex_view():
    torch.manual_seed(1)
    host_z, z = both(torch.randn(4, 6, dtype=torch.complex64))
    host_r, r = torch.view_as_real(host_z[1:, ::2].t()), torch.view_as_real(z[1:, ::2].t())
    assert_same(r, host_r)
    host_r[..., 1].zero_()  # the imaginary parts of every other column
    r[..., 1].zero_()
    assert_same(z, host_z)


def test_view_as_complex_values_and_writes_both_ways():
    torch.manual_seed(2)
    host_x, x = both(torch.randn(5, 3, 2))
    host_c, c = torch.view_as_complex(host_x), torch.view_as_complex(x)
    assert_same(c, host_c)
    host_c.mul_(2j)
    c.mul_(2j)
    assert_same(x, host_x)
    host_x[4, 1, 1] = -9.0
    x[4, 1, 1] = -9.0
    assert_same(c, host_c)
    # Back to real: a view of the real storage again, with the same layout.
    assert_same(torch.view_as_real(c), torch.view_as_real(host_c))


def test_real_and_imag_are_writable_views():
    torch.manual_seed(3)
    host_z, z = both(torch.randn(6, dtype=torch.complex64))
    assert_same(z.real, host_z.real)
    assert_same(z.imag, host_z.imag)
    host_z.imag.zero_()
    z.imag.zero_()
    host_z.real[::2] = 4.0
    z.real[::2] = 4.0
    assert_same(z, host_z)


def test_view_dtype_between_complex_and_real():
    torch.manual_seed(4)
    host_x, x = both(torch.randn(3, 8))
    assert_same(x.view(torch.complex64), host_x.view(torch.complex64))
    x.view(torch.complex64)[1, 2] = 3 + 4j
    host_x.view(torch.complex64)[1, 2] = 3 + 4j
    assert_same(x, host_x)
    host_z, z = both(torch.randn(2, 3, dtype=torch.complex128))
    assert_same(z.view(torch.float64), host_z.view(torch.float64))


def test_a_bitcast_view_is_refused_with_a_clear_error():
    x = torch.randn(4).to("tpu")
    with pytest.raises(NotImplementedError, match="reinterprets its bytes|views that reinterpret"):
        x.view(torch.int32)
    assert torch.equal(x.cpu(), x.cpu())  # x is still usable


def test_autograd_of_fft_abs_matches_cpu():
    torch.manual_seed(5)
    host = torch.randn(4, 16, requires_grad=True)
    dev = host.detach().to("tpu").requires_grad_()
    torch.fft.fft(host).abs().sum().backward()
    torch.fft.fft(dev).abs().sum().backward()
    torch.testing.assert_close(dev.grad.cpu(), host.grad, rtol=1e-4, atol=1e-5)


def test_autograd_through_real_imag_of_a_complex_leaf_matches_cpu():
    torch.manual_seed(6)
    host = torch.randn(5, dtype=torch.complex64, requires_grad=True)
    dev = host.detach().to("tpu").requires_grad_()
    weights = torch.randn(5)
    (host.real * weights + host.imag**2).sum().backward()
    (dev.real * weights.to("tpu") + dev.imag**2).sum().backward()
    torch.testing.assert_close(dev.grad.cpu(), host.grad, rtol=1e-6, atol=1e-6)


def test_writes_through_a_real_view_in_fused_mode():
    torch.manual_seed(7)
    host_z, z = both(torch.randn(3, 2, dtype=torch.complex64))
    with tpurec.mode("fused"):
        r = torch.view_as_real(z)
        r[..., 0].add_(1.0)
        out = (z * 2).cpu()
    torch.view_as_real(host_z)[..., 0].add_(1.0)
    assert torch.equal(out, host_z * 2)
    assert_same(z, host_z)


def test_view_as_real_under_inference_mode():
    host_z, z = both(torch.randn(4, dtype=torch.complex64))
    with torch.inference_mode():
        assert torch.equal(torch.view_as_real(z).cpu(), torch.view_as_real(host_z))


@pytest.mark.skipif(os.environ.get("TPUREC_MODE") == "fused", reason="checks eager program reuse")
def test_same_layout_over_complex_and_real_storages_are_different_programs():
    # A complex view of a real storage and a complex tensor of its own storage may have the same
    # shape, strides and offset; programs (and their cached output types) must not be shared.
    torch.manual_seed(8)
    host_x, x = both(torch.randn(4))
    over_real = x.view(torch.complex64)  # 2 complex elements over 4 floats
    own = torch.randn(4, dtype=torch.complex64).to("tpu")[:2]
    assert over_real.shape == own.shape and over_real.stride() == own.stride()
    assert torch.equal((over_real * 2).cpu(), host_x.view(torch.complex64) * 2)
    assert torch.equal((own * 2).cpu(), own.cpu() * 2)


def test_complex_views_in_compiled_mode():
    torch.manual_seed(9)

    def views(z):
        r = torch.view_as_real(z)
        return (r * 2).sum(-1), torch.view_as_complex(r * 3), z.view(torch.float32), r.view(torch.complex64)

    def write_real_part(z):
        z = z.clone()
        z.real.mul_(2)
        return z

    z = torch.randn(4, 3, dtype=torch.complex64)
    for actual, expected in zip(torch.compile(views, backend="tpu")(z.to("tpu")), views(z)):
        assert torch.equal(actual.cpu(), expected)
    assert torch.equal(torch.compile(write_real_part, backend="tpu")(z.to("tpu")).cpu(), write_real_part(z))


def test_autograd_of_fft_abs_in_compiled_mode_matches_cpu():
    torch.manual_seed(10)
    host = torch.randn(8, requires_grad=True)
    dev = host.detach().to("tpu").requires_grad_()
    compiled = torch.compile(lambda x: torch.fft.fft(x).abs().sum(), backend="tpu")
    compiled(dev).backward()
    torch.fft.fft(host).abs().sum().backward()
    torch.testing.assert_close(dev.grad.cpu(), host.grad, rtol=1e-4, atol=1e-5)
