"""Properties of plans over random table sets (hypothesis): every plan is complete, valid,
fits, round-trips through JSON, and its report agrees with distribution_bytes."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tpurec.sparse.planner import (
    TableSpec,
    TpuCostModel,
    TpuPlannerConfig,
    TpuTopology,
    distribution_bytes,
    plan,
    plan_from_json,
    plan_to_json,
    tpu_sharding_types,
    validate_plan,
)

ROW_SHARDED = {"row_wise", "table_row_wise"}


@st.composite
def table_sets(draw):
    n = draw(st.integers(1, 5))
    tables = []
    for i in range(n):
        features = draw(st.integers(1, 2))
        tables.append(
            TableSpec(
                name=f"t{i}",
                num_embeddings=draw(st.integers(1, 2_000_000)),
                embedding_dim=draw(st.sampled_from([8, 16, 32, 64, 128])),
                pooling_factor=float(draw(st.integers(1, 20))),
                feature_names=[f"t{i}_f{j}" for j in range(features)],
            )
        )
    return tables


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tables=table_sets(),
    topology=st.sampled_from(["v5p-8", "v6e-8", "v5p-16", "v5e-8", "2xv6e-8"]),
    batch=st.integers(64, 4096),
    row_wise_output=st.sampled_from(["sparse", "psum_scatter"]),
)
def test_any_table_set_gives_a_complete_valid_plan(tables, topology, batch, row_wise_output):
    tpu = TpuTopology.from_name(topology)
    cfg = TpuPlannerConfig(timeout_seconds=5, compare_torchrec_default=False)
    cfg.estimator.row_wise_output = row_wise_output
    result = plan(tables, tpu, batch_size=batch, config=cfg)
    sp, report = result
    world = tpu.world_size

    assert set(sp.plan) == {""} and set(sp.plan[""]) == {t.name for t in tables}
    validate_plan(sp, tables, world)
    assert plan_from_json(json.loads(json.dumps(plan_to_json(sp)))) == sp
    assert report.max_hbm_per_chip <= report.hbm_available_per_chip
    allowed = set(tpu_sharding_types(tpu))
    assert set(report.sharding_types) <= allowed
    for o in result.options:
        if o.sharding_type in ROW_SHARDED:
            assert len({tpu.slice_of(s.rank) for s in o.shards}) == 1

    latency = TpuCostModel(tpu).collective_latency_seconds(report.sharding_types) * 1000
    assert report.collective_latency_ms == pytest.approx(latency) and latency > 0
    assert report.estimate.comms_ms >= report.collective_latency_ms

    comm = distribution_bytes(sp, tables, world, report.local_batch_size * world, row_wise_output=row_wise_output)
    for t in report.tables:
        assert t.dist_bytes_per_device == pytest.approx(comm.tables[t.name].max_per_device)


@settings(max_examples=40, deadline=None)
@given(
    topology=st.sampled_from(["v5p-8", "v5p-128", "v6e-64", "v7x-64"]),
    pfs=st.lists(st.floats(1.0, 200.0), min_size=1, max_size=4),
    batch=st.integers(1, 100_000),
)
def test_row_wise_output_rows_bracket_the_batch(topology, pfs, batch):
    """Over the g shards, every bag hits at least one shard and at most pf of them."""
    model = TpuCostModel(TpuTopology.from_name(topology))
    wk = model.work("row_wise", batch, pfs, 10_000_000, 64)
    g = wk.group
    bags = batch * len(pfs)
    assert g * wk.out_rows >= bags * (1 - 1e-9)
    assert g * wk.out_rows <= batch * sum(max(1.0, pf) for pf in pfs) * (1 + 1e-9)
    assert wk.out_rows <= bags * (1 + 1e-9)


@st.composite
def sharding_plans(draw):
    """Random valid plans over random tables: (plan, {name: (rows, dim)}, devices)."""
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
    from torchrec.distributed.types import (
        BoundsCheckMode,
        EmbeddingModuleShardingPlan,
        ParameterSharding,
        ShardingPlan,
    )

    devices = draw(st.sampled_from([1, 2, 4, 8]))
    shapes, module = {}, EmbeddingModuleShardingPlan()
    for i in range(draw(st.integers(1, 6))):
        rows, dim = draw(st.integers(1, 1000)), draw(st.sampled_from([8, 16, 32]))
        name = f"t{i}"
        shapes[name] = (rows, dim)
        kind = draw(st.sampled_from(["data_parallel", "table_wise", "row_wise", "column_wise"]))
        extra = {}
        if draw(st.booleans()):
            extra = {
                "enforce_hbm": draw(st.booleans()),
                "bounds_check_mode": draw(st.sampled_from(list(BoundsCheckMode))),
            }
        if kind == "data_parallel":
            module[name] = ParameterSharding(kind, "dense", list(range(devices)), None, **extra)
            continue
        if kind == "table_wise":
            r = draw(st.integers(0, devices - 1))
            pieces = [((0, 0), (rows, dim), r)]
        elif kind == "row_wise":
            cuts = sorted(draw(st.sets(st.integers(1, max(1, rows - 1)), max_size=devices - 1))) if rows > 1 else []
            edges = [0, *cuts, rows]
            pieces = [((a, 0), (b - a, dim), k % devices) for k, (a, b) in enumerate(zip(edges, edges[1:]))]
        else:
            parts = draw(st.sampled_from([1, 2]))
            w = dim // parts
            pieces = [((0, k * w), (rows, w), draw(st.integers(0, devices - 1))) for k in range(parts)]
        shards = [ShardMetadata(list(o), list(s), f"rank:{r}/tpu:{r}") for o, s, r in pieces]
        module[name] = ParameterSharding(kind, "fused", [p[2] for p in pieces], EnumerableShardingSpec(shards), **extra)
    return ShardingPlan({draw(st.sampled_from(["", "sparse.ebc"])): module}), shapes, devices


@settings(max_examples=60, deadline=None)
@given(case=sharding_plans())
def test_any_plan_round_trips_and_validates(case, tmp_path_factory):
    from tpurec.sparse.planner import load_plan, save_plan

    sp, shapes, devices = case
    path = tmp_path_factory.mktemp("plans") / "p.json"
    save_plan(sp, path)
    assert load_plan(path) == sp
    validate_plan(sp, shapes, devices)
    # One device fewer than a rank in use: a clear error, the plan untouched.
    used = max(r for m in sp.plan.values() for ps in m.values() for r in (ps.ranks or [0]))
    if used > 0:
        before = plan_to_json(sp)
        with pytest.raises(ValueError, match="outside the mesh"):
            validate_plan(sp, shapes, used)
        assert plan_to_json(sp) == before
