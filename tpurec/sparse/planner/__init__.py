"""TPU-topology sharding planner that speaks TorchRec.

``plan(tables_or_module, topology, batch_size)`` runs TorchRec's
``EmbeddingShardingPlanner`` on a :class:`TpuTopology` with SparseCore-aware
estimators and TPU sharders, and returns a TorchRec ``ShardingPlan`` and a
:class:`PlanReport`.

Example::

    from tpurec.sparse.planner import load_tables, plan
    sharding_plan, report = plan(load_tables("examples/planner/mlperf_dlrm_dcnv2.json"),
                                 "v5p-128", batch_size=55296)
    print(report)
"""

from tpurec.sparse.planner.estimators import (
    TpuCostModel,
    TpuPerfEstimator,
    TpuStorageEstimator,
)
from tpurec.sparse.planner.planner import PlanResult, load_tables, plan, tables_to_module
from tpurec.sparse.planner.report import PlanReport, StepEstimate, TableReport
from tpurec.sparse.planner.sharder import (
    TpuEmbeddingBagCollectionSharder,
    TpuEmbeddingCollectionSharder,
    tpu_sharders,
    tpu_sharding_types,
)
from tpurec.sparse.planner.topology import TPU_GENERATIONS, TpuGeneration, TpuTopology
from tpurec.sparse.planner.types import (
    TableSpec,
    TpuEstimatorConfig,
    TpuPlannerConfig,
    TpuPlanningError,
)

__all__ = [
    "PlanReport",
    "PlanResult",
    "StepEstimate",
    "TPU_GENERATIONS",
    "TableReport",
    "TableSpec",
    "TpuCostModel",
    "TpuEmbeddingBagCollectionSharder",
    "TpuEmbeddingCollectionSharder",
    "TpuEstimatorConfig",
    "TpuGeneration",
    "TpuPerfEstimator",
    "TpuPlannerConfig",
    "TpuPlanningError",
    "TpuStorageEstimator",
    "TpuTopology",
    "load_tables",
    "plan",
    "tables_to_module",
    "tpu_sharders",
    "tpu_sharding_types",
]
