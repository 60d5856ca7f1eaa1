"""TorchRec's single-rank DMP suites, ``ModelParallelSparseOnlyBase`` and ``ModelParallelStateDictBase``, their
scenarios written again for the ``tpu`` device (single_rank_suites.py, one process, a world of one) and checked
against the same calls on CPU: module types, input validation, state dicts loaded across models, devices and
prefixes, the fused optimizer's state, shard counts; outputs and states within 1e-5 relative and 1e-6 absolute
of TorchRec's CPU run, and equal where TorchRec's tests require two models to be equal. The two tests of the
suites that demand CUDA are left out (see single_rank_suites.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import single_rank_suites  # beside this file (only its scenario names are read here)
from launcher import environment
from ports import free_port_pair

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
def test_torchrec_single_rank_dmp_scenarios_pass_on_tpu_as_on_cpu(tmp_path):
    env = environment(
        OUT=str(tmp_path), OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port_pair())
    )
    run = subprocess.run(
        [sys.executable, str(HERE / "single_rank_suites.py")], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-6000:]
    results = json.loads((tmp_path / "single_rank_suites.json").read_text())
    assert list(results) == list(single_rank_suites.SCENARIOS)
    failed = {name: error for name, error in results.items() if error != "passed"}
    assert not failed, "\n\n".join(f"{name}:\n{error}" for name, error in failed.items())
