"""TorchRec's own DistributedModelParallel on the tpu device, unmodified: an EmbeddingBagCollection
sharded table-, row- and column-wise (each alone and mixed in one plan) by TorchRec's planner, on 2
and 4 processes, and an EmbeddingCollection sharded row- and table-wise, train like the same TorchRec
collection on CPU in one process, with a plain optimizer over ``model.parameters()``, and their
``state_dict`` loads into a freshly sharded model (see dmp_worker.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from ports import free_port_pair

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
LAUNCH_SECONDS = 420
sys.path.insert(0, str(HERE))
try:
    import dmp_worker
finally:
    sys.path.remove(str(HERE))


def _launch(processes: int, out: Path, plans: tuple[str, ...]) -> None:
    """Runs dmp_worker.py under torchrun; fails with its output unless every rank ended well."""
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=1",  # one device per process
        "JAX_PLATFORMS": "cpu",
        "TPUREC_TEST_HANG_SECONDS": str(LAUNCH_SECONDS - 30),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port_pair()),
        str(HERE / "dmp_worker.py"), str(out), ",".join(plans),
    ]  # fmt: skip
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=LAUNCH_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the {processes}-process launch did not end within {LAUNCH_SECONDS} s:\n{output[-6000:]}")
    assert proc.returncode == 0, output[-6000:]


def _check(out: Path, plan: str, processes: int) -> None:
    """Losses (1e-5 relative) and tables assembled from every rank's shards equal the CPU reference."""
    losses, tables = dmp_worker.reference(plan)
    ranks = [np.load(f"{out}.{plan}.{rank}.npz") for rank in range(processes)]
    np.testing.assert_allclose(ranks[0]["losses"], losses, rtol=1e-5, atol=0, err_msg=f"{plan}: losses")
    assembled = {name: np.full_like(t, np.nan) for name, t in tables.items()}
    shards = {name: 0 for name in tables}
    for got in ranks:
        for key in got.files:
            if key == "losses" or key.endswith("|offsets"):
                continue
            name = key.split("|")[0]
            (r0, c0), block = got[key + "|offsets"], got[key]
            assembled[name][r0 : r0 + block.shape[0], c0 : c0 + block.shape[1]] = block
            shards[name] += 1
    for name, want in tables.items():
        np.testing.assert_allclose(assembled[name], want, rtol=1e-5, atol=1e-6, err_msg=f"{plan}: table {name}")
    kind_of_plan = plan.removeprefix("ec_")
    kinds = {name: dmp_worker.MIXED[name] if kind_of_plan == "mixed" else kind_of_plan for name in tables}
    for name, kind in kinds.items():
        wanted = {"table_wise": 1, "row_wise": processes, "column_wise": 2}[kind]
        dim = dict((n, d) for n, _r, d in dmp_worker._tables(plan))[name]
        if kind == "column_wise" and dim == 16:
            wanted = 1  # one column shard of the smallest width
        assert shards[name] == wanted, (plan, name, kind, shards[name])


@pytest.mark.slow
def test_two_processes_each_sharding_type_and_a_mixed_plan(tmp_path):
    plans = ("table_wise", "row_wise", "column_wise", "mixed")
    _launch(2, tmp_path / "two", plans)
    for plan in plans:
        _check(tmp_path / "two", plan, 2)


@pytest.mark.slow
def test_two_processes_embedding_collection_row_and_table_wise(tmp_path):
    """An EmbeddingCollection (unpooled lookups) on the UNFUSED_TPU kernel matches its CPU twin."""
    plans = ("ec_row_wise", "ec_table_wise")
    _launch(2, tmp_path / "ec", plans)
    for plan in plans:
        _check(tmp_path / "ec", plan, 2)


@pytest.mark.slow
def test_four_processes_mixed_plan(tmp_path):
    _launch(4, tmp_path / "four", ("mixed",))
    _check(tmp_path / "four", "mixed", 4)


@pytest.mark.slow
def test_several_column_shards_of_a_table_on_a_rank_are_refused(tmp_path):
    """Four column shards of one table on 2 processes: every rank holds two, and DMP refuses with
    the table named (one parameter per table, as the sharded module registers it, cannot be them)."""
    _launch(2, tmp_path / "cw", ("stacked",))
    for rank in range(2):
        text = (tmp_path / f"cw.stacked.{rank}").read_text()
        assert text.startswith("NotImplementedError") and "column shards of table 'wide'" in text, text
        assert "min_partition" in text, text
