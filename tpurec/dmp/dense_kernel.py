"""TorchRec's DENSE compute kernel on the tpu device: tpurec's unfused tpu kernel in place of FBGEMM's.

TorchRec gives a table the ``DENSE`` kernel (FBGEMM's ``DenseTableBatchedEmbeddingBagsCodegen``,
plain autograd tables trained by the dense optimizer) when it is data-parallel (the only kernel
its planner allows there) and, in ``construct_module_sharding_plan``'s ``row_wise()``,
``table_wise()``, ``column_wise()``... when no kernel is named and the table has no in-backward
optimizer. Without CUDA TorchRec builds FBGEMM's kernel on the CPU: a data-parallel group's
``DistributedDataParallel`` wrapper (``device_ids=[tpu]``) refuses a CPU module, and the kernel's
tables are ``TableBatchedEmbeddingSlice`` views of one flat weight, a tensor subclass that cannot
be made over a tpu tensor either.

:mod:`tpurec.dmp.grouped_lookups` (a patch of ``tpurec/_patches.py``, applied when
``torchrec.distributed.embedding_lookup`` is imported) makes TorchRec's grouped lookups
(``GroupedPooledEmbeddingsLookup``, ``GroupedEmbeddingsLookup``) build a ``DENSE`` group of any
sharding type on a tpu device with :class:`DenseTPUEmbeddingBag` / :class:`DenseTPUEmbedding`
(:func:`kernel_classes`) instead: TorchRec's tpu kernels (``BatchedTPUEmbeddingBag`` /
``BatchedTPUEmbedding``, one tpu parameter per table shard, looked up by ``torch.ops.torchrec``,
tpurec's ``sparse_dense_matmul`` in ``tpurec/dmp/lookup_ops.py``) with what FBGEMM's dense kernel
does that they do not:

* tables of any width (TorchRec's pooled tpu table takes multiples of 16 only, a limit of its
  Pallas kernel that tpurec's lookup does not have);
* the tables' values in ``state_dict`` detached from autograd, as FBGEMM's kernel gives them: the
  sharded collection declares a ``DENSE`` table's ShardedTensor ``requires_grad=False`` and
  refuses local shards that require grad. They share the parameters' storage, so loading a
  state_dict writes the tables the lookups read.

A data-parallel table's gradient is the dense table gradient, which the sharded collection's
DDP wrapper all-reduces (averages) over the ``"tpu"`` group; a sharded table's is its shard's,
trained by the optimizer over ``model.parameters()`` as on CPU. Pooling (sum, mean) is the
group's, as in FBGEMM's kernel. Every other device keeps FBGEMM's kernel.

FBGEMM's kernel also takes per-sample weights (a weighted collection), which TorchRec's tpu
lookups would drop: a weighted batch is pooled with ``torch.nn.functional.embedding_bag`` and its
``per_sample_weights`` on tpu instead (the weighted sum, divided by the bag's length for MEAN, as
FBGEMM pools). Variable batch sizes per feature, which the lookups would mis-stack, raise
``NotImplementedError``.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch
from torch import nn

__all__ = ["is_dense", "kernel_classes"]

_KERNELS = "torchrec.distributed.batched_embedding_kernel"
_TPU_MODULES = "torchrec.experimental.torch_tpu.modules.embedding_modules"


def _check_input(kernel: str, features: Any) -> None:
    """Refuses what the tpu lookups would compute differently from FBGEMM's dense kernel."""
    if features.variable_stride_per_key():
        raise NotImplementedError(
            f"{kernel}: a DENSE-kernel table on the tpu device takes one batch size for every feature "
            "(variable batch sizes per feature are not run); shard these tables another way"
        )


