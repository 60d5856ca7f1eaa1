"""DTensor on a 4-device tpu mesh (four processes, one XLA:CPU device each) equals plain CPU tensors.

The checks each rank makes are in stack_worker.py (``dtensor``): distribute_tensor with Shard, Replicate
and Partial, redistribute between them, matmul, elementwise ops, reductions and distribute_module.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import launcher

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
def test_dtensor_on_four_process_tpu_mesh(tmp_path):
    reports = launcher.reports(HERE / "stack_worker.py", 4, tmp_path / "dtensor", "dtensor", seconds=300)
    placements = ("Shard(0)", "Shard(1)", "Replicate")
    wanted = [f"redistribute {a} -> {b}" for a in placements for b in placements if a != b]
    wanted += ["redistribute Partial -> Replicate", "redistribute Partial -> Shard(1)", "distribute_tensor Partial",
               "matmul Shard(0) @ Replicate", "matmul Replicate @ Shard(1)", "matmul Shard(1) @ Shard(0)",
               "elementwise Shard(0)", "sum Shard(1)", "sum dim 0 Shard(0)", "mean dim 1 Shard(1)",
               "amax dim 1 Shard(1)", "softmax Shard(0) dim 1", "distribute_module Linear"]  # fmt: skip
    for rank, report in enumerate(reports):
        missing = [w for w in wanted if w not in report]
        assert not missing, (rank, missing, report)
