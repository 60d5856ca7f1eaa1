"""The native XLA:CPU batched matmul (tpurec/native/matmul_cpu.cc) behind aten.bmm.

Checked through the tpu device (eager, fused, compiled) against PyTorch CPU on the
same inputs, with every transposed-operand case the kernel folds. Tolerance: rtol
1e-5, atol 1e-5 (float32 sums of at most 80 products; the kernel adds in k order
with fused multiply-adds, PyTorch's BLAS in its own order).
"""

from __future__ import annotations

import gc
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tpurec
from tpurec.dense import native_matmul
from tpurec.dense.trace_context import traced_as_spmd, transpose, transposed_from

RTOL = ATOL = 1e-5

# (batch, m, k, n): DLRM's interaction shape, ragged edges of the 3 x 32 tiles and of the 8 x 8
# blocks a transposed op(b) is packed in, op(b) read in place (n a multiple of 32), empty dims.
SHAPES = [
    (16, 27, 64, 27),
    (3, 5, 7, 33),
    (2, 1, 1, 1),
    (4, 9, 16, 16),
    (3, 7, 5, 64),
    (3, 4, 13, 19),
    (2, 0, 3, 2),
    (2, 3, 0, 2),
    (0, 3, 4, 5),
]


def _operand(shape, transposed: bool, generator) -> torch.Tensor:
    """A CPU tensor of ``shape``; ``transposed``: a transposed view of a contiguous tensor."""
    if transposed:
        return torch.randn(shape[0], shape[2], shape[1], generator=generator).transpose(1, 2)
    return torch.randn(*shape, generator=generator)


@pytest.fixture
def native_calls(monkeypatch):
    """The (trans_a, trans_b) of every native kernel call traced during the test."""
    from tpurec.core import fused, runtime

    runtime.programs.clear()  # every program of the test is traced (and counted) afresh
    fused.clear_programs()
    calls = []
    real = native_matmul._call

    def counting(a, b, trans_a, trans_b):
        calls.append((trans_a, trans_b))
        return real(a, b, trans_a, trans_b)

    monkeypatch.setattr(native_matmul, "_call", counting)
    return calls


def _device_bmm(a: torch.Tensor, b: torch.Tensor, mode: str):
    """bmm and its gradients on tpu, in ``mode``; operands keep their (transposed) layouts."""
    with tpurec.mode("eager" if mode == "compiled" else mode):
        leaf_a = a.detach().to("tpu").requires_grad_()  # .to keeps a transposed layout's strides
        leaf_b = b.detach().to("tpu").requires_grad_()
        if mode == "compiled":
            torch._dynamo.reset()  # each shape compiles afresh (static shapes, no recompile limit)
        fn = torch.compile(torch.bmm, backend="tpu", fullgraph=True) if mode == "compiled" else torch.bmm
        out = fn(leaf_a, leaf_b)
        out.backward(torch.ones_like(out))
        return out.cpu(), leaf_a.grad.cpu(), leaf_b.grad.cpu()