@functools.cache
def kernel_classes() -> tuple[type, type]:
    """The DENSE tpu kernels: TorchRec's TPU kernels, any table width, detached state_dict values."""
    kernels = importlib.import_module(_KERNELS)
    tpu_modules = importlib.import_module(_TPU_MODULES)
    from torchrec.modules.embedding_configs import data_type_to_sparse_type

    from tpurec.dmp.unfused_tables import stack_column_shards

    class PooledTable(tpu_modules.TPUEmbeddingBagUnfused):
        """TorchRec's pooled tpu table (its offset lookup) of any width."""

        def __init__(self, rows: int, dim: int, device: torch.device | None, dtype: torch.dtype, mode: str) -> None:
            # TorchRec's __init__ but its multiple-of-16 check (its Pallas kernel's, not tpurec's lookup's).
            nn.Module.__init__(self)
            self._num_embeddings = rows
            self._embedding_dim = dim
            self._device = device
            self._dtype = dtype
            self._weight = nn.Parameter(torch.zeros((rows, dim), dtype=dtype, device=device))
            self.output_dtype = dtype
            self.mode = mode
            self._kernel = tpu_modules.PooledLookupKernel.OFFSET

        def forward(
            self, input: torch.Tensor, offsets: torch.Tensor, per_sample_weights: torch.Tensor | None = None
        ) -> torch.Tensor:
            # A KeyedJaggedTensor's per-key offsets may be computed on the host (from its lengths).
            device = self._weight.device
            input, offsets = input.to(device), offsets.to(device)
            if per_sample_weights is None:
                return super().forward(input, offsets)
            # FBGEMM's weighted pooling: the weighted sum, divided by the bag's length for MEAN.
            per_sample_weights = per_sample_weights.to(device)
            pooled = nn.functional.embedding_bag(
                input, self._weight, offsets, mode="sum", per_sample_weights=per_sample_weights,
                include_last_offset=True,
            )  # fmt: skip
            if self.mode == "mean":
                lengths = (offsets[1:] - offsets[:-1]).clamp(min=1)
                pooled = pooled / lengths.unsqueeze(1).to(pooled.dtype)
            return pooled

    class DenseTPUEmbeddingBag(kernels.BatchedTPUEmbeddingBag):
        """A DENSE pooled group on tpu (tpurec.dmp.dense_kernel)."""

        def __init__(
            self, config: Any, pg: Any = None, device: torch.device | None = None, sharding_type: Any = None
        ) -> None:
            # TorchRec's BatchedTPUEmbeddingBag.__init__ with tables of any width.
            kernels.BaseBatchedEmbeddingBag.__init__(self, config, pg, device, sharding_type)
            self.pooled_lookup_kernel = tpu_modules.PooledLookupKernel.OFFSET
            self._use_batched_lookup = False
            dtype = data_type_to_sparse_type(config.data_type).as_dtype()
            mode = "mean" if self._pooling == kernels.PoolingMode.MEAN else "sum"
            self._emb_modules = nn.ModuleList(
                PooledTable(rows, cols, device, dtype, mode)
                for rows, cols in zip(self._local_rows, self._local_cols, strict=True)
            )
            self.init_parameters()
            stack_column_shards(self)

        def split_embedding_weights(self) -> list[torch.Tensor]:
            return [weight.detach() for weight in super().split_embedding_weights()]

        def forward(self, features: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            _check_input(type(self).__name__, features)
            if features.weights_or_none() is None:
                return super().forward(features, *args, **kwargs)
            # A weighted collection: each feature's bags pooled with its per-sample weights.
            by_key = features.to_dict()
            outputs = [
                self._emb_modules[self._feature_table_map[i]](
                    input=by_key[key].values(), offsets=by_key[key].offsets(), per_sample_weights=by_key[key].weights()
                )
                for i, key in enumerate(features.keys())
            ]
            return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    class DenseTPUEmbedding(kernels.BatchedTPUEmbedding):
        """A DENSE sequence group on tpu (tpurec.dmp.dense_kernel)."""

        def split_embedding_weights(self) -> list[torch.Tensor]:
            return [weight.detach() for weight in super().split_embedding_weights()]

        def forward(self, features: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            _check_input(type(self).__name__, features)
            return super().forward(features, *args, **kwargs)

    return DenseTPUEmbeddingBag, DenseTPUEmbedding


def is_dense(config: Any) -> bool:
    """Whether TorchRec planned the table group ``config`` (a ``GroupedEmbeddingConfig``) with its DENSE kernel."""
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel

    return config.compute_kernel == EmbeddingComputeKernel.DENSE
