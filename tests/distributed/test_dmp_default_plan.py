"""TorchRec's DistributedModelParallel with the plans TorchRec makes by default, on tpu as on CPU:
DMP's own planner (no plan given) and ``construct_module_sharding_plan`` with no compute kernel
named (row-, table-, column-wise and data-parallel tables on TorchRec's ``DENSE`` kernel), with
tables of dims 8 and 16, train on 2 processes on tpu like the same DMP model on CPU (gloo) in the
same processes; an EmbeddingCollection's row-, table-wise and data-parallel tables so planned
train like the collection on CPU in one process; a plan placing rank ``r`` on ``tpu:r`` gets
tpurec's error (see dmp_default_plan_worker.py)."""

from __future__ import annotations

from pathlib import Path

import dmp_default_plan_worker as worker  # beside this file
import numpy as np
import pytest
from launcher import run

HERE = Path(__file__).resolve().parent

SECONDS = 540
PROCESSES = 2


def _tables(out: Path, case: str, device: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The losses and every table assembled from the ranks' shards (a whole table: equal on every rank)."""
    ranks = [np.load(f"{out}.{case}.{device}.{rank}.npz") for rank in range(PROCESSES)]
    tables = {name: np.full((rows, dim), np.nan, np.float32) for name, rows, dim in worker._tables(case)}
    for got in ranks:
        for key in got.files:
            name, *rest = key.split("|")
            if len(rest) != 1:
                continue
            (r0, c0), block = got[key + "|offsets"], got[key]
            if rest == ["whole"] and not np.isnan(tables[name]).all():
                np.testing.assert_array_equal(tables[name], block, err_msg=f"{case} {device}: data-parallel {name}")
            tables[name][r0 : r0 + block.shape[0], c0 : c0 + block.shape[1]] = block
    return ranks[0]["losses"], tables


@pytest.mark.slow
def test_two_processes_default_plans_train_on_tpu_as_on_cpu(tmp_path):
    """Losses within 1e-5 relative, every trained table within 1e-5 relative and 1e-6 absolute of
    the CPU model's; every table trained; the misplaced plan refused on both ranks."""
    out = tmp_path / "default"
    run(HERE / "dmp_default_plan_worker.py", PROCESSES, str(out), ",".join(worker.CASES), seconds=SECONDS)
    for case in ("planner", "constructed", "sequence"):
        if case == "sequence":
            cpu_losses, cpu_tables = worker.sequence_reference()
        else:
            cpu_losses, cpu_tables = _tables(out, case, "cpu")
        tpu_losses, tpu_tables = _tables(out, case, "tpu")
        np.testing.assert_allclose(tpu_losses, cpu_losses, rtol=1e-5, atol=0, err_msg=f"{case}: losses")
        start = worker._start(case)
        for name, want in cpu_tables.items():
            assert not np.isnan(want).any() and not np.isnan(tpu_tables[name]).any(), (case, name)
            np.testing.assert_allclose(tpu_tables[name], want, rtol=1e-5, atol=1e-6, err_msg=f"{case}: table {name}")
            assert np.abs(want - start[name]).max() > 1e-4, f"{case}: table {name} did not train"
    for rank in range(PROCESSES):
        text = Path(f"{out}.placement.{rank}").read_text()
        assert text.startswith("ValueError") and "tpu:1" in text and "on_process_devices" in text, (rank, text)
