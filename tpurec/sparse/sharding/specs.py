"""Per-table shard specs of a plan: moved to :mod:`tpurec.sparse.spec.shards` (this path keeps working)."""

from tpurec.sparse.spec.shards import SHARDING_TYPES, ShardPiece, TableSharding, module_plans, table_shardings

__all__ = ["SHARDING_TYPES", "ShardPiece", "TableSharding", "table_shardings", "module_plans"]
