"""Sharded execution of TorchRec sharding plans over a ``jax.sharding.Mesh``.

``tpurec.shard(model, plan, mesh)`` (see :func:`shard`) lays the model's
embedding tables out as the plan says and makes its dense part
data-parallel; see docs/sharding.md.
"""

from tpurec.sparse.sharding.ebc import ShardedEmbeddingBagCollection, host_values
from tpurec.sparse.sharding.model import default_mesh, distribute_batch, replicate, shard
from tpurec.sparse.sharding_plan.layout import Layout
from tpurec.sparse.sharding_plan.shards import SHARDING_TYPES, ShardPiece, TableSharding, module_plans, table_shardings

__all__ = [
    "SHARDING_TYPES",
    "Layout",
    "ShardPiece",
    "ShardedEmbeddingBagCollection",
    "TableSharding",
    "default_mesh",
    "distribute_batch",
    "host_values",
    "module_plans",
    "replicate",
    "shard",
    "table_shardings",
]
