"""The DLRM dense step of ``python -m tpurec.bench modes`` as the programs it runs.

A warm step must compile nothing, in fused and compiled mode. A compiled model
under fused mode runs its whole training step (compiled forward, eager loss,
compiled backward, eager Adagrad) as one XLA program, or, with
``TPUREC_FUSED_COMPILED_GRAPHS=dispatch``, dispatches each compiled graph with
the eager ops recorded before it (two programs per step); both with the losses
of PyTorch on CPU.
"""

from __future__ import annotations

import math

import pytest
import torch

import tpurec
from tpurec.bench.modes import NUM_SPARSE, EMBEDDING_DIM, DenseStep

BATCH = 8
WARMUP = 2
STEPS = 3
# float32 on two backends, 5 Adagrad steps: the relative tolerance the compile tests use for losses.
LOSS_RTOL = 1e-5


def _run(device: str, mode: str, compiled: bool) -> tuple[list[float], list[dict]]:
    """Trains the bench's dense step; returns the losses and tpurec's stats after each warm step."""
    torch.manual_seed(0)
    model = DenseStep().to(device)
    forward = torch.compile(model, backend="tpu") if compiled else model
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    dense = torch.randn(BATCH, 13, generator=g).to(device)
    # Embedding-sized values (|x| ~ 0.1): unit-variance rows would make the 64-dim dot
    # products large and the loss saturate near 0, where a relative comparison says little.
    sparse = (0.1 * torch.randn(BATCH, NUM_SPARSE, EMBEDDING_DIM, generator=g)).to(device)
    labels = torch.rand(BATCH, 1, generator=g).round().to(device)
    losses, stats = [], []
    with tpurec.mode(mode):
        for step in range(WARMUP + STEPS):
            tpurec.reset_stats()
            optimizer.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(forward(dense, sparse), labels)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            if step >= WARMUP:
                stats.append(tpurec.stats())
    return losses, stats


@pytest.fixture(scope="module")
def cpu_losses() -> list[float]:
    losses = _run("cpu", "eager", False)[0]
    assert 0.1 < losses[0] < 2 and losses[-1] < losses[0], losses  # a loss that learns, not a saturated one
    return losses


@pytest.mark.parametrize(
    "mode,compiled",
    [("fused", False), ("fused", True), ("eager", True)],
    ids=["fused", "compiled-fused", "compiled-eager"],
)
def test_warm_dense_step_compiles_nothing_and_matches_cpu(mode, compiled, cpu_losses):
    losses, stats = _run("tpu", mode, compiled)
    assert [s["compilations"] for s in stats] == [0] * STEPS
    assert [s["recompilations"] for s in stats] == [0] * STEPS
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(cpu_losses), rtol=LOSS_RTOL, atol=0)


def test_compiled_model_in_fused_mode_runs_the_step_as_one_program(cpu_losses):
    assert tpurec.config.get("TPUREC_FUSED_COMPILED_GRAPHS") == "defer"  # the default
    losses, stats = _run("tpu", "fused", True)
    for s in stats:
        # One program: compiled forward and backward graphs are nodes of the fused window.
        assert s["executions"] == 1, s
        assert s["fused_graphs"] == 1 and s["sync_points"] == {"item": 1}, s
        assert s["ops_by_name"]["compiled forward graph"] == 1
        assert s["ops_by_name"]["compiled backward graph"] == 1
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(cpu_losses), rtol=LOSS_RTOL, atol=0)


