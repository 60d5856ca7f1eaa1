"""TorchRec's DistributedModelParallel of an ``EmbeddingCollection`` with the optimizer fused into the backward
(TorchRec's ``FUSED`` kernel, its planner's pick), on the tpu device with 2 processes: trains like TorchRec's
unsharded collection with the same in-backward optimizer on CPU (it was refused: NotImplementedError).
See dmp_fused_sequence_worker.py."""

from __future__ import annotations

from pathlib import Path

import dmp_fused_sequence_worker as worker  # beside this file
import numpy as np
import pytest
from launcher import run

HERE = Path(__file__).resolve().parent
RUNS = (("table_wise", "sgd"), ("row_wise", "adagrad"))


@pytest.mark.slow
def test_two_processes_fused_embedding_collection_trains_as_torchrec_unsharded(tmp_path):
    run(HERE / "dmp_fused_sequence_worker.py", 2, str(tmp_path / "ec"), ",".join(f"{p}:{o}" for p, o in RUNS),
        seconds=540)  # fmt: skip
    for plan, optimizer in RUNS:
        losses, tables = worker.reference(optimizer, world=2)
        ranks = [np.load(f"{tmp_path / 'ec'}.{plan}.{optimizer}.{rank}.npz") for rank in range(2)]
        np.testing.assert_allclose(ranks[0]["losses"], losses, rtol=1e-5, atol=1e-6, err_msg=f"{plan}/{optimizer}")
        assembled = {name: np.full_like(t, np.nan) for name, t in tables.items()}
        for got in ranks:
            for key in got.files:
                if key.startswith("table|"):
                    _, name, r0, c0 = key.split("|")
                    block = got[key]
                    assembled[name][int(r0) : int(r0) + block.shape[0], int(c0) : int(c0) + block.shape[1]] = block
        for name, want in tables.items():
            np.testing.assert_allclose(
                assembled[name], want, rtol=1e-5, atol=1e-6, err_msg=f"{plan}/{optimizer}: {name}"
            )
            assert not np.array_equal(want, worker.weights()[name]), name  # the tables trained
