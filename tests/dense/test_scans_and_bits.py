"""cummax/cummin, logcumsumexp, angle, frexp, nextafter, group norm and prims.var through the tpu device vs CPU.

The OpInfo entries run through the device harness; the cases their samples do
not reach (ties and NaN in a running max/min, inf/NaN/-0.0 for the bit ops, the
``prims.var`` prim called directly) are checked here against the CPU kernels.
"""

from __future__ import annotations

import pytest
import torch

from opinfo_device import check_opinfo

ENTRIES = ["cummax", "cummin", "angle", "frexp", "nextafter", "native_group_norm", "nn.functional.group_norm"]


@pytest.mark.parametrize("name", ENTRIES)
def test_entry_matches_cpu(name: str) -> None:
    check_opinfo(name)


@pytest.mark.parametrize("op", [torch.cummax, torch.cummin])
def test_running_extreme_ties_and_nan(op) -> None:
    # torch's rule: ties go to the later index, and NaN (once seen) is the running value.
    x = torch.tensor(
        [[1.0, 3.0, 3.0, 0.0, float("nan"), 5.0, float("nan"), 2.0], [2.0, 2.0, 1.0, 1.0, 4.0, 4.0, -1.0, -1.0]]
    )
    for dim in (0, 1, -1):
        expected = op(x, dim)
        actual = op(x.to("tpu"), dim)
        torch.testing.assert_close(actual.values.cpu(), expected.values, equal_nan=True)
        torch.testing.assert_close(actual.indices.cpu(), expected.indices)
    ints = torch.tensor([3, 1, 3, 7, 7, 0])
    expected, actual = op(ints, 0), op(ints.to("tpu"), 0)
    assert torch.equal(actual.values.cpu(), expected.values) and torch.equal(actual.indices.cpu(), expected.indices)


def test_bit_ops_special_values() -> None:
    # No subnormals: XLA flushes them to zero in arithmetic, unlike the CPU kernels.
    x = torch.tensor([-0.0, 0.0, -2.5, 3.0, float("inf"), float("-inf"), float("nan"), 1e-30])
    torch.testing.assert_close(torch.angle(x.to("tpu")).cpu(), torch.angle(x), equal_nan=True)
    mantissa, exponent = torch.frexp(x.to("tpu"))
    expected_mantissa, expected_exponent = torch.frexp(x)
    torch.testing.assert_close(mantissa.cpu(), expected_mantissa, equal_nan=True)
    assert torch.equal(exponent.cpu(), expected_exponent)
    y = torch.tensor([1.0, -1.0, -3.0, 3.0, 0.0, 0.0, 1.0, 0.0])
    assert torch.equal(
        torch.nextafter(x.to("tpu"), y.to("tpu")).cpu().view(torch.int32), torch.nextafter(x, y).view(torch.int32)
    )


@pytest.mark.parametrize("dims, correction", [([1], 1.0), ([0, 2], 0.0), ([], 1.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
def test_prims_var(dims: list[int], correction: float, dtype: torch.dtype) -> None:
    x = torch.randn(3, 4, 5, dtype=dtype)
    expected = torch.ops.prims.var(x, dims, correction)
    actual = torch.ops.prims.var(x.to("tpu"), dims, correction)
    assert actual.device.type == "tpu"
    torch.testing.assert_close(actual.cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64])
def test_logcumsumexp_infinities_nan_and_complex(dtype: torch.dtype) -> None:
    # Real values scan an accurate log-add-exp written in tpurec; complex ones keep JAX's.
    inf, nan = float("inf"), float("nan")
    torch.manual_seed(0)
    rows = [torch.randn(9) * 30, torch.tensor([-inf, -inf, 0.0, inf, 1.0, inf, nan, 2.0, -inf])]
    x = torch.stack(rows).to(dtype) if not dtype.is_complex else torch.randn(2, 9, dtype=dtype)
    torch.testing.assert_close(torch.logcumsumexp(x.to("tpu"), 1).cpu(), torch.logcumsumexp(x, 1), equal_nan=True)
