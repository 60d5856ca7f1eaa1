"""SparseCore embedding modules: a drop-in torchrec EmbeddingBagCollection whose
backward applies a fused optimizer in place.

Example::

    import torch
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
    from tpurec.sparse import Capacity, EmbeddingBagCollection, RowWiseAdagrad

    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t0", embedding_dim=16, num_embeddings=1000,
                                   feature_names=["f0", "f1"])],
        optimizer=RowWiseAdagrad(learning_rate=0.05),
        capacities=Capacity(max_ids_per_partition=512),
    )
    kt = ebc(kjt)                 # KeyedTensor, like torchrec
    kt.values().sum().backward()  # updates ebc's tables in place
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any, ClassVar, Literal, Mapping, Sequence

import jax
import numpy as np
import torch
from torch import nn
from torch.autograd.variable import Variable
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from tpurec.core import mode
from tpurec.sparse import export as _export
from tpurec.sparse.lookup import CsrLookup, Prepared, Staged, TrainableLookup, check_optimizer_state, restage
from tpurec.sparse.optimizers import Adam, EmbeddingOptimizer, optimizer_from_torch
from tpurec.sparse.preprocess import stack_tables
from tpurec.sparse.ops import touched_rows_update_cpu
from tpurec.sparse.types import PAD_ID, Capacity, SparseCoreInput, StackedTable

__all__ = ["EmbeddingBagCollection", "OUTPUT_DTYPES", "TABLE_DTYPES"]

TABLE_DTYPES: dict[DataType, torch.dtype] = {
    DataType.FP32: torch.float32,
    DataType.FP16: torch.float16,
    DataType.BF16: torch.bfloat16,
}
"""Table ``data_type`` -> the dtype its weights are stored in (FBGEMM's ``weights_precision``)."""

OUTPUT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
"""The pooled output dtypes (FBGEMM's ``output_dtype``)."""


class _FusedLookup(torch.autograd.Function):
    """Pooled lookup of one stack; its backward runs the fused optimizer."""

    @staticmethod
    def forward(ctx, weight, row_pointers, embedding_ids, sample_ids, gains, module, index, batch_size):
        ctx.csr = (row_pointers, embedding_ids, sample_ids, gains)
        ctx.module, ctx.index = module, index
        module._lookup_started(ctx, ctx.csr)
        return torch.ops.tpurec.sparse_dense_matmul(
            row_pointers, embedding_ids, sample_ids, gains, weight, batch_size=batch_size
        )

    @staticmethod
    def backward(ctx, grad_output):
        module = ctx.module
        module._lookup_finished(ctx)
        if module.optimizer_semantics == "torch":
            module._stash_gradient(ctx.index, ctx.csr, grad_output.contiguous())
        else:
            module._apply_optimizer(ctx.index, ctx.csr, grad_output.contiguous())
        # The table is updated in place: it gets no .grad (a dense optimizer skips it).
        return (None,) * 8


def _combined_lookups(lookups: list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]):
    """One CSR input and output gradient for several lookups of one stack.

    Partition ``p`` holds each lookup's partition ``p`` in turn (entries past a row pointer
    become padding ids, so every position is inside the new row pointers); the samples of a
    lookup are shifted by the batches of the lookups before it, whose output gradients come
    first. The kernels sum a row's gradient over all entries: one update on the summed gradient.
    """
    ids_parts, sample_parts, gain_parts, grads = [], [], [], []
    offset = 0
    for (row_pointers, ids, samples, gains), grad_output in lookups:
        partitions = row_pointers.shape[0]
        size = ids.shape[0] // partitions
        position = (
            torch.arange(size, device=ids.device)[None, :]
            + (torch.arange(partitions, device=ids.device) * size)[:, None]
        )
        valid = (position < row_pointers[:, None]) & (ids.view(partitions, size) != PAD_ID)
        ids_parts.append(torch.where(valid, ids.view(partitions, size), PAD_ID))
        sample_parts.append(torch.where(valid, samples.view(partitions, size) + offset, 0))
        gain_parts.append(torch.where(valid, gains.view(partitions, size), 0.0))
        grads.append(grad_output)
        offset += grad_output.shape[0]
    ids = torch.cat(ids_parts, dim=1)
    partitions, size = ids.shape
    row_pointers = torch.arange(1, partitions + 1, dtype=torch.int32, device=ids.device) * size
    csr = (
        row_pointers,
        ids.reshape(-1),
        torch.cat(sample_parts, dim=1).reshape(-1),
        torch.cat(gain_parts, dim=1).reshape(-1),
    )
    return csr, torch.cat(grads, dim=0)


