"""``torch.distributed.checkpoint`` of TorchRec's DistributedModelParallel on the tpu device: a DMP
model trained a few steps, saved by 2 processes with ``dcp.save``, loads with ``dcp.load`` into a
freshly sharded model, of the same plan or another one (a rank then holds no shard of some table
on one side: table-wise tables live on one rank), with equal tables and lookups (see
dmp_checkpoint_worker.py)."""

from __future__ import annotations

from pathlib import Path

import dmp_worker  # beside this file
import numpy as np
import pytest
from launcher import run

HERE = Path(__file__).resolve().parent

PAIRS = ("row_wise:table_wise", "table_wise:mixed", "mixed:mixed")


@pytest.mark.slow
def test_two_processes_save_and_load_across_plans(tmp_path):
    run(HERE / "dmp_checkpoint_worker.py", 2, str(tmp_path), ",".join(PAIRS), seconds=420)
    start = dmp_worker._weights("mixed")
    for pair in PAIRS:
        folder = tmp_path / pair.replace(":", "-")
        assert (folder / "checkpoint" / ".metadata").is_file(), pair
        for rank in range(2):
            got = np.load(folder / f"rank{rank}.npz")
            for name, _rows, _dim in dmp_worker.TABLES:
                trained, loaded = got[f"trained|{name}"], got[f"loaded|{name}"]
                assert not np.isnan(trained).any() and not np.isnan(loaded).any(), (pair, name)
                # Training moved the tables: the checkpoint holds more than the starting values.
                assert not np.array_equal(trained, start[name]), (pair, name)
                np.testing.assert_array_equal(loaded, trained, err_msg=f"{pair} rank {rank}: table {name}")
            # Another plan sums a bag's rows in another order: float32 rounding apart, the same lookups.
            np.testing.assert_allclose(
                got["loaded_lookup"], got["trained_lookup"], rtol=1e-6, atol=1e-6, err_msg=f"{pair} rank {rank}"
            )