@pytest.mark.parametrize("mode", ["eager", "fused", "compiled"])
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bmm_through_device_matches_pytorch(shape, trans_a, trans_b, mode, native_calls):
    batch, m, k, n = shape
    g = torch.Generator().manual_seed(sum(shape))
    a = _operand((batch, m, k), trans_a, g).requires_grad_()
    b = _operand((batch, k, n), trans_b, g).requires_grad_()
    ref = torch.bmm(a, b)
    ref.backward(torch.ones_like(ref))
    out, grad_a, grad_b = _device_bmm(a, b, mode)
    torch.testing.assert_close(out, ref.detach(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(grad_a, a.grad, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(grad_b, b.grad, rtol=RTOL, atol=ATOL)
    assert native_calls, "aten.bmm did not reach the native kernel"
    if mode != "compiled" and batch and min(m, k, n) > 1:
        # Eager and fused read the operands' own transposed views: the kernel reads the
        # source with its flag instead of a copy (a view with a size-1 dim is contiguous).
        assert native_calls[0] == (trans_a, trans_b)


def test_baddbmm_through_device(native_calls):
    g = torch.Generator().manual_seed(0)
    x, a, b = torch.randn(8, 5, 6, generator=g), torch.randn(8, 5, 7, generator=g), torch.randn(8, 7, 6, generator=g)
    ref = torch.baddbmm(x, a, b, beta=0.5, alpha=2.0)
    out = torch.baddbmm(x.to("tpu"), a.to("tpu"), b.to("tpu"), beta=0.5, alpha=2.0).cpu()
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)
    assert native_calls


def test_other_dtypes_and_large_matrices_keep_xlas_dot(native_calls):
    g = torch.Generator().manual_seed(0)
    a64, b64 = (
        torch.randn(4, 3, 5, dtype=torch.float64, generator=g),
        torch.randn(4, 5, 2, dtype=torch.float64, generator=g),
    )
    torch.testing.assert_close(torch.bmm(a64.to("tpu"), b64.to("tpu")).cpu(), torch.bmm(a64, b64))
    big_a, big_b = (
        torch.randn(2, 8, 512, generator=g),
        torch.randn(2, 512, 256, generator=g),
    )  # K * N above the panel limit
    torch.testing.assert_close(
        torch.bmm(big_a.to("tpu"), big_b.to("tpu")).cpu(), torch.bmm(big_a, big_b), rtol=1e-4, atol=1e-4
    )
    assert native_calls == []


def test_jax_gradients_of_the_kernel_match_jnp():
    rng = np.random.default_rng(0)
    for trans_a in (False, True):
        for trans_b in (False, True):
            a = jnp.asarray(rng.standard_normal((3, 6, 4) if trans_a else (3, 4, 6)), jnp.float32)
            b = jnp.asarray(rng.standard_normal((3, 5, 6) if trans_b else (3, 6, 5)), jnp.float32)
            cot = jnp.asarray(rng.standard_normal((3, 4, 5)), jnp.float32)

            def reference(a, b, trans_a=trans_a, trans_b=trans_b):
                a = jnp.swapaxes(a, 1, 2) if trans_a else a
                b = jnp.swapaxes(b, 1, 2) if trans_b else b
                return jnp.sum(jnp.matmul(a, b, precision="highest") * cot)

            def native(a, b, trans_a=trans_a, trans_b=trans_b):
                return jnp.sum(native_matmul.batched_matmul(a, b, trans_a, trans_b) * cot)

            for got, want in zip(jax.grad(native, (0, 1))(a, b), jax.grad(reference, (0, 1))(a, b)):
                np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 3),
    m=st.integers(1, 40),
    k=st.integers(1, 70),
    n=st.integers(1, 70),
    trans_a=st.booleans(),
    trans_b=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_kernel_matches_numpy_on_random_shapes(batch, m, k, n, trans_a, trans_b, seed):
    """Every tile and packing edge (rows mod 3, columns mod 32, 8 x 8 blocks) against float64 numpy."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((batch, k, m) if trans_a else (batch, m, k)).astype(np.float32)
    b = rng.standard_normal((batch, n, k) if trans_b else (batch, k, n)).astype(np.float32)
    want = np.matmul(np.swapaxes(a, 1, 2) if trans_a else a, np.swapaxes(b, 1, 2) if trans_b else b, dtype=np.float64)
    got = native_matmul.batched_matmul(jnp.asarray(a), jnp.asarray(b), trans_a, trans_b)
    np.testing.assert_allclose(np.asarray(got), want, rtol=RTOL, atol=ATOL * 2)


def test_transposed_operand_is_not_materialized():
    x = jnp.ones((8, 27, 64), jnp.float32)
    text = jax.jit(lambda x: native_matmul.bmm(x, transpose(x, (0, 2, 1)), jnp.matmul)).lower(x).as_text()
    assert "tpurec_batched_matmul" in text and "transpose" not in text


def test_transpose_of_a_product_is_the_swapped_product():
    """Autograd transposes bmm's gradient for a transposed operand: that is one product, not a copy."""
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((4, 5, 6)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((4, 6, 7)), jnp.float32)
    program = jax.jit(lambda a, b: transpose(native_matmul.bmm(a, b, jnp.matmul), (0, 2, 1)))
    hlo = program.lower(a, b).compile().as_text()
    assert hlo.count('custom_call_target="tpurec_batched_matmul"') == 1 and " transpose(" not in hlo
    want = np.swapaxes(np.matmul(np.asarray(a), np.asarray(b), dtype=np.float64), 1, 2)
    np.testing.assert_allclose(np.asarray(program(a, b)), want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("mode", ["eager", "fused", "compiled"])
def test_transposed_view_of_a_product_through_device(mode):
    g = torch.Generator().manual_seed(3)
    a, b, c = torch.randn(3, 5, 6, generator=g), torch.randn(3, 6, 7, generator=g), torch.randn(3, 7, 5, generator=g)

    def f(a, b, c):
        return torch.bmm(a, b).transpose(1, 2) + c

    ref = f(a, b, c)
    fn = torch.compile(f, backend="tpu") if mode == "compiled" else f
    with tpurec.mode("fused" if mode == "compiled" else mode):
        out = fn(a.to("tpu"), b.to("tpu"), c.to("tpu")).cpu()
    torch._dynamo.reset()
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)


def test_export_for_tpu_keeps_xlas_dot():
    x = jnp.ones((8, 27, 64), jnp.float32)
    exported = jax.export.export(
        jax.jit(lambda x: native_matmul.bmm(x, jnp.swapaxes(x, 1, 2), jnp.matmul)), platforms=["tpu"]
    )(x)
    text = exported.mlir_module()
    assert "tpurec_batched_matmul" not in text and "dot_general" in text


def test_spmd_programs_keep_xlas_dot():
    a = jnp.ones((8, 4, 4), jnp.float32)
    assert native_matmul.applies(a, a)
    seen = []
    jax.jit(traced_as_spmd(lambda x: seen.append(native_matmul.applies(x, x)) or x)).lower(a)
    assert seen == [False]
    assert native_matmul.applies(a, a)  # only while such a program is traced


def test_remembered_transposes_are_forgotten_with_their_value():
    x = jnp.arange(24.0).reshape(2, 3, 4)
    y = transpose(x, (0, 2, 1))
    assert transposed_from(y)[0] is x and transposed_from(y)[1] == (0, 2, 1)
    assert transposed_from(x) is None and transpose(x, (0, 1, 2)) is x
    assert transpose(y, (0, 2, 1)) is x  # the two cancel: the source itself
    z = transpose(transpose(x, (1, 0, 2)), (0, 2, 1))
    assert transposed_from(z)[0] is x and z.shape == jnp.transpose(x, transposed_from(z)[1]).shape
    np.testing.assert_array_equal(z, jnp.transpose(jnp.transpose(x, (1, 0, 2)), (0, 2, 1)))
    from tpurec.dense import trace_context

    del z
    gc.collect()
    before = len(trace_context._TRANSPOSES)
    del y
    gc.collect()
    assert len(trace_context._TRANSPOSES) == before - 1


@pytest.mark.parametrize("how", ["environment", "python"])
@pytest.mark.parametrize("mode", ["eager", "fused", "compiled"])
def test_switching_the_kernel_off_between_two_calls_runs_the_program_of_the_new_setting(mode, how, monkeypatch):
    """``TPUREC_NATIVE_MATMUL`` changes the traced program, so it is part of the program cache key:
    after a switch the next call traces the product again with the new setting, and switching
    back reuses the first program."""
    from tpurec import config
    from tpurec.core import fused, runtime

    runtime.programs.clear()
    fused.clear_programs()
    torch._dynamo.reset()
    traced = []  # what each trace of aten.bmm's lowering decided: native kernel or XLA's dot
    real = native_matmul.applies

    def recording(a, b):
        traced.append(real(a, b))
        return traced[-1]

    monkeypatch.setattr(native_matmul, "applies", recording)
    monkeypatch.delenv("TPUREC_NATIVE_MATMUL", raising=False)

    def switch(on: bool) -> None:
        if how == "environment":
            monkeypatch.setenv("TPUREC_NATIVE_MATMUL", "1" if on else "0")
        else:
            config.update("TPUREC_NATIVE_MATMUL", on)

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 3, 5, generator=g), torch.randn(4, 5, 2, generator=g)
    ta, tb = a.to("tpu"), b.to("tpu")
    fn = torch.compile(torch.bmm, backend="tpu", fullgraph=True) if mode == "compiled" else torch.bmm

    def run() -> torch.Tensor:
        with tpurec.mode("eager" if mode == "compiled" else mode), torch.no_grad():
            return fn(ta, tb).cpu()

    try:
        torch.testing.assert_close(run(), torch.bmm(a, b), rtol=RTOL, atol=ATOL)
        first = len(traced)  # fused mode traces the product twice: its op program, then the window
        assert first and all(traced)
        switch(False)
        torch.testing.assert_close(run(), torch.bmm(a, b), rtol=RTOL, atol=ATOL)
        assert len(traced) > first, "the program traced with the native kernel ran after it was switched off"
        assert not any(traced[first:])
        second = len(traced)
        switch(True)
        torch.testing.assert_close(run(), torch.bmm(a, b), rtol=RTOL, atol=ATOL)
        assert len(traced) == second, "switching back should reuse the first program"
    finally:
        config.update("TPUREC_NATIVE_MATMUL", None)
