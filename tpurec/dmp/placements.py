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

:func:`check_placements` is what TorchRec's grouped lookups call (the patch
``torchrec_tpu_kernels``) before they build a tpu table group's kernel: a shard placed on
another tpu device than the process's raises tpurec's ``ValueError`` saying how to plan, on every
rank at the same point (the check reads every rank's placements), instead of PyTorch's
``Local shard tensor device does not match`` on some ranks while the others wait in a collective.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_placements", "on_process_devices"]


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


def check_placements(config: Any, device: torch.device) -> None:
    """Raises when a shard of a TorchRec table group is placed on a tpu device other than ``device``'s.

    tpurec runs one process per tpu device and a process's collectives use the device index its
    tensors are on, the same on every rank, so every tpu shard of the plan must name that index.

    Args:
        config: the group's ``GroupedEmbeddingConfig`` (its tables' ``global_metadata`` hold every
            rank's shard placements).
        device: the tpu device the group is built on (no index: the current device).

    Raises:
        ValueError: a shard's placement names another tpu device; the message says how to plan.
    """
    index = device.index if device.index is not None else torch.tpu.current_device()  # pyright: ignore[reportAttributeAccessIssue]
    for table in config.embedding_tables:
        metadata = getattr(table, "global_metadata", None)
        for shard in metadata.shards_metadata if metadata is not None else ():
            placement = shard.placement
            if placement is None:
                continue
            placed = placement.device()
            if placed.type != "tpu" or placed.index is None or placed.index == index:
                continue
            raise ValueError(
                f"the sharding plan places table {table.name!r}'s shard at {list(shard.shard_offsets)} on rank "
                f"{placement.rank()}'s {placed}, but each tpurec process holds its shards on its own tpu:{index} "
                "(one process per tpu device, the same device index on every rank). A plan made for a host whose "
                "processes share its devices (TorchRec's Topology(local_world_size=N), construct_module_sharding_plan("
                "local_size=N), or DistributedModelParallel's own planner under torchrun) places rank r on "
                "tpu:<r % N>. Pass the plan through tpurec.dmp.placements.on_process_devices(plan), or "
                "plan with local_world_size=1 (local_size=1), and give it to DistributedModelParallel(plan=...)"
            )
