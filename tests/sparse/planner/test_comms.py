"""distribution_bytes: what each device sends per step, against a routing simulation."""

from typing import List

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpurec.sparse.planner import TableSpec, distribution_bytes, plan
from tpurec.sparse.sharding_plan.traffic import (
    DistributionBytes,
    TablePlacement,
    placement_distribution_bytes,
)

ID_BYTES, GRAD_BYTES = 12, 4


def _simulate(p: TablePlacement, world: int, batch: int, seed: int = 0, row_wise_output: str = "psum_scatter"):
    """Route real random ids the way tpurec.shard does and count bytes sent to other devices.

    Pooling factors must be integers here (every sample has exactly that many ids).
    """
    gen = torch.Generator().manual_seed(seed)
    b = batch // world
    out = DistributionBytes.zeros(world)
    features = len(p.pooling_factors)
    group = sorted(set(p.shard_ranks))
    owner_of_sample = torch.arange(batch) // b
    if p.sharding_type == "data_parallel":
        # Every replica gathers every other device's entries and pooled-row gradients.
        for r in range(world):
            others = [d for d in range(world) if d != r]
            out.dense_grad[r] = len(others) * (
                b * sum(int(x) for x in p.pooling_factors) * ID_BYTES + b * features * p.dim * GRAD_BYTES
            )
        return out
    for f, pf in enumerate(p.pooling_factors):
        ids = torch.randint(0, p.rows, (batch, int(pf)), generator=gen)
        if p.sharding_type in ("table_wise", "column_wise", "table_column_wise"):
            for owner, sdim in zip(p.shard_ranks, p.shard_dims):
                for d in range(world):
                    if d != owner:
                        out.input_ids[d] += b * int(pf) * ID_BYTES  # every local id goes to the owner
                        out.output_grad[d] += b * sdim * GRAD_BYTES  # its samples' gradients go back
                out.output[owner] += int((owner_of_sample != owner).sum()) * sdim * GRAD_BYTES
        else:  # row-wise: MOD over the group
            g = len(group)
            dest = torch.tensor(group)[ids % g]  # [batch, pf]
            src = owner_of_sample[:, None].expand_as(dest)
            sent = (dest != src).sum(dim=1)
            for d in range(world):
                out.input_ids[d] += int(sent[owner_of_sample == d].sum()) * ID_BYTES
            for d in group:
                if row_wise_output == "psum_scatter" and g == world:
                    # psum_scatter of a [batch, dim] buffer, all_gather back.
                    out.output[d] += (g - 1) / g * batch * p.dim * GRAD_BYTES
                    out.output_grad[d] += (g - 1) / g * batch * p.dim * GRAD_BYTES
                elif row_wise_output == "psum_scatter":
                    # Table-row-wise: each shard's partial rows go to the other batch owners,
                    # and every other batch owner returns its samples' gradients.
                    out.output[d] += int((owner_of_sample != d).sum()) * p.dim * GRAD_BYTES
                    for s in range(world):
                        if s != d:
                            out.output_grad[s] += b * p.dim * GRAD_BYTES
                else:
                    hit = (dest == d).any(dim=1) & (owner_of_sample != d)
                    fwd = int(hit.sum()) * (p.dim * GRAD_BYTES + 4)
                    out.output[d] += fwd
                    out.output_grad[d] += fwd
    assert features == len(p.pooling_factors)
    return out


def _close(a: List[float], b: List[float], rel: float) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x == pytest.approx(y, rel=rel, abs=1e-6), (a, b)


def _check(p: TablePlacement, world: int, batch: int, rel: float, row_wise_output: str = "psum_scatter") -> None:
    got = placement_distribution_bytes(p, world, batch, ID_BYTES, GRAD_BYTES, row_wise_output=row_wise_output)
    ref = _simulate(p, world, batch, row_wise_output=row_wise_output)
    for field in ("input_ids", "output", "output_grad", "dense_grad"):
        _close(getattr(got, field), getattr(ref, field), rel)


def test_table_wise_exact():
    _check(TablePlacement("t", "table_wise", 1000, 16, [3.0, 1.0], [2], [16]), world=4, batch=64, rel=1e-12)


