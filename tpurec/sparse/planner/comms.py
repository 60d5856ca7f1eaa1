"""Distribution bytes of a plan: moved to :mod:`tpurec.sparse.spec.traffic` (this path keeps working)."""

from tpurec.sparse.spec.traffic import (
    DATA_PARALLEL_GRADS,
    ROW_WISE_OUTPUTS,
    DistributionBytes,
    HloCollective,
    PlanDistributionBytes,
    TablePlacement,
    distribution_bytes,
    executed_distribution_bytes,
    hlo_collectives,
    options_distribution_bytes,
    placement_distribution_bytes,
    placements_from_options,
)

__all__ = [
    "DATA_PARALLEL_GRADS",
    "ROW_WISE_OUTPUTS",
    "DistributionBytes",
    "HloCollective",
    "PlanDistributionBytes",
    "TablePlacement",
    "distribution_bytes",
    "executed_distribution_bytes",
    "hlo_collectives",
    "options_distribution_bytes",
    "placement_distribution_bytes",
    "placements_from_options",
]
