"""TorchRec sharding plans placed on the tpu device each process owns.

TorchRec's planner writes a shard's placement as ``rank:<r>/<device>:<r % local_world_size>``:
one process per host that sees every device of the host. tpurec runs one process per tpu
device, and that process's device is its ``tpu:0``; a placement ``tpu:1`` names a device the
process does not have, and the sharded module's ``ShardedTensor`` of its local shards
refuses it (``Local shard tensor device does not match with local Shard's placement``).
With ``Topology(local_world_size=1)`` every placement is ``tpu:0`` already, but table-row-wise
and grid plans place a table on the ranks of one host, which needs the hosts' real size
(torchrun's ``LOCAL_WORLD_SIZE``, which TorchRec's sharders read for their intra-host
groups): :func:`on_process_devices` keeps the plan's ranks, shards and sharding types and
names each rank's own ``tpu:0`` in its placements.
"""

from __future__ import annotations

from typing import Any

__all__ = ["on_process_devices"]


def on_process_devices(plan: Any) -> Any:
    """Points every tpu shard placement of a TorchRec ``ShardingPlan`` at its rank's ``tpu:0``.

    Args:
        plan: a ``torchrec.distributed.types.ShardingPlan`` (from ``EmbeddingShardingPlanner``).

    Returns:
        The same plan, changed in place: each shard placed on ``tpu:<k>`` of rank ``r`` is
        placed on ``tpu:0`` of rank ``r``; shards on other devices, ranks, sizes and offsets
        are unchanged.

    Raises:
        TypeError: ``plan`` is not a ``ShardingPlan``.
    """
    from torch.distributed._shard.sharding_spec.api import EnumerableShardingSpec
    from torch.distributed.remote_device import _remote_device
    from torchrec.distributed.types import ShardingPlan

    if not isinstance(plan, ShardingPlan):
        raise TypeError(f"on_process_devices takes a TorchRec ShardingPlan, got {type(plan).__name__}")
    for module_plan in plan.plan.values():
        for parameter_sharding in module_plan.values():  # pyright: ignore[reportAttributeAccessIssue]
            spec = parameter_sharding.sharding_spec
            if not isinstance(spec, EnumerableShardingSpec):
                continue  # data-parallel tables have no shards
            for shard in spec.shards:
                placement = shard.placement
                if placement is None or placement.device().type != "tpu":
                    continue
                shard.placement = _remote_device(f"rank:{placement.rank()}/tpu:0")
    return plan
