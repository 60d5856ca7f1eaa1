"""TorchRec's ``TrainPipelineSparseDist`` over a DistributedModelParallel model on the tpu device, 2
processes, a mixed (table-, row- and column-wise) plan: the pipeline (each batch's input
distribution issued a step ahead) trains like the plain loop and like the same collection trained
by TorchRec on CPU in one process (see dmp_pipeline_worker.py)."""

from __future__ import annotations

from pathlib import Path

import dmp_worker  # beside this file
import numpy as np
import pytest
from launcher import run

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
def test_two_processes_pipeline_trains_like_the_plain_loop(tmp_path):
    out = tmp_path / "pipe"
    run(HERE / "dmp_pipeline_worker.py", 2, str(out), "mixed", seconds=420)
    losses, tables, _grads = dmp_worker.reference("mixed")
    ranks = [np.load(f"{out}.{rank}.npz") for rank in range(2)]
    for got in ranks:
        assert list(got["pipelined"]) == ["ShardedEmbeddingBagCollection"], got["pipelined"]
        np.testing.assert_allclose(got["pipeline_losses"], got["loop_losses"], rtol=1e-5, atol=0)
    np.testing.assert_allclose(ranks[0]["pipeline_losses"], losses, rtol=1e-5, atol=0, err_msg="vs CPU")
    for way in ("pipeline", "loop"):
        assembled = {name: np.full_like(t, np.nan) for name, t in tables.items()}
        for got in ranks:
            for key in got.files:
                if key.startswith(f"{way}|") and not key.endswith("|offsets"):
                    (r0, c0), block = got[key + "|offsets"], got[key]
                    assembled[key.split("|")[1]][r0 : r0 + block.shape[0], c0 : c0 + block.shape[1]] = block
        for name, want in tables.items():
            np.testing.assert_allclose(assembled[name], want, rtol=1e-5, atol=1e-6, err_msg=f"{way}: table {name}")
    for got in ranks:
        for key in got.files:
            if key.startswith("pipeline|") and not key.endswith("|offsets"):
                np.testing.assert_allclose(got[key], got["loop" + key.removeprefix("pipeline")], rtol=1e-5, atol=1e-6)
