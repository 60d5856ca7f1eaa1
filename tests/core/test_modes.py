"""Execution modes: eager, fused (DeferAndFuse), debug; the shared compile cache."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from fresh_cache import fresh_cache
import torch

import tpurec


def train(mode, steps=20, warm=None, foreach=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(13, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
    ).to("tpu")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=foreach)
    forward = torch.compile(model, backend="tpu") if mode == "compiled" else model
    mode = "eager" if mode == "compiled" else mode
    g = torch.Generator().manual_seed(3)
    x = torch.randn(128, 13, generator=g).to("tpu")
    y = torch.rand(128, 1, generator=g).round().to("tpu")
    losses = []
    with tpurec.mode(mode):
        for step in range(steps):
            if step == warm:
                tpurec.reset_stats()
            optimizer.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(forward(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses


def test_modes_give_the_same_losses():
    eager = train("eager")
    for mode in ("fused", "debug", "compiled"):
        other = train(mode)
        for a, b in zip(other, eager):
            assert abs(a - b) <= 1e-5 * abs(b), (mode, a, b)


def test_compiled_warm_loop_makes_no_compilations():
    train("compiled", steps=55, warm=5)
    stats = tpurec.stats()
    assert stats["compilations"] == 0 and stats["cache_hits"] > 0, stats


@pytest.mark.parametrize("foreach", [False, True])
def test_fused_warm_loop_is_one_cached_graph_per_step(foreach):
    train("fused", steps=55, warm=5, foreach=foreach)
    stats = tpurec.stats()
    assert stats["compilations"] == 0, stats
    assert stats["fused_graphs"] == 50 and stats["sync_points"] == {"item": 50}
    assert stats["ops_per_fused_graph"] > 20
    # Parameters and optimizer state are updated in place: their old buffers are donated.
    assert stats["donated_buffers"] >= 50 * 6


def test_mode_switch_api():
    before = tpurec.get_mode()  # eager unless TPUREC_MODE says otherwise
    with tpurec.mode("fused"):
        assert tpurec.get_mode() == "fused"
        x = torch.ones(3, device="tpu") * 2
        assert tpurec.core.fused.pending_ops() > 0
    with tpurec.mode("eager"):
        assert tpurec.core.fused.pending_ops() == 0
    assert tpurec.get_mode() == before
    assert x.tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(ValueError, match="not a tpurec mode"):
        tpurec.set_mode("turbo")


def test_fused_sync_points_and_views():
    with tpurec.mode("fused"):
        tpurec.reset_stats()
        x = torch.arange(12.0, device="tpu").reshape(3, 4)
        v = x[:, 1]
        v.mul_(10)
        y = x.t() + 1
        print(y)  # printing is a sync point
        assert x[0, 1].item() == 10.0
        torch.tpu.synchronize()
        expected = torch.arange(12.0).reshape(3, 4)
        expected[:, 1] *= 10
        assert torch.equal(y.cpu(), expected.t() + 1)
        assert bool((x > 50).any()) is True and bool((x > 100).any()) is False
    reasons = tpurec.stats()["sync_points"]
    assert reasons.get("print") == 1 and reasons.get("item", 0) >= 1


def test_fused_graph_size_limit(monkeypatch):
    monkeypatch.setenv("TPUREC_FUSED_MAX_OPS", "8")
    with tpurec.mode("fused"):
        tpurec.reset_stats()
        x = torch.zeros(4, device="tpu")
        for _ in range(30):
            x = x + 1
        assert x.tolist() == [30.0] * 4
    assert tpurec.stats()["sync_points"]["graph size limit"] >= 3


def test_debug_mode_names_the_op_that_made_a_nan(monkeypatch):
    monkeypatch.setenv("TPUREC_CHECK_NAN", "1")
    x = torch.tensor([-1.0, 4.0], device="tpu")
    with tpurec.mode("debug"):
        assert torch.sqrt(x[1:]).tolist() == [2.0]
        with pytest.raises(FloatingPointError, match="sqrt"):
            torch.sqrt(x)


USER_SCRIPT = textwrap.dedent(
    """
    import json, torch, tpurec
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).to("tpu")
    forward = torch.compile(model, backend="tpu") if COMPILE else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 8).to("tpu"), torch.randn(32, 1).to("tpu")
    for step in range(6):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(forward(x), y)
        loss.backward()
        opt.step()
        print("loss", loss.item())
    s = tpurec.stats()
    print(json.dumps({"mode": tpurec.get_mode(), "compilations": s["compilations"], "disk_hits": s["disk_hits"],
                      "fused_graphs": s["fused_graphs"]}))
    """
)


def _run_user_script(env_extra, compile=False):
    env = dict(os.environ, **env_extra)
    script = f"COMPILE = {compile}\n" + USER_SCRIPT
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.mode_set_by_test
def test_unchanged_user_script_runs_fused_and_second_process_compiles_nothing(tmp_path):
    env = {"TPUREC_MODE": "fused", "TPUREC_CACHE_DIR": str(fresh_cache(tmp_path / "cache"))}
    first = _run_user_script(env)
    assert first["mode"] == "fused" and first["fused_graphs"] >= 6 and first["compilations"] > 0
    second = _run_user_script(env)
    assert second["compilations"] == 0 and second["disk_hits"] > 0, second


def test_second_process_reuses_compiled_mode_programs_from_disk(tmp_path):
    env = {"TPUREC_CACHE_DIR": str(fresh_cache(tmp_path / "cache"))}
    first = _run_user_script(env, compile=True)
    assert first["compilations"] > 0
    second = _run_user_script(env, compile=True)
    assert second["compilations"] == 0 and second["disk_hits"] > 0, second
