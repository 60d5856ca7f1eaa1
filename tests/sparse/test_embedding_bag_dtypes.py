"""``nn.functional.embedding_bag`` on the tpu device refuses per-sample weights of another dtype than
the table's, as PyTorch's CPU kernel does (``aten._embedding_bag`` and its forward-only variant:
"Expected tensor for argument #1 'weight' to have the same type as tensor for argument #1
'per_sample_weights'"), instead of promoting them; weights of the table's dtype compute as on CPU."""

from __future__ import annotations

import pytest
import torch

import tpurec

TABLE = torch.arange(40, dtype=torch.float32).reshape(10, 4) / 10
INDICES = torch.tensor([1, 2, 3, 7])
OFFSETS = torch.tensor([0, 2])


def _calls(weight: torch.Tensor, weights: torch.Tensor):
    indices, offsets = INDICES.to(weight.device), OFFSETS.to(weight.device)
    yield lambda: torch.nn.functional.embedding_bag(indices, weight, offsets, mode="sum", per_sample_weights=weights)
    yield lambda: torch.ops.aten._embedding_bag(weight, indices, offsets, False, 0, False, weights)
    yield lambda: torch.ops.aten._embedding_bag_forward_only(weight, indices, offsets, False, 0, False, weights)


@pytest.mark.parametrize(
    "table_dtype, weights_dtype",
    [(torch.float32, torch.float64), (torch.float32, torch.float16), (torch.float16, torch.float32)],
    ids=["float32_table_float64_weights", "float32_table_float16_weights", "float16_table_float32_weights"],
)
@pytest.mark.parametrize("mode", ["eager", "fused"])
def test_per_sample_weights_of_another_dtype_raise_as_on_cpu(table_dtype, weights_dtype, mode):
    weight = TABLE.to(table_dtype)
    weights = torch.tensor([0.5, 2.0, 1.0, 3.0], dtype=weights_dtype)
    for cpu_call, tpu_call in zip(_calls(weight, weights), _calls(weight.to("tpu"), weights.to("tpu"))):
        with pytest.raises(RuntimeError, match="to have the same type as tensor for argument") as on_cpu:
            cpu_call()
        with tpurec.mode(mode), pytest.raises(RuntimeError, match=r"weight.*per_sample_weights.*same dtype") as on_tpu:
            tpu_call()
        # Both name the two dtypes.
        assert str(table_dtype).removeprefix("torch.") in str(on_tpu.value), on_tpu.value
        assert str(weights_dtype).removeprefix("torch.") in str(on_tpu.value), on_tpu.value
        assert on_cpu.value is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_per_sample_weights_of_the_table_dtype_match_cpu(dtype):
    weight = TABLE.to(dtype)
    weights = torch.tensor([0.5, 2.0, 1.0, 3.0], dtype=dtype)
    for cpu_call, tpu_call in zip(_calls(weight, weights), _calls(weight.to("tpu"), weights.to("tpu"))):
        want, got = cpu_call(), tpu_call()
        want = want[0] if isinstance(want, tuple) else want
        got = got[0] if isinstance(got, tuple) else got
        # Sums of two products of values up to 3.9: float32 rounding (XLA may fuse a multiply-add that
        # CPU rounds twice); float16: the device sums in float32 and rounds once, CPU rounds each
        # product (one float16 ulp, 1e-3 relative).
        tolerance = 1e-6 if dtype == torch.float32 else 1e-3
        torch.testing.assert_close(got.cpu(), want, rtol=tolerance, atol=tolerance)
