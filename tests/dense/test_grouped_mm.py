"""aten::_grouped_mm through the tpu device against PyTorch's CPU kernel (forward and backward).

PyTorch's CPU kernel needs 16-byte aligned strides, so the shapes compared with it
are multiples of 8 elements; other shapes, which the device takes
too, are compared with a float64 loop of per-group products. Rows (or columns)
past ``offs[-1]`` are left uninitialised by PyTorch and are zero on the device.
"""

from __future__ import annotations

import pytest
import torch

import tpurec
from tpurec.core import accounting

pytestmark = pytest.mark.usefixtures("no_host_fallback")

F32 = dict(rtol=1e-5, atol=1e-5)


def _loop(a, b, offs):
    """The grouped product as explicit per-group float64 matmuls (zeros past offs[-1])."""
    a, b = a.double(), b.double()
    if offs is None:
        return a @ b
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    if a.dim() == 2 and b.dim() == 3:
        out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float64)
        for g, (s, e) in enumerate(zip(starts, ends)):
            out[s:e] = a[s:e] @ b[g]
        return out
    if a.dim() == 3:
        out = torch.zeros(a.shape[1], b.shape[1], dtype=torch.float64)
        for g, (s, e) in enumerate(zip(starts, ends)):
            out[:, s:e] = a[g] @ b[:, s:e]
        return out
    return torch.stack([a[:, s:e] @ b[s:e] for s, e in zip(starts, ends)])


def _offs(ends):
    return None if ends is None else torch.tensor(ends, dtype=torch.int32)


def _on(t):
    return None if t is None else t.to("tpu")


# (mat_a shape, mat_b shape, offs): every layout transformers and the backward use, with an
# empty group and (2D x 3D, 3D x 2D) a tail past offs[-1].
UNALIGNED = [
    ((7, 5), (3, 5, 6), [2, 2, 5]),
    ((3, 5, 6), (6, 9), [4, 4, 8]),
    ((5, 7), (7, 6), [2, 2, 7]),
    ((3, 5, 6), (3, 6, 7), None),
]


@pytest.mark.parametrize("sa, sb, ends", UNALIGNED)
def test_forward_matches_a_per_group_loop(sa, sb, ends):
    torch.manual_seed(0)
    a, b, offs = torch.randn(sa), torch.randn(sb), _offs(ends)
    out = torch._grouped_mm(a.to("tpu"), b.to("tpu"), offs=_on(offs)).cpu()
    torch.testing.assert_close(out.double(), _loop(a, b, offs), **F32)


ALIGNED = [
    ((16, 8), (3, 8, 8), [5, 5, 16]),  # 2D x 3D (the MoE forward)
    ((8, 16), (16, 8), [5, 5, 16]),  # 2D x 2D (its weight gradient)
    ((3, 8, 16), (16, 8), [3, 3, 8]),  # 3D x 2D (the 2D x 2D input gradient)
    ((3, 8, 8), (3, 8, 8), None),  # 3D x 3D
]


@pytest.mark.parametrize("sa, sb, ends", ALIGNED)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, F32), (torch.bfloat16, dict(rtol=1.6e-2, atol=1e-2))])
def test_forward_and_backward_match_the_cpu_kernel(sa, sb, ends, dtype, tol):
    torch.manual_seed(0)
    a = torch.randn(sa, dtype=dtype, requires_grad=True)
    b = torch.randn(sb, dtype=dtype, requires_grad=True)
    offs = _offs(ends)
    out = torch._grouped_mm(a, b, offs=offs)
    grad = torch.randn(out.shape, dtype=dtype)
    out.backward(grad)

    at = a.detach().to("tpu").requires_grad_()
    bt = b.detach().to("tpu").requires_grad_()
    out_t = torch._grouped_mm(at, bt, offs=_on(offs))
    out_t.backward(grad.to("tpu"))
    assert out_t.dtype == dtype and out_t.shape == out.shape
    torch.testing.assert_close(out_t.cpu(), out.detach(), **tol)
    torch.testing.assert_close(at.grad.cpu(), a.grad, **tol)
    torch.testing.assert_close(bt.grad.cpu(), b.grad, **tol)


def test_bfloat16_with_float32_out_dtype_keeps_the_float32_accumulation():
    # PyTorch's CPU kernel refuses out_dtype=float32 for bf16 (CUDA's F.grouped_mm documents it):
    # the reference is the float32 product of the same bf16 values.
    torch.manual_seed(0)
    a, b, offs = torch.randn(12, 8).bfloat16(), torch.randn(3, 8, 8).bfloat16(), _offs([5, 5, 12])
    out = torch._grouped_mm(a.to("tpu"), b.to("tpu"), offs=_on(offs), out_dtype=torch.float32)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), torch._grouped_mm(a.float(), b.float(), offs=offs), **F32)


