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

The CLI's ``--json`` file loads back with ``load_plan(path)``;
``validate_plan(plan, model, num_devices)`` checks a plan against a model and
a mesh; ``distribution_bytes(plan, tables, num_devices, batch)`` counts what
each device sends per step to distribute inputs and outputs.
"""

from tpurec.sparse.sharding_plan.traffic import (
    DistributionBytes,
    HloCollective,
    PlanDistributionBytes,
    distribution_bytes,
    executed_distribution_bytes,
    hlo_collectives,
)
from tpurec.sparse.planner.estimators import (
    TpuCostModel,
    TpuPerfEstimator,
    TpuPerfModel,
    TpuStorageEstimator,
)
from tpurec.sparse.planner.plan_io import (
    load_plan,
    plan_from_json,
    plan_to_json,
    save_plan,
)
from tpurec.sparse.sharding_plan.validate import validate_plan
from tpurec.sparse.planner.planner import PlanResult, load_tables, plan, tables_to_module
from tpurec.sparse.planner.report import (
    PlanReport,
    RecordedEmbeddingStats,
    StepEstimate,
    TableReport,
)
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
    "DistributionBytes",
    "HloCollective",
    "PlanDistributionBytes",
    "PlanReport",
    "PlanResult",
    "RecordedEmbeddingStats",
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
    "TpuPerfModel",
    "TpuPlannerConfig",
    "TpuPlanningError",
    "TpuStorageEstimator",
    "TpuTopology",
    "distribution_bytes",
    "executed_distribution_bytes",
    "hlo_collectives",
    "load_plan",
    "load_tables",
    "plan",
    "plan_from_json",
    "plan_to_json",
    "save_plan",
    "tables_to_module",
    "tpu_sharders",
    "tpu_sharding_types",
    "validate_plan",
]
