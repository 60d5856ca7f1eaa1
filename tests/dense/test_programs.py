"""Whole programs on CPU under ``LoweringChecker``: an MLP, a DLRM-style dense
arch with dot interaction, a transformer block (forward and backward), the
torch.optim foreach steps, plus ops that OpInfo samples never reach through
dispatch (in-place random ops, factories, composite-implicit ops)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dense_harness import DEFAULT_TOL, TRANSCENDENTAL_TOL, LoweringChecker
from tpurec.dense.registry import call_lowering

aten = torch.ops.aten


def run_checked(fn, must=(), tol=TRANSCENDENTAL_TOL):
    """Runs ``fn`` under the checker; fails on any mismatch or unreached op."""
    checker = LoweringChecker(tol=tol)
    with checker:
        fn()
    failures = [f"{r.op}: {r.message}" for r in checker.records if not r.ok]
    assert not failures, "\n".join(failures[:10])
    reached = {r.op for r in checker.records}
    missing = [str(m) for m in must if m not in reached]
    assert not missing, f"never reached: {missing}"
    return reached


def _mlp_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.Sigmoid(), nn.Linear(4, 1))
    x, y = torch.randn(5, 8), torch.rand(5, 1)
    loss = F.binary_cross_entropy_with_logits(model(x), y)
    loss.backward()


def test_mlp_forward_backward():
    run_checked(
        _mlp_step,
        must=[
            aten.addmm.default,
            aten.mm.default,
            aten.threshold_backward.default,
            aten.sigmoid_backward.default,
            aten.binary_cross_entropy_with_logits.default,
        ],
    )


def test_dlrm_dense_and_interaction():
    def step():
        torch.manual_seed(0)
        bottom = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        top = nn.Sequential(nn.Linear(8 + 6, 8), nn.ReLU(), nn.Linear(8, 1))
        dense = torch.randn(3, 4)
        emb = torch.randn(3, 3, 8, requires_grad=True)  # 3 sparse features
        d = bottom(dense)
        t = torch.cat([d.unsqueeze(1), emb], dim=1)  # (B, 4, 8)
        z = torch.bmm(t, t.transpose(1, 2))
        li, lj = torch.tril_indices(4, 4, offset=-1)
        inter = z[:, li, lj]
        out = top(torch.cat([d, inter], dim=1))
        F.binary_cross_entropy_with_logits(out, torch.rand(3, 1)).backward()

    run_checked(step, must=[aten.bmm.default, aten.cat.default, aten.index.Tensor])


def test_transformer_block():
    def step():
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(
            d_model=16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True, activation="gelu"
        )
        x = torch.randn(2, 5, 16)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            y = layer(x)
        F.cross_entropy(y.reshape(-1, 16), torch.randint(0, 16, (10,))).backward()

    run_checked(
        step,
        must=[
            aten._safe_softmax.default,
            aten._softmax_backward_data.default,
            aten.native_layer_norm.default,
            aten.native_layer_norm_backward.default,
            aten.gelu_backward.default,
            aten.bmm.default,
            aten._log_softmax.default,
            aten.nll_loss_forward.default,
            aten.nll_loss_backward.default,
        ],
    )


@pytest.mark.parametrize(
    "name,make",
    [
        ("sgd", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01, foreach=True)),
        ("adam", lambda p: torch.optim.Adam(p, lr=0.01, foreach=True)),
        ("adamw", lambda p: torch.optim.AdamW(p, lr=0.01, amsgrad=True, foreach=True)),
        ("adagrad", lambda p: torch.optim.Adagrad(p, lr=0.01, foreach=True)),
    ],
)
def test_optimizer_foreach_step(name, make):
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(3))]
    opt = make(params)

    def steps():
        for _ in range(2):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()

    reached = run_checked(steps)
    assert any("_foreach_" in str(op) for op in reached), reached


def test_foreach_overloads():
    torch.manual_seed(0)
    xs = [torch.rand(3) + 0.5, torch.rand(2, 2) + 0.5]
    ys = [torch.rand(3) + 0.5, torch.rand(2, 2) + 0.5]

    def calls():
        torch._foreach_add(xs, ys, alpha=2)
        torch._foreach_add(xs, 1.5)
        torch._foreach_add(xs, [1.0, 2.0])
        torch._foreach_add(xs, torch.tensor(0.5))
        torch._foreach_sub(xs, ys)
        torch._foreach_mul(xs, ys)
        torch._foreach_mul(xs, torch.tensor(3.0))
        torch._foreach_div(xs, ys)
        torch._foreach_div(xs, [2.0, 4.0])
        torch._foreach_pow(xs, 2.0)
        torch._foreach_pow(xs, ys)
        torch._foreach_pow(2.0, xs)
        torch._foreach_maximum(xs, ys)
        torch._foreach_maximum(xs, 0.9)
        torch._foreach_minimum(xs, ys)
        torch._foreach_clamp_min(xs, 0.7)
        torch._foreach_clamp_max(xs, 0.7)
        torch._foreach_addcmul(xs, ys, ys, value=0.5)
        torch._foreach_addcdiv(xs, ys, xs, [0.5, 0.25])
        torch._foreach_addcdiv(xs, ys, xs, torch.tensor([0.5, 0.25]))
        torch._foreach_lerp(xs, ys, 0.3)
        torch._foreach_lerp(xs, ys, ys)
        torch._foreach_sqrt(xs)
        torch._foreach_neg(xs)
        torch._foreach_exp(xs)
        torch._foreach_sign(xs)
        torch._foreach_reciprocal(xs)
        torch._foreach_norm(xs)
        torch._foreach_norm(xs, float("inf"))
        torch._foreach_max(xs)

    reached = run_checked(calls)
    assert sum("_foreach_" in str(op) for op in reached) >= 25, reached


def test_inplace_and_masked_assignment():
    def calls():
        x = torch.randn(4, 5)
        x[x > 0] = 0.0  # index_put_ with a bool mask
        x.masked_fill_(x < -1, 2.0)
        x.add_(torch.ones(5), alpha=3)
        x.clamp_(min=-0.5)
        y = torch.randn(4, 5)
        y[:, torch.tensor([0, 2])] = torch.randn(4, 2)
        y.index_put_((torch.tensor([1, 1, 3]),), torch.randn(3, 5), accumulate=True)
        y[torch.tensor([0, 3]), torch.tensor([1, 2])]

    run_checked(calls, must=[aten.index_put.default, aten.masked_fill.Scalar, aten.add.Tensor, aten.index.Tensor])


def test_ops_not_reached_by_opinfo():
    def calls():
        t = torch.rand(3, 4) + 0.1
        aten.pow.Scalar(2.0, t)
        aten.rsub.Scalar(t, 1.5)
        aten.sort.stable(torch.tensor([3, 1, 2, 1, 3]), stable=True, descending=True)
        aten.linalg_vector_norm.default(t - 0.5, 3.0, [1])
        aten.linalg_vector_norm.default(t - 0.5, 0.0)
        aten.linalg_vector_norm.default(t - 0.5, float("-inf"), [0], True)
        aten.sum.default(t.to(torch.bfloat16), dtype=torch.float32)
        aten.mean.dim(t.to(torch.bfloat16), [0], True)
        aten.where.ScalarOther(t > 0.5, t, 0.0)
        aten._to_copy.default(t, dtype=torch.bfloat16)
        aten._to_copy.default(t * 10, dtype=torch.int32)
        aten.div.Tensor(torch.tensor([3, -7]), torch.tensor([2, 2]))
        aten.add.Tensor(torch.tensor([1, 2], dtype=torch.int32), torch.tensor(2.5, dtype=torch.float64))
        aten.mul.Tensor(torch.tensor([1, 2], dtype=torch.int64), 1.5)
        aten.eq.Scalar(torch.tensor([1, 2]), 2)
        aten.cumsum.default(torch.tensor([True, False, True]), 0)
        aten.embedding_dense_backward.default(torch.randn(2, 3, 4), torch.tensor([[0, 1, 1], [4, 0, 2]]), 5, 0, True)
        aten.nll_loss_forward.default(
            torch.randn(4, 3).log_softmax(1), torch.tensor([0, 2, -100, 1]), torch.rand(3), 1, -100
        )
        aten.nll_loss2d_forward.default(torch.randn(2, 3, 2, 2), torch.randint(0, 3, (2, 2, 2)), None, 2, -100)
        aten.native_dropout_backward.default(torch.randn(3), torch.tensor([True, False, True]), 2.0)
        aten.addmm.default(torch.full((2, 2), float("nan")), torch.randn(2, 3), torch.randn(3, 2), beta=0)
        aten._addmm_activation.default(torch.randn(2), torch.randn(2, 3), torch.randn(3, 2), use_gelu=True)

    run_checked(
        calls,
        must=[
            aten.pow.Scalar,
            aten.rsub.Scalar,
            aten.sort.stable,
            aten.nll_loss2d_forward.default,
            aten._addmm_activation.default,
        ],
    )


def test_factories():
    def calls():
        torch.arange(5)
        torch.arange(1, 4)
        torch.arange(0.0, 1.0, 0.3)
        torch.arange(10, 0, -3)
        torch.arange(0, 1, 0.1, dtype=torch.float32)
        torch.linspace(-1, 1, 7)
        torch.linspace(0, 10, 1)
        torch.eye(3, 5, dtype=torch.int64)
        torch.full((2, 3), 7)
        torch.full((2,), True)
        torch.full((2,), 1.5, dtype=torch.bfloat16)
        torch.zeros(2, 3, dtype=torch.int32)
        torch.ones(4)
        torch.scalar_tensor(3)
        x = torch.randn(2, 3)
        x.new_ones((2,))
        torch.full_like(x, 2, dtype=torch.int64)
        x.fill_(3.0)
        x.zero_()

    run_checked(
        calls,
        must=[
            aten.arange.default,
            aten.arange.start,
            aten.arange.start_step,
            aten.linspace.default,
            aten.eye.m,
            aten.full.default,
            aten.fill.Scalar,
            aten.zero.default,
        ],
        tol=DEFAULT_TOL,
    )


@pytest.mark.parametrize(
    "op,args,kwargs",
    [
        # CompositeImplicit on CPU: these never reach a dispatch mode, but the
        # runtime may still see them (its own dispatch key), so check them directly.
        (aten.isfinite.default, (torch.tensor([1.0, float("inf"), float("nan")]),), {}),
        (aten.one_hot.default, (torch.tensor([0, 2, 1]), 4), {}),
        (aten.repeat_interleave.self_int, (torch.arange(6.0).reshape(2, 3), 2, 1), {}),
        (aten.repeat_interleave.self_Tensor, (torch.arange(3.0), torch.tensor([1, 0, 2])), {"output_size": 3}),
    ],
    ids=lambda v: str(v) if isinstance(v, torch._ops.OpOverload) else "",
)
def test_composite_ops_direct(op, args, kwargs):
    ref = op(*args, **kwargs)
    LoweringChecker()._compare(op, ref, call_lowering(op, args, kwargs))
