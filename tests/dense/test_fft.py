"""FFT lowerings through the tpu device: OpInfo samples vs CPU."""

from __future__ import annotations

import pytest
import torch

from opinfo_device import check_opinfo

# pocketfft and XLA's FFT sum in different orders; sizes here are <= 10^3.
TOL = dict(rtol=1e-4, atol=1e-4)

ENTRIES = [
    "fft.fft",
    "fft.fft2",
    "fft.fftn",
    "fft.ifft",
    "fft.ifft2",
    "fft.ifftn",
    "fft.rfft",
    "fft.rfft2",
    "fft.rfftn",
    "fft.irfft",
    "fft.hfft",
    "fft.ihfft",
    "fft.fftshift",
    "fft.ifftshift",
]


# Backward of the transforms between real and complex tensors goes through view_as_real
# (torch's formulas take at::real of a complex gradient): a real view of the complex storage.
@pytest.mark.parametrize("name", ENTRIES)
def test_opinfo_forward_and_backward_through_device(name):
    assert check_opinfo(name, max_samples=3, **TOL) > 0


@pytest.mark.parametrize("norm", [None, "ortho", "forward"])
def test_roundtrips_forward_only(norm):
    torch.manual_seed(0)
    x = torch.randn(4, 6, 5)
    xt = x.to("tpu")
    spectrum = torch.fft.rfftn(xt, dim=(1, 2), norm=norm)
    torch.testing.assert_close(spectrum.cpu(), torch.fft.rfftn(x, dim=(1, 2), norm=norm), **TOL)
    back = torch.fft.irfftn(spectrum, s=(6, 5), dim=(1, 2), norm=norm)
    torch.testing.assert_close(back.cpu(), x, **TOL)
    c = torch.fft.fft(xt.to(torch.complex64), dim=0, norm=norm)
    torch.testing.assert_close(c.cpu(), torch.fft.fft(x.to(torch.complex64), dim=0, norm=norm), **TOL)