@dataclasses.dataclass
class PreparedCsr(Prepared):
    """A KJT's CSR input as :meth:`EmbeddingBagCollection.prefetch` prepared it.

    Attributes:
        batch: the host CSR input.
        arrays: per stack, its CSR arrays on the tables' device (their copies started).
    """

    batch: SparseCoreInput
    arrays: list[list[Any]]


_MAX_PREFETCHED = 18
"""Batches :meth:`EmbeddingBagCollection.prefetch` keeps for forward (a pipeline needs 1-2, and
``TrainPipeline(steps_per_call=K)`` about 2K + 2: up to K = 8 before the oldest is dropped and
preprocessed again)."""


class EmbeddingBagCollection(CsrLookup, TrainableLookup, EmbeddingBagCollectionInterface):
    """Pooled embedding lookups on SparseCore-shaped ops, with a fused optimizer.

    Behaves like ``torchrec.EmbeddingBagCollection`` (same configs, same
    ``KeyedTensor`` output, same state dict keys ``embedding_bags.<table>.weight``),
    except that ``backward`` updates the tables in place with ``optimizer``
    (FBGEMM semantics) and leaves no gradient on them.

    Tables of one embedding dim and data_type are stored stacked in one
    parameter (``stacked_weight_<i>``); optimizer slots are float32 buffers next
    to them and are checkpointed through :meth:`optimizer_state_dict`.

    FP16 and BF16 tables (``data_type``) follow FBGEMM's TBE, as TorchRec's sharded
    modules run it on CPU: weights stored in that dtype, pooled in float32 into a
    float32 output, updated in float32 and rounded back to nearest (FBGEMM's CPU
    kernels have no stochastic rounding); Adam is refused for them
    (docs/torchrec_semantics.md).

    Args:
        tables: torchrec table configs.
        is_weighted: the features carry per-id weights.
        optimizer: an :class:`EmbeddingOptimizer`, a torch/torchrec optimizer
            class (then ``optimizer_kwargs`` apply), or None (the default): an
            inference module, whose tables never change; a backward through
            its lookup raises instead of silently applying some optimizer.
        optimizer_kwargs: keyword arguments of a torch optimizer class.
        device: where the tables live, e.g. ``"tpu"`` (default CPU). ``"meta"``:
            no values and no memory, for :func:`tpurec.shard` to create each shard
            on its own device (see :mod:`tpurec.sparse.table_init`); such a
            collection cannot look ids up before it is sharded.
        num_partitions: MOD partitions of every table.
        capacities: static per-partition capacities (one for all stacks or per
            stack name, see ``suggest_capacities``). None grows them on demand
            to powers of two (each growth compiles the kernels again).
        overflow: ``"error"`` or ``"drop"`` (see ``preprocess_kjt``); dropped entries are
            counted per feature in :meth:`dropped_entries` and ``tpurec.stats()``.
        stack: stack tables of equal dim and data_type.
        output_dtype: dtype of the pooled output (FBGEMM's ``output_dtype``;
            TorchRec's sharder ``fused_params["output_dtype"]``): float32 (the
            default), float16 or bfloat16; the sums are float32, rounded once.

    Example::

        ebc = EmbeddingBagCollection(tables, optimizer=torch.optim.Adagrad,
                                     optimizer_kwargs={"lr": 0.1}, device="tpu")
    """

    def __init__(
        self,
        tables: Sequence[EmbeddingBagConfig],
        is_weighted: bool = False,
        optimizer: EmbeddingOptimizer | type | Any = None,
        optimizer_kwargs: Mapping[str, Any] | None = None,
        device: torch.device | str | None = None,
        num_partitions: int = 1,
        capacities: Capacity | Mapping[str, Capacity] | None = None,
        overflow: Literal["error", "drop"] = "error",
        stack: bool = True,
        output_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if not tables:
            raise ValueError("EmbeddingBagCollection needs at least one table")
        if output_dtype not in OUTPUT_DTYPES:
            raise ValueError(
                f"output_dtype={output_dtype}: the pooled output can be {', '.join(map(str, OUTPUT_DTYPES))} "
                "(FBGEMM's output_dtype FP32, FP16, BF16)"
            )
        # FBGEMM's output_dtype: the float32 pooled sums rounded (to nearest) to it; the
        # gradient flows back widened to float32.
        self.output_dtype = output_dtype
        for cfg in tables:
            if cfg.data_type not in TABLE_DTYPES:
                raise ValueError(
                    f"table {cfg.name!r} has data_type={cfg.data_type.name}: tpurec's EmbeddingBagCollection trains "
                    "FP32, FP16 and BF16 tables (quantized tables are inference-only in TorchRec, and would be "
                    "widened here). Build the table with data_type=DataType.FP32, FP16 or BF16."
                )
        self._embedding_bag_configs = list(tables)
        self._is_weighted = is_weighted
        if optimizer is None and optimizer_kwargs:
            raise ValueError(f"optimizer_kwargs {dict(optimizer_kwargs)} given without an optimizer")
        self.optimizer: EmbeddingOptimizer | None = (
            None if optimizer is None else optimizer_from_torch(optimizer, optimizer_kwargs)
        )
        half = [t.name for t in tables if t.data_type != DataType.FP32]
        if isinstance(self.optimizer, Adam) and half:
            raise ValueError(
                f"tables {half} are FP16/BF16 and the optimizer is Adam: FBGEMM has no CPU Adam to follow and its "
                "GPU Adam rounds the new weights stochastically, so tpurec cannot reproduce it. Use FP32 tables "
                "with Adam, or SGD, Adagrad or RowWiseAdagrad with FP16/BF16 tables."
            )
        # "torch" semantics: each lookup's (CSR input, output gradient) of the running backward
        # pass, per stack, until its end applies one update on their summed gradient.
        self._stashed_gradients: dict[int, list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]] = {}
        self.num_partitions = num_partitions
        self.overflow = overflow
        # CPU tables: update the touched rows in place instead of calling the
        # functional gradient op (same math; False forces the op, for tests).
        self.cpu_in_place = True
        self._stacks = stack_tables(self._embedding_bag_configs, stack=stack)
        self._fixed_capacities = capacities
        self._auto_capacities = {}
        self._steps = [0] * len(self._stacks)
        # stage(): per stack the CSR tensors that hold the staged batch on the tables' device; the
        # same tensors from batch to batch, so a captured step reads each new batch.
        self._static_csr: list[list[torch.Tensor]] = []
        self._static_batch_size = 0  # the batch size the staged tensors were made for
        # Set while tpurec.sparse.checkpoint loads the tables with their optimizer state
        # (so load_state_dict does not warn that the optimizer restarts).
        self._optimizer_state_follows = False
        self._init_outputs(self._embedding_bag_configs)  # torchrec's order: tables, then their features
        configs = {t.name: t for t in self._embedding_bag_configs}
        # On "meta" the tables get no values (and no host memory): tpurec.shard creates each
        # shard on its own device (tpurec.sparse.table_init); an unsharded lookup refuses.
        on_meta = device is not None and torch.device(device).type == "meta"
        where = torch.device("meta") if on_meta else None
        for i, st in enumerate(self._stacks):
            # A stack holds tables of one data_type (stack_tables groups by dim and type);
            # the weights are stored in it, the optimizer slots in float32 (as FBGEMM keeps them).
            dtype = TABLE_DTYPES[configs[st.tables[0].name].data_type]
            weight = torch.empty(st.num_rows, st.embedding_dim, dtype=dtype, device=where)
            for t in st.tables if not on_meta else ():
                cfg = configs[t.name]
                rows = weight[t.row_offset : t.row_offset + t.num_embeddings]
                if cfg.init_fn is not None:
                    cfg.init_fn(rows)
                else:
                    rows.uniform_(cfg.get_weight_init_min(), cfg.get_weight_init_max())
            self.register_parameter(f"stacked_weight_{i}", nn.Parameter(weight))
            for slot, shape in self._slot_names_and_shapes():
                size = (st.num_rows,) if shape == "row" else (st.num_rows, st.embedding_dim)
                self.register_buffer(
                    f"stacked_{slot}_{i}", torch.zeros(size, dtype=torch.float32, device=where), persistent=False
                )
        if device is not None and not on_meta:
            self.to(device)

    def _apply(self, fn: Any, recurse: bool = True) -> "EmbeddingBagCollection":
        super()._apply(fn, recurse)
        self._store_tables_lane_dense()
        return self

    def _store_tables_lane_dense(self) -> None:
        """Where the TensorCore kernels run the lookups, keeps each table on the tpu device (and its
        element slots) in their lane-dense layout (:func:`tpurec.sparse.kernels.tensorcore.rows_per_line`):
        the same values, stored as the 128-lane lines the kernels stream, so no step changes layouts.
        Other kernels read rows as they are (on XLA:CPU the lines cost the native kernel's step a copy
        of the table: DLRM's 26 x 100k x 64 step took 162 ms instead of 79)."""
        from tpurec.core import array_of, with_storage_shape
        from tpurec.sparse.kernels.tensorcore import stored_shape
        from tpurec.sparse.ops import kernel_family

        element_slots = [slot for slot, shape in self._slot_names_and_shapes() if shape != "row"]
        names = [
            n
            for i in range(len(self._stacks))
            for n in (f"stacked_weight_{i}", *(f"stacked_{s}_{i}" for s in element_slots))
        ]
        tables = [getattr(self, n) for n in names]
        tables = [t for t in tables if t.device.type == "tpu" and t.dtype == torch.float32 and t.dim() == 2]
        if not tables:
            return  # (asked before the kernel family, which starts JAX's runtime: a module on the CPU must not)
        try:
            if kernel_family() != "tensorcore":
                return
        except ValueError:
            return  # a TPUREC_SPARSE_KERNEL this platform cannot run: the first lookup says so
        for t in tables:
            shape = stored_shape(t.shape[0], t.shape[1])
            if tuple(getattr(array_of(t), "shape", shape)) != shape:
                t.data = with_storage_shape(t, shape)

    def _slot_names_and_shapes(self) -> list[tuple[str, str]]:
        return [] if self.optimizer is None else list(self.optimizer.slots.items())

    def stacked_weight(self, index: int) -> nn.Parameter:
        """The parameter holding stack ``index``."""
        return getattr(self, f"stacked_weight_{index}")

    # --- forward / backward ---------------------------------------------------------

    def prefetch(self, features: KeyedJaggedTensor, batch: SparseCoreInput | None = None) -> None:
        """Preprocesses ``features`` and starts moving its CSR arrays to the tables' device.

        Safe to call from another thread while a step runs (it changes no
        parameter or optimizer state). The next ``forward`` of this same KJT
        object uses the result instead of preprocessing again.

        Args:
            features: a KJT with the tables' features (CPU).
            batch: ``features`` already preprocessed by :meth:`preprocess`
                (None: preprocess here).
        """
        if batch is None:
            batch = self.preprocess(features)
        device = self.device
        arrays: list[list[Any]] = []
        for st in self._stacks:
            csr = batch.stacks[st.name].arrays()
            if device.type == "tpu":
                from tpurec.core import jax_device

                target = jax_device(device.index)
                arrays.append([jax.device_put(a, target) for a in csr])  # asynchronous copies
            else:
                arrays.append([torch.from_numpy(a).to(device) for a in csr])
        self._keep_prefetched(PreparedCsr(features, batch, arrays))

    def stage(self, features: KeyedJaggedTensor, batch: SparseCoreInput | None = None) -> None:
        """Preprocesses ``features`` into the collection's static CSR input, for the next forward.

        The CSR arrays are written into tensors the collection keeps from batch to batch (in
        place, while their shapes stay the same: fixed capacities and batch size), and the next
        ``forward`` of this same KJT object reads them. A KJT handed to :meth:`prefetch` before
        is taken from there, its transfers already started. A step captured by :func:`tpurec.graph`
        reads those tensors, so staging the next batch before ``g.replay()`` feeds it to the
        replay, as ``copy_()`` into a static input does for dense tensors. Dropped entries
        (``overflow="drop"``) are counted here.

        Args:
            features: a KJT with the tables' features (CPU).
            batch: ``features`` already preprocessed by :meth:`preprocess` (None: preprocess here).

        Raises:
            RuntimeError: the staged batch's lookup still waits for its backward (staging would
                change its input); nothing changes.
            CapacityError: as :meth:`preprocess`; nothing changes.

        Example::

            ebc.stage(kjt)
            with tpurec.graph(g):
                loss = step(kjt)      # forward(kjt) reads the staged CSR tensors
            for kjt in batches:
                ebc.stage(kjt)
                g.replay()
        """
        self._refuse_restaging([t for stack in self._static_csr for t in stack], "CSR input")
        moved_ahead = None
        if batch is None:
            entry: PreparedCsr | None = self._pop_prefetched(features)
            if entry is not None:
                batch, moved_ahead = entry.batch, entry.arrays
            else:
                batch = self.preprocess(features)
        device = self.device
        index = 0
        if device.type == "tpu":
            from tpurec.core import TpuModule, jax_device

            index = device.index if device.index is not None else TpuModule.current_device()
        stacks, renewed = [], False
        for i, st in enumerate(self._stacks):
            arrays: Sequence[Any] = batch.stacks[st.name].arrays()
            if device.type == "tpu":
                # asynchronous copies (already started by prefetch())
                arrays = (
                    moved_ahead[i]
                    if moved_ahead is not None
                    else [jax.device_put(a, jax_device(index)) for a in arrays]
                )
            old = self._static_csr[i] if i < len(self._static_csr) else None
            # A new batch size makes new tensors even where the CSR shapes (set by the capacities) stay:
            # a step captured for the old batch size then refuses to replay instead of misreading the batch.
            tensors, new = restage(old, arrays, batch.batch_size == self._static_batch_size, device, index)
            stacks.append(tensors)
            renewed |= new
        self._static_csr, self._static_batch_size = stacks, batch.batch_size
        self.staged_generation += renewed
        self._staged = Staged(features, batch)
        self._drops.add(batch.dropped_by_feature)

    def _take_prefetched(self, features: KeyedJaggedTensor) -> tuple[SparseCoreInput, list[list[Any]]] | None:
        entry: PreparedCsr | None = self._pop_prefetched(features)
        if entry is None:
            return None
        batch, arrays = entry.batch, entry.arrays
        device = self.device
        if device.type == "tpu":
            from tpurec.core import wrap

            index = device.index if device.index is not None else torch.tpu.current_device()
            arrays = [[wrap(a, index) for a in stack] for stack in arrays]
        return batch, arrays

    def __prepare_scriptable__(self) -> "EmbeddingBagCollection":
        """torch.jit.script cannot compile the host preprocessing: raises, naming torch.export instead."""
        raise NotImplementedError(_export.SCRIPT_UNSUPPORTED)

    # Preprocessing is host code (numpy over the KJT): under torch.compile the
    # lookup runs outside the graph, in the current tpurec mode, and the dense
    # parts around it compile.
    @torch.compiler.disable
    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pooled embeddings of ``features``.

        Args:
            features: KJT with the tables' features (CPU; ids are preprocessed on
                the host and moved to the tables' device). As in TorchRec, each
                feature may have its own batch size (``stride_per_key_per_rank``),
                and ``inverse_indices`` expand every feature's pooled rows to the
                full batch.

        Returns:
            ``KeyedTensor`` with one ``[batch, dim]`` block per feature and table
            (``"<feature>@<table>"`` for a feature of several tables), in torchrec's
            order.
        """
        if _export.is_tracing(features):  # torch.export / torch.fx: one traceable op (tpurec/sparse/export.py)
            return _export.traced_forward(self, features)
        if self.device.type == "meta":
            raise RuntimeError(
                f"the tables {[c.name for c in self._embedding_bag_configs]} are on 'meta' and have no values: "
                "shard the model with tpurec.shard(model, plan, seed=...), which creates each shard on its device, "
                "or build the collection on a device (device='tpu' or the host) to look ids up unsharded"
            )
        self._check_trainable_lookup(features)
        prefetched = self._take_prefetched(features)
        staged = self._take_staged(features) if prefetched is None else None
        if staged is not None:
            batch = staged  # its drops were counted by stage()
        else:
            batch = self.preprocess(features) if prefetched is None else prefetched[0]
            self._drops.add(batch.dropped_by_feature)
        device = self.device
        out_batch = batch.output_batch_size
        stack_outputs = []
        for i, st in enumerate(self._stacks):
            if prefetched is not None:
                arrays = prefetched[1][i]
            elif staged is not None:
                arrays = self._static_csr[i]
            else:
                arrays = [torch.from_numpy(a).to(device) for a in batch.stacks[st.name].arrays()]
            out = _FusedLookup.apply(self.stacked_weight(i), *arrays, self, i, st.num_slots * batch.batch_size)
            if batch.inverse_indices is not None:
                # TorchRec's process_pooled_embeddings: output sample b of a feature is the
                # bag inverse_indices name; the gather's backward sums the gradients of the
                # samples sharing a bag, as TorchRec's index select does.
                out = out.index_select(0, self._expansion_index(st, batch).to(device))
            stack_outputs.append(out.view(st.num_slots, out_batch, st.embedding_dim))
        values = self._pooled_values(stack_outputs, out_batch)
        if self._weights_need_grad(features):
            values = values + self._per_id_weight_gradients(features, batch)
        values = values.to(self.output_dtype)
        return KeyedTensor(keys=self._embedding_names, length_per_key=self._length_per_key, values=values)

    @staticmethod
    def _expansion_index(stack: StackedTable, batch: SparseCoreInput) -> torch.Tensor:
        """Rows of the stack's lookup output ``[slots * batch.batch_size]`` giving each
        output sample of each slot (``[slots * output batch]``, int64, on the host).

        Its shape depends on the output batch only, however the features' own batch
        sizes vary: one program for every such batch.
        """
        assert batch.inverse_indices is not None
        rows = batch.batch_size
        return torch.from_numpy(
            np.concatenate([s.slot * rows + batch.inverse_indices[s.feature] for s in stack.features])
        )

    def _per_id_weight_gradients(self, features: KeyedJaggedTensor, batch: SparseCoreInput) -> torch.Tensor:
        """A term equal to zero whose gradient w.r.t. each per-id weight is TorchRec's.

        With SUM pooling a bag is ``sum_j w_j * W[id_j]``, so d/dw_j is ``W[id_j]`` dotted with
        the bag's gradient. The fused lookup takes the weights as constants (they are folded
        into the CSR gains on the host); adding ``sum_j (w_j - w_j.detach()) * W[id_j]`` (exactly
        0, with the table rows as they were at this forward) gives the weights that gradient
        without changing the output or the tables' fused update. A feature's term has a
        row per bag, expanded to the output batch by ``inverse_indices`` like the lookup.
        """
        device = self.device
        per_feature = features.to_dict()
        inverse = batch.inverse_indices
        blocks = []
        for cfg in self._embedding_bag_configs:
            # The lookup pools in float32 (also for FP16/BF16 tables), so does this term.
            table = self.table_weight(cfg.name).detach().float()
            for feature in cfg.feature_names:
                jagged = per_feature[feature]
                weights = jagged.weights()
                lengths = jagged.lengths().long()
                bags = lengths.shape[0]  # the feature's own batch size
                samples = torch.repeat_interleave(torch.arange(bags), lengths).to(device)
                rows = table[jagged.values().long().to(device)]
                delta = (weights - weights.detach()).to(device=device, dtype=table.dtype)
                block = torch.zeros(bags, cfg.embedding_dim, dtype=table.dtype, device=device)
                block = block.index_add(0, samples, delta[:, None] * rows)
                if inverse is not None:
                    block = block.index_select(0, torch.from_numpy(inverse[feature]).to(device))
                blocks.append(block)
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)

    _max_prefetched: ClassVar[int] = _MAX_PREFETCHED

    def _stash_gradient(self, index: int, csr: tuple[torch.Tensor, ...], grad_output: torch.Tensor) -> None:
        # The update waits for the end of the backward pass, when every lookup of the step has
        # given its gradient (as the post-accumulate-grad hook of apply_optimizer_in_backward).
        if not self._stashed_gradients:
            Variable._execution_engine.queue_callback(self._apply_stashed_gradients)
        self._stashed_gradients.setdefault(index, []).append((csr, grad_output))

    def _apply_stashed_gradients(self) -> None:
        stashed, self._stashed_gradients = self._stashed_gradients, {}
        for index, lookups in stashed.items():
            csr, grad_output = lookups[0] if len(lookups) == 1 else _combined_lookups(lookups)
            self._apply_optimizer(index, csr, grad_output)

    def _apply_optimizer(self, index: int, csr: tuple[torch.Tensor, ...], grad_output: torch.Tensor) -> None:
        if self.optimizer is None:
            tables = [t.name for t in self._stacks[index].tables]
            raise RuntimeError(
                f"tpurec EmbeddingBagCollection (tables {tables}) has no embedding optimizer, so it is for inference "
                "and its tables take no gradient. To train them, build it with optimizer=... (e.g. "
                "tpurec.sparse.RowWiseAdagrad(learning_rate=0.05)) or pass optimizer= to from_torchrec; to keep them "
                "frozen, detach its output or run it under torch.no_grad() / torch.inference_mode()."
            )
        hyperparameters = self._next_captured_step(index)
        op = getattr(torch.ops.tpurec, self.optimizer.op_name)
        weight = self.stacked_weight(index)
        slots = [getattr(self, f"stacked_{s}_{index}") for s in self.optimizer.slots]
        with torch.no_grad():
            if weight.device.type == "cpu" and self.cpu_in_place:
                # Same kernel math, but only the touched rows come back and are
                # written in place: no new table per step.
                ids, *rows = touched_rows_update_cpu(
                    self.optimizer.op_name, [*csr, grad_output, weight.detach(), *slots], hyperparameters
                )
                valid = ids != PAD_ID
                index_rows = ids[valid].long()
                for target, value in zip([weight, *slots], rows):
                    target.index_copy_(0, index_rows, value[valid].to(target.dtype))
                return
            # One fused program for the update and the write-back: the old table and
            # slot buffers are donated to it, so the update happens in place even in
            # eager mode (no copy of whole tables per step).
            with mode("fused") if weight.device.type == "tpu" else contextlib.nullcontext():
                updated = op(*csr, grad_output, weight.detach(), *slots, **hyperparameters)
                updated = updated if isinstance(updated, (tuple, list)) else (updated,)
                for target, value in zip([weight, *slots], updated):
                    target.copy_(value)

    # --- checkpoints ----------------------------------------------------------------

    def _tables_loaded(self, prefix: str) -> None:
        if self.optimizer is not None and self.optimizer.slots and not self._optimizer_state_follows:
            warnings.warn(
                f"tpurec: loaded the tables of {prefix.rstrip('.') or 'the EmbeddingBagCollection'} but not its "
                f"{type(self.optimizer).__name__} state (slots {list(self.optimizer.slots)} and step counts): the "
                "embedding optimizer restarts from zero unless load_optimizer_state_dict follows. To resume "
                "training, save and load with tpurec.sparse.checkpoint.save/load.",
                UserWarning,
                stacklevel=3,  # the frame that called _load_from_state_dict
            )

    def optimizer_state_dict(self) -> dict[str, Any]:
        """Optimizer slots per table (views) and step counts, for checkpointing.

        Returns:
            ``{"optimizer": "Adam", "steps": [...], "state": {"embedding_bags.<t>.weight":
            {"momentum1": ...}}}``; ``optimizer`` is None (and every table's
            slots empty) for an inference module.
        """
        state: dict[str, dict[str, torch.Tensor]] = {}
        for key, i, t in self._tables():
            state[key] = {
                s: getattr(self, f"stacked_{s}_{i}")[t.row_offset : t.row_offset + t.num_embeddings]
                for s, _ in self._slot_names_and_shapes()
            }
        name = None if self.optimizer is None else type(self.optimizer).__name__
        return {"optimizer": name, "steps": list(self._steps), "state": state}

    def check_optimizer_state_dict(self, state_dict: Mapping[str, Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Checks that ``state_dict`` (from :meth:`optimizer_state_dict`) fits this
        module, without writing anything.

        Args:
            state_dict: ``{"optimizer": ..., "steps": [...], "state": {...}}``.

        Returns:
            ``(slot view, value)`` pairs that :meth:`load_optimizer_state_dict` copies.

        Raises:
            ValueError: the state does not fit this module (the message says what differs).
        """
        mine = self.optimizer_state_dict()
        check_optimizer_state(
            state_dict,
            {key: {name: tuple(t.shape) for name, t in slots.items()} for key, slots in mine["state"].items()},
            mine["optimizer"],
            len(mine["steps"]),
            "this EmbeddingBagCollection",
            "build the module with the optimizer the checkpoint was trained with",
        )
        return [
            (target, state_dict["state"][key][name])
            for key, slots in mine["state"].items()
            for name, target in slots.items()
        ]

    def load_optimizer_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Loads what :meth:`optimizer_state_dict` returned (copies into the slots).

        Everything is checked (:meth:`check_optimizer_state_dict`) before
        anything is written, so a state of another optimizer, other tables or
        other shapes leaves the module as it was.

        Args:
            state_dict: ``{"optimizer": ..., "steps": [...], "state": {...}}``.

        Raises:
            ValueError: the state does not fit this module.
        """
        writes = self.check_optimizer_state_dict(state_dict)
        with torch.no_grad():
            for target, value in writes:
                target.copy_(value)
        self._steps = list(state_dict["steps"])
