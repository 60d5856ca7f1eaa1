"""A quantized (INT8/INT4/INT2) inference collection sharded over a device mesh.

:class:`ShardedQuantEmbeddingBagCollection` is what ``tpurec.shard`` makes of a
:class:`~tpurec.sparse.QuantEmbeddingBagCollection`, as TorchRec's
``QuantEmbeddingBagCollectionSharder`` makes a ``ShardedQuantEmbeddingBagCollection`` of its
quantized EBC for sharded inference. It computes what TorchRec's sharded module computes:

* table-wise and column-wise shards return whole pooled rows of their tables or column blocks
  (a column shard keeps its rows' float16 scale and bias and its columns' packed values);
* row-wise shards each pool the ids of a bag that fall in their rows, cast to the output
  dtype, and the batch owner adds the shards' partial sums one device after another in mesh
  order, each sum rounded to the output dtype (FBGEMM's ``sum_reduce_to_one``);
* a row-wise MEAN table averages each shard's ids of a bag on their own and sums the shard
  means, as TorchRec's sharded inference does (its unsharded module averages the whole bag,
  so the two differ; ``tpurec.shard`` warns once naming such tables).

Routing and packing are the float collection's (``routing.py``); the forward program is
``programs.forward`` with the quantized lookup kernel of each stack and rank-ordered sums.
Nothing here trains: the tables are buffers, and the output needs no gradient.
"""

from __future__ import annotations

import functools
from typing import Literal, Mapping, Sequence, cast

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor
from torchrec.distributed.types import ShardingType

from tpurec.core import Program, mesh_arrays_in_use, replace_array, wrap
from tpurec.sparse.lookup import EmbeddingLookup
from tpurec.sparse.preprocess import stack_tables
from tpurec.sparse.quant import (
    OUTPUT_DTYPES,
    QUANT_BITS,
    SCALE_BIAS_BYTES,
    QuantEmbeddingBagCollection,
    _stored_rows,
    _torchrec_quant_order,
    quantized_sparse_dense_matmul,
    row_bytes,
)
from tpurec.sparse.sharding import programs
from tpurec.sparse.sharding.ebc import _global_from_host, host_values
from tpurec.sparse.sharding.routing import InputRouter
from tpurec.sparse.sharding_plan.layout import Layout
from tpurec.sparse.sharding_plan.shards import TableSharding

__all__ = [
    "QUANT_SHARDING_TYPES",
    "ShardedQuantEmbeddingBagCollection",
    "check_quant_shardings",
    "mean_row_wise_tables",
]

QUANT_SHARDING_TYPES: tuple[str, ...] = (
    ShardingType.TABLE_WISE.value,
    ShardingType.ROW_WISE.value,
    ShardingType.COLUMN_WISE.value,
)
"""The sharding types TorchRec's ``QuantEmbeddingBagCollectionSharder`` offers for quantized tables."""


def check_quant_shardings(
    where: str, configs: Sequence[EmbeddingBagConfig], shardings: Mapping[str, TableSharding]
) -> None:
    """Raises for a plan of quantized tables that TorchRec's quantized sharder would not run.

    Args:
        where: the collection, for the message (e.g. ``"QuantEmbeddingBagCollection at 'sparse'"``).
        configs: its tables.
        shardings: table name -> how the plan shards it.

    Raises:
        ValueError: a sharding type other than table-wise, row-wise or column-wise, or a column
            shard that does not start and end on a whole byte of packed values.
    """
    for cfg in configs:
        ts = shardings[cfg.name]
        if ts.sharding_type not in QUANT_SHARDING_TYPES:
            raise ValueError(
                f"{where}: table {cfg.name!r} is planned {ts.sharding_type}, but quantized tables shard "
                f"{', '.join(QUANT_SHARDING_TYPES)} only (TorchRec's QuantEmbeddingBagCollectionSharder). Plan it "
                "with one of those."
            )
        bits = QUANT_BITS[cfg.data_type]
        for p in ts.pieces:
            if (p.col_offset * bits) % 8 or (p.cols * bits) % 8:
                raise ValueError(
                    f"{where}: table {cfg.name!r} ({cfg.data_type.name}) has a column shard of columns "
                    f"[{p.col_offset}, {p.col_offset + p.cols}) that splits a byte of its packed {bits}-bit values; "
                    f"column shards of it must start and end on multiples of {8 // bits} columns"
                )


def mean_row_wise_tables(configs: Sequence[EmbeddingBagConfig], shardings: Mapping[str, TableSharding]) -> list[str]:
    """The MEAN tables split into row shards (each shard's ids are averaged on their own)."""
    return [
        c.name
        for c in configs
        if c.pooling == PoolingType.MEAN and len({p.row_offset for p in shardings[c.name].pieces}) > 1
    ]


