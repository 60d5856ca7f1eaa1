"""TorchRec's DLRM (``torchrec.models.dlrm.DLRM``) under TorchRec's own DistributedModelParallel on
the tpu device: its tables sharded data-, table-, row- and column-wise (each alone, and one plan
mixing all four), its dense and over arch wrapped by DMP in DistributedDataParallel over the
``"tpu"`` group, trained 10 steps of ``torch.optim.SGD(model.parameters())`` on 2 and 4 processes,
equal the same DLRM trained by TorchRec on CPU in one process on the whole batch (see
dmp_dlrm_worker.py). An EmbeddingCollection's data-parallel tables train like on CPU too; a
weighted collection's data-parallel table pools with its per-sample weights as on CPU.

One launch per number of processes runs every plan (a launch's start, imports and first programs cost far more
than one more plan); each test checks its plans' results."""

from __future__ import annotations

from pathlib import Path

import dmp_dlrm_worker as worker  # beside this file
import numpy as np
import pytest
from launcher import run

HERE = Path(__file__).resolve().parent

SECONDS = 900  # a bound on a hang: the two-process launch of every plan takes 2-5 min on 2 busy cores
TWO_PROCESS_PLANS = ("mixed", "sequence", "weighted", "data_parallel", "table_wise", "row_wise", "column_wise")
FOUR_PROCESS_PLANS = ("mixed", "data_parallel", "table_wise", "row_wise", "column_wise")


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every two-process plan trained in one launch; the results' path prefix."""
    out = tmp_path_factory.mktemp("dmp_dlrm") / "two"
    run(HERE / "dmp_dlrm_worker.py", 2, str(out), ",".join(TWO_PROCESS_PLANS), seconds=SECONDS)
    return out


@pytest.fixture(scope="module")
def four_processes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every four-process plan trained in one launch; the results' path prefix."""
    out = tmp_path_factory.mktemp("dmp_dlrm") / "four"
    run(HERE / "dmp_dlrm_worker.py", 4, str(out), ",".join(FOUR_PROCESS_PLANS), seconds=SECONDS)
    return out


def _check(out: Path, plan: str, processes: int) -> None:
    """Losses (1e-5 relative), tables assembled from every rank's shards and every rank's dense
    parameters equal the CPU reference (1e-5 relative, 1e-6 absolute); the tables did train."""
    losses, want = worker.reference()
    start = worker.start_state()
    ranks = [np.load(f"{out}.{plan}.{rank}.npz") for rank in range(processes)]
    np.testing.assert_allclose(ranks[0]["losses"], losses, rtol=1e-5, atol=0, err_msg=f"{plan}: losses")
    kinds = worker._plan_types(plan)
    for name, value in want.items():
        if not name.startswith(worker.TABLE_PREFIX):
            for rank, got in enumerate(ranks):
                np.testing.assert_allclose(
                    got[name], value, rtol=1e-5, atol=1e-6, err_msg=f"{plan} rank {rank}: {name}"
                )
            continue
        table = name.removeprefix(worker.TABLE_PREFIX + ".").removesuffix(".weight")
        if kinds[table] == "data_parallel":
            # Whole on every rank, kept equal by DDP's all-reduce of its gradient.
            for rank, got in enumerate(ranks):
                assert name in got.files, (plan, rank, name)
                np.testing.assert_allclose(
                    got[name], value, rtol=1e-5, atol=1e-6, err_msg=f"{plan} rank {rank}: {name}"
                )
            assembled = ranks[0][name]
        else:
            assembled = np.full_like(value, np.nan)
            shards = 0
            for got in ranks:
                for key in got.files:
                    if key.startswith(name + "|") and not key.endswith("|offsets"):
                        (r0, c0), block = got[key + "|offsets"], got[key]
                        assembled[r0 : r0 + block.shape[0], c0 : c0 + block.shape[1]] = block
                        shards += 1
            wanted = {"table_wise": 1, "row_wise": processes, "column_wise": 2}[kinds[table]]
            assert shards == wanted, (plan, table, kinds[table], shards)
            np.testing.assert_allclose(assembled, value, rtol=1e-5, atol=1e-6, err_msg=f"{plan}: table {table}")
        assert np.abs(assembled - start[name].numpy()).max() > 1e-4, f"{plan}: table {table} did not train"


@pytest.mark.slow
def test_two_processes_mixed_plan_sequence_tables_and_weighted_tables(two_processes: Path) -> None:
    """One plan with a data-parallel, a table-wise, a row-wise and a column-wise table; an
    EmbeddingCollection's data-parallel tables (TorchRec's BatchedTPUEmbedding) trained like on
    CPU; a weighted collection's data-parallel lookup on tpu pooling with the per-sample weights
    as on CPU, and its UNFUSED_TPU row-wise lookup raising (TorchRec's tpu kernel would drop
    them)."""
    out = two_processes
    _check(out, "mixed", 2)
    losses, tables = worker.sequence_reference()
    start = worker._sequence_start()
    for rank in range(2):
        got = np.load(f"{out}.sequence.{rank}.npz")
        np.testing.assert_allclose(got["losses"], losses, rtol=1e-5, atol=0, err_msg=f"sequence rank {rank}: losses")
        for name, want in tables.items():
            np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6, err_msg=f"sequence rank {rank}: {name}")
            assert np.abs(want - start[name]).max() > 1e-4, f"sequence table {name} did not train"
    for rank in range(2):
        lines = dict(line.split(" ", 1) for line in Path(f"{out}.weighted.{rank}").read_text().splitlines())
        assert sorted(lines) == ["data_parallel", "row_wise"], lines
        assert lines["data_parallel"].startswith("looked up, matching CPU"), lines
        text = lines["row_wise"]
        assert text.startswith("NotImplementedError") and "per-sample weights" in text, text


@pytest.mark.slow
@pytest.mark.parametrize("plans", [("data_parallel", "table_wise"), ("row_wise", "column_wise")], ids="-".join)
def test_two_processes_each_sharding_type_alone(two_processes: Path, plans: tuple[str, ...]) -> None:
    """Every table of one sharding type."""
    for plan in plans:
        _check(two_processes, plan, 2)


@pytest.mark.slow
@pytest.mark.parametrize(
    "plans", [("mixed",), ("data_parallel", "table_wise"), ("row_wise", "column_wise")], ids="-".join
)
def test_four_processes_mixed_plan_and_each_sharding_type_alone(four_processes: Path, plans: tuple[str, ...]) -> None:
    for plan in plans:
        _check(four_processes, plan, 4)
