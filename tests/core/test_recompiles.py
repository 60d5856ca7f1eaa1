"""Recompilation diagnostics: TPUREC_LOG=recompiles, tpurec.explain_recompiles(), stats() reasons."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tpurec


@pytest.fixture(autouse=True)
def _start_in_eager_mode():
    """These tests check eager-mode mechanics or enter the mode they test themselves, so each
    starts in eager mode even when the suite runs with TPUREC_MODE=fused."""
    with tpurec.mode("eager"):
        yield


THIS_FILE = os.path.abspath(__file__)


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to("tpu")


def _batch(size):
    g = torch.Generator().manual_seed(size)
    return torch.randn(size, 13, generator=g).to("tpu"), torch.rand(size, 1, generator=g).to("tpu")


def test_fused_loop_whose_batch_size_changes_once_reports_one_recompilation():
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tpurec.mode("fused"):
        tpurec.reset_stats()
        for step in range(8):
            x, y = _batch(16 if step < 5 else 15)
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            loss.item()  # the sync point: one fused window per step
    reports = tpurec.explain_recompiles()
    assert len(reports) == 1, [str(r) for r in reports]
    report = reports[0]
    assert report.program.startswith("fused window")
    assert "changed from [16, 13] to [15, 13]" in report.reason, report
    assert report.user_line.startswith(f"{THIS_FILE}:") and "loss.item()" in report.user_line, report.user_line
    assert "batch" in report.hint
    stats = tpurec.stats()
    assert stats["recompilations"] == 1 and stats["recompile_reasons"] == {report.reason: 1}, stats


def test_the_first_steps_are_warm_up_not_recompilations():
    model = _mlp()
    optimizer = torch.optim.Adam(model.parameters())  # its state appears at step 1: a second window shape
    with tpurec.mode("fused"):
        tpurec.reset_stats()
        for _ in range(4):
            x, y = _batch(8)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            torch.tpu.synchronize()
    assert tpurec.stats()["compilations"] + tpurec.stats()["disk_hits"] > 0 and tpurec.explain_recompiles() == []


def test_eager_op_reports_static_argument_and_shape_changes_with_the_users_line():
    tpurec.reset_stats()
    for dim in (0, 0, 0, 1):
        torch.ones(6, 4, device="tpu").sum(dim=dim)  # the last one: a new static value
    for rows in (6, 6, 6, 5):
        torch.ones(rows, 4, device="tpu").sum(dim=0)  # the last one: a new shape
    # Op programs are grouped by op: earlier tests' sums may make the first [6, 4] sum a recompilation too.
    reports = {r.reason: r for r in tpurec.explain_recompiles() if r.program == "op aten.sum.dim_IntList"}
    static = reports["static value of argument 1 (dim) changed from [0] to [1]"]
    shape = reports["shape of argument 0 (self) changed from [6, 4] to [5, 4]"]
    assert "sum(dim=dim)" in static.user_line and "static" in static.hint
    assert str(shape).startswith("tpurec: recompiled op aten.sum.dim_IntList")


def test_a_new_fused_window_structure_is_explained():
    x = torch.randn(4, 4).to("tpu")
    tpurec.reset_stats()
    with tpurec.mode("fused"):
        for combine in (torch.add, torch.add, torch.add, torch.sub):
            combine(x * 2, 1).sum().item()  # the same sync point; the last window has another op
    (report,) = tpurec.explain_recompiles()
    assert report.reason.startswith("a new fused-window structure"), report
    assert "aten.sub.Tensor (was aten.add.Tensor)" in report.reason
    assert "sync point" in report.hint


def test_compiled_graph_recompilation_names_the_input_and_dynamos_guard():
    torch._dynamo.reset()  # Dynamo remembers dims it saw change (automatic dynamic) per code object
    model = _mlp()
    compiled = torch.compile(model, backend="tpu")
    batches = [_batch(16 if step < 4 else 15)[0] for step in range(6)]  # allocated before: only the graph compiles
    tpurec.reset_stats()
    with torch.no_grad():
        for x in batches:
            compiled(x)
    reports = tpurec.explain_recompiles()
    assert len(reports) == 1, [str(r) for r in reports]
    report = reports[0]
    assert report.program.startswith("inference graph"), report
    assert "shape [16, 13] -> [15, 13]" in report.reason, report  # against the static graph's program
    assert any("Dynamo guard failed" in c and "expected 16, actual 15" in c for c in report.changes), report
    torch._dynamo.reset()


def test_a_dynamic_graph_recompiles_its_xla_program_per_size_and_says_so():
    torch._dynamo.reset()
    compiled = torch.compile(_mlp(), backend="tpu", dynamic=True)  # one symbolic graph, one XLA program per size
    batches = [_batch(16 if step < 3 else 15)[0] for step in range(5)]
    tpurec.reset_stats()
    with torch.no_grad():
        for x in batches:
            compiled(x)
    reports = tpurec.explain_recompiles()
    assert len(reports) == 1, [str(r) for r in reports]
    assert "shape [16, 13] -> [15, 13]" in reports[0].reason, reports[0]
    assert any("size value 16 -> 15" in c for c in reports[0].changes)
    assert not any("Dynamo guard" in c for c in reports[0].changes)  # Dynamo did not trace again
    torch._dynamo.reset()


def test_tpurec_log_recompiles_logs_each_one_on_stderr(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(
        textwrap.dedent("""
        import torch, tpurec
        x = torch.ones(8, 3).to("tpu")
        with tpurec.mode("fused"):
            for size in (8, 8, 8, 7, 7):
                (x[:size] * 3).sum().item()
        print("recompilations", tpurec.stats()["recompilations"])
    """)
    )
    env = dict(os.environ, TPUREC_LOG="recompiles", TPUREC_CACHE_DIR="off")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "recompilations 1" in out.stdout
    assert out.stderr.count("tpurec: recompiled fused window") == 1, out.stderr
    assert f"{script}:6" in out.stderr and "hint:" in out.stderr
