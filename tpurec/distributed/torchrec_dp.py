"""TorchRec's data-parallel tables on the tpu device: TorchRec's own TPU kernel in place of FBGEMM's.

TorchRec runs a data-parallel table (sharding type ``DATA_PARALLEL``, compute kernel
``DENSE``, the only kernel its planner allows there) on FBGEMM's
``DenseTableBatchedEmbeddingBagsCodegen``, which it builds on the CPU wherever CUDA is
absent; its sharded collection then wraps that lookup in ``DistributedDataParallel`` with
``device_ids=[tpu]``, and DDP refuses a CPU module for a tpu device. The kernel's tables are
``TableBatchedEmbeddingSlice`` views of one flat weight, a tensor subclass that cannot be made
over a tpu tensor either.

:func:`install` (a patch of ``tpurec/_patches.py``, applied when
``torchrec.distributed.embedding_lookup`` is imported) makes TorchRec's grouped lookups
(``GroupedPooledEmbeddingsLookup``, ``GroupedEmbeddingsLookup``) build a data-parallel group on
a tpu device with TorchRec's own tpu kernel instead (``BatchedTPUEmbeddingBag`` /
``BatchedTPUEmbedding``, the ``UNFUSED_TPU`` kernel): one tpu parameter per table, whole on
every rank, looked up by ``torch.ops.torchrec`` (tpurec's ``sparse_dense_matmul``,
``tpurec/sparse/torchrec_ops.py``), its gradient the dense table gradient, which the sharded
collection's DDP wrapper all-reduces (averages) over the ``"tpu"`` group. Pooling (sum, mean)
is the table's, as in FBGEMM's kernel. Every other device keeps TorchRec's FBGEMM kernel.

FBGEMM's kernel also takes per-sample weights (a weighted collection) and variable batch
sizes per feature; TorchRec's tpu kernel would ignore the first and mis-stack the second, so
a data-parallel group on tpu raises ``NotImplementedError`` for either instead.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch

__all__ = ["install"]

_LOOKUPS = "torchrec.distributed.embedding_lookup"
_KERNELS = "torchrec.distributed.batched_embedding_kernel"


def _check_input(kernel: str, features: Any) -> None:
    """Refuses what TorchRec's tpu kernel would compute differently from FBGEMM's dense kernel."""
    if features.weights_or_none() is not None:
        raise NotImplementedError(
            f"{kernel}: a data-parallel table on the tpu device takes no per-sample weights (a weighted "
            "EmbeddingBagCollection; TorchRec's tpu kernel would drop them); shard weighted tables with tpurec.shard"
        )
    if features.variable_stride_per_key():
        raise NotImplementedError(
            f"{kernel}: a data-parallel table on the tpu device takes one batch size for every feature "
            "(variable batch sizes per feature are not run); shard these tables another way"
        )


@functools.cache
def _classes() -> tuple[type, type]:
    """The data-parallel tpu kernels: TorchRec's TPU kernels with the input check in front."""
    kernels = importlib.import_module(_KERNELS)

    class DataParallelTPUEmbeddingBag(kernels.BatchedTPUEmbeddingBag):
        """A data-parallel pooled group on tpu: TorchRec's ``BatchedTPUEmbeddingBag`` (tpurec.distributed.torchrec_dp)."""

        def forward(self, features: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            _check_input(type(self).__name__, features)
            return super().forward(features, *args, **kwargs)

    class DataParallelTPUEmbedding(kernels.BatchedTPUEmbedding):
        """A data-parallel sequence group on tpu: TorchRec's ``BatchedTPUEmbedding`` (tpurec.distributed.torchrec_dp)."""

        def forward(self, features: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            _check_input(type(self).__name__, features)
            return super().forward(features, *args, **kwargs)

    return DataParallelTPUEmbeddingBag, DataParallelTPUEmbedding


def _is_tpu_dense(config: Any, device: torch.device | None) -> bool:
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel

    return device is not None and device.type == "tpu" and config.compute_kernel == EmbeddingComputeKernel.DENSE


def install() -> None:
    """Makes TorchRec's grouped lookups build data-parallel groups on tpu with its tpu kernel (idempotent)."""
    lookups = importlib.import_module(_LOOKUPS)
    pooled = lookups.GroupedPooledEmbeddingsLookup
    sequence = lookups.GroupedEmbeddingsLookup
    # Its own mark: torchrec_tpu_fused wraps the same methods (marked _tpurec), and this wraps that.
    if getattr(pooled._create_embedding_kernel, "_tpurec_data_parallel", False):
        return
    pooled_original = pooled._create_embedding_kernel
    sequence_original = sequence._create_embedding_kernel

    def create_pooled(
        self: Any, config: Any, device: torch.device | None, pg: Any, sharding_type: Any, env: Any
    ) -> torch.nn.Module:
        if not _is_tpu_dense(config, device):
            return pooled_original(self, config, device, pg, sharding_type, env)
        fused = config.fused_params or {}
        return _classes()[0](
            config=config,
            pg=pg,
            device=device,
            sharding_type=sharding_type,
            pooled_lookup_kernel=fused.get("pooled_lookup_kernel"),
        )

    def create_sequence(
        self: Any, config: Any, pg: Any, device: torch.device | None, env: Any = None
    ) -> torch.nn.Module:
        if not _is_tpu_dense(config, device):
            return sequence_original(self, config, pg, device, env)
        return _classes()[1](config=config, pg=pg, device=device)

    for cls, method in ((pooled, create_pooled), (sequence, create_sequence)):
        method.__name__ = "_create_embedding_kernel"
        method.__doc__ = (
            "TorchRec's kernel for the group; a data-parallel (DENSE) group on a tpu device gets TorchRec's tpu "
            "kernel (tpurec.distributed.torchrec_dp)."
        )
        method._tpurec_data_parallel = True  # pyright: ignore[reportFunctionMemberAccess]
        cls._create_embedding_kernel = method
