"""load_plan / plan_to_json / validate_plan: the CLI's JSON back into a ShardingPlan, checked."""

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
from torchrec.distributed.types import (
    BoundsCheckMode,
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingPlan,
)
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.types import DataType

from tpurec.sparse.planner import (
    TableSpec,
    load_plan,
    plan,
    plan_from_json,
    plan_to_json,
    save_plan,
    tables_to_module,
    validate_plan,
)
from tpurec.sparse.planner.__main__ import main as cli_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

TABLES = [
    TableSpec("big", 200_000, 64, 4.0),
    TableSpec("mid", 3_000, 32, 2.0),
    TableSpec("tiny", 10, 16, 1.0),
    TableSpec("multi", 500, 16, 2.0, feature_names=["f_a", "f_b"]),
]


def _assert_plans_equal(a: ShardingPlan, b: ShardingPlan) -> None:
    assert a.plan.keys() == b.plan.keys()
    for path in a.plan:
        assert a.plan[path].keys() == b.plan[path].keys()
        for name in a.plan[path]:
            pa, pb = a.plan[path][name], b.plan[path][name]
            assert pa == pb, f"{path}.{name}: {pa} != {pb}"
            if pa.sharding_spec is not None:
                for sa, sb in zip(pa.sharding_spec.shards, pb.sharding_spec.shards):
                    assert sa.placement.rank() == sb.placement.rank()
                    assert str(sa.placement.device()) == str(sb.placement.device())
    assert a == b


def _spec(shards):
    return EnumerableShardingSpec([ShardMetadata(list(o), list(s), p) for o, s, p in shards])


def test_cli_json_round_trips_to_the_same_sharding_plan(tmp_path):
    """plan -> `tpurec plan --json` (own process, the path users run) -> load_plan -> equal plan."""
    tables = tmp_path / "tables.json"
    tables.write_text(json.dumps({"tables": [t.__dict__ for t in TABLES]}))
    out = tmp_path / "plan.json"
    args = ["--topology", "v5p-16", "--tables", str(tables), "--batch-size", "2048", "--timeout", "10"]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-m", "tpurec.sparse.planner", *args, "--json", str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    loaded = load_plan(out)
    # The same planner inputs give the same plan in this process.
    expected, _ = plan(TABLES, "v5p-16", batch_size=2048)
    _assert_plans_equal(loaded, expected)
    assert isinstance(loaded.plan[""], EmbeddingModuleShardingPlan)
    validate_plan(loaded, tables_to_module(TABLES), num_devices=8)


def test_round_trip_keeps_every_parameter_sharding_field(tmp_path):
    original = ShardingPlan(
        {
            "sparse.ebc": EmbeddingModuleShardingPlan(
                {
                    "tw": ParameterSharding(
                        "table_wise",
                        "fused",
                        [3],
                        _spec([((0, 0), (10, 8), "rank:3/tpu:3")]),
                        enforce_hbm=True,
                        stochastic_rounding=False,
                        bounds_check_mode=BoundsCheckMode.WARNING,
                        output_dtype=DataType.BF16,
                    ),
                    "cw": ParameterSharding(
                        "column_wise",
                        "fused",
                        [0, 1],
                        _spec([((0, 0), (20, 8), "rank:0/tpu:0"), ((0, 8), (20, 8), "rank:1/tpu:1")]),
                    ),
                    "dp": ParameterSharding("data_parallel", "dense", [0, 1, 2, 3], None),
                }
            ),
            "": EmbeddingModuleShardingPlan(
                {
                    "rw": ParameterSharding(
                        "row_wise",
                        "fused",
                        [0, 1],
                        _spec([((0, 0), (5, 4), "rank:0/tpu:0"), ((5, 0), (5, 4), "rank:1/tpu:1")]),
                    ),
                }
            ),
        }
    )
    path = tmp_path / "p.json"
    save_plan(original, path)
    _assert_plans_equal(load_plan(path), original)
    # A bare plan object (no "report"/"plan" wrapper) loads too.
    _assert_plans_equal(plan_from_json(json.loads(json.dumps(plan_to_json(original)))), original)


@pytest.mark.parametrize(
    "doc, needle",
    [
        ([1, 2], "JSON object"),
        ({"": {"t": {"compute_kernel": "fused"}}}, "missing ['sharding_type']"),
        ({"": {"t": {"sharding_type": "table_wise", "compute_kernel": "fused", "ranks": ["0"]}}}, "ranks"),
        (
            {"": {"t": {"sharding_type": "table_wise", "compute_kernel": "fused", "shards": [{"sizes": [1, 1]}]}}},
            "shard 0 needs",
        ),
        (
            {"": {"t": {"sharding_type": "table_wise", "compute_kernel": "fused", "output_dtype": "FP99"}}},
            "unknown enum",
        ),
    ],
)
def test_malformed_plan_json_is_a_clear_error(doc, needle):
    with pytest.raises(ValueError) as info:
        plan_from_json(doc)
    assert needle in str(info.value)


