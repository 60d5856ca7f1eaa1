"""Graph breaks, dynamic batch dims, errors, registration."""

import logging

import pytest
import torch
from torch import nn

import tpurec
from compile_models import MLP, mlp_batch


def _grads(model):
    return [p.grad.cpu().clone() for p in model.parameters()]


def _run(model_fn, compiled: bool, *inputs):
    torch.manual_seed(0)
    model = model_fn().to("tpu")
    fn = torch.compile(model, backend="tpu") if compiled else model
    out = fn(*(t.to("tpu") for t in inputs))
    out.sum().backward()
    return out.detach().cpu(), _grads(model)


def _assert_same(a, b):
    (out_a, grads_a), (out_b, grads_b) = a, b
    torch.testing.assert_close(out_a, out_b, rtol=1e-6, atol=1e-7)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-7)


class PrintInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 8), nn.Linear(8, 1)

    def forward(self, x):
        h = torch.relu(self.a(x))
        print("hidden", h[0, :2])  # graph break: runs eagerly on tpu
        return self.b(h)


class ItemInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 8), nn.Linear(8, 1)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        scale = h.abs().max().item()  # data-dependent Python float: graph break
        return self.b(h / (scale + 1.0))


@pytest.mark.parametrize("model_fn", [PrintInForward, ItemInForward])
def test_graph_breaks_fall_back_to_eager(model_fn, capsys):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
    _assert_same(_run(model_fn, True, x), _run(model_fn, False, x))


def test_mark_dynamic_batch_recompiles_with_logged_reason(caplog):
    torch.manual_seed(0)
    model = MLP().to("tpu")
    reference = MLP().to("tpu")
    reference.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="tpu")
    sizes = [8, 16, 24, 8, 16]
    with caplog.at_level(logging.WARNING, logger="tpurec.compile"):
        for i, n in enumerate(sizes):
            x, y = (t.to("tpu") for t in mlp_batch(n, seed=n))
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(y, 0)
            if i == 3:
                tpurec.reset_stats()
            got = compiled(x, y)
            want = reference(x, y)
            got.backward()
            want.backward()
            torch.testing.assert_close(got.cpu(), want.detach().cpu(), rtol=1e-6, atol=1e-7)
            for p, q in zip(model.parameters(), reference.parameters()):
                torch.testing.assert_close(p.grad.cpu(), q.grad.cpu(), rtol=1e-5, atol=1e-7)
                p.grad = q.grad = None
        revisit = tpurec.stats()
    reasons = [r.getMessage() for r in caplog.records if "recompiling" in r.getMessage()]
    # forward and backward each rebuilt for batch 16 and 24; the revisits of 8 and 16 reuse programs
    assert len(reasons) == 4, reasons
    assert "a dynamic dim took a new value: input" in reasons[0]
    assert revisit["compilations"] == 0, revisit


def test_backend_is_registered():
    assert "tpu" in torch._dynamo.list_backends()


class Unsupported(nn.Module):
    def forward(self, x):
        return torch.linalg.ldl_factor(x).LD + 1


def test_unsupported_op_error_names_op_and_user_line():
    compiled = torch.compile(Unsupported(), backend="tpu")
    with pytest.raises(Exception) as info:
        compiled(torch.randn(4, 4, device="tpu"))
    text = str(info.value)
    assert "linalg_ldl_factor_ex" in text
    assert "torch.linalg.ldl_factor(x).LD + 1" in text
