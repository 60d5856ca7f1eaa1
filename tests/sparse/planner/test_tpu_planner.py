"""plan(): TorchRec's planner on TPU topologies, the report, the CLI."""

import json
import os
import re
import time

import pytest
from torchrec.distributed.types import ParameterSharding, ShardingPlan

from tpurec.sparse.planner import (
    PlanReport,
    TableSpec,
    TpuPlannerConfig,
    TpuPlanningError,
    TpuTopology,
    load_tables,
    plan,
    tables_to_module,
)
from tpurec.sparse.planner.__main__ import main as cli_main
from tpurec.sparse.planner.report import collapse_rank_rows

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
MLPERF = os.path.join(ROOT, "examples", "planner", "mlperf_dlrm_dcnv2.json")
ROW_WISE = {"row_wise", "table_row_wise"}

SMALL = [
    TableSpec("huge", 20_000_000, 128, 8.0),
    TableSpec("mid", 300_000, 64, 3.0),
    TableSpec("tiny", 10, 32, 1.0),
    TableSpec("multi", 5_000, 16, 2.0, feature_names=["f_a", "f_b"]),
]


def _check(result, tpu: TpuTopology):
    sp, report = result
    assert isinstance(sp, ShardingPlan) and isinstance(report, PlanReport)
    # Per-chip HBM after optimizer slots stays within what is available.
    assert report.max_hbm_per_chip <= report.hbm_available_per_chip
    for t in report.tables:
        if t.sharding_type in ROW_WISE:
            assert len(t.slices) == 1, f"{t.name} row group straddles slices {t.slices}"
    for o in result.options:
        if o.sharding_type in ROW_WISE:
            assert len({tpu.slice_of(s.rank) for s in o.shards}) == 1
        if o.sharding_type == "row_wise":
            assert tpu.num_slices == 1
    return sp, report


def test_small_plan_is_a_torchrec_plan():
    tpu = TpuTopology.from_name("v5p-16")
    result = plan(SMALL, tpu, batch_size=4096)
    sp, report = _check(result, tpu)
    module_plan = sp.plan[""]
    assert set(module_plan.keys()) == {t.name for t in SMALL}
    for name, ps in module_plan.items():
        assert isinstance(ps, ParameterSharding)
        assert ps.compute_kernel in {"fused", "dense"}
        if ps.sharding_type != "data_parallel":
            assert ps.sharding_spec is not None
            for shard in ps.sharding_spec.shards:
                assert str(shard.placement.device()).startswith("tpu:")
    assert report.local_batch_size == 4096 // tpu.world_size
    text = str(report)
    for needle in ("tpurec SparseCore model", "TorchRec default estimators", "HBM-bandwidth bound", "huge"):
        assert needle in text
    assert report.torchrec_default is not None and report.torchrec_default.total_ms > 0
    assert 0 < report.hbm_bound.total_ms <= report.estimate.total_ms
    doc = json.loads(report.to_json())
    assert doc["topology"]["name"] == "v5p-16" and len(doc["tables"]) == 4


def test_plan_accepts_a_module_and_constraints():
    from torchrec.distributed.planner.types import ParameterConstraints

    tpu = TpuTopology.from_name("v6e-16")
    module = tables_to_module(SMALL)
    cons = {"mid": ParameterConstraints(sharding_types=["table_wise"], pooling_factors=[3.0])}
    sp, report = plan(module, tpu, batch_size=2048, constraints=cons)
    assert sp.plan[""]["mid"].sharding_type == "table_wise"


def test_multislice_keeps_row_groups_in_a_slice():
    tpu = TpuTopology.from_name("v6e-16", num_slices=2)
    result = plan(SMALL, tpu, batch_size=4096)
    _, report = _check(result, tpu)
    assert "row_wise" not in report.sharding_types