def test_column_wise_every_shard_gets_every_id():
    p = TablePlacement("t", "column_wise", 1000, 32, [2.0], [0, 3], [16, 16])
    _check(p, world=4, batch=64, rel=1e-12)
    got = placement_distribution_bytes(p, 4, 64)
    # Device 1 owns no shard and sends its 16 samples x 2 ids to both owners.
    assert got.input_ids[1] == 2 * 16 * 2 * ID_BYTES


def test_row_wise_matches_simulated_routing():
    # Expected counts vs one large random batch: within 2%.
    _check(
        TablePlacement("t", "row_wise", 100_000, 8, [4.0, 1.0], [0, 1, 2, 3], [8] * 4), world=4, batch=8192, rel=0.02
    )


def test_table_row_wise_group_inside_the_mesh():
    _check(
        TablePlacement("t", "table_row_wise", 100_000, 8, [3.0], [4, 5, 6, 7], [8] * 4), world=8, batch=8192, rel=0.02
    )


def test_row_wise_sparse_partial_sums_match_simulation():
    _check(
        TablePlacement("t", "row_wise", 100_000, 8, [3.0], list(range(8)), [8] * 8),
        world=8,
        batch=16384,
        rel=0.03,
        row_wise_output="sparse",
    )


def test_data_parallel_only_exchanges_gradients():
    placement = TablePlacement("t", "data_parallel", 10, 4, [1.0], [0, 1], [4, 4])
    got = placement_distribution_bytes(placement, 2, 8)
    assert got.per_device == [0.0, 0.0]
    # all_gather: the other device's 4 entries (12 B) and 4 pooled-row gradients (4 x 4 B).
    assert got.dense_grad == [4 * 12 + 4 * 16.0] * 2
    dense = placement_distribution_bytes(placement, 2, 8, data_parallel_grad="all_reduce")
    assert dense.dense_grad == [10 * 4 * 4.0, 10 * 4 * 4.0]  # 2 (P-1)/P x table bytes, P=2
    with pytest.raises(ValueError, match="data_parallel_grad"):
        placement_distribution_bytes(placement, 2, 8, data_parallel_grad="ring")


def test_bad_inputs_are_clear():
    with pytest.raises(ValueError, match="outside a mesh of 2"):
        placement_distribution_bytes(TablePlacement("t", "table_wise", 10, 4, [1.0], [5], [4]), 2, 8)
    with pytest.raises(ValueError, match="not one tpurec runs"):
        placement_distribution_bytes(TablePlacement("t", "grid_shard", 10, 4, [1.0], [0], [4]), 2, 8)
    with pytest.raises(ValueError, match="row_wise_output"):
        placement_distribution_bytes(
            TablePlacement("t", "row_wise", 10, 4, [1.0], [0], [4]), 2, 8, row_wise_output="dense"
        )


def test_plan_level_counts_agree_with_the_report_column():
    tables = [TableSpec("big", 500_000, 64, 4.0), TableSpec("mid", 2_000, 32, 2.0), TableSpec("tiny", 8, 16, 1.0)]
    sp, report = plan(tables, "v5p-16", batch_size=1024)
    # The report counts row-wise outputs the way the estimator models them (SparseCore partial sums).
    comm = distribution_bytes(sp, tables, world_size=8, batch_size=1024, row_wise_output="sparse")
    for t in report.tables:
        assert t.dist_bytes_per_device == pytest.approx(comm.tables[t.name].max_per_device)
    assert report.distribution_bytes["distribution_max_per_device"] == pytest.approx(comm.total.max_per_device)
    assert set(comm.by_sharding_type) == set(report.sharding_types)
    total = DistributionBytes.zeros(8)
    for group in comm.by_sharding_type.values():
        total.add_(group)
    _close(total.per_device, comm.total.per_device, 1e-12)
    with pytest.raises(ValueError, match="not among the tables given"):
        distribution_bytes(sp, tables[:2], world_size=8, batch_size=1024)


_SHARDING = st.sampled_from(["table_wise", "column_wise", "row_wise", "table_row_wise", "data_parallel"])


