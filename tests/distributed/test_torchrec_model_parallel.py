"""TorchRec's own model-parallel test (``torchrec.distributed.test_utils``'s
``sharding_single_rank_test_single_process``, what its ``ModelParallelTestShared`` runs in each
rank) on the tpu device with 2 processes: TorchRec's ``TestSparseNN`` with plain and weighted
tables, planned by TorchRec's default planner with its default sharder, and with every table
data-parallel (``DENSE``) or table-, row- or column-wise (``FUSED``) as its tests parametrize them;
TorchRec's code trains the sharded model and checks it against the unsharded one (see
torchrec_model_worker.py for the glue)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torchrec_model_worker as worker  # beside this file
from launcher import run

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
def test_torchrec_model_parallel_cases_pass_on_tpu_with_two_processes(tmp_path):
    out = tmp_path / "model"
    run(HERE / "torchrec_model_worker.py", 2, str(out), ",".join(worker.CASES), seconds=540)
    for rank in range(2):
        assert Path(f"{out}.{rank}").read_text().split() == [w for c in worker.CASES for w in (c, "passed")], rank