def test_not_json_is_a_clear_error(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("not json")
    with pytest.raises(ValueError, match="is not JSON"):
        load_plan(p)


def _small_plan() -> ShardingPlan:
    return ShardingPlan(
        {
            "": EmbeddingModuleShardingPlan(
                {
                    "a": ParameterSharding("table_wise", "fused", [1], _spec([((0, 0), (100, 16), "rank:1/tpu:1")])),
                    "b": ParameterSharding(
                        "row_wise",
                        "fused",
                        [0, 1],
                        _spec([((0, 0), (25, 8), "rank:0/tpu:0"), ((25, 0), (25, 8), "rank:1/tpu:1")]),
                    ),
                    "c": ParameterSharding("data_parallel", "dense", [0, 1], None),
                }
            )
        }
    )


SMALL_TABLES = [TableSpec("a", 100, 16), TableSpec("b", 50, 8), TableSpec("c", 4, 8)]


def test_validate_accepts_a_matching_plan_in_every_table_form():
    sp = _small_plan()
    validate_plan(sp, SMALL_TABLES, 2)
    validate_plan(sp, {"a": (100, 16), "b": (50, 8), "c": (4, 8)}, 2)
    configs = [
        EmbeddingBagConfig(
            name=t.name, num_embeddings=t.num_embeddings, embedding_dim=t.embedding_dim, feature_names=[t.name]
        )
        for t in SMALL_TABLES
    ]
    validate_plan(sp, configs, 2)
    validate_plan(sp, tables_to_module(SMALL_TABLES), 2)


@pytest.mark.parametrize(
    "mutate, tables, devices, needle",
    [
        (lambda p: None, SMALL_TABLES, 1, "rank 1 is outside the mesh of 1 devices"),
        (
            lambda p: setattr(p.plan[""]["a"], "sharding_type", "grid_shard"),
            SMALL_TABLES,
            2,
            "unknown sharding type 'grid_shard'",
        ),
        (lambda p: p.plan[""].pop("b"), SMALL_TABLES, 2, "tables ['b'] are in the model but not in the plan"),
        (lambda p: None, SMALL_TABLES[:2], 2, "tables ['c'] that the model does not have"),
        (
            lambda p: None,
            [TableSpec("a", 100, 16), TableSpec("b", 60, 8), TableSpec("c", 4, 8)],
            2,
            "cover 400 of the table's 480",
        ),
        (
            lambda p: None,
            [TableSpec("a", 90, 16), TableSpec("b", 50, 8), TableSpec("c", 4, 8)],
            2,
            "outside the 90 x 16 table",
        ),
        (
            lambda p: (
                setattr(p.plan[""]["a"], "ranks", [0])
                or setattr(p.plan[""]["a"], "sharding_spec", _spec([((0, 0), (100, 16), "rank:5/tpu:1")]))
            ),
            SMALL_TABLES,
            2,
            "shard 0 is placed on rank:5/tpu:1, outside the mesh of 2 devices",
        ),
        (
            lambda p: setattr(p.plan[""]["a"], "sharding_spec", _spec([((0,), (100,), "rank:1/tpu:1")])),
            SMALL_TABLES,
            2,
            "shards are 2-D",
        ),
    ],
)
def test_validate_rejects_with_a_clear_message_and_changes_nothing(mutate, tables, devices, needle):
    sp = _small_plan()
    mutate(sp)
    before = plan_to_json(sp)
    with pytest.raises(ValueError) as info:
        validate_plan(sp, tables, devices)
    assert needle in str(info.value)
    assert plan_to_json(sp) == before


def test_validate_rejects_overlapping_shards_that_tpurec_shard_would_reject():
    # Both row blocks of table b on rows 0..24 (rows 25..49 uncovered): the table's area, inside it.
    # (torch's sharding spec refuses overlapping shards when built, so the plan is edited after.)
    sp = _small_plan()
    sp.plan[""]["b"].sharding_spec.shards[1].shard_offsets = [0, 0]
    before = plan_to_json(sp)
    with pytest.raises(ValueError, match=r"table 'b' \(row_wise\): its shards do not tile"):
        validate_plan(sp, SMALL_TABLES, 2)
    assert plan_to_json(sp) == before


def test_validate_matches_module_paths_of_a_model():
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = tables_to_module(SMALL_TABLES)

    model = Model()
    moved = ShardingPlan({"ebc": _small_plan().plan[""]})
    validate_plan(moved, model, 2)
    with pytest.raises(ValueError, match="plan module '<root>' is not an embedding collection"):
        validate_plan(_small_plan(), model, 2)
    with pytest.raises(ValueError, match="holds no embedding collection"):
        validate_plan(moved, torch.nn.Linear(2, 2), 2)
    with pytest.raises(TypeError):
        validate_plan({"": {}}, SMALL_TABLES, 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_devices"):
        validate_plan(moved, model, 0)


def test_cli_writes_atomically_and_names_load_plan(tmp_path, capsys):
    tables = tmp_path / "t.json"
    tables.write_text(json.dumps([{"name": "x", "num_embeddings": 1000, "embedding_dim": 16}]))
    out = tmp_path / "plan.json"
    assert (
        cli_main(
            [
                "--topology",
                "v6e-8",
                "--tables",
                str(tables),
                "--batch-size",
                "256",
                "--timeout",
                "5",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    # No temporary file left behind.
    assert {p.name for p in tmp_path.iterdir()} == {"t.json", "plan.json"}
    validate_plan(load_plan(out), [TableSpec("x", 1000, 16)], 8)