@settings(max_examples=25, deadline=None)
@given(
    sharding_type=_SHARDING,
    world=st.sampled_from([2, 4, 8]),
    pfs=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    dim=st.sampled_from([8, 16]),
    seed=st.integers(0, 2**16),
)
def test_any_table_matches_the_simulation(sharding_type, world, pfs, dim, seed):
    """Random placements of a table with random pooling factors: formula vs routed ids."""
    rng = torch.Generator().manual_seed(seed)
    if sharding_type == "table_wise":
        ranks, dims = [int(torch.randint(0, world, (1,), generator=rng))], [dim]
    elif sharding_type == "column_wise":
        ranks = torch.randperm(world, generator=rng)[:2].tolist()
        dims = [dim // 2, dim - dim // 2]
    elif sharding_type == "row_wise":
        ranks, dims = list(range(world)), [dim] * world
    elif sharding_type == "table_row_wise":
        half = max(1, world // 2)
        start = int(torch.randint(0, 2, (1,), generator=rng)) * half if world > 1 else 0
        ranks, dims = list(range(start, start + half)), [dim] * half
    else:
        ranks, dims = list(range(world)), [dim] * world
    p = TablePlacement("t", sharding_type, 50_000, dim, [float(x) for x in pfs], ranks, dims)
    exact = sharding_type in ("table_wise", "column_wise", "data_parallel")
    _check(p, world, batch=world * 1024, rel=1e-12 if exact else 0.05)


def test_planner_bytes_equal_what_the_compiled_row_wise_program_moves():
    """A row-wise step written as tpurec.shard runs it (all_to_all ids, psum_scatter, grad's
    all_gather) on 8 CPU devices: the collectives in its HLO send exactly what the planner counts."""
    import os
    import subprocess
    import sys

    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, ParameterSharding, ShardingPlan

    from tpurec.sparse.planner import hlo_collectives

    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run(
        [sys.executable, os.path.join(here, "_rw_distribution_program.py")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    sent = {}
    for c in hlo_collectives(proc.stdout, num_devices=8):
        sent[c.kind] = sent.get(c.kind, 0.0) + c.sent_bytes

    world, local_batch, pooling, dim, rows_per_shard = 8, 16, 4, 16, 100
    shards = [ShardMetadata([r * rows_per_shard, 0], [rows_per_shard, dim], f"rank:{r}/tpu:{r}") for r in range(world)]
    sp = ShardingPlan(
        {
            "": EmbeddingModuleShardingPlan(
                {"t": ParameterSharding("row_wise", "fused", list(range(world)), EnumerableShardingSpec(shards))}
            )
        }
    )
    comm = distribution_bytes(
        sp, [TableSpec("t", world * rows_per_shard, dim, float(pooling))], world, world * local_batch
    )
    assert set(sent) == {"all-to-all", "reduce-scatter", "all-gather"}
    assert sent["all-to-all"] == pytest.approx(max(comm.total.input_ids))  # 64 ids x 12 B x 7/8 = 672
    assert sent["reduce-scatter"] == pytest.approx(max(comm.total.output))  # 7/8 x 128 x 16 x 4 = 7168
    assert sent["all-gather"] == pytest.approx(max(comm.total.output_grad))


def test_hlo_collective_parsing_forms():
    from tpurec.sparse.planner import hlo_collectives

    text = "\n".join(
        [
            "  a = (s32[4,2]{1,0}, f32[4]{0}) all-to-all(x, y), channel_id=1, replica_groups={{0,1},{2,3}}",
            "  b = bf16[8,16]{1,0} all-reduce(z), replica_groups=[2,4]<=[8], to_apply=add",
            "  c = f32[10]{0} collective-permute(w), source_target_pairs={{0,1}}",
            "  d = f32[32]{0} all-gather-start(v), replica_groups={}, dimensions={0}",
            "  e = f32[2,2]{1,0} add(p, q)",
        ]
    )
    got = hlo_collectives(text, num_devices=8)
    assert [c.kind for c in got] == ["all-to-all", "all-reduce", "collective-permute", "all-gather"]
    assert got[0].result_bytes == 4 * 2 * 4 + 4 * 4 and got[0].group_size == 2
    assert got[0].sent_bytes == pytest.approx(48 / 2)
    assert got[1].group_size == 4 and got[1].sent_bytes == pytest.approx(2 * 8 * 16 * 2 * 3 / 4)
    assert got[2].sent_bytes == 40
    assert got[3].group_size == 8 and got[3].sent_bytes == pytest.approx(128 * 7 / 8)


def _run_sharded_step(scenario: str):
    """Runs _sharded_step_hlo.py (its own process: XLA dumps HLO from the start); (bytes by kind, doc)."""
    import json
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(os.path.dirname(here)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, os.path.join(here, "_sharded_step_hlo.py"), scenario],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    sent = {}
    for kind, nbytes in doc["collectives"]:
        sent[kind] = sent.get(kind, 0.0) + nbytes
    return sent, doc


def test_planner_bytes_equal_what_tpurec_shard_programs_move():
    """tpurec.shard runs one step of a balanced TW + RW + DP plan on 8 CPU devices; the collectives
    XLA receives (HLO dump) send, per device, exactly what distribution_bytes counts."""
    from tpurec.sparse.planner import executed_distribution_bytes, plan_from_json

    sent, doc = _run_sharded_step("balanced")
    plan, tables = plan_from_json(doc["plan"]), doc["tables"]
    comm = distribution_bytes(plan, tables, world_size=8, batch_size=doc["batch"])
    tw, rw = comm.by_sharding_type["table_wise"], comm.by_sharding_type["row_wise"]
    assert set(sent) == {"all-to-all", "reduce-scatter", "all-gather"}
    for d in range(8):  # SPMD: every device runs the same collectives
        assert sent["reduce-scatter"] == pytest.approx(rw.output[d])  # 7/8 x 32 x 8 x 4 = 896
        # The row-wise gradients' all_gather, and the data-parallel table's entries + gradients.
        assert sent["all-gather"] == pytest.approx(rw.output_grad[d] + comm.total.dense_grad[d])
        assert sent["all-to-all"] == pytest.approx(comm.total.input_ids[d] + tw.output[d] + tw.output_grad[d])
        assert sum(sent.values()) == pytest.approx(comm.total.per_device[d] + comm.total.dense_grad[d])
    # Balanced and exactly filled: the buffer model agrees with the payload.
    executed = executed_distribution_bytes(plan, tables, 8, doc["batch"], capacity=doc["capacity"])
    assert executed["total"] == pytest.approx(sum(sent.values()))


def test_executed_bytes_match_a_padded_mixed_plan():
    """TW, CW, TWRW, RW and DP tables of two widths, random ids, capacity 32: the static buffers
    tpurec.shard sends are what executed_distribution_bytes counts, kind by kind."""
    from tpurec.sparse.planner import executed_distribution_bytes, plan_from_json

    sent, doc = _run_sharded_step("mixed")
    plan = plan_from_json(doc["plan"])
    ex = executed_distribution_bytes(plan, doc["tables"], 8, doc["batch"], capacity=doc["capacity"])
    assert sent["all-to-all"] == pytest.approx(ex["ids_all_to_all"] + ex["output_all_to_all"] + ex["grad_all_to_all"])
    assert sent["reduce-scatter"] == pytest.approx(ex["output_psum_scatter"])
    assert sent["all-gather"] == pytest.approx(ex["grad_all_gather"] + ex["data_parallel_all_gather"])
    assert sum(sent.values()) == pytest.approx(ex["total"])
    # The payload is smaller: padding to the capacity and to the busiest device's slots.
    payload = distribution_bytes(plan, doc["tables"], 8, doc["batch"])
    assert max(payload.total.per_device) + max(payload.total.dense_grad) < ex["total"]


def test_executed_bytes_reject_unusable_plans():
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, ParameterSharding, ShardingPlan

    from tpurec.sparse.planner import executed_distribution_bytes

    tables = [TableSpec("t", 10, 8)]
    no_spec = ShardingPlan({"": EmbeddingModuleShardingPlan({"t": ParameterSharding("table_wise", "fused", [0])})})
    with pytest.raises(ValueError, match="no shard metadata"):
        executed_distribution_bytes(no_spec, tables, 2, 8)
    two = ShardingPlan({"a": EmbeddingModuleShardingPlan(), "b": EmbeddingModuleShardingPlan()})
    with pytest.raises(ValueError, match="one module's plan at a time"):
        executed_distribution_bytes(two, tables, 2, 8)
    with pytest.raises(ValueError, match="not among the tables"):
        executed_distribution_bytes(no_spec, [TableSpec("u", 10, 8)], 2, 8)
