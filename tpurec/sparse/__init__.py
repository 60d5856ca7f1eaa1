"""tpurec.sparse: KeyedJaggedTensor -> SparseCore CSR input, the
``torch.ops.tpurec`` sparse op set, and embedding modules with fused optimizers.

The planner (``tpurec.sparse.planner``) is imported on demand, not here.
``__all__`` is the public API. The preprocessing steps behind the collections
(``preprocess_kjt``, ``read_kjt``, ``stack_tables`` and their types, ``PAD_ID``)
are implementation details, importable from ``tpurec.sparse.preprocess`` and
``tpurec.sparse.types``.

Example::

    import tpurec.sparse as sparse
    model = sparse.from_torchrec(torchrec_model)
"""

from tpurec.sparse import ops  # noqa: F401  (registers torch.ops.tpurec.*)
from tpurec.sparse.convert import from_torchrec
from tpurec.sparse import checkpoint  # noqa: E402  (needs the modules above)
from tpurec.sparse.modules import EmbeddingBagCollection
from tpurec.sparse.sequence import EmbeddingCollection
from tpurec.sparse.quant import QuantEmbeddingBagCollection
from tpurec.sparse.optimizers import SGD, Adagrad, Adam, EmbeddingOptimizer, RowWiseAdagrad, optimizer_from_torch
from tpurec.sparse.pipeline import TrainPipeline
from tpurec.sparse.preprocess import suggest_capacities
from tpurec.sparse.types import Capacity, CapacityError

# Not public (not in __all__), kept as attributes so that code written against earlier
# releases (``sparse.preprocess_kjt(...)``) keeps working.
from tpurec.sparse.preprocess import preprocess_kjt, read_kjt, stack_tables  # noqa: F401
from tpurec.sparse.types import (  # noqa: F401
    PAD_ID,
    FeatureSlot,
    SparseCoreInput,
    StackedCsr,
    StackedTable,
    TableInStack,
)

__all__ = [
    "SGD",
    "Adagrad",
    "Adam",
    "Capacity",
    "CapacityError",
    "EmbeddingBagCollection",
    "EmbeddingCollection",
    "EmbeddingOptimizer",
    "QuantEmbeddingBagCollection",
    "RowWiseAdagrad",
    "TrainPipeline",
    "checkpoint",
    "from_torchrec",
    "optimizer_from_torch",
    "suggest_capacities",
]

# The parts of tpurec.sparse, lowest first: each imports only parts below it (even inside
# a function), checked by tests/core/test_layering.py. ``sharding_plan``, ``planner`` and
# ``mesh_batches`` are device-free: they import nothing of the device runtime (tpurec.core,
# tpurec.dense).
LAYERS = (
    "sharding_plan",  # what a sharding plan says: shard specs, layouts, validation, sharding types, traffic
    "planner",  # the TPU sharding planner (calls nothing of the executor)
    "mesh_batches",  # a batch rebuilt piece by piece, and the mesh a model's batches go to
    "types",  # Capacity, stacked tables, SparseCore CSR input
    "batching",  # the batch sizes of a KeyedJaggedTensor
    "drops",  # entries dropped by overflow="drop", counted per module and in tpurec.stats()
    "update_rules",  # the fused optimizers' update rules, each declared once
    "kernels",  # the lookup kernels (reference, SparseCore, TensorCore, native)
    "preprocess",  # KeyedJaggedTensor -> SparseCore CSR
    "ops",  # torch.ops.tpurec.*
    "optimizers",  # fused embedding optimizers
    "table_init",  # initial table values independent of the sharding (tables born on meta)
    "lookup",  # what every embedding collection does around its lookup (batches ahead, optimizer state)
    "export",  # torch.export / tracing of the collections
    "modules",  # EmbeddingBagCollection
    "sequence",  # EmbeddingCollection
    "quant",  # QuantEmbeddingBagCollection
    "managed",  # managed-collision remaps
    "convert",  # from_torchrec
    "pipeline",  # TrainPipeline
    "sharding",  # the executor: tpurec.shard (calls the planner)
    "checkpoint",  # checkpoints of unsharded and sharded models
)
DEVICE_FREE_LAYERS = ("sharding_plan", "planner", "mesh_batches")
