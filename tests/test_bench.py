"""The benchmarks as users run them (``python -m tpurec.bench ...``): tiny settings, JSON checked, no timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def bench(*args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "tpurec.bench", *args], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_dispatch_reports_host_cost_per_op_next_to_pytorch_cpu():
    result = bench("dispatch", "--ops", "20", "--repeats", "2", "--warmup", "1")
    assert set(result["ops"]) == {"add", "view", "add_", "matmul"}
    for op, row in result["ops"].items():
        assert set(row) == {"cpu_pytorch", "eager", "fused", "floor_subclass", "floor_jax"}, op
        for config, figures in row.items():
            assert figures["wall_ns"] > 0 and figures["host_ns"] > 0, (op, config)
            if config in ("eager", "fused"):
                # A cached op must not compile again after warm-up.
                assert figures["compilations"] == 0, (op, config, figures)
            if config != "cpu_pytorch":
                assert figures["vs_cpu"] == pytest.approx(figures["host_ns"] / row["cpu_pytorch"]["host_ns"])
                assert figures["vs_cpu_wall"] == pytest.approx(figures["wall_ns"] / row["cpu_pytorch"]["wall_ns"])
        assert row["fused"]["flush_us"] > 0


def test_every_benchmark_reports_where_its_compile_seconds_went():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "tpurec.bench", "dispatch", "--op", "add", "--ops", "5", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)["compile"]
    assert report["programs"] >= 1 and report["programs"] == sum(e["programs"] for e in report["by_program"].values())
    assert set(report["phases"]) == {"tracing", "lowering", "xla_compile", "cache_load"}
    assert report["seconds"] >= sum(e["seconds"] for e in report["by_program"].values()) - 1e-6
    slowest = next(iter(report["by_program"]))
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("python -m tpurec.bench: ")]
    assert len(line) == 1, proc.stderr[-3000:]
    assert f"compiling {report['programs']} programs (tracing " in line[0] and f"slowest: {slowest} " in line[0]


def test_dispatch_reports_no_host_time_where_the_thread_clock_ticks_coarsely(monkeypatch):
    # Under gVisor (some TPU machines) time.thread_time() advances in 10 ms ticks: a loop of ops reads 0.
    from tpurec.bench import clocks, dispatch

    monkeypatch.setattr(clocks, "thread_clock_tick", lambda: 0.01)
    result = dispatch.main(["--op", "add", "--ops", "20", "--repeats", "2", "--modes", "cpu_pytorch", "eager"])
    assert result["thread_clock_tick_us"] == pytest.approx(1e4)
    row = result["ops"]["add"]
    assert row["cpu_pytorch"]["host_ns"] is None and row["eager"]["host_ns"] is None
    assert row["eager"]["vs_cpu"] is None
    assert row["eager"]["vs_cpu_wall"] == pytest.approx(row["eager"]["wall_ns"] / row["cpu_pytorch"]["wall_ns"])


def test_dispatch_refuses_a_loop_longer_than_the_fused_window():
    env = dict(os.environ, PYTHONPATH=str(ROOT), TPUREC_FUSED_MAX_OPS="10")
    proc = subprocess.run(
        [sys.executable, "-m", "tpurec.bench", "dispatch", "--ops", "20"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 2
    assert "--ops must stay below the fused window's limit (10 ops)" in proc.stderr


def test_modes_reports_host_time_per_step():
    result = bench(
        "modes",
        "--batch",
        "4",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--round-steps",
        "1",
        "--modes",
        "cpu_pytorch",
        "eager",
        "fused_adagrad",
        "compiled_optim",
        "graphed",
        "graphed_k8",
    )
    run = result["runs"][0]
    for config in ("cpu_pytorch", "eager", "fused_adagrad", "compiled_optim", "graphed", "graphed_k8"):
        assert 0 < run[config]["host_ms_per_step"], run[config]
        # The main thread's CPU time cannot exceed the process's (every thread's) CPU time.
        assert run[config]["host_ms_per_step"] <= run[config]["cpu_ms_per_step"] * 1.05 + 0.05, run[config]
    # The stubbed steps come after the losses: the tpu losses are PyTorch CPU's, not the stubs' zeros.
    assert run["cpu_pytorch"]["host_ms_per_step_stubbed"] is None
    for config in ("eager", "fused_adagrad", "compiled_optim", "graphed", "graphed_k8"):
        assert run[config]["host_ms_per_step_stubbed"] > 0, run[config]
        compiled = run[config]["compile"]  # the warm-up's compile seconds, by kind of program
        assert compiled["seconds"] >= sum(e["seconds"] for e in compiled["by_program"].values()) - 1e-6, compiled
    for config in ("eager", "fused_adagrad", "compiled_optim", "graphed"):
        assert run[config]["last_loss"] == pytest.approx(run["cpu_pytorch"]["last_loss"], rel=1e-5), run
    # 8 steps per launch: one program per 8 steps, and every step's loss that of the single steps
    k8 = run["graphed_k8"]
    assert k8["programs_per_step"] == pytest.approx(1 / 8) and k8["compilations_after_warmup"] == 0, k8
    match = k8["losses_match_single_steps"]
    assert match["reference"] == "graphed" and match["steps_compared"] >= 3 and match["equal"], match
    assert match["max_abs_difference"] == 0.0 and match["first_differing_step"] is None, match
    assert run["graphed_k8"]["compile"]["by_program"]["captured step x8"]["programs"] == 1
    floor = result["pytorch_cpu_host_floor"]
    assert floor["batch"] == 1 and floor["host_ms_per_step"] > 0, floor


def test_text_with_buckets_compiles_at_most_twice_per_bucket_and_matches_cpu():
    result = bench("text", "--steps", "6", "--max-length", "32", "--how", "fused", "--check")
    fused = result["fused"]
    assert result["buckets"] == [16, 32]
    # fused mode: the window up to loss.item() and the backward + optimizer window, per bucket; an unpadded
    # batch (all-ones attention mask, which transformers skips) one forward program more
    assert fused["compile_requests"] <= 2 * fused["buckets_seen"] + fused["exact_fit_buckets"], fused
    assert fused["loss_relative_difference"] <= 1e-5, fused


def test_collectives_reports_tpu_and_gloo_per_collective_and_size():
    result = bench("collectives", "--processes", "2", "--sizes", "8", "64", "--repeats", "2", "--warmup", "1")
    assert result["benchmark"] == "collectives" and result["processes"] == 2 and result["dtype"] == "float32"
    rows = result["results"]
    expected = {"all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor",
                "all_to_all_single_even", "all_to_all_single_uneven"}  # fmt: skip
    assert {(r["collective"], r["elements"]) for r in rows} == {(c, s) for c in expected for s in (8, 64)}
    assert len(rows) == 12
    for row in rows:
        assert row["tpu_ms"] > 0 and row["gloo_ms"] > 0, row
        assert row["tpu_vs_gloo"] == pytest.approx(row["tpu_ms"] / row["gloo_ms"]), row


def test_collectives_refuses_sizes_that_do_not_split_evenly():
    proc = subprocess.run(
        [sys.executable, "-m", "tpurec.bench", "collectives", "--processes", "2", "--sizes", "7"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "every --sizes value must be a multiple of --processes (2)" in proc.stderr


def test_collectives_run_is_bounded_by_its_timeout():
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "tpurec.bench", "collectives", "--sizes", "8", "--timeout", "1"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "rank 0 of the 2-process benchmark did not finish within 1 s (--timeout)" in proc.stderr
    assert time.monotonic() - start < 120


def test_transformer_compiled_step_compiles_nothing_after_warmup_and_matches_cpu():
    result = bench(
        "transformer", "--steps", "2", "--warmup", "2", "--round-steps", "1", "--batch", "2", "--length", "8"
    )
    cpu = result["cpu_pytorch"]["last_loss"]
    for name in ("compiled", "compiled_dispatch", "graphed"):
        assert result[name]["compilations_after_warmup"] == 0, result
        # Four SGD steps of a float32 model (graphed: two plain, the capture, one replay): the CPU twin's loss
        # within the compile tests' 1e-5.
        assert abs(result[name]["last_loss"] - cpu) <= 1e-5 * abs(cpu), result
    for name in ("cpu_pytorch", "compiled", "compiled_dispatch", "graphed"):
        assert 0 < result[name]["host_ms_per_step"] and 0 < result[name]["min_step_ms"] <= result[name]["step_ms"]
    assert result["cpu_pytorch"]["host_ms_per_step_stubbed"] is None
    assert all(result[name]["host_ms_per_step_stubbed"] > 0 for name in ("compiled", "compiled_dispatch", "graphed"))


def test_device_time_exports_the_step_programs_and_replays_them_without_tpurec(tmp_path):
    # Exported for XLA:CPU (here) instead of TPU: the same files and runner a TPU machine uses.
    index = bench(
        "device_time", "export", "--out", str(tmp_path), "--configs", "modes_fused", "modes_compiled_optim_dispatch",
        "--batch", "4", "--warmup", "2", "--host-steps", "2", "--platform", "cpu",
    )  # fmt: skip
    steps = index["steps"]
    assert set(steps) == {"modes_fused_b4", "modes_compiled_optim_dispatch_b4"}
    # Fused: one program, enqueued at the loss read. Compiled graphs dispatched at once (not the default): forward,
    # backward and optimizer graph each end a program, enqueued in that order within the step.
    assert len(steps["modes_fused_b4"]["programs"]) == 1
    compiled = steps["modes_compiled_optim_dispatch_b4"]
    assert compiled["compiled_graphs"] == "dispatch" and len(compiled["programs"]) == 3
    at = [p["enqueued_at_host_ms"] for p in compiled["programs"]]
    assert 0 < at[0] < at[1] < at[2] < compiled["last_call_returned_at_host_ms"] <= compiled["host_ms_per_step"]
    # The runner is a file run on its own: only JAX and numpy, no tpurec or torch import.
    runner = ROOT / "tpurec" / "bench" / "device_time.py"
    code = (
        "import runpy, sys; sys.modules['torch'] = None; sys.modules['tpurec'] = None; "
        f"sys.argv = [{str(runner)!r}, 'run', {str(tmp_path)!r}, '--iters', '3']; "
        f"runpy.run_path({str(runner)!r}, run_name='__main__')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    for name, entry in steps.items():
        timing = result["steps"][name]
        assert timing["programs"] == len(entry["programs"])
        assert timing["device_ms_median"] > 0 and timing["device_ms_pipelined"] > 0
        assert timing["host_over_device"] == pytest.approx(
            timing["host_ms_per_step_exported_from"] / timing["device_ms_pipelined"]
        )
        # The replay runs the host's whole step and waits for the device where the last call returned.
        assert timing["replayed_step_ms"] >= timing["host_ms_per_step_exported_from"]
        assert timing["replayed_wait_ms"] == pytest.approx(
            timing["replayed_step_ms"] - timing["host_ms_per_step_exported_from"]
        )
