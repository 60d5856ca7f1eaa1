"""FSDP2 (fully_shard) on tpu: two processes train a 2-layer transformer like one CPU process on the
whole batch, and a torch.distributed.checkpoint saved by two processes loads in four."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import launcher

HERE = Path(__file__).resolve().parent


def _reference():
    import stack_worker

    return stack_worker.STEPS, stack_worker.reference()


@pytest.mark.slow
def test_fully_shard_two_processes_then_checkpoint_loads_in_four(tmp_path):
    checkpoint = tmp_path / "checkpoint"
    reports = launcher.reports(HERE / "stack_worker.py", 2, tmp_path / "fsdp", "fsdp", str(checkpoint))
    assert all("fsdp trained" in r and "dcp saved" in r for r in reports), reports
    steps, (losses, params) = _reference()
    got = np.load(tmp_path / "fsdp.fsdp.npz")
    assert len(got["losses"]) == steps
    np.testing.assert_allclose(got["losses"], losses, rtol=1e-5, atol=0)
    assert set(params) == set(got.files) - {"losses"}
    for name, want in params.items():
        np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6, err_msg=name)
    # The 2-process checkpoint, resharded onto 4 processes, holds exactly the trained parameters.
    reports = launcher.reports(HERE / "stack_worker.py", 4, tmp_path / "load", "load", str(checkpoint), str(tmp_path / "fsdp.fsdp.npz"),
                       seconds=300)  # fmt: skip
    assert all("dcp loaded" in r and "dcp loaded trains" in r for r in reports), reports
