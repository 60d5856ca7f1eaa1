"""Sharders that offer TorchRec's planner the sharding types TPUs run.

TorchRec's stock sharders choose their sharding types by compute device; the
TPU ones here offer what SparseCores run:

* ``data_parallel`` (DP): the table on every device, dense all-reduce.
* ``table_wise`` (TW) and ``column_wise`` (CW): whole tables or column blocks
  on one device each.
* ``row_wise`` (RW): rows MOD-sharded (``id % P``) over all devices of one
  slice (SparseCore's native layout).
* ``table_row_wise`` (TWRW): rows MOD-sharded over the devices of one slice,
  for multislice jobs, so row-wise groups never straddle DCN.

On one slice RW and TWRW are the same layout, so only RW is offered; on
several slices RW would span DCN and is left out unless asked for.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.types import ShardingType

from tpurec.sparse.planner.topology import TpuTopology
from tpurec.sparse.sharding_plan.sharding_types import PLANNER_SHARDING_TYPES, SEQUENCE_SHARDING_TYPES

__all__ = [
    "TPU_SHARDING_TYPES",
    "TpuEmbeddingBagCollectionSharder",
    "TpuEmbeddingCollectionSharder",
    "tpu_sharding_types",
    "tpu_sharders",
]

TPU_SHARDING_TYPES: List[str] = list(PLANNER_SHARDING_TYPES)


def tpu_sharding_types(
    topology: TpuTopology,
    allowed: Optional[List[str]] = None,
    allow_cross_slice_row_wise: bool = False,
) -> List[str]:
    """Sharding types worth offering on ``topology``.

    Args:
        topology: the TPU job.
        allowed: restrict to these (TorchRec ``ShardingType`` values).
        allow_cross_slice_row_wise: keep RW on multislice jobs.

    Returns:
        Sharding type values, in TorchRec's order.

    Example::

        tpu_sharding_types(TpuTopology.from_name("v6e-256", num_slices=2))
        # ['data_parallel', 'table_wise', 'column_wise', 'table_row_wise']
    """
    types = list(TPU_SHARDING_TYPES)
    if topology.num_slices == 1:
        types.remove(ShardingType.TABLE_ROW_WISE.value)
    elif not allow_cross_slice_row_wise:
        types.remove(ShardingType.ROW_WISE.value)
    if allowed is not None:
        unknown = set(allowed) - set(TPU_SHARDING_TYPES)
        if unknown:
            raise ValueError(f"Sharding types {sorted(unknown)} are not run on TPU; choose from {TPU_SHARDING_TYPES}")
        types = [t for t in types if t in allowed]
    return types


def _kernels(sharding_type: str) -> List[str]:
    # Sharded tables run the fused kernel (SparseCore lookup whose backward
    # applies the optimizer in place); replicated ones are dense parameters
    # updated by the dense optimizer after the all-reduce.
    if sharding_type == ShardingType.DATA_PARALLEL.value:
        return [EmbeddingComputeKernel.DENSE.value]
    return [EmbeddingComputeKernel.FUSED.value]


class TpuEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """``EmbeddingBagCollection`` sharder offering the TPU sharding types.

    Args:
        sharding_types: the types to offer (see :func:`tpu_sharding_types`).
        fused_params: passed to TorchRec (e.g. the optimizer).
        **kwargs: other ``EmbeddingBagCollectionSharder`` arguments.

    Example::

        topo = TpuTopology.from_name("v5p-128")
        sharder = TpuEmbeddingBagCollectionSharder(tpu_sharding_types(topo))
        sharder.sharding_types("tpu")
    """

    def __init__(
        self,
        sharding_types: Optional[List[str]] = None,
        fused_params: Optional[Dict[str, Any]] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(fused_params=fused_params, **kwargs)
        self._tpu_sharding_types = list(sharding_types or TPU_SHARDING_TYPES)

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return list(self._tpu_sharding_types)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return _kernels(sharding_type)


class TpuEmbeddingCollectionSharder(EmbeddingCollectionSharder):
    """``EmbeddingCollection`` (sequence) sharder offering the TPU sharding types.

    TorchRec runs sequence tables with DP, TW, CW and RW only.

    Args:
        sharding_types: the types to offer.
        fused_params: passed to TorchRec.
        **kwargs: other ``EmbeddingCollectionSharder`` arguments.

    Example::

        TpuEmbeddingCollectionSharder(["table_wise", "row_wise"])
    """

    _SEQUENCE_TYPES = frozenset(SEQUENCE_SHARDING_TYPES)

    def __init__(
        self,
        sharding_types: Optional[List[str]] = None,
        fused_params: Optional[Dict[str, Any]] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(fused_params=fused_params, **kwargs)
        types = sharding_types or TPU_SHARDING_TYPES
        self._tpu_sharding_types = [t for t in types if t in self._SEQUENCE_TYPES]

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return list(self._tpu_sharding_types)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return _kernels(sharding_type)


def tpu_sharders(
    topology: TpuTopology,
    allowed: Optional[List[str]] = None,
    allow_cross_slice_row_wise: bool = False,
    fused_params: Optional[Dict[str, Any]] = None,
) -> List[Any]:
    """The TPU sharders for ``topology`` (EmbeddingBagCollection and EmbeddingCollection).

    Args:
        topology: the TPU job.
        allowed: restrict the sharding types.
        allow_cross_slice_row_wise: keep RW on multislice jobs.
        fused_params: passed to TorchRec.

    Returns:
        Sharders, ready for ``EmbeddingShardingPlanner.plan``.

    Example::

        sharders = tpu_sharders(TpuTopology.from_name("v4-32"))
    """
    types = tpu_sharding_types(topology, allowed, allow_cross_slice_row_wise)
    return [
        TpuEmbeddingBagCollectionSharder(types, fused_params=fused_params),
        TpuEmbeddingCollectionSharder(types, fused_params=fused_params),
    ]
