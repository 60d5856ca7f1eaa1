"""Ops whose tpu results the CPU shadow (``tpurec.debug.shadow``) found differing from PyTorch CPU.

Each case runs through the tpu device and is compared with PyTorch on CPU: values exactly
(equal NaN places, the same zero signs where CPU's are consistent), dtypes exactly, and
errors by type and message.
"""

from __future__ import annotations

import pytest
import torch

NAN, INF = float("nan"), float("inf")


def _same(tpu: torch.Tensor, cpu: torch.Tensor, *, signed_zeros: bool = True) -> None:
    tpu = tpu.cpu()
    assert tpu.dtype == cpu.dtype and tpu.shape == cpu.shape
    torch.testing.assert_close(tpu, cpu, rtol=0, atol=0, equal_nan=True)
    if signed_zeros and not cpu.is_complex() and cpu.is_floating_point():
        assert torch.equal(torch.signbit(tpu), torch.signbit(cpu)), (tpu, cpu)


# --- sign / sgn: NaN -> 0, -0 -> +0 as on CPU --------------------------------------------

@pytest.mark.parametrize("op", [torch.sign, torch.sgn])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_sign_of_nan_and_signed_zero_is_positive_zero(op, dtype):
    x = torch.tensor([NAN, -0.0, 0.0, 2.0, -3.0, INF, -INF, 1e-30], dtype=dtype)
    _same(op(x.to("tpu")), op(x))


@pytest.mark.parametrize("op", [torch.sign, torch.sgn])
@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool])
def test_sign_of_integers_and_bools(op, dtype):
    x = torch.tensor([0, 1, 1, 0], dtype=dtype) if dtype == torch.bool else torch.tensor([0, 1, 7], dtype=dtype)
    if dtype.is_signed:
        x = torch.tensor([0, -1, 7, -128 if dtype == torch.int8 else -1000], dtype=dtype)
    _same(op(x.to("tpu")), op(x))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_sgn_of_complex_is_unit_phase_and_zero_at_zero(dtype):
    # Finite values and NaN only: for infinite components CPU's own result depends on which
    # of its kernels (vectorised or scalar) handles the element.
    x = torch.tensor([complex(NAN, 0), complex(0, NAN), complex(-0.0, -0.0), 0j, complex(3, 4),
                      complex(-1e-30, 1e-30), complex(1e30, -1e30), complex(0, -2)], dtype=dtype)
    tpu, cpu = torch.sgn(x.to("tpu")).cpu(), torch.sgn(x)
    assert tpu.dtype == cpu.dtype
    torch.testing.assert_close(tpu, cpu, rtol=1e-6, atol=0, equal_nan=True)
    # CPU's zero is +0+0j, also for -0-0j.
    zero = cpu.abs() == 0
    assert not torch.signbit(torch.view_as_real(tpu)[zero]).any()
