"""The TorchRec sharding types tpurec runs: the one list, and how each kind moves its data.

Every other list of sharding types in tpurec (what the executor accepts, what
plans may hold, what the planner offers, what sequence tables allow, how the
traffic model treats each kind) is derived from the names here.

Example::

    from tpurec.sparse.sharding_plan.sharding_types import SHARDING_TYPES
    "row_wise" in SHARDING_TYPES  # True
"""

from __future__ import annotations

from torchrec.distributed.types import ShardingType

__all__ = [
    "DATA_PARALLEL",
    "OWNER_SHARDED",
    "PLANNER_SHARDING_TYPES",
    "ROW_SHARDED",
    "SEQUENCE_SHARDING_TYPES",
    "SHARDING_TYPES",
]

DATA_PARALLEL: str = ShardingType.DATA_PARALLEL.value
"""A copy of the table on every device."""

ROW_SHARDED: tuple[str, ...] = (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value)
"""Rows split over a group of devices: each shard returns partial sums of every sample."""

OWNER_SHARDED: tuple[str, ...] = (
    ShardingType.TABLE_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.TABLE_COLUMN_WISE.value,
)
"""Whole tables or column blocks, each on one device: each shard returns whole pooled rows."""

SHARDING_TYPES: tuple[str, ...] = (
    DATA_PARALLEL,
    ShardingType.TABLE_WISE.value,
    ShardingType.ROW_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.TABLE_ROW_WISE.value,
    ShardingType.TABLE_COLUMN_WISE.value,
)
"""The TorchRec sharding types ``tpurec.shard`` executes (and plans may hold)."""

# The planner offers the SparseCore layouts (see tpurec.sparse.planner.sharder), not
# table-column-wise, which runs when a given plan names it; TorchRec's enum order is the order offered.
PLANNER_SHARDING_TYPES: tuple[str, ...] = tuple(
    t.value for t in ShardingType if t.value in SHARDING_TYPES and t.value != ShardingType.TABLE_COLUMN_WISE.value
)
"""The sharding types the TPU planner offers, in TorchRec's order."""

# TorchRec's EmbeddingCollectionSharder runs sequence tables with these only.
SEQUENCE_SHARDING_TYPES: tuple[str, ...] = tuple(
    t for t in PLANNER_SHARDING_TYPES if t != ShardingType.TABLE_ROW_WISE.value
)
"""The sharding types a sequence (``EmbeddingCollection``) table may use."""