def test_too_big_fails_with_numbers():
    tables = [TableSpec(f"t{i}", 400_000_000, 256, 1.0) for i in range(4)]
    with pytest.raises(TpuPlanningError) as info:
        plan(tables, "v4-8", batch_size=1024)
    msg = str(info.value)
    assert "GiB HBM per chip" in msg and "available" in msg
    e = info.value
    assert e.needed_bytes_per_chip > e.available_bytes_per_chip
    assert f"{e.needed_bytes_per_chip / 1024**3:.2f}" in msg
    assert f"{e.available_bytes_per_chip / 1024**3:.2f}" in msg


def test_optimizer_state_counts_towards_capacity():
    # 2 x 60M x 128 fp32 = 57 GiB of weights: fits 4 v4 chips (4 x 28.8 GiB
    # after the 10% reservation) with SGD but not with Adam (3x the bytes).
    tables = [TableSpec(f"t{i}", 60_000_000, 128, 1.0) for i in range(2)]
    sgd = TpuPlannerConfig()
    sgd.estimator.optimizer = "sgd"
    sp, report = plan(tables, "v4-8", batch_size=1024, config=sgd)
    assert report.max_hbm_per_chip <= report.hbm_available_per_chip
    adam = TpuPlannerConfig()
    adam.estimator.optimizer = "adam"
    with pytest.raises(TpuPlanningError):
        plan(tables, "v4-8", batch_size=1024, config=adam)


def test_cli(tmp_path, capsys):
    tables = tmp_path / "t.json"
    tables.write_text(
        json.dumps(
            {
                "embedding_dim": 64,
                "tables": [
                    {"name": "a", "num_embeddings": 100000, "pooling_factor": 4},
                    {"name": "b", "num_embeddings": 50, "embedding_dim": 32},
                ],
            }
        )
    )
    out = tmp_path / "plan.json"
    rc = cli_main(["--topology", "v5p-16", "--tables", str(tables), "--batch-size", "2048", "--json", str(out)])
    assert rc == 0
    assert "per-step embedding time" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert set(doc["plan"]["<root>"]) == {"a", "b"}
    assert doc["report"]["batch_size"] == 2048


def test_cli_reports_failure(tmp_path, capsys):
    tables = tmp_path / "t.json"
    tables.write_text(json.dumps([{"name": "x", "num_embeddings": 2_000_000_000, "embedding_dim": 128}]))
    rc = cli_main(["--topology", "v4-8", "--tables", str(tables), "--batch-size", "64"])
    assert rc == 2
    assert "HBM per chip" in capsys.readouterr().err


def test_mlperf_tables_file():
    tables = load_tables(MLPERF)
    assert len(tables) == 26
    assert sum(t.num_embeddings == 40_000_000 for t in tables) == 5
    assert all(t.embedding_dim == 128 for t in tables)
    assert [int(t.pooling_factor) for t in tables] == [
        3,
        2,
        1,
        2,
        6,
        1,
        1,
        1,
        1,
        7,
        3,
        8,
        1,
        6,
        9,
        5,
        1,
        1,
        1,
        12,
        100,
        27,
        10,
        3,
        1,
        1,
    ]
    assert sorted(t.num_embeddings for t in tables if t.num_embeddings < 40_000_000) == sorted(
        [
            39060,
            17295,
            7424,
            20265,
            3,
            7122,
            1543,
            63,
            3067956,
            405282,
            10,
            2209,
            11938,
            155,
            4,
            976,
            14,
            590152,
            12973,
            108,
            36,
        ]
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, slices",
    [("v5p-128", 1), ("v6e-256", 1), ("v6e-256", 2), ("v7x-64", 1), ("v4-32", 1)],
)
def test_mlperf_plans_under_60s(name, slices):
    tpu = TpuTopology.from_name(name, num_slices=slices)
    t0 = time.perf_counter()
    result = plan(load_tables(MLPERF), tpu, batch_size=55296)
    elapsed = time.perf_counter() - t0
    assert elapsed < 60.0, f"{name} x{slices}: {elapsed:.1f}s"
    _, report = _check(result, tpu)
    assert len(report.tables) == 26
    assert report.torchrec_default is not None


