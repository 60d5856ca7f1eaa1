"""TorchRec's ``FUSED`` compute kernel on the tpu device: the optimizer fused into the lookup's backward.

On a ``"tpu"`` compute device TorchRec 1.9.2's sharders offer two kernels for a sharded table:
``FUSED`` (FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen``, the optimizer applied inside its
backward) and ``UNFUSED_TPU`` (plain autograd parameters). The planner picks ``FUSED`` unless told
otherwise, and ``torchrec.optim.apply_optimizer_in_backward(...)`` or a sharder's
``fused_params`` choose its optimizer (``fused_params["optimizer"]``, an FBGEMM ``EmbOptimType``,
with ``learning_rate``, ``eps``, ...). FBGEMM's TBE cannot be built on tpu (its constructor calls
FBGEMM ops with CPU/CUDA kernels only), and the ``UNFUSED_TPU`` kernel ignores the optimizer in
``fused_params`` (the tables would silently stay as they are).

:func:`create_kernel` is what TorchRec's grouped lookups call for a tpu device (the patch
``torchrec_tpu_kernels``, :mod:`tpurec.dmp.grouped_lookups`): it builds,
for a pooled table group with the ``FUSED`` kernel on tpu, a :class:`TpuFusedEmbeddingBag`: the
same tables and the same fused optimizer as FBGEMM's TBE, run as tpurec's sparse op set (the
lookup ``torch.ops.tpurec.sparse_dense_matmul``, the update its
``sparse_dense_matmul_grad_with_<optimizer>`` in the backward, in place). What FBGEMM would do
and tpurec cannot do exactly raises ``NotImplementedError`` when the model is sharded:
another optimizer or setting, pooling other than SUM and MEAN, tables other than FP32, FP16 and BF16 (and Adam
with FP16/BF16 tables), several column shards
of one table on a rank, variable batch sizes, and ``UNFUSED_TPU`` with an in-backward optimizer. An
``EmbeddingCollection``'s ``FUSED`` groups run :mod:`tpurec.dmp.fused_sequence_kernel`.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import nn

__all__ = ["create_kernel", "is_fused", "kernel_class", "optimizer_of"]

# FBGEMM TBE arguments that change nothing for float32 tables held in device memory (no cache,
# no rounding), whatever their values.
_NO_EFFECT = frozenset(
    {
        "cache_algorithm",
        "cache_load_factor",
        "cache_sets",
        "cache_reserved_memory",
        "cache_precision",
        "stochastic_rounding",
        "bounds_check_mode",
        "prefetch_pipeline",
        "record_cache_metrics",
        "gather_uvm_cache_stats",
        "stats_reporter_config",
        "uvm_host_mapped",
        "enforce_hbm",
        "embedding_table_index_type",
        "embedding_table_offset_type",
        "enable_raw_embedding_streaming",
    }
)
# TorchRec's names of each optimizer's state per table (its EmbeddingFusedOptimizer: the first
# state is "momentum1", the others take FBGEMM's get_optimizer_state names).
_STATE_KEYS = {"momentum1": "momentum1", "momentum2": "exp_avg_sq"}


def _tbe_defaults() -> dict[str, Any]:
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    parameters = inspect.signature(SplitTableBatchedEmbeddingBagsCodegen.__init__).parameters
    return {name: p.default for name, p in parameters.items() if p.default is not inspect.Parameter.empty}


def optimizer_of(fused_params: dict[str, Any] | None) -> Any:
    """The tpurec fused optimizer FBGEMM's TBE would run for TorchRec's ``fused_params``.

    Missing settings take the TBE constructor's defaults (as TorchRec's ``FUSED`` kernel passes
    ``fused_params`` to it): no optimizer at all is FBGEMM's ``EXACT_SGD`` with learning rate 0.01.

    Args:
        fused_params: a table group's ``fused_params`` (``optimizer``, ``learning_rate``, ...).

    Returns:
        A :class:`tpurec.sparse.optimizers.EmbeddingOptimizer`.

    Raises:
        NotImplementedError: FBGEMM's update with these settings is not one tpurec runs exactly.
    """
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode

    from tpurec.sparse.optimizers import SGD, Adagrad, Adam, RowWiseAdagrad

    defaults = _tbe_defaults()
    params = dict(fused_params or {})
    read = {key: params.pop(key, defaults[key]) for key in ("optimizer", "learning_rate", "eps", "beta1", "beta2")}
    weight_decay = float(params.pop("weight_decay", defaults["weight_decay"]))
    decay_mode = WeightDecayMode(params.pop("weight_decay_mode", defaults["weight_decay_mode"]))
    for key, value in params.items():
        if key not in defaults:
            raise NotImplementedError(
                f"fused_params[{key!r}] = {value!r}: not an argument of FBGEMM's TBE, which TorchRec's FUSED kernel "
                "passes fused_params to; remove it"
            )
        if key not in _NO_EFFECT and value != defaults[key]:
            raise NotImplementedError(
                f"fused_params[{key!r}] = {value!r} (FBGEMM's default: {defaults[key]!r}) changes FBGEMM's fused "
                "update in a way tpurec's fused optimizers do not reproduce; leave it at its default, or use the "
                "UNFUSED_TPU compute kernel with a torch optimizer over model.parameters()"
            )
    optimizer = EmbOptimType(read["optimizer"])
    lr, eps = float(read["learning_rate"]), float(read["eps"])
    if weight_decay != 0 and not (optimizer == EmbOptimType.EXACT_ROWWISE_ADAGRAD and decay_mode == WeightDecayMode.L2):
        raise NotImplementedError(
            f"fused_params weight_decay={weight_decay} with weight_decay_mode={decay_mode.name} for {optimizer.name}: "
            "tpurec's fused optimizers run weight decay only as EXACT_ROWWISE_ADAGRAD's L2 mode; use weight_decay=0"
        )
    if optimizer == EmbOptimType.EXACT_SGD:
        return SGD(learning_rate=lr)
    if optimizer == EmbOptimType.EXACT_ADAGRAD:
        return Adagrad(learning_rate=lr, eps=eps)
    if optimizer == EmbOptimType.EXACT_ROWWISE_ADAGRAD:
        return RowWiseAdagrad(learning_rate=lr, eps=eps, weight_decay=weight_decay)
    if optimizer == EmbOptimType.ADAM:
        return Adam(learning_rate=lr, beta1=float(read["beta1"]), beta2=float(read["beta2"]), eps=eps)
    raise NotImplementedError(
        f"FBGEMM's fused optimizer {optimizer.name} is not run by tpurec on tpu; supported: EXACT_SGD "
        "(torch.optim.SGD), EXACT_ADAGRAD (torch.optim.Adagrad), EXACT_ROWWISE_ADAGRAD "
        "(torchrec.optim.RowWiseAdagrad) and ADAM (torch.optim.Adam)"
    )


class _GroupLookup(torch.autograd.Function):
    """The pooled lookup of a kernel's tables; its backward runs the kernel's fused optimizer."""

    @staticmethod
    def forward(
        ctx: Any, kernel: Any, inputs: list[tuple[tuple[torch.Tensor, ...], int]], batch: int, placeholder, *weights
    ):
        ctx.kernel, ctx.inputs, ctx.batch = kernel, inputs, batch
        outputs = []
        for (csr, features), weight in zip(inputs, weights, strict=True):
            pooled = torch.ops.tpurec.sparse_dense_matmul(*csr, weight, batch_size=features * batch)
            # [features * batch, dim] -> [batch, features * dim]: feature-major columns, as FBGEMM.
            outputs.append(pooled.view(features, batch, -1).permute(1, 0, 2).reshape(batch, -1))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):
        ctx.kernel._update(ctx.inputs, ctx.batch, grad_output)
        # The tables were updated in place: they get no .grad (a dense optimizer skips them).
        return (None, None, None, None) + (None,) * len(ctx.inputs)


def _fused_optimizer_class() -> type:
    from torchrec.optim.fused import FusedOptimizer

    class TpuEmbeddingFusedOptimizer(FusedOptimizer):
        """A :class:`TpuFusedEmbeddingBag`'s optimizer as TorchRec's ``KeyedOptimizer``: its params
        are the tables (``<table>.weight``), its state each table's slots under TorchRec's keys
        (``<table>.momentum1``, ``<table>.exp_avg_sq``), as local tensors; ``step()`` passes
        ``param_groups[0]["lr"]`` to the fused update (as TorchRec's ``EmbeddingFusedOptimizer``)."""

        def __init__(self, kernel: Any) -> None:
            self._kernel = kernel
            params: dict[str, Any] = {}
            state: dict[Any, Any] = {}
            for name, weight in kernel.named_tables():
                params[f"{name}.weight"] = weight
                state[weight] = {f"{name}.{_STATE_KEYS[slot]}": tensor for slot, tensor in kernel.slots[name].items()}
            group = {"params": list(params.values()), "lr": kernel.optimizer.learning_rate}
            super().__init__(params, state, [group])

        def step(self, closure: Any = None) -> None:
            (group,) = list(self.param_groups)
            self._kernel.optimizer.learning_rate = float(group["lr"])

        def zero_grad(self, set_to_none: bool = False) -> None:
            pass

    return TpuEmbeddingFusedOptimizer


def _kernel_class() -> type:
    from torchrec.distributed.batched_embedding_kernel import BaseBatchedEmbeddingBag
    from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
    from torchrec.modules.embedding_configs import DataType, PoolingType
    from torchrec.optim.fused import EmptyFusedOptimizer, FusedOptimizerModule
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from tpurec.sparse.update_rules import rule_of

    class Kernel(BaseBatchedEmbeddingBag, FusedOptimizerModule):
        _sequence = False  # (the sequence kernel, tpurec.dmp.fused_sequence_kernel, looks up unpooled)

        def __init__(
            self,
            config: GroupedEmbeddingConfig,
            pg: Any = None,
            device: torch.device | None = None,
            sharding_type: Any = None,
        ) -> None:
            super().__init__(config, pg, device, sharding_type)
            tables = list(config.embedding_tables)
            names = [t.name for t in tables]
            # FBGEMM's weights_precision (TorchRec's data_type_to_sparse_type): the tables in their dtype, the
            # optimizer state in float32, each row's update in float32 rounded back to nearest even (FBGEMM's
            # CPU kernels; tpurec.sparse.update_rules).
            dtypes = {DataType.FP32: torch.float32, DataType.FP16: torch.float16, DataType.BF16: torch.bfloat16}
            for table in tables:
                if names.count(table.name) > 1:
                    raise NotImplementedError(
                        f"the FUSED kernel on tpu holds {names.count(table.name)} column shards of table "
                        f"{table.name!r} on this rank, which tpurec does not stack into one table: plan at most one "
                        "column shard of a table per rank (a larger min_partition, or more ranks)"
                    )
                if not self._sequence and table.pooling not in (PoolingType.SUM, PoolingType.MEAN):
                    raise NotImplementedError(
                        f"table {table.name!r}: {table.pooling.name} pooling with the FUSED kernel on tpu is not run "
                        "by tpurec; use PoolingType.SUM or MEAN"
                    )
                if table.data_type not in dtypes:
                    raise NotImplementedError(
                        f"table {table.name!r}: {table.data_type.name} tables with the FUSED kernel on tpu are not run "
                        "by tpurec; use DataType.FP32, FP16 or BF16"
                    )
            # FBGEMM's pooling mode, as TorchRec's kernels take it (pooling_type_to_pooling_mode): MEAN
            # pools each bag's sum divided by its length, except for row-wise shards (SUM: TorchRec
            # divides the summed rows by the lengths after its output distribution).
            self._mean = self._pooling == PoolingMode.MEAN
            self.optimizer = optimizer_of(config.fused_params)
            half = [t.name for t in tables if t.data_type != DataType.FP32]
            if half and not rule_of(self.optimizer.op_name).half_tables:
                raise NotImplementedError(
                    f"tables {half} are FP16/BF16 and the fused optimizer is {type(self.optimizer).__name__}: FBGEMM has "
                    "no CPU kernel of it for such tables to follow (its GPU kernel rounds stochastically); use FP32 "
                    "tables with it, or SGD, Adagrad or RowWiseAdagrad"
                )
            self._features = [t.num_features() for t in tables]
            self._steps = 0
            # What makes autograd run the lookup's backward (FBGEMM's TBE keeps one too); a plain
            # attribute, so no module walk yields it as a parameter.
            self._placeholder = torch.zeros(0, requires_grad=True)
            self._tables: dict[str, nn.Parameter] = {}
            self.slots: dict[str, dict[str, torch.Tensor]] = {}
            for table, rows, cols in zip(tables, self._local_rows, self._local_cols, strict=True):
                # No grad (TorchRec's FUSED state_dict shards say so): the placeholder carries the backward.
                weight = nn.Parameter(
                    torch.empty(rows, cols, dtype=dtypes[table.data_type], device=device), requires_grad=False
                )
                # TorchRec's mark of a parameter its fused optimizer updates (in_backward_optimizer_filter).
                weight._in_backward_optimizers = [EmptyFusedOptimizer()]  # pyright: ignore[reportAttributeAccessIssue]
                self._tables[table.name] = weight
                self.slots[table.name] = {
                    slot: torch.zeros((rows, cols) if kind == "element" else (rows,), device=device)
                    for slot, kind in self.optimizer.slots.items()
                }
            self.init_parameters()
            self._optim = _fused_optimizer_class()(self)

        def named_tables(self) -> Iterator[tuple[str, nn.Parameter]]:
            """``(table name, local table)`` of each table of the group."""
            yield from self._tables.items()

        def split_embedding_weights(self) -> list[torch.Tensor]:
            return list(self._tables.values())

        def named_split_embedding_weights(
            self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
        ) -> Iterator[tuple[str, torch.Tensor]]:
            for name, weight in self._tables.items():
                yield f"{prefix}{'.' if prefix else ''}{name}.weight", weight

        def named_parameters(
            self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
        ) -> Iterator[tuple[str, nn.Parameter]]:
            for name, weight in self.named_split_embedding_weights(prefix):
                yield name, cast(nn.Parameter, weight)

        def named_buffers(
            self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
        ) -> Iterator[tuple[str, torch.Tensor]]:
            yield from ()  # TorchRec's convention for fused kernels: the tables are no buffers

        def named_parameters_by_table(self) -> Iterator[tuple[str, nn.Parameter]]:
            yield from self._tables.items()

        @property
        def emb_module(self) -> nn.Module:
            # TorchRec asks its kernels for the FBGEMM module behind them; here the kernel is its own.
            return self

        @property
        def fused_optimizer(self) -> Any:
            return self._optim

        def flush(self) -> None:
            pass

        def purge(self) -> None:
            pass

        def forward(
            self,
            features: KeyedJaggedTensor,
            vbe_output: torch.Tensor | None = None,
            vbe_output_offsets: torch.Tensor | None = None,
        ) -> torch.Tensor:
            if features.variable_stride_per_key():
                raise NotImplementedError(
                    "variable batch sizes per feature with the FUSED kernel on tpu are not run by tpurec"
                )
            batch = features.stride()
            # The entry ranges of each table's features: sizes the host must know (one program per size).
            offsets = features.offsets().cpu()
            lengths = (offsets[1:] - offsets[:-1]).to(torch.int64)
            values, weights = features.values(), features.weights_or_none()
            device = values.device
            inputs, first = [], 0
            for count in self._features:
                bags = slice(first * batch, (first + count) * batch)
                start, end = int(offsets[bags.start]), int(offsets[bags.stop])
                entries = max(end - start, 1)  # one padding entry (past the row pointer) for an empty batch
                ids = torch.zeros(entries, dtype=torch.int32, device=device)
                gains = torch.ones(entries, dtype=torch.float32, device=device)
                samples = torch.zeros(entries, dtype=torch.int32)
                if end > start:
                    ids = values[start:end].to(torch.int32)
                    samples = torch.repeat_interleave(torch.arange(count * batch, dtype=torch.int32), lengths[bags])
                    if weights is not None:
                        gains = weights[start:end].to(torch.float32)
                    if self._mean:  # each entry's share of its bag: 1 / the bag's length (times its weight)
                        bag_lengths = lengths[bags]
                        share = torch.repeat_interleave(1.0 / bag_lengths.clamp(min=1).to(torch.float32), bag_lengths)
                        gains = gains * share.to(device)
                row_pointers = torch.tensor([end - start], dtype=torch.int32).to(device)
                inputs.append(((row_pointers, ids, samples.to(device), gains), count))
                first += count
            return _GroupLookup.apply(self, inputs, batch, self._placeholder, *self._tables.values())

        def _update(self, inputs: list[tuple[tuple[torch.Tensor, ...], int]], batch: int, grad: torch.Tensor) -> None:
            from tpurec.core import mode

            self._steps += 1  # one optimizer step per backward of the group, as FBGEMM's TBE counts
            op = getattr(torch.ops.tpurec, self.optimizer.op_name)
            hyperparameters = self.optimizer.hyperparameters(self._steps)
            column = 0
            with torch.no_grad():
                for (csr, count), (name, weight) in zip(inputs, self._tables.items(), strict=True):
                    dim = weight.shape[1]
                    block = grad[:, column : column + count * dim]
                    column += count * dim
                    grad_rows = block.reshape(batch, count, dim).permute(1, 0, 2).reshape(count * batch, dim)
                    slots = list(self.slots[name].values())
                    # One fused program for the update and its write-back (the old buffers donated).
                    fused = mode("fused") if weight.device.type == "tpu" else contextlib.nullcontext()
                    with fused:
                        updated = op(*csr, grad_rows.contiguous(), weight.detach(), *slots, **hyperparameters)
                        updated = updated if isinstance(updated, (tuple, list)) else (updated,)
                        for target, value in zip([weight, *slots], updated, strict=True):
                            target.copy_(value)

    Kernel.__name__ = Kernel.__qualname__ = "TpuFusedEmbeddingBag"
    Kernel.__module__ = __name__
    return Kernel


_CLASS: type | None = None


def kernel_class() -> type:
    """The :class:`TpuFusedEmbeddingBag` class (built on first use: TorchRec's base classes are slow to import)."""
    global _CLASS
    if _CLASS is None:
        import tpurec.sparse.ops  # noqa: F401 (registers torch.ops.tpurec)

        # TorchRec's column-wise output distribution on tpu calls torch.ops.torchrec.permute_pooled_embs,
        # which its TPU kernel module defines: a model whose groups all run this kernel imports it nowhere else
        # (AttributeError: '_OpNamespace' 'torchrec' object has no attribute 'permute_pooled_embs').
        import tpurec.dmp.lookup_ops  # noqa: F401 (defines torch.ops.torchrec and lowers it)

        _CLASS = _kernel_class()
    return _CLASS


def __getattr__(name: str) -> Any:
    if name == "TpuFusedEmbeddingBag":
        return kernel_class()
    raise AttributeError(name)


def _check_unfused(config: Any) -> None:
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel

    if config.compute_kernel == EmbeddingComputeKernel.UNFUSED_TPU and "optimizer" in (config.fused_params or {}):
        tables = [t.name for t in config.embedding_tables]
        raise NotImplementedError(
            f"tables {tables}: TorchRec's UNFUSED_TPU kernel ignores the in-backward optimizer "
            f"({config.fused_params['optimizer']}, from apply_optimizer_in_backward or the sharder's fused_params), "
            "so the tables would not train. Use the compute kernel 'fused' (tpurec runs its optimizer in the "
            "backward), or drop the in-backward optimizer and train model.parameters() with a torch optimizer"
        )


def is_fused(config: Any) -> bool:
    """Whether a table group has TorchRec's ``FUSED`` compute kernel."""
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel

    return config.compute_kernel == EmbeddingComputeKernel.FUSED


def create_kernel(pooled: bool, config: Any, pg: Any, device: torch.device, sharding_type: Any = None) -> Any:
    """The tpu kernel of a table group TorchRec's grouped lookup builds, or None for TorchRec's own.

    Args:
        pooled: an EmbeddingBagCollection's group (else an EmbeddingCollection's).
        config: the ``GroupedEmbeddingConfig``.
        pg: its process group.
        device: a tpu device.
        sharding_type: the group's sharding type (its pooling mode).

    Returns:
        A :class:`TpuFusedEmbeddingBag` for a pooled ``FUSED`` group, else None (TorchRec builds it).

    Raises:
        NotImplementedError: a group tpurec cannot run as TorchRec would (see the module's docstring).
    """
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel

    _check_unfused(config)
    if config.compute_kernel != EmbeddingComputeKernel.FUSED:
        return None
    if not pooled:  # (an EmbeddingCollection's FUSED group: tpurec.dmp.fused_sequence_kernel builds it)
        raise ValueError("create_kernel builds pooled FUSED groups; use fused_sequence_kernel.create_kernel")
    return kernel_class()(config, pg, device, sharding_type)
