"""What AOTAutograd does around our graphs: input mutations, aliased outputs,
batch norm buffers, compiled optimizer steps, the fused mode."""

import torch
from torch import nn

import tpurec


class Mutating(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.bn = nn.Linear(8, 8), nn.BatchNorm1d(8)

    def forward(self, x):
        h = self.bn(self.lin(x))  # running stats: buffers mutated in place
        h2 = h.clone()
        h2[:, 0] += 1.0  # in-place through a view
        h2.mul_(2)
        return h2, x.view(-1), x.t()  # outputs aliasing the input


def _run(compiled: bool):
    torch.manual_seed(0)
    model = Mutating().to("tpu")
    fn = torch.compile(model, backend="tpu") if compiled else model
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(2)).to("tpu")
    a, b, c = fn(x)
    (a.sum() + b.sum()).backward()
    return [a, b, c, model.bn.running_mean, model.bn.running_var, model.lin.weight.grad], c.stride()


def test_mutations_and_aliases_match_eager():
    eager, eager_stride = _run(False)
    compiled, compiled_stride = _run(True)
    assert compiled_stride == eager_stride
    for got, want in zip(compiled, eager):
        assert got.device.type == "tpu"
        torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-6, atol=1e-6)


def _adam(compiled_step: bool):
    torch.manual_seed(0)
    model = nn.Linear(8, 1).to("tpu")
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    step = torch.compile(optimizer.step, backend="tpu") if compiled_step else optimizer.step
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(2)).to("tpu")
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        step()
        losses.append(loss.item())
    return losses


def test_compiled_optimizer_step():
    eager, compiled = _adam(False), _adam(True)
    for a, b in zip(compiled, eager):
        assert abs(a - b) <= 1e-5 * abs(b), (compiled, eager)


def test_compiled_model_in_fused_mode():
    from compile_models import train

    eager = train("mlp", "tpu", 5, compiled=False)
    with tpurec.mode("fused"):
        compiled = train("mlp", "tpu", 5, compiled=True)
    for a, b in zip(compiled, eager):
        assert abs(a - b) <= 1e-5 * abs(b), (compiled, eager)


class GroupNormHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.gn, self.lin = nn.GroupNorm(2, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.lin(self.gn(x)).logsumexp(-1).sum()


def test_ops_without_lowering_run_through_decompositions():
    # native_group_norm has no lowering: PyTorch's decomposition runs, compiled, and matches CPU.
    torch.manual_seed(0)
    cpu = GroupNormHead()
    tpu = GroupNormHead().to("tpu")
    tpu.load_state_dict(cpu.state_dict())
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(4))
    want = cpu(x)
    want.backward()
    got = torch.compile(tpu, backend="tpu")(x.to("tpu"))
    got.backward()
    torch.testing.assert_close(got.cpu(), want.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(tpu.gn.weight.grad.cpu(), cpu.gn.weight.grad, rtol=1e-5, atol=1e-6)


def test_inference_under_no_grad():
    from compile_models import TransformerBlock, transformer_batch

    torch.manual_seed(0)
    model = TransformerBlock().to("tpu").eval()
    x, y = (t.to("tpu") for t in transformer_batch())
    with torch.no_grad():
        want = model(x, y)
        tpurec.reset_stats()
        compiled = torch.compile(model, backend="tpu")
        got = [compiled(x, y) for _ in range(3)]
    assert tpurec.stats()["cache_hits"] >= 2
    for g in got:
        torch.testing.assert_close(g.cpu(), want.cpu(), rtol=1e-6, atol=1e-7)
