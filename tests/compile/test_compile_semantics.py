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


def test_compiled_optimizer_step_writes_its_inputs_without_eager_copies():
    # The parameters' and the state's updates stay in the graph (keep_inference_input_mutations):
    # the backend stores them, instead of AOTAutograd's epilogue running one eager copy_ per update.
    torch.manual_seed(0)
    model = nn.Linear(8, 3).to("tpu")
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    step = torch.compile(optimizer.step, backend="tpu")
    reference = nn.Linear(8, 3).to("tpu")
    reference.load_state_dict(model.state_dict())
    reference_optimizer = torch.optim.Adagrad(reference.parameters(), lr=0.1)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(2)).to("tpu")
    for i in range(3):
        for m, opt in ((model, optimizer), (reference, reference_optimizer)):
            opt.zero_grad()
            m(x).square().mean().backward()
        before = dict(tpurec.stats()["ops_by_name"])
        step()
        if i:  # after the first call (Dynamo's capture runs the optimizer's eager code once)
            after = tpurec.stats()["ops_by_name"]
            assert after.get("copy_.default", 0) == before.get("copy_.default", 0), "an eager copy_ per update"
        reference_optimizer.step()
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(optimizer.state[got]["sum"].cpu(), reference_optimizer.state[want]["sum"].cpu())
        assert float(optimizer.state[got]["step"].cpu()) == 3.0


def test_compiled_mutation_of_a_view_input_writes_through_the_view():
    def bump(x, y):
        x.add_(y)
        return x.sum()

    compiled = torch.compile(bump, backend="tpu")
    for fn in (bump, compiled):
        base = torch.arange(12.0).reshape(3, 4).to("tpu")
        view = base[1:, ::2]
        total = fn(view, torch.ones(2, 2).to("tpu"))
        want = torch.arange(12.0).reshape(3, 4)
        want[1:, ::2] += 1
        assert torch.equal(base.cpu(), want)
        assert float(total.cpu()) == float(want[1:, ::2].sum())
        assert view._version >= 1
