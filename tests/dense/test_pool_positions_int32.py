"""Max pooling computes window positions in int32 (a TPU emulates int64) and returns int64 indices.

A ResNet's 3x3 max pool with int64 gathers and argmaxes took 7.5 s of XLA:TPU compile time (v5e),
3.3 s with int32 positions. Checked: the program lowered for a TPU gathers and reduces no int64
values, and the pool's values and indices are PyTorch CPU's (ties and NaN included).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import torch

from tpurec.dense.registry import get_lowering

aten = torch.ops.aten


def test_a_tpu_max_pool_gathers_and_reduces_no_int64() -> None:
    lowering = get_lowering(aten.max_pool2d_with_indices.default)
    assert lowering is not None

    def pool(x):
        return lowering.fn(x, [3, 3], [2, 2], [1, 1], [1, 1], False)

    x = jax.ShapeDtypeStruct((2, 8, 16, 16), jnp.float32)
    text = jax.export.export(jax.jit(pool), platforms=("tpu",))(x).mlir_module()
    wide = [
        line.strip()[:160]
        for line in text.splitlines()
        if re.search(r"tensor<(?:[\dx]*x)?i64>", line)
        and any(op in line for op in ("stablehlo.gather", "stablehlo.reduce", "stablehlo.compare"))
    ]
    assert not wide, wide


def test_max_pool_indices_as_on_cpu_with_ties_and_nan() -> None:
    x = torch.randint(0, 3, (2, 3, 9, 10)).float()  # many ties: the first maximum wins
    x[0, 0, 2, 3] = float("nan")
    values, indices = torch.nn.functional.max_pool2d(x, 3, 2, 1, return_indices=True)
    got_values, got_indices = torch.nn.functional.max_pool2d(x.to("tpu"), 3, 2, 1, return_indices=True)
    torch.testing.assert_close(got_values.cpu(), values, equal_nan=True)
    assert got_indices.dtype == torch.int64
    assert torch.equal(got_indices.cpu(), indices)