def test_compiled_model_in_fused_mode_dispatches_each_graph_with_the_ops_before_it(cpu_losses):
    # Each compiled graph's window is enqueued when the graph is called, so the device runs it
    # while Python records the rest of the step. Per warm step: [the last step's Adagrad ops +
    # forward graph] and [the eager loss and its backward + backward graph]; the loss is then
    # already computed, so loss.item() runs nothing.
    with tpurec.config.override(fused_compiled_graphs="dispatch"):
        losses, stats = _run("tpu", "fused", True)
    for s in stats:
        assert s["executions"] == 2 and s["fused_graphs"] == 2, s
        assert s["sync_points"] == {"compiled graph": 2}, s
        assert s["ops_by_name"]["compiled forward graph"] == 1
        assert s["ops_by_name"]["compiled backward graph"] == 1
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(cpu_losses), rtol=LOSS_RTOL, atol=0)
    # Split where eager mode splits the compiled graphs: the same sums as compiled eager, bit for bit
    # (one program per step, deferred, lets XLA fuse across the graphs: equal only within LOSS_RTOL).
    assert losses == _run("tpu", "eager", True)[0]


@pytest.mark.parametrize("graphs,flushes", [("defer", {}), ("dispatch", {"compiled graph": 1})])
def test_compiled_graph_reading_a_view_in_fused_mode_matches_eager(graphs, flushes):
    # A view input (a slice of a pending tensor) is read inside the window, not synced.
    def f(x):
        return (x * 2).sum(0)

    compiled = torch.compile(f, backend="tpu")
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    with tpurec.mode("fused"), tpurec.config.override(fused_compiled_graphs=graphs):
        x = base.to("tpu") + 1
        tpurec.reset_stats()
        out = compiled(x[1:3, ::2])
        assert tpurec.stats()["sync_points"] == flushes
        got = out.cpu()
    torch.testing.assert_close(got, f((base + 1)[1:3, ::2]))


@pytest.mark.slow
def test_bench_modes_cli_reports_one_program_per_step_and_no_compilations():
    import json
    import subprocess
    import sys

    command = [
        sys.executable,
        "-m",
        "tpurec.bench",
        "modes",
        "--batch",
        "8",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--modes",
        "cpu_pytorch",
        "fused",
        "compiled",
        "compiled_eager",
        "compiled_optim",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (run,) = json.loads(done.stdout)["runs"]
    assert run["fused"]["programs_per_step"] == 1 and run["compiled"]["programs_per_step"] == 1, run
    assert run["compiled_eager"]["programs_per_step"] > 1, run
    assert run["compiled_optim"]["programs_per_step"] == 1, run
    # The compiled optimizer's update is the eager one's, bit for bit.
    assert run["compiled_optim"]["last_loss"] == run["compiled"]["last_loss"], run
    for name in ("fused", "compiled", "compiled_eager", "compiled_optim"):
        assert run[name]["compilations_after_warmup"] == 0, run
        # The first step's loss (same weights, no update yet): float32 layers, rtol 1e-5.
        assert run[name]["first_loss"] == pytest.approx(run["cpu_pytorch"]["first_loss"], rel=1e-5)
        # After 3 Adagrad steps on 8 samples the loss is about 1e-8, softplus(-margin) with a
        # margin of about 18, so it is compared on the margin's scale (-log loss). Adagrad's
        # first update is lr * g / sqrt(g * g) = lr * sign(g): a rounding difference in a
        # near-zero gradient moves that weight by up to 2 * lr, hence rtol 1e-4 there.
        margin, reference = -math.log(run[name]["last_loss"]), -math.log(run["cpu_pytorch"]["last_loss"])
        assert margin == pytest.approx(reference, rel=1e-4)
    assert set(run["ratios"]) >= {"fused_speedup_vs_cpu", "compiled_speedup_vs_cpu", "compiled_speedup_vs_fused"}


def test_bench_modes_rejects_a_bad_batch():
    from tpurec.bench.modes import main

    with pytest.raises(SystemExit):
        main(["--batch", "0"])


def test_compiled_dropout_in_fused_mode_draws_eagers_masks():
    # Random graph nodes get their (seed, counter) triples as runtime scalars of the window.
    from compile_models import train

    eager = train("transformer", "tpu", 4, compiled=False, eval_mode=False)
    with tpurec.mode("fused"):
        compiled = train("transformer", "tpu", 4, compiled=True, eval_mode=False)
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=LOSS_RTOL, atol=0)
