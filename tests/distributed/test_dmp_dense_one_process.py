"""tpurec's DENSE tpu kernel in a DistributedModelParallel world of one process (its input's
offsets computed on the host): dmp_dense_on_device.py, the script that measures it on a TPU, run on
XLA:CPU. Tables of dims 4 to 24, plain and weighted, data-parallel: the pooled lookups and the
table gradients equal TorchRec's CPU collection's within 1e-5 absolute (pooled values are sums of
up to 5 rows of magnitude up to 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from launcher import environment
from ports import free_port_pair

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
def test_one_process_dmp_dense_tables_of_any_width_match_cpu(tmp_path):
    env = environment(
        OUT=str(tmp_path), OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port_pair())
    )
    out = subprocess.run(
        [sys.executable, str(HERE / "dmp_dense_on_device.py")], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-6000:]
    report = json.loads((tmp_path / "dmp_dense_on_device.json").read_text())
    for kind in ("plain", "weighted"):
        for dim, diffs in report[kind]["tables"].items():
            assert diffs["lookup_max_abs_diff"] <= 1e-5 and diffs["grad_max_abs_diff"] <= 1e-5, (kind, dim, diffs)
