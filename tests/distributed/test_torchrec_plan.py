"""tpurec.dmp.placements.on_process_devices: a TorchRec plan's tpu placements on each rank's tpu:0."""

from __future__ import annotations

import pytest

pytest.importorskip("torchrec")

from torch.distributed._shard.sharding_spec.api import EnumerableShardingSpec  # noqa: E402
from torch.distributed._shard.metadata import ShardMetadata  # noqa: E402
from torchrec.distributed.types import EmbeddingModuleShardingPlan, ParameterSharding, ShardingPlan  # noqa: E402

from tpurec.dmp.placements import on_process_devices  # noqa: E402


def _sharding(sharding_type: str, placements: list[str]) -> ParameterSharding:
    shards = [
        ShardMetadata(shard_offsets=[4 * i, 0], shard_sizes=[4, 16], placement=placement)
        for i, placement in enumerate(placements)
    ]
    ranks = [int(p.split("/")[0].removeprefix("rank:")) for p in placements]
    return ParameterSharding(
        sharding_type=sharding_type,
        compute_kernel="unfused_tpu",
        ranks=ranks,
        sharding_spec=EnumerableShardingSpec(shards),
    )


def test_tpu_placements_name_each_rank_s_tpu_0_and_nothing_else_changes():
    twrw = _sharding("table_row_wise", ["rank:2/tpu:0", "rank:3/tpu:1"])
    cpu = _sharding("row_wise", ["rank:0/cpu", "rank:1/cpu"])
    dp = ParameterSharding(sharding_type="data_parallel", compute_kernel="dense", ranks=[0, 1])
    plan = ShardingPlan({"": EmbeddingModuleShardingPlan({"t0": twrw, "t1": cpu, "t2": dp})})
    assert on_process_devices(plan) is plan
    shards = twrw.sharding_spec.shards  # pyright: ignore[reportOptionalMemberAccess, reportAttributeAccessIssue]
    assert [str(s.placement) for s in shards] == ["rank:2/tpu:0", "rank:3/tpu:0"]
    assert [(s.shard_offsets, s.shard_sizes) for s in shards] == [([0, 0], [4, 16]), ([4, 0], [4, 16])]
    assert twrw.ranks == [2, 3]
    cpu_shards = cpu.sharding_spec.shards  # pyright: ignore[reportOptionalMemberAccess, reportAttributeAccessIssue]
    assert [str(s.placement) for s in cpu_shards] == ["rank:0/cpu", "rank:1/cpu"]
    assert dp.sharding_spec is None


def test_something_else_than_a_plan_is_refused():
    with pytest.raises(TypeError, match="ShardingPlan, got dict"):
        on_process_devices({"": {}})
