"""TorchRec's own DistributedModelParallel on the tpu device, unmodified: an EmbeddingBagCollection
sharded table-, row-, column-, table-row- and grid-wise (each alone, and table/row/column mixed in
one plan) by TorchRec's planner, on 2 and 4 processes (table-row-wise and grid also on two torchrun
nodes), several column shards of one table on a rank, and an EmbeddingCollection sharded row- and
table-wise, give the forward values and table gradients of the same TorchRec collection on CPU in
one process, train like it with a plain optimizer over ``model.parameters()``, and their
``state_dict`` loads into a freshly sharded model (see dmp_worker.py).

One launch per torchrun layout (2 processes on one node, 4 on two) runs every plan of that layout (a launch's start,
imports and first programs cost far more than one more plan); each test checks its plans' results."""

from __future__ import annotations

from pathlib import Path

import dmp_worker  # beside this file
import numpy as np
import pytest
from launcher import run

HERE = Path(__file__).resolve().parent
LAUNCH_SECONDS = 900  # a bound on a hang; a launch takes 2-6 min on 2 busy cores
ONE_HOST_PLANS = (
    "table_wise", "row_wise", "column_wise", "mixed", "stacked", "ec_row_wise", "ec_table_wise", "table_row_wise",
    "grid_shard",
)  # fmt: skip
TWO_HOST_PLANS = ("mixed", "table_row_wise", "grid_shard")


def _launch(processes: int, out: Path, plans: tuple[str, ...], hosts: int = 1) -> None:
    """Runs dmp_worker.py under torchrun, ``hosts`` torchrun nodes (one agent each) of equal size;
    fails with their output unless every rank ended well."""
    run(HERE / "dmp_worker.py", processes, str(out), ",".join(plans), nodes=hosts, seconds=LAUNCH_SECONDS)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every plan of two processes on one node, trained in one launch; the results' path prefix."""
    out = tmp_path_factory.mktemp("dmp") / "two"
    _launch(2, out, ONE_HOST_PLANS)
    return out


def _assemble(ranks: list, tables: dict[str, np.ndarray], suffix: str) -> tuple[dict[str, np.ndarray], dict]:
    """The tables (``suffix=""``) or their gradients (``"|grad"``) put together from every rank's
    shards, and the number of shards of each."""
    assembled = {name: np.full_like(t, np.nan) for name, t in tables.items()}
    shards = {name: 0 for name in tables}
    for got in ranks:
        for key in got.files:
            name, *rest = key.split("|")
            if name not in tables or len(rest) != 1:
                continue
            (r0, c0), block = got[key + "|offsets"], got[key + suffix]
            assembled[name][r0 : r0 + block.shape[0], c0 : c0 + block.shape[1]] = block
            shards[name] += 1
    return assembled, shards


def _check(out: Path, plan: str, processes: int, hosts: int = 1) -> None:
    """Losses (1e-5 relative), the first forward's values, the first step's table gradients and
    the trained tables, assembled from every rank's shards (1e-5 relative, 1e-6 absolute), equal
    the CPU reference."""
    losses, tables, grads = dmp_worker.reference(plan)
    ranks = [np.load(f"{out}.{plan}.{rank}.npz") for rank in range(processes)]
    np.testing.assert_allclose(ranks[0]["losses"], losses, rtol=1e-5, atol=0, err_msg=f"{plan}: losses")
    for rank, got in enumerate(ranks):
        want = dmp_worker.reference_forward(plan, rank, processes)
        np.testing.assert_allclose(got["forward"], want, rtol=1e-5, atol=1e-6, err_msg=f"{plan}: rank {rank} forward")
    assembled, shards = _assemble(ranks, tables, "")
    assembled_grads, _ = _assemble(ranks, tables, "|grad")
    for name, want in tables.items():
        np.testing.assert_allclose(assembled[name], want, rtol=1e-5, atol=1e-6, err_msg=f"{plan}: table {name}")
        np.testing.assert_allclose(
            assembled_grads[name], grads[name], rtol=1e-5, atol=1e-6, err_msg=f"{plan}: gradient of {name}"
        )
    per_host = processes // hosts
    for name, kind in dmp_worker.sharding_types(plan).items():
        dim = dict((n, d) for n, _r, d in dmp_worker._tables(plan))[name]
        wanted = {
            "table_wise": 1, "row_wise": processes, "column_wise": dim // 16, "table_row_wise": per_host,
            "grid_shard": dim // 16 * per_host,
        }[kind]  # fmt: skip
        assert shards[name] == wanted, (plan, name, kind, shards[name])


@pytest.mark.slow
def test_two_processes_each_sharding_type_and_a_mixed_plan(two_processes: Path) -> None:
    """Table-, row- and column-wise, a mix, and four column shards of one table on 2 ranks (each
    rank holds two: the sharded module's table parameter is them stacked)."""
    for plan in ("table_wise", "row_wise", "column_wise", "mixed", "stacked"):
        _check(two_processes, plan, 2)


@pytest.mark.slow
def test_two_processes_embedding_collection_row_and_table_wise(two_processes: Path) -> None:
    """An EmbeddingCollection (unpooled lookups) on the UNFUSED_TPU kernel matches its CPU twin:
    forward values, table gradients, trained tables."""
    for plan in ("ec_row_wise", "ec_table_wise"):
        _check(two_processes, plan, 2)


@pytest.mark.slow
def test_two_processes_table_row_wise_and_grid_on_one_host(two_processes: Path) -> None:
    """One host of two ranks: each table row-wise over the host; grid puts both column shards of
    t3 on every rank (stacked)."""
    for plan in ("table_row_wise", "grid_shard"):
        _check(two_processes, plan, 2)


@pytest.mark.slow
def test_four_processes_on_two_hosts_mixed_table_row_wise_and_grid(tmp_path):
    """Two torchrun nodes of two ranks: a table's shards on the ranks of one host (grid: a host per
    column shard), and the mixed plan."""
    plans = TWO_HOST_PLANS
    _launch(4, tmp_path / "four", plans, hosts=2)
    for plan in plans:
        _check(tmp_path / "four", plan, 4, hosts=2)
