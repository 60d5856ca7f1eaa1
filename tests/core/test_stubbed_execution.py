"""Stubbed execution (tpurec/core/stubs.py): a step's host cost measured without its computation.

``tpurec.core.stubbed_execution()`` makes every program return outputs of the real shapes and
dtypes without computing them, so ``bench modes`` / ``bench transformer`` can time what the
host needs to issue a step. What it must keep: the real programs' calling path (shapes,
dtypes, strides of the tensors made), work pending on entry run for real, real results
again once it ends, one compilation per stub.
"""

import torch

import tpurec
from tpurec.core import stubs


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 5, generator=g), torch.randn(5, 3, generator=g)


def test_eager_ops_under_stubs_give_the_real_metadata_and_zeros_then_real_values_again():
    a, w = _inputs()
    ta, tw = a.to("tpu"), w.to("tpu")
    with tpurec.mode("eager"):
        with stubs.stubbed_execution():
            assert stubs.execution_stubbed()
            mm = ta @ tw
            mask = ta > 0
            index = ta.argmax(dim=1)
            half = ta.to(torch.float16).t()
        assert not stubs.execution_stubbed()
        real = ta @ tw
    assert mm.shape == (6, 3) and mm.dtype == torch.float32
    minus_inf = torch.full((2, 3), float("-inf")).to("tpu")
    with stubs.stubbed_execution():
        masked = minus_inf + ta[:2, :3]  # an inf first input: the stub's zeros stay zeros
    assert masked.cpu().eq(0).all()
    assert mask.dtype == torch.bool and index.dtype == torch.int64 and index.shape == (6,)
    assert half.shape == (5, 6) and half.stride() == (1, 5) and half.dtype == torch.float16
    assert not mm.cpu().any() and not mask.cpu().any() and not index.cpu().any() and not half.cpu().any()
    torch.testing.assert_close(real.cpu(), a @ w, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ta.cpu(), a)  # the inputs were only read


def test_pending_fused_work_runs_for_real_before_the_stubs_and_recorded_work_as_stubs_after():
    a, w = _inputs()
    ta, tw = a.to("tpu"), w.to("tpu")
    with tpurec.mode("fused"):
        before = ta @ tw  # pending on entry: runs for real
        with stubs.stubbed_execution():
            inside = (ta @ tw).relu() + 1  # recorded inside: runs as a stub when the context ends
        after = ta @ tw
    torch.testing.assert_close(before.cpu(), a @ w, rtol=1e-6, atol=1e-6)
    assert inside.shape == (6, 3) and not inside.cpu().any()
    torch.testing.assert_close(after.cpu(), a @ w, rtol=1e-6, atol=1e-6)


def test_a_stubbed_training_step_keeps_its_parameters_shapes_and_compiles_its_stub_once():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).to("tpu")
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    x = torch.randn(6, 5).to("tpu")

    def step() -> float:
        optimizer.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        return loss.item()

    with tpurec.mode("fused"):
        step()
        with stubs.stubbed_execution():
            first = step()  # traces and compiles the window's stub (its parameters donated)
            compilations = tpurec.stats()["compilations"]
            losses = [step() for _ in range(3)]
            assert tpurec.stats()["compilations"] == compilations
    assert first == 0.0 and losses == [0.0, 0.0, 0.0]
    for parameter, shape in zip(model.parameters(), [(8, 5), (8,), (1, 8), (1,)]):
        assert parameter.shape == shape and parameter.dtype == torch.float32
        assert parameter.cpu().shape == shape  # a live buffer, not a deleted (donated) one
    assert optimizer.state[model[0].weight]["sum"].shape == (8, 5)


def test_a_compiled_graph_run_outside_fused_mode_is_stubbed_too():
    a, w = _inputs()
    ta, tw = a.to("tpu"), w.to("tpu")
    f = torch.compile(lambda x, y: torch.tanh(x @ y).sum(dim=0), backend="tpu")
    with tpurec.mode("eager"):
        torch.testing.assert_close(f(ta, tw).cpu(), torch.tanh(a @ w).sum(dim=0), rtol=1e-5, atol=1e-6)
        with stubs.stubbed_execution():
            stubbed = f(ta, tw)
        again = f(ta, tw)
    assert stubbed.shape == (3,) and not stubbed.cpu().any()
    torch.testing.assert_close(again.cpu(), torch.tanh(a @ w).sum(dim=0), rtol=1e-5, atol=1e-6)
