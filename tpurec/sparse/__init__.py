"""tpurec.sparse: KeyedJaggedTensor -> SparseCore CSR input, the
``torch.ops.tpurec`` sparse op set, and embedding modules with fused optimizers.

The planner (``tpurec.sparse.planner``) is imported on demand, not here.

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
from tpurec.sparse.preprocess import preprocess_kjt, read_kjt, stack_tables, suggest_capacities
from tpurec.sparse.types import (
    PAD_ID,
    Capacity,
    CapacityError,
    FeatureSlot,
    SparseCoreInput,
    StackedCsr,
    StackedTable,
    TableInStack,
)

__all__ = [
    "PAD_ID",
    "Capacity",
    "CapacityError",
    "FeatureSlot",
    "SparseCoreInput",
    "StackedCsr",
    "StackedTable",
    "TableInStack",
    "preprocess_kjt",
    "read_kjt",
    "stack_tables",
    "suggest_capacities",
    "EmbeddingOptimizer",
    "SGD",
    "Adagrad",
    "RowWiseAdagrad",
    "Adam",
    "optimizer_from_torch",
    "EmbeddingBagCollection",
    "EmbeddingCollection",
    "QuantEmbeddingBagCollection",
    "from_torchrec",
    "TrainPipeline",
    "checkpoint",
]