class ShardedQuantEmbeddingBagCollection(EmbeddingLookup, EmbeddingBagCollectionInterface):
    """A quantized inference collection whose stored rows are sharded ``jax.Array`` s on a mesh.

    Built by :func:`tpurec.shard` from a :class:`~tpurec.sparse.QuantEmbeddingBagCollection` and a
    table-wise, row-wise or column-wise plan. Takes the unsharded module's ``KeyedJaggedTensor``
    (each process its local batch, split evenly over its devices) and returns its
    ``KeyedTensor``: the same keys in the same order, of its ``output_dtype``, batch-sharded on
    the mesh. The state dict is the unsharded module's (whole stored rows per table).

    Args:
        source: the unsharded module (its stored rows are copied).
        shardings: table name -> :class:`TableSharding` (checked by :func:`check_quant_shardings`).
        mesh: the device mesh (rank ``r`` of the plan is ``mesh.devices.flat[r]``).
        capacity: entries each source device may send each destination per group and batch;
            None grows it on demand.
        overflow: ``"error"`` or ``"drop"`` when a batch exceeds ``capacity``.
    """

    def __init__(
        self,
        source: QuantEmbeddingBagCollection,
        shardings: Mapping[str, TableSharding],
        mesh: Mesh,
        capacity: int | None = None,
        overflow: Literal["error", "drop"] = "error",
    ) -> None:
        super().__init__()
        if overflow not in ("error", "drop"):
            raise ValueError(f"overflow must be 'error' or 'drop', got {overflow!r}")
        if capacity is not None and capacity <= 0:
            raise ValueError(f"capacity must be a positive number of entries, got {capacity}")
        configs = list(source.embedding_bag_configs())
        check_quant_shardings(type(source).__name__, configs, shardings)
        self._embedding_bag_configs = configs
        self._is_weighted = source.is_weighted()
        self._output_dtype = source.output_dtype()
        self.row_alignment = source.row_alignment
        self.mesh = mesh
        self.axis = tuple(mesh.axis_names)
        # The unsharded module's output order (TorchRec's quantized order: tables by pooling).
        ordered = _torchrec_quant_order(configs)
        self._bits = {c.name: QUANT_BITS[c.data_type] for c in configs}
        self.layout = Layout(ordered, dict(shardings), mesh.devices.size, kinds=self._bits)
        self._group_bits = [cast(int, grp.kind) for grp in self.layout.groups]  # bits per value of each stack
        self._stacks = stack_tables(ordered, stack=False)
        self.dropped = 0  # entries overflow="drop" left out, in all (dropped_entries(): per feature)
        self.router = InputRouter(
            ordered, self._stacks, self.layout, mesh, self._is_weighted, capacity, overflow, mean_per_row_block=True
        )
        self._init_outputs(ordered)
        self._sharded = NamedSharding(mesh, P(self.axis))
        self._program_cache: dict[int, Program] = {}
        host = {c.name: source.table_weight(c.name).detach().cpu().numpy() for c in configs}
        self._lay_out(host, register=True)
        mesh_arrays_in_use()

    # --- stored rows on the mesh ----------------------------------------------------

    def _stored_width(self, group: int) -> int:
        """Bytes of one stored row of sharded group ``group`` (its width in values, its bits)."""
        return row_bytes(self.layout.groups[group].width, self._group_bits[group], self.row_alignment)

    def _lay_out(self, host: Mapping[str, np.ndarray], register: bool = False) -> None:
        """Lays each table's whole stored rows (uint8 ``[rows, row bytes]``) out on the mesh.

        A column shard's rows are the table's scale and bias followed by its columns' packed values.
        """
        L, D = self.layout, self.layout.num_devices
        for g, grp in enumerate(L.groups):
            bits, R = self._group_bits[g], grp.rows_per_device
            stack = np.zeros((D * R, self._stored_width(g)), np.uint8)
            for p, offset in grp.offsets.items():
                rows = host[p.table][p.row_offset : p.row_offset + p.rows]
                start = p.device * R + offset
                first, size = SCALE_BIAS_BYTES + p.col_offset * bits // 8, p.cols * bits // 8
                stack[start : start + p.rows, :SCALE_BIAS_BYTES] = rows[:, :SCALE_BIAS_BYTES]
                stack[start : start + p.rows, SCALE_BIAS_BYTES : SCALE_BIAS_BYTES + size] = rows[
                    :, first : first + size
                ]
            array = _global_from_host(stack, self._sharded)
            if register:
                self.register_buffer(f"shard_weight_{g}", wrap(array, 0), persistent=False)
            else:
                replace_array(getattr(self, f"shard_weight_{g}"), array)

    def full_rows(self) -> dict[str, np.ndarray]:
        """Every table's whole stored rows (uint8 ``[rows, row bytes]``), assembled on the host."""
        from tpurec.core import value_of

        L = self.layout
        tables = {
            c.name: np.zeros(
                (c.num_embeddings, row_bytes(c.embedding_dim, self._bits[c.name], self.row_alignment)), np.uint8
            )
            for c in L.configs  # (the output order)
        }
        for g, grp in enumerate(L.groups):
            bits, R = self._group_bits[g], grp.rows_per_device
            stack = host_values(value_of(getattr(self, f"shard_weight_{g}")))
            for p, offset in grp.offsets.items():
                start = p.device * R + offset
                shard = stack[start : start + p.rows]
                first, size = SCALE_BIAS_BYTES + p.col_offset * bits // 8, p.cols * bits // 8
                rows = tables[p.table][p.row_offset : p.row_offset + p.rows]
                rows[:, :SCALE_BIAS_BYTES] = shard[:, :SCALE_BIAS_BYTES]
                rows[:, first : first + size] = shard[:, SCALE_BIAS_BYTES : SCALE_BIAS_BYTES + size]
        return tables

    # --- state dict: the unsharded module's keys, whole stored rows ---------------------

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name, rows in self.full_rows().items():
            destination[prefix + f"embedding_bags.{name}.weight"] = torch.from_numpy(rows)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        # As the unsharded module's: whole rows or TorchRec's split scale/bias form; all checked first.
        tables = self.full_rows()
        expected: set[str] = set()
        for cfg in self._embedding_bag_configs:
            key = prefix + f"embedding_bags.{cfg.name}.weight"
            expected.update((key, key + "_qscale", key + "_qbias"))
            if key not in state_dict:
                missing_keys.append(key)
                continue
            rows, width = tables[cfg.name].shape
            value, error = _stored_rows(state_dict, key, rows, cfg.embedding_dim, self._bits[cfg.name], width)
            if error is not None:
                error_msgs.append(error)
                continue
            assert value is not None
            tables[cfg.name] = value.detach().cpu().numpy()
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in expected)
        if error_msgs or (strict and missing_keys):
            return
        self._lay_out(tables)

    # --- torchrec interface ---------------------------------------------------------

    def output_dtype(self) -> torch.dtype:
        return self._output_dtype

    @property
    def device(self) -> torch.device:
        return torch.device("tpu")

    @property
    def overflow(self) -> Literal["error", "drop"]:  # type: ignore[override]  # (a read-only property here)
        """What a batch beyond a fixed capacity does: ``"error"`` or ``"drop"``."""
        return cast(Literal["error", "drop"], self.router.overflow)

    # --- lookup ---------------------------------------------------------------------

    def _program(self, b: int) -> Program:
        """The forward program for ``b`` samples per device (cached)."""
        if b not in self._program_cache:
            dtype = OUTPUT_DTYPES[self._output_dtype]
            lookups = [
                functools.partial(
                    quantized_sparse_dense_matmul.fn, bits=bits, embedding_dim=grp.width, output_dtype=dtype
                )
                for grp, bits in zip(self.layout.groups, self._group_bits)
            ]

            def forward(weights: list[jax.Array], groups: list[tuple[jax.Array, jax.Array, jax.Array]]) -> jax.Array:
                out, _, _ = programs.forward(
                    self.layout, self.mesh, lookups, weights, [], groups, [], b, rank_ordered_sums=True
                )
                return out

            self._program_cache[b] = Program(forward)
        return self._program_cache[b]

    @torch.compiler.disable
    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pooled embeddings of this process's batch, as TorchRec's sharded quantized EBC computes them.

        Returns:
            ``KeyedTensor`` of ``output_dtype`` over the global batch (all processes' samples, in
            process order), batch-sharded on the mesh, keys in the unsharded module's order.

        Raises:
            ValueError: a malformed batch, or a local batch that does not split evenly over this
                process's devices.
            NotImplementedError: the per-id weights require grad, or a variable batch per feature
                (both as the unsharded module).
        """
        from tpurec.core import value_of

        tables = [t.name for t in self._embedding_bag_configs]
        if self._weights_need_grad(features):
            raise NotImplementedError(
                f"ShardedQuantEmbeddingBagCollection (tables {tables}) is for inference, but the KJT's per-id "
                "weights require grad: TorchRec's quantized lookup gives them no gradient either. Detach the weights."
            )
        if features.variable_stride_per_key() or features.inverse_indices_or_none() is not None:
            raise NotImplementedError(
                f"ShardedQuantEmbeddingBagCollection (tables {tables}) does not look up KeyedJaggedTensors with a "
                "variable batch size per feature (VBE) or inverse_indices: TorchRec's quantized EmbeddingBagCollection "
                "does not expand them either. Give every feature the same batch size and no inverse_indices."
            )
        batch, dropped = self.router.pack(self.router.route(features))
        self.dropped += dropped
        self._drops.add(batch.dropped)
        b = batch.per_device
        if b == 0:
            empty = np.zeros((0, self.layout.total_dim), jnp.dtype(OUTPUT_DTYPES[self._output_dtype]))
            values = wrap(self.router.to_global(empty), 0, self._output_dtype)
        else:
            weights = [value_of(getattr(self, f"shard_weight_{g}")) for g in range(len(self.layout.groups))]
            values = wrap(self._program(b)(weights, batch.groups), 0, self._output_dtype)
        return KeyedTensor(keys=self._embedding_names, length_per_key=self._length_per_key, values=values)
