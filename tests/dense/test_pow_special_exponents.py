"""``pow`` with a Python number exponent of 1, 2, 3, -1, -2, 0.5 or -0.5: a small program of its own.

Those exponents (``transcendental.SPECIAL_EXPONENTS``) travel as static values, so that an RMSNorm's
``x.pow(2)`` compiles to a product, not to the general case (``2 ** (y log2 x)`` in pairs of float32
numbers, about 400 StableHLO operations per call, 70% of a small Llama's fused training step); every
other exponent is still a runtime scalar that one program serves. Checked through the tpu device
in eager, fused and compiled mode: the values (bit for bit those of the general case, and PyTorch
CPU's), the program sizes, and which calls share a program.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
import torch

import tpurec
from tpurec.core import runtime

_SPECIAL = (1, 2, 3, -1, -2, 0.5, -0.5, 2.0, -1.0)
_EDGES = [0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 0.5, 1e-30, -1e-30, 1e30, -1e30, 3.4e38, float("inf"), float("-inf")]
_EDGES += [float("nan"), 1.0000001, 0.9999999, 7.25, -7.25, 1e-19, 1.1e-19]
_OPERATION = re.compile(r"^\s*(?:%\S+(?:, %\S+)* = )?\"?(stablehlo\.[a-z_]+)", re.M)


def _lowered_texts(monkeypatch) -> list[str]:
    """Collects the StableHLO text of every program compiled from now on (its first run)."""
    texts: list[str] = []
    execute = runtime.Program._execute

    def observed(self, jitted, args):
        if not self.ran:
            specs = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x, args
            )
            texts.append(jitted.lower(*specs).as_text())
        return execute(self, jitted, args)

    monkeypatch.setattr(runtime.Program, "_execute", observed)
    return texts


def _operations(text: str) -> int:
    return len(_OPERATION.findall(text))


def test_a_fused_rmsnorm_step_holds_no_general_power(monkeypatch) -> None:
    # An RMSNorm's forward and backward (x.pow(2), and pow_backward's x.pow(1)) in one fused window:
    # before, each pow compiled the general case (exp and log2 in pairs, ~400 operations): 1800+ here.
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    weight = torch.rand(16, generator=torch.Generator().manual_seed(1)) + 0.5
    leaf = x.clone().requires_grad_()
    (leaf * torch.rsqrt(leaf.pow(2).mean(-1, keepdim=True) + 1e-6) * weight).sum().backward()
    texts = _lowered_texts(monkeypatch)
    on_tpu = x.to("tpu").requires_grad_()
    with tpurec.mode("fused"):
        (on_tpu * torch.rsqrt(on_tpu.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.to("tpu")).sum().backward()
    assert on_tpu.grad is not None and leaf.grad is not None
    torch.testing.assert_close(on_tpu.grad.cpu(), leaf.grad, rtol=1e-4, atol=1e-5)
    (window,) = [t for t in texts if "jit_fused" in t]
    assert _operations(window) < 200, f"{_operations(window)} StableHLO operations in the RMSNorm step's program"


@pytest.mark.parametrize("exponent", _SPECIAL, ids=repr)
def test_special_exponents_equal_the_general_case_bit_for_bit(exponent) -> None:
    x = torch.tensor(_EDGES + list(np.linspace(-3, 3, 25)), dtype=torch.float32)
    static = x.to("tpu").pow(exponent).cpu()
    general = x.to("tpu").pow(torch.tensor(float(exponent), device="tpu")).cpu()  # a runtime exponent
    assert torch.equal(static.view(torch.int32), general.view(torch.int32)), (static, general)
    expected = x.pow(exponent)
    # Against CPU where x is finite and normal, and so is the result (the device flushes numbers below
    # float32's normal range to zero; at -inf and -0 the general case is C's pow, CPU's sqrt and rsqrt not).
    tiny = torch.finfo(torch.float32).tiny
    normal = (x.abs() >= tiny) & x.isfinite() & ((expected.abs() >= tiny) | expected.isinf())
    torch.testing.assert_close(static[normal], expected[normal], rtol=2e-7, atol=0, equal_nan=True)


def test_exponents_in_turn_each_get_their_power_and_others_share_one_program() -> None:
    x = torch.linspace(0.25, 4, 16)
    on_tpu = x.to("tpu")
    for exponent in (2, 3, 0.5, 2, -1, 2.5, 1.5, 3):  # the fast path must not reuse 2's program for 3
        torch.testing.assert_close(on_tpu.pow(exponent).cpu(), x.pow(exponent), rtol=2e-7, atol=0)
        torch.testing.assert_close((on_tpu**exponent).cpu(), x**exponent, rtol=2e-7, atol=0)
    tpurec.reset_stats()
    for exponent in (1.25, -0.75, 7.0):
        torch.testing.assert_close(on_tpu.pow(exponent).cpu(), x.pow(exponent), rtol=2e-7, atol=0)
    assert tpurec.stats()["compile_requests"] == 0  # other exponents: 2.5's program, a runtime scalar
    in_place = on_tpu.clone()
    in_place.pow_(2)
    in_place.pow_(0.5)
    torch.testing.assert_close(in_place.cpu(), x.pow(2).pow(0.5), rtol=2e-7, atol=0)


def test_integer_and_float64_bases_keep_their_paths() -> None:
    ints = torch.arange(-4, 5)
    for exponent in (2, 3, 1):
        assert torch.equal(ints.to("tpu").pow(exponent).cpu(), ints.pow(exponent))
    wide = torch.linspace(-3, 3, 13, dtype=torch.float64)
    for exponent in (2, 0.5, -1, 2.5):
        torch.testing.assert_close(wide.to("tpu").pow(exponent).cpu(), wide.pow(exponent), equal_nan=True)
    half = torch.linspace(0.5, 3, 11, dtype=torch.bfloat16)
    for exponent in (2, -0.5, 1.5):
        torch.testing.assert_close(half.to("tpu").pow(exponent).cpu(), half.pow(exponent))


def test_compiled_graph_with_special_and_other_exponents() -> None:
    def f(t):
        return t.pow(2) + t.pow(0.5) * t.pow(2.5) - t**-2

    x = torch.linspace(0.5, 3, 12)
    compiled = torch.compile(f, backend="tpu")
    torch.testing.assert_close(compiled(x.to("tpu")).cpu(), f(x), rtol=1e-6, atol=1e-6)
