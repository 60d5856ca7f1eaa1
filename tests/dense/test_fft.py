"""FFT lowerings through the tpu device: OpInfo samples vs CPU."""

from __future__ import annotations

import pytest
import torch

from device_opinfo import check_opinfo

# pocketfft and XLA's FFT sum in different orders; sizes here are <= 10^3.
TOL = dict(rtol=1e-4, atol=1e-4)

# Failures outside the FFT lowerings, in the core: the backward of the c2r
# transforms uses view_as_real (a byte-reinterpreting view, which the core
# refuses by design), and ifft/ihfft of real input return a lazily conjugated
# result (the conj bit) that is read back without the conjugation.
CORE_COMPLEX_VIEWS = pytest.mark.xfail(strict=False, reason="core: view_as_real / conj bit")

ENTRIES = [
    "fft.fft",
    "fft.fft2",
    "fft.fftn",
    "fft.ifft2",
    "fft.ifftn",
    "fft.rfft",
    "fft.fftshift",
    "fft.ifftshift",
    pytest.param("fft.ifft", marks=CORE_COMPLEX_VIEWS),
    "fft.rfft2",
    "fft.rfftn",
    pytest.param("fft.irfft", marks=CORE_COMPLEX_VIEWS),
    pytest.param("fft.hfft", marks=CORE_COMPLEX_VIEWS),
    pytest.param("fft.ihfft", marks=CORE_COMPLEX_VIEWS),
]


@pytest.mark.parametrize("name", ENTRIES)
def test_opinfo_through_device(name):
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
