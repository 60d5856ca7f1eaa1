"""TorchRec's ``FUSED_UVM`` and ``FUSED_UVM_CACHING`` compute kernels under DistributedModelParallel on
tpu: tables planned on them (row-, column- and table-wise, beside a ``FUSED`` table) train on 2
processes like the same DMP model on CPU (TorchRec's FBGEMM kernel, gloo) in the same processes,
5 steps with the optimizer in the backward; sharding on tpu gives exactly one warning that they
run in device memory, on CPU none (see dmp_uvm_worker.py)."""

from __future__ import annotations

from pathlib import Path

import dmp_uvm_worker as worker  # beside this file
import numpy as np
import pytest
from launcher import run

HERE = Path(__file__).resolve().parent

SECONDS = 420
PROCESSES = 2


def _run(out: Path, device: str) -> tuple[list[np.ndarray], dict[str, np.ndarray]]:
    """Each rank's npz and every table assembled from the ranks' shards."""
    ranks = [np.load(f"{out}.{device}.{rank}.npz") for rank in range(PROCESSES)]
    tables = {name: np.full(w.shape, np.nan, np.float32) for name, w in worker.start().items()}
    for got in ranks:
        for key in got.files:
            name, *rest = key.split("|")
            if len(rest) != 1:
                continue
            (r0, c0), block = got[key + "|offsets"], got[key]
            tables[name][r0 : r0 + block.shape[0], c0 : c0 + block.shape[1]] = block
    return ranks, tables


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["rowwise"])
def test_host_memory_kernels_train_on_tpu_as_on_cpu_with_one_warning(tmp_path, optimizer):
    """Losses within 1e-5 relative, every trained table within 1e-5 relative and 1e-6 absolute of the
    CPU model's; every table trained; one warning per tpu rank naming the kernels, none on CPU."""
    out = tmp_path / "uvm"
    run(HERE / "dmp_uvm_worker.py", PROCESSES, str(out), optimizer, seconds=SECONDS)
    cpu_ranks, cpu_tables = _run(out, "cpu")
    tpu_ranks, tpu_tables = _run(out, "tpu")
    np.testing.assert_allclose(tpu_ranks[0]["losses"], cpu_ranks[0]["losses"], rtol=1e-5, atol=0, err_msg="losses")
    start = worker.start()
    for name, want in cpu_tables.items():
        assert not np.isnan(want).any() and not np.isnan(tpu_tables[name]).any(), name
        np.testing.assert_allclose(tpu_tables[name], want, rtol=1e-5, atol=1e-6, err_msg=f"table {name}")
        assert np.abs(want - start[name]).max() > 1e-4, f"table {name} did not train"
    for rank in range(PROCESSES):
        assert list(cpu_ranks[rank]["host_memory_warnings"]) == [], rank
        (message,) = list(tpu_ranks[rank]["host_memory_warnings"])
        assert "device memory" in message and "'fused' kernel" in message, message