def _step(a, b, offs, grad, compiled=False):
    fn = lambda x, y, o: torch._grouped_mm(x, y, offs=o)  # noqa: E731
    if compiled:
        fn = torch.compile(fn, backend="tpu")
    at = a.to("tpu").requires_grad_()
    bt = b.to("tpu").requires_grad_()
    out = fn(at, bt, _on(offs))
    out.backward(grad.to("tpu"))
    return out.cpu(), at.grad.cpu(), bt.grad.cpu()


@pytest.mark.parametrize("mode", ["fused", "compiled"])
def test_fused_and_compiled_match_eager_cpu(mode):
    # float32 in compiled mode: PyTorch's meta kernel refuses it (CUDA's bf16-only rule); the
    # device's fake-tensor rule lets Dynamo trace it.
    torch.manual_seed(0)
    a, b, offs = torch.randn(12, 8), torch.randn(3, 8, 4), _offs([4, 4, 12])
    grad = torch.randn(12, 4)
    ac, bc = a.clone().requires_grad_(), b.clone().requires_grad_()
    ref = torch._grouped_mm(ac, bc, offs=offs)
    ref.backward(grad)
    if mode == "fused":
        with tpurec.mode("fused"):
            got = _step(a, b, offs, grad)
    else:
        got = _step(a, b, offs, grad, compiled=True)
    for g, r in zip(got, (ref.detach(), ac.grad, bc.grad)):
        torch.testing.assert_close(g, r, **F32)


def test_new_offsets_reuse_the_compiled_program():
    torch.manual_seed(0)
    a, b = torch.randn(12, 8).to("tpu"), torch.randn(3, 8, 4).to("tpu")
    torch._grouped_mm(a, b, offs=_offs([4, 4, 12]).to("tpu")).cpu()
    built = accounting.stats()["programs_built"]
    for ends in ([0, 6, 12], [12, 12, 12], [1, 2, 3]):
        offs = _offs(ends)
        out = torch._grouped_mm(a, b, offs=offs.to("tpu")).cpu()
        torch.testing.assert_close(out.double(), _loop(a.cpu(), b.cpu(), offs), **F32)
    assert accounting.stats()["programs_built"] == built


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda a, b, o: torch._grouped_mm(a.double(), b.double(), offs=o), "float32, bfloat16 or float16"),
        (lambda a, b, o: torch._grouped_mm(a, b.bfloat16(), offs=o), "of one dtype"),
        (lambda a, b, o: torch._grouped_mm(a, b, offs=o, out_dtype=torch.bfloat16), "out_dtype torch.bfloat16"),
        (lambda a, b, o: torch._grouped_mm(a, b, offs=o.long()), "1D int32"),
        (lambda a, b, o: torch._grouped_mm(a, b), "offs is needed"),
        (lambda a, b, o: torch._grouped_mm(a, b, offs=o, bias=torch.zeros(3, 4, device="tpu")), "bias"),
    ],
)
def test_unsupported_calls_raise_naming_what(call, message):
    a, b, offs = torch.randn(12, 8).to("tpu"), torch.randn(3, 8, 4).to("tpu"), _offs([4, 4, 12]).to("tpu")
    with pytest.raises((RuntimeError, NotImplementedError), match=message):
        call(a, b, offs)


@pytest.mark.slow
def test_tiny_deepseek_v3_trains_one_adamw_step_as_on_cpu():
    """transformers' default experts path (grouped_mm) on the device, against a CPU twin.

    Tolerances: loss and gradients rtol 1e-4 (gradients also atol 1e-6 of their largest
    entry); parameters rtol 1e-4, atol 1e-5 = 1% of lr, because AdamW's first step is
    lr * g / (|g| + 1e-8): entries with |g| below eps turn float32 summation-order noise
    in g (~1e-11 here) into parameter differences of ~1e-6.
    """
    import copy

    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        n_group=1,
        topk_group=1,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    cpu_model = transformers.DeepseekV3ForCausalLM(config)
    assert cpu_model.config._experts_implementation == "grouped_mm"
    dev_model = copy.deepcopy(cpu_model).to("tpu")
    ids = torch.randint(0, 64, (2, 12))

    def step(model, ids):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        grads = {n: p.grad.cpu().clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        return loss.detach().cpu(), grads, {n: p.detach().cpu() for n, p in model.named_parameters()}

    calls = accounting.counters().ops_by_name["_grouped_mm.default"]
    want = step(cpu_model, ids)
    got = step(dev_model, ids.to("tpu"))
    assert accounting.counters().ops_by_name["_grouped_mm.default"] - calls == 6  # 2 forward + 4 backward
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=0)
    assert got[1].keys() == want[1].keys()
    for name, grad in want[1].items():
        named = lambda m, name=name: f"{name}: {m}"  # noqa: E731
        torch.testing.assert_close(got[1][name], grad, rtol=1e-4, atol=1e-6 * float(grad.abs().max()), msg=named)
    for name, param in want[2].items():
        named = lambda m, name=name: f"{name}: {m}"  # noqa: E731
        torch.testing.assert_close(got[2][name], param, rtol=1e-4, atol=1e-5, msg=named)
