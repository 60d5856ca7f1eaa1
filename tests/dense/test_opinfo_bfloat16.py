"""bfloat16 through the tpu device: the matmul, convolution and elementwise families.

Each entry's bfloat16 samples run on tpu and on CPU (forward outputs and input
gradients), with the comparison of ``opinfo_device.check_opinfo``; a host
fallback fails. Tolerances, stated per family:

* elementwise: both sides compute in float32 and round once to bfloat16, so
  they differ by at most one bfloat16 ulp (2**-8 relative): torch.testing's
  bfloat16 defaults, ``rtol=1.6e-2, atol=1e-5``.
* matmul and convolution: both accumulate in float32 and round once, but in a
  different order; sums of many rounded products of magnitude ~1 that cancel
  differ by a few ulp of the largest term, hence ``atol=2e-2``.

Where tpu and CPU still differ by more, both are judged against CPU's float64
result of the same sample, as for float32 (``opinfo_device.float64_verdict``):
CPU's bfloat16 kernels are not always correctly rounded either. Seen: CPU's
``rsqrt`` of bfloat16 2.359375 is 0.6484375 where float64 gives 0.65103 and tpu
the nearest bfloat16, 0.65234375; ``rsqrt``'s backward (``result ** 3``) then
triples the difference.
"""

from __future__ import annotations

import pytest
import torch

from opinfo_device import check_entry, check_opinfo, entry_name, float32_entries

ELEMENTWISE = """
add sub mul div.no_rounding_mode neg abs exp log sqrt rsqrt tanh sigmoid sin cos pow maximum minimum where
clamp lerp nn.functional.relu nn.functional.gelu nn.functional.silu nn.functional.leaky_relu
""".split()
MATMUL = "matmul mm bmm addmm baddbmm nn.functional.linear einsum".split()
CONVOLUTION = "nn.functional.conv1d nn.functional.conv2d nn.functional.conv_transpose2d".split()

ELEMENTWISE_TOL = dict(rtol=1.6e-2, atol=1e-5)
ACCUMULATING_TOL = dict(rtol=1.6e-2, atol=2e-2)


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_elementwise_bfloat16(name):
    assert check_opinfo(name, dtype=torch.bfloat16, max_samples=3, **ELEMENTWISE_TOL) > 0


@pytest.mark.parametrize("name", MATMUL + CONVOLUTION)
def test_accumulating_bfloat16(name):
    assert check_opinfo(name, dtype=torch.bfloat16, max_samples=3, **ACCUMULATING_TOL) > 0


def test_a_wrong_bfloat16_result_still_fails():
    # 5% off: beyond the tolerance, and far beyond CPU's own error against float64.
    op = next(o for o in float32_entries() if entry_name(o) == "exp")
    wrong = lambda f: lambda *a, **k: f(*a, **k) * 1.05  # noqa: E731
    result = check_entry(op, wrap=wrong, dtype=torch.bfloat16, tol=ELEMENTWISE_TOL, backward=False)
    assert "wrong values" in result.forward, result.forward


def test_rsqrt_on_tpu_is_the_correctly_rounded_bfloat16():
    x = torch.tensor([2.359375], dtype=torch.bfloat16)
    exact = torch.rsqrt(x.double())
    tpu = torch.rsqrt(x.to("tpu")).cpu()
    assert tpu.item() == 0.65234375 and (tpu.double() - exact).abs() < (torch.rsqrt(x).double() - exact).abs()
