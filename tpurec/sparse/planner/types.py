"""Configuration dataclasses and errors of the TPU planner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from torchrec.distributed.planner.types import PlannerError, PlannerErrorType

# One table as planned lives in the leaf both the planner and the executor import.
from tpurec.sparse.sharding_plan.tables import TableSpec, as_table_spec

__all__ = [
    "OPTIMIZER_SLOTS",
    "TableSpec",
    "TpuEstimatorConfig",
    "TpuPlannerConfig",
    "TpuPlanningError",
    "as_table_spec",
]

# Optimizer state per table row, as (slots proportional to the embedding
# dimension, fixed slots per row). Adagrad keeps one accumulator per element;
# row-wise Adagrad one per row; Adam/LAMB/FTRL two per element. These are the
# states jax-tpu-embedding and FBGEMM keep next to the table.
OPTIMIZER_SLOTS: Dict[str, tuple] = {
    "sgd": (0, 0),
    "adagrad": (1, 0),
    "rowwise_adagrad": (0, 1),
    "adam": (2, 0),
    "lamb": (2, 0),
    "ftrl": (2, 0),
}


@dataclass
class TpuEstimatorConfig:
    """Knobs of the SparseCore cost and storage model.

    Args:
        optimizer: embedding optimizer (fused into the backward), one of
            :data:`OPTIMIZER_SLOTS`.
        dedup: SparseCores fetch each distinct row of a partition once;
            expected distinct rows are those of uniform draws (a pessimistic
            bound for real, skewed ids).
        sc_hbm_efficiency: fraction of HBM peak that random row gathers reach.
        tensorcore_gather_efficiency: same, for chips without SparseCores.
        hbm_access_granule: bytes; row reads round up to this.
        id_bytes: bytes per id in the SparseCore CSR input (int32 id, int32
            sample id, f32 gain).
        partition_skew: ids in the fullest partition over the mean (MOD
            sharding balances uniform ids; raise it for hot ids).
        capacity_factor: static CSR capacity over expected ids (inputs are
            padded to a fixed capacity so a new batch never recompiles).
        input_buffers: CSR buffers in flight (2: the next batch is
            preprocessed while the current one runs).
        row_pad: rows of each shard pad to ``row_pad`` x SparseCores.
        dim_pad: embedding dims pad to a multiple of this.
        ici_latency_s: fixed cost of one ICI collective.
        dcn_latency_s: fixed cost of one collective crossing DCN.
        grad_bytes: bytes per element of activations and gradients.
        row_wise_output: how row-wise shards return pooled rows:
            ``"sparse"`` (SparseCore: each shard sends only the partial sums
            of samples that hit its rows) or ``"psum_scatter"`` (a dense
            reduce-scatter of every sample's partial sum, as
            ``tpurec.shard`` runs it today).
        data_parallel_grad: how data-parallel tables get their gradients:
            ``"all_reduce"`` (TorchRec: a dense all-reduce of the table
            gradient, then a dense update) or ``"all_gather"`` (as
            ``tpurec.shard`` runs it: every replica gathers the batch's
            entries and pooled gradients and applies the sparse update).

    Example::

        TpuEstimatorConfig(optimizer="rowwise_adagrad", partition_skew=1.2)
    """

    optimizer: str = "adagrad"
    dedup: bool = True
    sc_hbm_efficiency: float = 0.7
    tensorcore_gather_efficiency: float = 0.3
    hbm_access_granule: int = 32
    id_bytes: int = 12
    partition_skew: float = 1.0
    capacity_factor: float = 2.0
    input_buffers: int = 2
    row_pad: int = 8
    dim_pad: int = 8
    ici_latency_s: float = 5e-6
    dcn_latency_s: float = 50e-6
    grad_bytes: int = 4
    row_wise_output: str = "sparse"
    data_parallel_grad: str = "all_reduce"

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZER_SLOTS:
            raise ValueError(f"Unknown optimizer {self.optimizer!r}; known: {sorted(OPTIMIZER_SLOTS)}")
        if self.row_wise_output not in ("sparse", "psum_scatter"):
            raise ValueError(f"row_wise_output must be 'sparse' or 'psum_scatter', got {self.row_wise_output!r}")
        if self.data_parallel_grad not in ("all_reduce", "all_gather"):
            raise ValueError(
                f"data_parallel_grad must be 'all_reduce' or 'all_gather', got {self.data_parallel_grad!r}"
            )


@dataclass
class TpuPlannerConfig:
    """How :func:`tpurec.sparse.planner.plan` searches.

    Args:
        estimator: cost/storage model settings.
        sharding_types: TorchRec sharding types to offer (default: DP, TW, CW,
            RW on one slice; DP, TW, CW, TWRW on several, so row-wise groups
            stay inside a slice).
        allow_cross_slice_row_wise: also offer RW spanning slices.
        cw_min_dim: column-wise shard width where a table has no
            ``min_partition`` constraint.
        reserved_hbm_fraction: HBM per device kept for the dense model,
            activations and XLA scratch.
        timeout_seconds: search budget for the proposers.
        proposers: ``"greedy"``, ``"greedy_nodepth"``, ``"uniform"``,
            ``"grid"``, ``"dp"``.
        compare_torchrec_default: also estimate the chosen plan with TorchRec's
            default estimators, for the report.

    Example::

        TpuPlannerConfig(timeout_seconds=30, estimator=TpuEstimatorConfig(optimizer="sgd"))
    """

    estimator: TpuEstimatorConfig = field(default_factory=TpuEstimatorConfig)
    sharding_types: Optional[List[str]] = None
    allow_cross_slice_row_wise: bool = False
    cw_min_dim: Optional[int] = 32
    reserved_hbm_fraction: float = 0.1
    timeout_seconds: Optional[int] = 45
    proposers: List[str] = field(default_factory=lambda: ["greedy", "uniform"])
    compare_torchrec_default: bool = True


class TpuPlanningError(PlannerError):
    """No plan: states the HBM needed and available per chip.

    Args:
        message: what failed.
        needed_bytes_per_chip: least HBM one chip needs over all plans.
        available_bytes_per_chip: HBM one chip offers to embeddings.
    """

    def __init__(
        self,
        message: str,
        needed_bytes_per_chip: Optional[float] = None,
        available_bytes_per_chip: Optional[float] = None,
        error_type: PlannerErrorType = PlannerErrorType.INSUFFICIENT_STORAGE,
    ) -> None:
        self.needed_bytes_per_chip = needed_bytes_per_chip
        self.available_bytes_per_chip = available_bytes_per_chip
        super().__init__(message, error_type=error_type)