def test_report_prints_torchrec_stats_and_distribution_bytes():
    tpu = TpuTopology.from_name("v6e-8")
    sp, report = plan(SMALL[1:], tpu, batch_size=2048)
    text = str(report)
    # TorchRec's own per-rank table (EmbeddingStats), one row per rank.
    assert "Planner Statistics" in text and report.torchrec_stats
    rank_rows = [ln for ln in report.torchrec_stats if ln.strip("# ").split(" ")[0].isdigit()]
    assert len(rank_rows) == tpu.world_size
    assert "dist/dev" in text and "bytes one device sends per step" in text
    assert report.distribution_bytes["distribution_max_per_device"] > 0
    # Start-up latency: once per collective of each sharding group present.
    from tpurec.sparse.planner import TpuCostModel

    expected = TpuCostModel(tpu).collective_latency_seconds(report.sharding_types) * 1000
    assert report.collective_latency_ms == pytest.approx(expected)
    assert report.estimate.comms_ms >= report.collective_latency_ms
    doc = json.loads(report.to_json())
    assert doc["torchrec_stats"] == report.torchrec_stats


def _printed_rank_rows(text: str) -> list[tuple[int, int, str]]:
    """(first rank, last rank, figures) of each row of the printed per-rank table."""
    rows = []
    for m in re.finditer(r"^#\s+(\d+)(?:-(\d+))?(\s{3}.*)$", text, re.MULTILINE):
        rows.append((int(m.group(1)), int(m.group(2) or m.group(1)), m.group(3)))
    return rows


def test_printed_torchrec_stats_show_alike_consecutive_ranks_once():
    # 256 ranks, most with the same figures: the printed table names each run of ranks once, and
    # every rank's figures are the ones TorchRec logged for it (the JSON keeps TorchRec's rows).
    tpu = TpuTopology.from_name("v5e-256")
    _, report = plan(SMALL, tpu, batch_size=32768)
    logged = {int(m.group(1)): m.group(2) for m in map(re.compile(r"^#\s+(\d+)(\s{3}.*)$").match,
              report.torchrec_stats) if m}  # fmt: skip
    assert sorted(logged) == list(range(256))
    printed = _printed_rank_rows(str(report).split("TorchRec's planner stats", 1)[1])
    assert len(printed) < len(set(logged.values())) + 8 and len(printed) < 64, len(printed)
    assert [r for first, last, _ in printed for r in range(first, last + 1)] == list(range(256))
    for first, last, figures in printed:
        assert all(logged[r] == figures for r in range(first, last + 1)), (first, last)
    assert json.loads(report.to_json())["torchrec_stats"] == report.torchrec_stats


def test_collapse_rank_rows_merges_only_consecutive_alike_ranks():
    header = ["# ---- #", "#      Rank     HBM (GB)  #", "#    ------   ----------  #"]
    rows = ["#         0   0.5 (0%)  #", "#         1   0.5 (0%)  #", "#         2   0.7 (0%)  #",
            "#         3   0.5 (0%)  #", "#         4   0.5 (0%)  #"]  # fmt: skip
    after = ["#                         #", "#         7   a note     #"]
    assert collapse_rank_rows(header + rows + after) == [
        *header,
        "#       0-1   0.5 (0%)  #",
        rows[2],
        "#       3-4   0.5 (0%)  #",
        *after,
    ]
    # A rank column too narrow for the range keeps TorchRec's rows.
    narrow = ["# Rank HBM #", "#  98   0.5 #", "#  99   0.5 #"]
    assert collapse_rank_rows(narrow) == narrow
    assert collapse_rank_rows(rows) == rows  # no table header: not a rank table


def test_v5e_plan_says_there_is_no_sparsecore():
    _, report = plan(SMALL[1:], "v5e-8", batch_size=1024)
    text = str(report)
    assert "NOTE: v5e has no SparseCore" in text
    assert any("no SparseCore" in n for n in report.notes)
    assert "tpurec model (TensorCore gather)" in text
    _, v5p = plan(SMALL[1:], "v5p-8", batch_size=1024)
    assert "no SparseCore" not in str(v5p)
