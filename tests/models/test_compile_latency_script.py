"""tests/models/compile_latency_on_device.py (the chip's compile-latency script) runs on CPU as on the chip.

Its tiny family (``mlp``) in fused mode: a cold process compiles the first step's program, a new process
with the same persistent cache folder reads every program from disk and compiles none; the JSON goes to
``$OUT``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "compile_latency_on_device.py"


@pytest.mark.slow
def test_cold_process_compiles_and_warm_process_reads_every_program_from_disk(tmp_path) -> None:
    env = {**os.environ, "OUT": str(tmp_path)}
    command = [sys.executable, str(SCRIPT), "--families", "mlp", "--modes", "fused", "--timeout", "240"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "compile_latency_mlp_fused.json").read_text())
    cold, warm = result["cold"], result["warm"]
    assert "error" not in cold and "error" not in warm, (cold.get("error"), warm.get("error"))
    first = cold["steps"][0]
    assert first["compile_requests"] >= 1 and first["disk_hits"] == 0
    assert first["by_program"] and first["phases"]["xla_compile"] > 0
    assert all(step["compile_requests"] == step["disk_hits"] for step in warm["steps"]), warm["steps"]
    assert sum(step["disk_hits"] for step in warm["steps"]) >= 1
    assert cold["steps"][2]["compile_requests"] == 0 and warm["steps"][2]["compile_requests"] == 0
    assert [s["loss"] for s in cold["steps"]] == [s["loss"] for s in warm["steps"]]
    assert cold["programs"] and all(p["stablehlo_ops"] > 0 for p in cold["programs"])
