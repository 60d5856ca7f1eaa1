"""A tpurec EmbeddingBagCollection sharded over a device mesh: the module.

Three parts, as TorchRec splits a sharded module into input distribution,
compute and output distribution (see docs/sharding.md):

* ``routing.py`` (host, per process): validates the local batch and routes each
  id to the shards holding its row, in fixed-capacity arrays on the mesh. Under
  :class:`~tpurec.sparse.TrainPipeline` this runs in :meth:`prefetch` on the
  pipeline's worker thread for batch ``i + 1`` while step ``i`` runs;
* ``programs.py`` (SPMD): the forward program (entries to their owners, lookups,
  pooled rows back to the batch owners) and the backward program (gradients to
  the shards, the fused optimizer on each, buffers donated);
* this module: the tables and optimizer slots as parameters and buffers, state
  dicts, the optimizer state, and ``forward`` joining the two through autograd.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar, Literal, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from torch import nn
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from tpurec.core import Program, mesh_arrays_in_use, replace_array, wrap
from tpurec.sparse.lookup import Staged, TrainableLookup, check_optimizer_state, restage
from tpurec.sparse.modules import TABLE_DTYPES
from tpurec.sparse.ops import kernel_for
from tpurec.sparse.optimizers import EmbeddingOptimizer
from tpurec.sparse.preprocess import stack_tables
from tpurec.sparse.sharding import programs
from tpurec.sparse.sharding_plan.layout import Layout
from tpurec.sparse.sharding.routing import InputRouter, MeshBatch, Prefetched, Routed
from tpurec.sparse.sharding_plan.shards import TableSharding
from tpurec.sparse.update_rules import rule_of
from tpurec.sparse.table_init import check_rows_fit, local_stack_values, table_init, table_key

__all__ = ["ShardedEmbeddingBagCollection", "host_values"]


def _global_from_host(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array with ``host``'s values (every process passes the same ``host``)."""
    if jax.process_count() == 1:
        return jax.device_put(host, sharding)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def host_values(array: jax.Array) -> np.ndarray:
    """All values of a (possibly multi-process) global array, on this host."""
    if array.is_fully_addressable:
        return np.asarray(array)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def _padded(positions: np.ndarray, fill: int) -> np.ndarray:
    """``positions`` padded with ``fill`` to a power of two (programs are made per length)."""
    size = 1 << max(0, int(positions.size - 1).bit_length())
    return np.concatenate([positions, np.full(size - positions.size, fill, np.int64)]).astype(np.int32)


@jax.jit
def _take_rows(stack: jax.Array, positions: jax.Array) -> jax.Array:
    return stack[positions]


@functools.lru_cache(maxsize=None)
def _row_setter(sharding: Any) -> Any:
    """A program setting rows of a stack laid out as ``sharding`` (its output keeps that layout)."""

    def set_rows(stack: jax.Array, positions: jax.Array, values: jax.Array, columns: jax.Array) -> jax.Array:
        # Rows ``positions`` become ``values`` in the columns ``columns`` marks; positions past
        # the end (padding) are dropped.
        if stack.ndim == 1:
            new = values
        else:
            new = jnp.where(columns[None, :], values, stack[jnp.clip(positions, 0, stack.shape[0] - 1)])
        return stack.at[positions].set(new, mode="drop")

    return jax.jit(set_rows, out_shardings=sharding)


STACK_DTYPES = {kind: jnp.dtype(str(dtype).removeprefix("torch.")) for kind, dtype in TABLE_DTYPES.items()}
"""Table ``data_type`` -> the dtype of its stack's rows (the unsharded collection's ``TABLE_DTYPES``)."""


def _host_float32(tensor: torch.Tensor) -> np.ndarray:
    """``tensor``'s values as a float32 host array (exact for float16/bfloat16/float32 tensors)."""
    return tensor.detach().cpu().to(torch.float32).numpy()


_MAX_PREFETCHED = 8
"""Batches :meth:`ShardedEmbeddingBagCollection.prefetch` keeps for forward (a pipeline needs 1-2)."""


class _ShardedLookup(torch.autograd.Function):
    """The sharded forward program; its backward runs the sharded fused optimizer.

    ``id_weights`` is the KJT's per-id weights tensor when it needs a gradient
    (else None): the backward then also returns TorchRec's gradient for it.
    """

    @staticmethod
    def forward(ctx, anchor, id_weights, module, batch):
        out, saved = module._run_forward(batch, with_rows=id_weights is not None)
        ctx.module, ctx.saved = module, saved
        ctx.id_weights = None if id_weights is None else (id_weights.device, id_weights.dtype)
        module._lookup_started(ctx, ())
        return out

    @staticmethod
    def backward(ctx, grad_output):
        module = ctx.module
        module._lookup_finished(ctx)
        if module._sums_this_backward():
            id_grad = module._stash_lookup(ctx.saved, grad_output)
        else:
            id_grad = module._run_backward(ctx.saved, grad_output)
        if ctx.id_weights is not None:
            device, dtype = ctx.id_weights
            id_grad = torch.from_numpy(id_grad).to(device=device, dtype=dtype)
        # The tables are updated in place: they get no .grad (a dense optimizer skips them).
        return None, id_grad, None, None


class _StagedLookup(torch.autograd.Function):
    """The sharded lookup of a staged batch, run (eager) or recorded (fused) as tpu work.

    Unlike :class:`_ShardedLookup` it reads the tables, the batch's entries and the output's
    gradient as tensors and writes the updated tables into their tensors, without reading a
    value: in fused mode both programs join the step's window, so :func:`tpurec.graph` can
    capture the step. ``entries`` are the collection's static entry tensors (``stage()``).
    """

    @staticmethod
    def forward(ctx, anchor, module, entries, b):
        out, received = module._staged_forward(entries, b)
        ctx.module, ctx.entries, ctx.received, ctx.b = module, entries, received, b
        module._lookup_started(ctx, entries)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        module = ctx.module
        module._lookup_finished(ctx)
        if module._sums_this_backward():
            module._stash_staged_lookup(ctx.entries, ctx.received, grad_output, ctx.b)
        else:
            module._staged_backward(ctx.entries, ctx.received, grad_output, ctx.b)
        return None, None, None, None


class ShardedEmbeddingBagCollection(TrainableLookup, EmbeddingBagCollectionInterface):
    """An EmbeddingBagCollection whose tables are sharded ``jax.Array`` s on a mesh.

    Built by :func:`tpurec.shard` from a tpurec ``EmbeddingBagCollection`` and a
    plan; takes the same ``KeyedJaggedTensor`` (each process passes its local
    batch, split evenly over its devices) and returns the same ``KeyedTensor``,
    whose values are a batch-sharded global ``[batch, sum of dims]`` tpu tensor.

    Args:
        source: the unsharded module (tables, optimizer state and settings are copied).
        shardings: table name -> :class:`TableSharding`.
        mesh: the device mesh (rank ``r`` of the plan is ``mesh.devices.flat[r]``).
        capacity: entries each source device may send each destination per
            group and step; None grows it on demand to powers of two (a growth
            compiles the programs again).
        overflow: ``"error"`` (raise :class:`CapacityError`) or ``"drop"`` (count
            the dropped entries in ``dropped`` and, per feature, :meth:`dropped_entries`).
        seed: when ``source``'s tables are on ``meta``: the seed every shard is
            born from, on its own device (see :mod:`tpurec.sparse.table_init`;
            the same seed gives the same tables under any plan); optimizer
            slots start at zero. Unused for a source with values.
        zero_slots: the optimizer slots start at zero instead of the source's (its optimizer was
            replaced by one whose slots it does not hold).

    Example::

        sharded = ShardedEmbeddingBagCollection(ebc, table_shardings(configs, plan, 8), mesh)
        kt = sharded(kjt)
    """

    optimizer: EmbeddingOptimizer  # (never None: tpurec.shard refuses an inference collection)

    def __init__(
        self,
        source: Any,
        shardings: Mapping[str, TableSharding],
        mesh: Mesh,
        capacity: int | None = None,
        overflow: Literal["error", "drop"] = "error",
        seed: int = 0,
        zero_slots: bool = False,
    ) -> None:
        super().__init__()
        if overflow not in ("error", "drop"):
            raise ValueError(f"overflow must be 'error' or 'drop', got {overflow!r}")
        if capacity is not None and capacity <= 0:
            raise ValueError(f"capacity must be a positive number of entries, got {capacity}")
        configs: list[EmbeddingBagConfig] = list(source.embedding_bag_configs())
        if getattr(source, "output_dtype", torch.float32) != torch.float32:
            raise NotImplementedError(
                f"sharding an EmbeddingBagCollection with output_dtype={source.output_dtype} is not supported yet: "
                "the sharded lookup returns float32. Build it with output_dtype=torch.float32 (the default)."
            )
        self._embedding_bag_configs = configs
        self._is_weighted = source.is_weighted()
        if source.optimizer is None:  # an inference module (no embedding optimizer)
            raise ValueError(
                "sharding an EmbeddingBagCollection without an embedding optimizer is not supported: pass "
                "optimizer= to tpurec.shard (or build the module with one)"
            )
        half = [f"{c.name} ({c.data_type.name})" for c in configs if c.data_type != DataType.FP32]
        if half and not rule_of(source.optimizer.op_name).half_tables:
            raise ValueError(
                f"tables {half} are FP16/BF16 and the optimizer is {type(source.optimizer).__name__}: FBGEMM has no "
                "CPU kernel of it to follow for such tables (as the unsharded collection refuses). Use FP32 tables "
                "with it, or SGD, Adagrad or RowWiseAdagrad with FP16/BF16 tables."
            )
        self.optimizer = source.optimizer
        # As the unsharded collection's (docs/torchrec_semantics.md): "torch" (the optimizer came
        # from apply_optimizer_in_backward) makes one update per backward pass on the summed gradient
        # of the lookups in it; "fbgemm" one update per lookup.
        self.optimizer_semantics = getattr(source, "optimizer_semantics", "fbgemm")
        # "torch" semantics, several lookups in one backward pass: each lookup's (gradient, received
        # entries, data-parallel entries, samples per device) until the pass ends (_stash_lookup).
        self._stashed_lookups: list[tuple[jax.Array, list[Any], list[Any], int]] = []
        self._stash_pass = -1  # the backward pass (autograd's graph task) they belong to
        # Their programs: ("summed", samples per device of each lookup) -> the summed update,
        # ("dots", samples per device) -> per-id weight gradients alone.
        self._stash_programs: dict[tuple[str, Any], Program] = {}
        self.mesh = mesh
        self.axis = tuple(mesh.axis_names)
        # Tables of one dtype share a stack: the stacks are global arrays of the tables' dtype
        # (float16/bfloat16 rows, float32 optimizer slots, as the unsharded collection keeps them).
        self.layout = Layout(configs, dict(shardings), mesh.devices.size, kinds={c.name: c.data_type for c in configs})
        self.dropped = 0  # entries overflow="drop" left out, in all (dropped_entries(): per feature)
        # One step count: the sharded collection steps all its tables together.
        self._steps = [max(getattr(source, "_steps", [0]) or [0])]
        self._stacks = stack_tables(configs, stack=False)
        # Host routing of each batch (capacities, this process's devices): see routing.py.
        self.router = InputRouter(configs, self._stacks, self.layout, mesh, self._is_weighted, capacity, overflow)
        # stage(): the static entry tensors the staged lookup reads (each group's and then each
        # data-parallel group's rows, samples and gains) and the samples per device they were made for.
        self._static_entries: list[torch.Tensor] = []
        self._static_per_device: int | None = None
        self._staged_program_cache: dict[int, tuple[Program, Program]] = {}
        self._init_outputs(configs)

        self._sharded = NamedSharding(mesh, P(self.axis))
        self._replicated = NamedSharding(mesh, P())

        if source.device.type == "meta":
            # Born sharded: each shard is created on its device; no host ever holds a table.
            self._init_on_mesh(seed)
            mesh_arrays_in_use()
            return
        host_tables = {c.name: _host_float32(source.table_weight(c.name)) for c in configs}
        if zero_slots:
            host_slots = {
                c.name: {
                    s: np.zeros(
                        (c.num_embeddings,) if kind == "row" else (c.num_embeddings, c.embedding_dim), np.float32
                    )
                    for s, kind in self.optimizer.slots.items()
                }
                for c in configs
            }
        else:
            opt_state = source.optimizer_state_dict()["state"]
            host_slots = {
                c.name: {
                    s: _host_float32(opt_state[f"embedding_bags.{c.name}.weight"][s]) for s in self.optimizer.slots
                }
                for c in configs
            }
        self._load_host_tables(host_tables, host_slots, register=True)
        mesh_arrays_in_use()

    @property
    def samples_multiple(self) -> int:
        """This process's batch must be a multiple of this (its devices, which split it evenly)."""
        return self.router.local_devices

    # --- state ------------------------------------------------------------------

    def _stack_dtype(self, group: Any) -> np.dtype:
        """The dtype of a (data-parallel) group's table stack: its tables' (their ``kind``)."""
        return STACK_DTYPES[group.kind]

    def _load_host_tables(
        self, tables: Mapping[str, np.ndarray], slots: Mapping[str, Mapping[str, np.ndarray]], register: bool = False
    ) -> None:
        """Lays full host tables (and optimizer slots) out on the mesh.

        The tables' values are rounded to their dtype (to nearest even, as the unsharded
        collection's ``load_state_dict`` does); the slots stay float32.
        """
        L, D = self.layout, self.layout.num_devices
        kinds = self.optimizer.slots

        def blank(rows: int, width: int, kind: str | None) -> np.ndarray:
            return np.zeros((rows,) if kind == "row" else (rows, width), np.float32)

        arrays: dict[str, jax.Array] = {}
        for g, grp in enumerate(L.groups):
            R, w = grp.rows_per_device, grp.width
            stacks = {None: blank(D * R, w, None), **{s: blank(D * R, w, k) for s, k in kinds.items()}}
            for p, offset in grp.offsets.items():
                start = p.device * R + offset
                rows = slice(p.row_offset, p.row_offset + p.rows)
                stacks[None][start : start + p.rows] = tables[p.table][rows, p.col_offset : p.col_offset + p.cols]
                for s, k in kinds.items():
                    value = slots[p.table][s]
                    stacks[s][start : start + p.rows] = (
                        value[rows] if k == "row" else value[rows, p.col_offset : p.col_offset + p.cols]
                    )
            arrays[f"shard_weight_{g}"] = _global_from_host(stacks[None].astype(self._stack_dtype(grp)), self._sharded)
            for s in kinds:
                arrays[f"shard_{s}_{g}"] = _global_from_host(stacks[s], self._sharded)
        for g, dg in enumerate(L.dp_groups):
            stacks = {
                None: blank(dg.num_rows, dg.width, None),
                **{s: blank(dg.num_rows, dg.width, k) for s, k in kinds.items()},
            }
            for name, offset in dg.offsets.items():
                n = tables[name].shape[0]
                stacks[None][offset : offset + n] = tables[name]
                for s in kinds:
                    stacks[s][offset : offset + n] = slots[name][s]
            arrays[f"dp_weight_{g}"] = _global_from_host(stacks[None].astype(self._stack_dtype(dg)), self._replicated)
            for s in kinds:
                arrays[f"dp_{s}_{g}"] = _global_from_host(stacks[s], self._replicated)
        for name, array in arrays.items():
            if register:
                tensor = wrap(array, 0)
                if "weight" in name:
                    self.register_parameter(name, nn.Parameter(tensor))
                else:
                    self.register_buffer(name, tensor, persistent=False)
            else:
                replace_array(getattr(self, name), array)

    def _init_on_mesh(self, seed: int) -> None:
        """Registers the tables, born on their devices from ``seed``, and zero optimizer slots.

        Each device computes only its own rows (``shard_map`` over the piece
        lists of its local stack); data-parallel stacks are computed on every
        device. Values: :func:`tpurec.sparse.table_init.local_stack_values`.
        """
        L, D = self.layout, self.layout.num_devices
        configs = self._embedding_bag_configs
        check_rows_fit(configs)
        inits = [table_init(c) for c in configs]  # raises for an init_fn it cannot apply per shard
        keys = [table_key(seed, c.name) for c in configs]
        k1 = keys[0][0]
        params = (
            jnp.asarray(np.array([i.code for i in inits], np.int32)),
            jnp.asarray(np.array([i.a for i in inits], np.float32)),
            jnp.asarray(np.array([i.b for i in inits], np.float32)),
            jnp.asarray(np.array([k[1] for k in keys], np.uint32)),
        )
        index = {c.name: i for i, c in enumerate(configs)}
        kinds = self.optimizer.slots

        def piece_arrays(pieces: list[list[tuple[int, int, int, int, int]]]) -> list[np.ndarray]:
            # [devices, pieces] (start, rows, table, row offset, col offset); padding pieces hold no row.
            width = max(1, max(len(p) for p in pieces))
            out = [
                np.zeros((len(pieces), width), dtype) for dtype in (np.int32, np.int32, np.int32, np.uint32, np.uint32)
            ]
            for d, entries in enumerate(pieces):
                for j, entry in enumerate(sorted(entries)):
                    for array, value in zip(out, entry):
                        array[d, j] = value
                for j in range(len(entries), width):
                    out[0][d, j] = np.iinfo(np.int32).max
            return out

        def zeros(shape: tuple[int, ...], sharding: NamedSharding) -> jax.Array:
            return jax.jit(lambda: jnp.zeros(shape, jnp.float32), out_shardings=sharding)()

        arrays: dict[str, jax.Array] = {}
        spec = P(self.axis)
        for g, grp in enumerate(L.groups):
            R, w = grp.rows_per_device, grp.width
            per_device: list[list[tuple[int, int, int, int, int]]] = [[] for _ in range(D)]
            for p, offset in grp.offsets.items():
                per_device[p.device].append((offset, p.rows, index[p.table], p.row_offset, p.col_offset))
            host = piece_arrays(per_device)
            pieces = [_global_from_host(a, self._sharded) for a in host]

            def local(starts, counts, tables, row_offsets, col_offsets, R=R, w=w):
                return local_stack_values(
                    starts[0], counts[0], tables[0], row_offsets[0], col_offsets[0], params, k1, R, w
                )

            born = jax.shard_map(local, mesh=self.mesh, in_specs=(spec,) * 5, out_specs=spec, check_vma=False)
            dtype = self._stack_dtype(grp)
            arrays[f"shard_weight_{g}"] = jax.jit(
                lambda *p, born=born, dtype=dtype: born(*p).astype(dtype), out_shardings=self._sharded
            )(*pieces)
            for s, k in kinds.items():
                arrays[f"shard_{s}_{g}"] = zeros((D * R,) if k == "row" else (D * R, w), self._sharded)
        for g, dg in enumerate(L.dp_groups):
            entries = [
                (offset, configs[index[name]].num_embeddings, index[name], 0, 0) for name, offset in dg.offsets.items()
            ]
            host = [a[0] for a in piece_arrays([entries])]
            stack = functools.partial(local_stack_values, params=params, k1=k1, num_rows=dg.num_rows, width=dg.width)
            dtype = self._stack_dtype(dg)
            arrays[f"dp_weight_{g}"] = jax.jit(
                lambda *h, stack=stack, dtype=dtype: stack(*h).astype(dtype), out_shardings=self._replicated
            )(*host)
            for s, k in kinds.items():
                arrays[f"dp_{s}_{g}"] = zeros(
                    (dg.num_rows,) if k == "row" else (dg.num_rows, dg.width), self._replicated
                )
        for name, array in arrays.items():
            tensor = wrap(array, 0)
            if "weight" in name:
                self.register_parameter(name, nn.Parameter(tensor))
            else:
                self.register_buffer(name, tensor, persistent=False)

    def _arrays(self, prefix: str, count: int) -> tuple[list[jax.Array], list[list[jax.Array]]]:
        from tpurec.core import value_of

        weights = [value_of(getattr(self, f"{prefix}_weight_{g}")) for g in range(count)]
        slots = [[value_of(getattr(self, f"{prefix}_{s}_{g}")) for s in self.optimizer.slots] for g in range(count)]
        return weights, slots

    def table_weight(self, name: str) -> np.ndarray:
        """Table ``name``'s full ``[rows, dim]`` values on the host (a copy)."""
        return self.full_tables()[0][name]

    def _row_places(self, name: str, rows: np.ndarray) -> list[tuple[str, int, np.ndarray, np.ndarray, slice, slice]]:
        """Where rows ``rows`` of table ``name`` live: per stack holding some of them,
        ``(prefix, group, positions in the stack, which of rows, table columns, stack columns)``."""
        L = self.layout
        places = []
        for g, grp in enumerate(L.groups):
            for p, offset in grp.offsets.items():
                inside = np.flatnonzero((p.table == name) & (rows >= p.row_offset) & (rows < p.row_offset + p.rows))
                if inside.size:
                    positions = p.device * grp.rows_per_device + offset + rows[inside] - p.row_offset
                    places.append(
                        ("shard", g, positions, inside, slice(p.col_offset, p.col_offset + p.cols), slice(0, p.cols))
                    )
        for g, dg in enumerate(L.dp_groups):
            if name in dg.offsets:
                dim = next(c.embedding_dim for c in self._embedding_bag_configs if c.name == name)
                everything = np.arange(rows.size)
                places.append(("dp", g, dg.offsets[name] + rows, everything, slice(0, dim), slice(0, dim)))
        return places

    def rows_of(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` of table ``name``, ``[len(rows), dim]`` float32 on the host (a copy; only those rows move).

        Args:
            name: a table of this collection.
            rows: row numbers in ``[0, num_embeddings)``.
        """
        from tpurec.core import value_of

        rows = np.asarray(rows, np.int64).reshape(-1)
        dim = next(c.embedding_dim for c in self._embedding_bag_configs if c.name == name)
        out = np.zeros((rows.size, dim), np.float32)
        for prefix, g, positions, inside, columns, stack_columns in self._row_places(name, rows):
            stack = value_of(getattr(self, f"{prefix}_weight_{g}"))
            taken = np.asarray(_take_rows(stack, jnp.asarray(_padded(positions, 0))))
            out[inside, columns] = taken[: positions.size, stack_columns]
        return out

    def write_rows(self, name: str, rows: np.ndarray, values: np.ndarray, zero_slots: bool = False) -> None:
        """Writes ``values`` into rows ``rows`` of table ``name`` on their shards.

        Args:
            name: a table of this collection.
            rows: distinct row numbers in ``[0, num_embeddings)``.
            values: ``[len(rows), dim]`` new rows (rounded to the table's dtype).
            zero_slots: also set the optimizer slots of those rows to zero.
        """
        from tpurec.core import value_of

        rows = np.asarray(rows, np.int64).reshape(-1)
        values = np.asarray(values, np.float32).reshape(rows.size, -1)
        for prefix, g, positions, inside, columns, stack_columns in self._row_places(name, rows):
            weight = getattr(self, f"{prefix}_weight_{g}")
            stack = value_of(weight)
            # Padded to a power of two (out-of-range positions are dropped): few distinct programs.
            at = jnp.asarray(_padded(positions, stack.shape[0]))
            block = np.zeros((at.shape[0], stack.shape[1]), np.float32)
            block[: positions.size, stack_columns] = values[inside, columns]
            block = block.astype(stack.dtype)  # rounded to the table's dtype
            keep = np.zeros(stack.shape[1], bool)
            keep[stack_columns] = True
            replace_array(weight, _row_setter(stack.sharding)(stack, at, jnp.asarray(block), jnp.asarray(keep)))
            if zero_slots:
                for s in self.optimizer.slots:
                    slot = getattr(self, f"{prefix}_{s}_{g}")
                    current = value_of(slot)
                    zeros = jnp.zeros((at.shape[0], *current.shape[1:]), current.dtype)
                    every = jnp.ones(current.shape[1:] or (1,), bool)
                    replace_array(slot, _row_setter(current.sharding)(current, at, zeros, every))

    def full_tables(self) -> tuple[dict[str, np.ndarray], dict[str, dict[str, np.ndarray]]]:
        """Every table and optimizer slot, assembled from the shards on the host.

        Returns:
            ``(tables, slots)``: table name -> ``[rows, dim]`` (float32: FP16/BF16 tables widened,
            exactly); table name ->
            slot name -> ``[rows]`` (row-wise slots) or ``[rows, dim]``. For a
            column-wise table a row-wise slot comes from its first column shard.
        """
        L = self.layout
        kinds = self.optimizer.slots
        tables = {
            c.name: np.zeros((c.num_embeddings, c.embedding_dim), np.float32) for c in self._embedding_bag_configs
        }
        dims = {c.name: c.embedding_dim for c in self._embedding_bag_configs}
        slots = {
            c.name: {
                s: np.zeros((c.num_embeddings,) if k == "row" else (c.num_embeddings, c.embedding_dim), np.float32)
                for s, k in kinds.items()
            }
            for c in self._embedding_bag_configs
        }
        weights, slot_arrays = self._arrays("shard", len(L.groups))
        for g, grp in enumerate(L.groups):
            R = grp.rows_per_device
            w_host = host_values(weights[g])
            s_host = [host_values(a) for a in slot_arrays[g]]
            for p, offset in grp.offsets.items():
                start = p.device * R + offset
                rows = slice(p.row_offset, p.row_offset + p.rows)
                tables[p.table][rows, p.col_offset : p.col_offset + p.cols] = w_host[start : start + p.rows]
                for (s, k), value in zip(kinds.items(), s_host):
                    if k == "row":
                        if p.col_offset == 0:
                            slots[p.table][s][rows] = value[start : start + p.rows]
                    else:
                        slots[p.table][s][rows, p.col_offset : p.col_offset + p.cols] = value[start : start + p.rows]
        weights, slot_arrays = self._arrays("dp", len(L.dp_groups))
        for g, dg in enumerate(L.dp_groups):
            w_host = host_values(weights[g])
            s_host = [host_values(a) for a in slot_arrays[g]]
            for name, offset in dg.offsets.items():
                n = tables[name].shape[0]
                tables[name][:] = w_host[offset : offset + n, : dims[name]]
                for s, value in zip(kinds, s_host):
                    slots[name][s][:] = value[offset : offset + n]
        return tables, slots

    # --- state dict: torchrec's keys, whole tables ---------------------------------------

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # The unsharded collection's keys and shapes, so state dicts move between
        # sharded and unsharded models (sharded checkpoints: see tpurec/sparse/checkpoint/sharded.py).
        tables, _ = self.full_tables()
        dtypes = {c.name: TABLE_DTYPES[c.data_type] for c in self._embedding_bag_configs}
        for name, value in tables.items():
            # In the table's dtype, as the unsharded collection's state dict (float32 values: exact).
            destination[prefix + f"embedding_bags.{name}.weight"] = torch.from_numpy(value).to(dtypes[name])

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        tables, slots = self.full_tables()
        expected = set()
        for cfg in self._embedding_bag_configs:
            key = prefix + f"embedding_bags.{cfg.name}.weight"
            expected.add(key)
            if key not in state_dict:
                missing_keys.append(key)
                continue
            value = state_dict[key]
            if tuple(value.shape) != tables[cfg.name].shape:
                error_msgs.append(
                    f"size mismatch for {key}: checkpoint {tuple(value.shape)}, model {tables[cfg.name].shape}"
                )
                continue
            tables[cfg.name] = _host_float32(value)
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in expected)
        if not error_msgs:
            self._load_host_tables(tables, slots)

    # --- optimizer state: the unsharded collection's format, whole tables -------------------

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The fused optimizer's slots (whole tables, host copies) and step count.

        Returns:
            ``{"optimizer": "Adagrad", "steps": [step], "state": {"embedding_bags.<t>.weight":
            {"momentum1": tensor}}}``, the unsharded collection's format (one step
            count: the sharded collection steps all its tables together).
        """
        _, slots = self.full_tables()
        state = {
            f"embedding_bags.{name}.weight": {s: torch.from_numpy(value) for s, value in table_slots.items()}
            for name, table_slots in slots.items()
        }
        return {"optimizer": type(self.optimizer).__name__, "steps": [self._step], "state": state}

    def load_optimizer_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Loads what :meth:`optimizer_state_dict` (sharded or unsharded) returned.

        Everything is checked before anything is written. The step count becomes the
        largest of ``steps`` (an unsharded collection counts one per stack).

        Raises:
            ValueError: the state is of another optimizer, other tables, slots or shapes.
        """
        tables, slots = self.full_tables()
        check_optimizer_state(
            state_dict,
            {f"embedding_bags.{name}.weight": {s: v.shape for s, v in kinds.items()} for name, kinds in slots.items()},
            type(self.optimizer).__name__,
            None,
            "this collection",
            "shard a module built with the optimizer the checkpoint was trained with",
        )
        new_slots = {
            name: {slot: _host_float32(state_dict["state"][f"embedding_bags.{name}.weight"][slot]) for slot in kinds}
            for name, kinds in slots.items()
        }
        self._load_host_tables(tables, new_slots)
        self._step = max(state_dict["steps"])

    # --- torchrec interface ---------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """The tpu device the collection's outputs are addressed on (their values span the mesh)."""
        return next(self.parameters()).device

    # --- host side: route ids to their shards --------------------------------------

    @property
    def feature_names(self) -> list[str]:
        """The KJT keys this collection looks up."""
        return [f for cfg in self._embedding_bag_configs for f in cfg.feature_names]

    def prefetch(self, features: KeyedJaggedTensor) -> None:
        """Validates ``features``, routes its ids and starts sending them to the mesh.

        Everything of the step that does not need the tables: validation,
        routing to shards, fixed-capacity packing and the host-to-mesh copies
        (asynchronous ``jax.device_put`` of the global entry arrays). Safe to
        call from another thread while a step runs: it changes no table,
        optimizer slot or ``dropped`` count (with automatic capacities it may
        raise the capacity of later batches). The next ``forward`` of this same
        KJT object uses the result instead of doing the work again. With several
        processes the packing waits for the step (its capacity agreement is a
        collective); validation and routing still happen here.

        Args:
            features: this process's batch (CPU KJT with the tables' features).

        Raises:
            ValueError, CapacityError: as :meth:`distribute_input`, for a bad
                batch (nothing is kept for it).
        """
        routed = self._route(features)
        if jax.process_count() > 1:
            entry = Prefetched(features, routed=routed)
        else:
            batch, dropped = self._pack(routed)
            entry = Prefetched(features, batch=batch, dropped=dropped)
        self._keep_prefetched(entry)

    def stage(self, features: KeyedJaggedTensor) -> None:
        """Routes ``features`` into the collection's static entry tensors, for the next forward.

        The sharded counterpart of :meth:`tpurec.sparse.EmbeddingBagCollection.stage`: the
        batch's entry arrays go into tensors the collection keeps from batch to batch (in place,
        while their shapes and the samples per device stay the same), and the next ``forward``
        of this same KJT object reads them. That forward and its backward run as tpu work on
        those tensors (in fused mode, recorded into the step's window with the fused optimizer's
        update of the shards), so :func:`tpurec.graph` can capture a step of a sharded model, and
        staging the next batch before ``g.replay()`` feeds it to the replay. A KJT handed to
        :meth:`prefetch` before is taken from there. Dropped entries (``overflow="drop"``) are
        counted here.

        Args:
            features: this process's batch (CPU KJT with the tables' features).

        Raises:
            RuntimeError: the staged batch's lookup still waits for its backward (staging would
                change its input); nothing changes.
            ValueError, CapacityError: as :meth:`distribute_input`; nothing changes.

        Example::

            sharded.stage(kjt)
            with tpurec.graph(g):
                loss = step(kjt)      # forward(kjt) reads the staged entry tensors
            for kjt in batches:
                sharded.stage(kjt)
                g.replay()
        """
        self._refuse_restaging(self._static_entries, "entries")
        batch = self._take_prefetched(features)
        if batch is None:
            batch = self.distribute_input(features)
        arrays = [a for entries in (*batch.groups, *batch.dp) for a in entries]
        # A new batch size makes new tensors even where the entry shapes (set by the capacity)
        # stay: a step captured for the old one then refuses to replay instead of misreading.
        self._static_entries, renewed = restage(
            self._static_entries, arrays, batch.per_device == self._static_per_device, self.device, 0
        )
        self._static_per_device = batch.per_device
        self.staged_generation += renewed
        self._staged = Staged(features, batch)

    def _staged_forward(self, entries: list[Any], b: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The forward program on the tables' and the entries' tensors: ``(out, received entries)``."""
        from tpurec.core import fresh, pending_value, run_program

        L = self.layout
        tables: list[Any] = [getattr(self, f"shard_weight_{g}") for g in range(len(L.groups))]
        tables += [getattr(self, f"dp_weight_{g}") for g in range(len(L.dp_groups))]
        program = self._staged_programs(b)[0]
        outs = run_program(program, *(pending_value(t) for t in (*tables, *entries)))
        return fresh(outs[0], 0), [fresh(o, 0) for o in outs[1:]]

    def _staged_backward(self, entries: list[Any], received: list[Any], grad_output: Any, b: int) -> None:
        """The backward program: the fused optimizer's update written into the tables' and slots' tensors."""
        from tpurec.core import pending_value, run_program, store_array

        hyper = self._next_captured_step(0)
        targets = self._state_tensors()
        dp_entries = entries[3 * len(self.layout.groups) :]
        inputs = (grad_output.contiguous(), *targets, *received, *dp_entries)
        program = self._staged_programs(b)[1]
        outs = run_program(program, *(pending_value(t) for t in inputs), *hyper.values())
        for t, new in zip(targets, outs):
            store_array(t._storage, new)

    def _state_tensors(self) -> list[Any]:
        """Each sharded group's table and slots, then each data-parallel group's (the backward's order)."""
        L, slots = self.layout, list(self.optimizer.slots)
        return [
            getattr(self, f"{prefix}_{name}_{g}")
            for prefix, count in (("shard", len(L.groups)), ("dp", len(L.dp_groups)))
            for g in range(count)
            for name in ("weight", *slots)
        ]

    @property
    def _step(self) -> int:
        """The optimizer steps of every table (the sharded collection steps them together)."""
        return self._steps[0]

    @_step.setter
    def _step(self, value: int) -> None:
        self._steps[0] = value

    def _step_tables(self, index: int) -> list[str]:
        return [c.name for c in self._embedding_bag_configs]

    def _hyperparameters(self, step: int) -> dict[str, Any]:
        # Floats: the programs take them as arguments (one program for every value).
        return {k: float(v) for k, v in self.optimizer.hyperparameters(step).items()}

    _tables_noun: ClassVar[str] = "the sharded tables"

    def _staged_programs(self, b: int) -> tuple[Program, Program]:
        """The forward and backward programs of staged lookups for ``b`` samples per device (cached).

        Over flat lists of arrays (a fused window's nodes take flat inputs): the forward takes
        the tables and the entries and returns the output and the received entries; the
        backward takes the output's gradient, the tables and slots, the received entries, the
        data-parallel entries and the hyperparameters, and returns the new tables and slots.
        """
        cache = self._staged_program_cache
        if b in cache:
            return cache[b]
        L = self.layout
        groups, dps, slots = len(L.groups), len(L.dp_groups), len(self.optimizer.slots)
        state_size = (groups + dps) * (1 + slots)  # each table and its optimizer slots
        names = list(self.optimizer.hyperparameters(1))

        def triples(flat: Sequence[Any]) -> list[tuple[Any, ...]]:
            return [tuple(flat[k : k + 3]) for k in range(0, len(flat), 3)]

        def forward(*flat):
            tables, entries = flat[: groups + dps], flat[groups + dps :]
            out, received, _ = self._forward_fn(
                list(tables[:groups]), list(tables[groups:]), triples(entries[: 3 * groups]),
                triples(entries[3 * groups :]), b,
            )  # fmt: skip
            return [out, *(x for entries in received for x in entries)]

        def backward(*flat):
            grad, rest = flat[0], flat[1:]
            state, rest = rest[:state_size], rest[state_size:]
            received, dp, hyper = rest[: 3 * groups], rest[3 * groups : 3 * (groups + dps)], rest[3 * (groups + dps) :]
            per_table = [list(state[k : k + 1 + slots]) for k in range(0, len(state), 1 + slots)]
            new_w, new_s, new_dw, new_ds, _ = self._backward_fn(
                grad, [t[0] for t in per_table[:groups]], [t[1:] for t in per_table[:groups]],
                [t[0] for t in per_table[groups:]], [t[1:] for t in per_table[groups:]],
                triples(received), triples(dp), [], dict(zip(names, hyper)), b,
            )  # fmt: skip
            return [x for w, s in (*zip(new_w, new_s), *zip(new_dw, new_ds)) for x in (w, *s)]

        state = (groups + dps) * (1 + slots)
        cache[b] = (
            Program(forward),
            # Eagerly the tables and slots are updated in place (donated); a fused window donates
            # the buffers its writes replace.
            Program(backward, donate_argnums=tuple(range(1, 1 + state))),
        )
        return cache[b]

    def _take_prefetched(self, features: KeyedJaggedTensor) -> MeshBatch | None:
        """The prepared batch of this KJT object (counting its drops), or None."""
        entry: Prefetched | None = self._pop_prefetched(features)
        if entry is None:
            return None
        if entry.batch is None:
            assert entry.routed is not None
            entry.batch, entry.dropped = self._pack(entry.routed)
        self._count_drops(entry.batch, entry.dropped)
        return entry.batch

    def distribute_input(self, features: KeyedJaggedTensor) -> MeshBatch:
        """Validates this process's batch and builds the global entry arrays.

        Nothing changes on a bad batch except (with automatic capacities) a
        larger capacity for the next batches. Entries dropped by
        ``overflow="drop"`` are added to ``dropped``.

        Returns:
            The batch's entry arrays on the mesh (per group ``(rows, samples, gains)``),
            and which KJT id each of this process's entries came from.

        Raises:
            ValueError: a malformed batch (the message says what is wrong), or a
                local batch that does not split evenly over this process's devices.
            CapacityError: a fixed ``capacity`` overflows with ``overflow="error"``.
        """
        batch, dropped = self._pack(self._route(features))
        self._count_drops(batch, dropped)
        return batch

    def _count_drops(self, batch: MeshBatch, dropped: int) -> None:
        """Counts the entries a batch taken by a step left out (``overflow="drop"``)."""
        self.dropped += dropped
        self._drops.add(batch.dropped)

    def _route(self, features: KeyedJaggedTensor) -> Routed:
        """Validates ``features`` and routes its entries (host only; see :meth:`InputRouter.route`)."""
        return self.router.route(features)

    def _pack(self, routed: Routed) -> tuple[MeshBatch, int]:
        """The routed batch's fixed-capacity arrays on the mesh (see :meth:`InputRouter.pack`)."""
        return self.router.pack(routed)

    @property
    def fixed_capacity(self) -> int | None:
        """The fixed capacity (entries per source device, destination and group), or None (automatic)."""
        return self.router.fixed_capacity

    @fixed_capacity.setter
    def fixed_capacity(self, value: int | None) -> None:
        self.router.fixed_capacity = value

    @property
    def overflow(self) -> Literal["error", "drop"]:
        """What a batch beyond a fixed capacity does: ``"error"`` or ``"drop"`` (settable between steps)."""
        return self.router.overflow

    @overflow.setter
    def overflow(self, value: Literal["error", "drop"]) -> None:
        if value not in ("error", "drop"):
            raise ValueError(f"overflow must be 'error' or 'drop', got {value!r}")
        self.router.overflow = value

    # --- programs -------------------------------------------------------------------

    def _kernel(self, name: str):
        def on_rows(*args: Any, **kwargs: Any) -> Any:
            # This collection keeps its shards as [rows, dim] arrays, so the TensorCore kernels
            # stream rows as they are here (lane-dense lines would be a repacking copy per call).
            from tpurec import config

            # Chosen per stack at trace time by its dtype, as the op's lowering chooses
            # (float16/bfloat16 stacks take the kernels that follow FBGEMM's rounding).
            table = args[4] if name == "sparse_dense_matmul" else args[5]
            kernel = kernel_for(name, table_dtype=table.dtype)
            with config.override(tensorcore_lane_dense=False):
                return kernel(*args, **kwargs)

        return on_rows

    def _forward_fn(self, weights, dp_weights, groups, dp, b: int, with_rows: bool = False):
        """:func:`programs.forward` on this collection's layout, mesh and lookup kernel."""
        lookup = self._kernel("sparse_dense_matmul")
        return programs.forward(self.layout, self.mesh, lookup, weights, dp_weights, groups, dp, b, with_rows)

    def _backward_fn(self, grad, weights, slots, dp_weights, dp_slots, received, dp, kept, hyper, b: int):
        """:func:`programs.backward` on this collection's layout, mesh and optimizer kernel."""
        update = self._kernel(self.optimizer.op_name)
        return programs.backward(
            self.layout, self.mesh, update, grad, weights, slots, dp_weights, dp_slots, received, dp, kept, hyper, b
        )

    def _run_forward(self, batch: MeshBatch, with_rows: bool = False) -> tuple[torch.Tensor, tuple]:
        L = self.layout
        weights, _ = self._arrays("shard", len(L.groups))
        dp_weights, _ = self._arrays("dp", len(L.dp_groups))
        b = batch.per_device
        origins = (batch.origins, batch.num_ids) if with_rows else None
        if b == 0:
            # An empty batch: nothing to look up; the programs would split by zero samples.
            # The [0, dims] output is batch-sharded like every other (as unsharded: [0, D]).
            empty = np.zeros((0, L.total_dim), np.float32)
            return wrap(self.router.to_global(empty), 0), ([], batch.dp, [], origins, b)
        program = self._programs(b, with_rows)[0]
        out, received, kept = program(weights, dp_weights, batch.groups, batch.dp)
        return wrap(out, 0), (received, batch.dp, kept, origins, b)

    def _run_backward(self, saved: tuple, grad_output: torch.Tensor) -> np.ndarray | None:
        """Runs the backward program; returns the per-id weights' gradient (KJT order) when asked for."""
        from tpurec.core import value_of

        received, dp, kept, origins, b = saved
        L = self.layout
        if b == 0:
            # An empty batch updates no row, but counts as a step (as the unsharded collection does).
            self._count_step(0)
            return None if origins is None else np.zeros(origins[1], np.float32)
        grad = value_of(grad_output.contiguous(), "sharded embedding backward")
        weights, slots = self._arrays("shard", len(L.groups))
        dp_weights, dp_slots = self._arrays("dp", len(L.dp_groups))
        hyper = self._next_step(0)
        program = self._programs(b, origins is not None)[1]
        new_w, new_s, new_dw, new_ds, dots = program(
            grad, weights, slots, dp_weights, dp_slots, received, dp, kept, hyper
        )
        self._replace_state(new_w, new_s, new_dw, new_ds)
        if origins is None:
            return None
        entries, num_ids = origins
        return programs.id_weight_gradient(dots, entries, num_ids)

    # --- several lookups in one backward pass ("torch" semantics) -------------------------

    def _sums_this_backward(self) -> bool:
        """Whether a lookup's backward joins the pass's summed update instead of updating now: with
        ``apply_optimizer_in_backward``'s semantics, where another lookup of this collection has given its
        gradient to this backward pass or waits for its backward in it. (A lookup alone in its pass updates
        at once; one whose backward is not in this pass, such as an evaluation's, does not count.)"""
        if self.optimizer_semantics != "torch":
            return False
        if self._stashed_lookups and self._stash_pass == torch._C._current_graph_task_id():
            return True
        # (A lookup's autograd context is its backward node.)
        return any(torch._C._will_engine_execute_node(ctx) for ctx in list(self._pending_lookups))

    def _stash(self, grad: jax.Array, received: list[Any], dp: list[Any], b: int) -> None:
        """Keeps one lookup's gradient and entries for the update at the end of the backward pass."""
        from torch.autograd import Variable

        task = torch._C._current_graph_task_id()
        if self._stash_pass != task:
            # A pass that raised never ran its end-of-pass update: its lookups are dropped, as autograd
            # drops the gradients of a failed backward.
            self._stashed_lookups, self._stash_pass = [], task
            Variable._execution_engine.queue_callback(self._apply_stashed_lookups)
        self._stashed_lookups.append((grad, list(received), list(dp), b))

    def _stash_lookup(self, saved: tuple, grad_output: Any) -> np.ndarray | None:
        """:meth:`_run_backward`'s part of a lookup whose update waits for the end of the pass: its per-id
        weights' gradient (KJT order) when asked for, computed now from the rows as the forward read them."""
        from tpurec.core import value_of

        received, dp, kept, origins, b = saved
        if b == 0:
            self._stash(jnp.zeros((0, self.layout.total_dim), jnp.float32), [], [], 0)
            return None if origins is None else np.zeros(origins[1], np.float32)
        grad = value_of(grad_output.contiguous(), "sharded embedding backward")
        self._stash(grad, received, dp, b)
        if origins is None:
            return None
        weights, slots = self._arrays("shard", len(self.layout.groups))
        dp_weights, dp_slots = self._arrays("dp", len(self.layout.dp_groups))
        dots = self._dots_program(b)(grad, weights, slots, dp_weights, dp_slots, received, dp, kept)
        entries, num_ids = origins
        return programs.id_weight_gradient(dots, entries, num_ids)

    def _stash_staged_lookup(self, entries: list[Any], received: list[Any], grad_output: Any, b: int) -> None:
        """:meth:`_staged_backward`'s part of a staged lookup whose update waits for the end of the pass."""
        from tpurec.core import value_of

        groups = len(self.layout.groups)
        arrays = [value_of(t, "sharded embedding backward") for t in received]
        dp = [value_of(t, "sharded embedding backward") for t in entries[3 * groups :]]
        grad = value_of(grad_output.contiguous(), "sharded embedding backward")
        self._stash(
            grad,
            [tuple(arrays[k : k + 3]) for k in range(0, len(arrays), 3)],
            [tuple(dp[k : k + 3]) for k in range(0, len(dp), 3)],
            b,
        )

    def _apply_stashed_lookups(self) -> None:
        """The end of the backward pass: one update on the summed gradient of the stashed lookups."""
        stashed, self._stashed_lookups, self._stash_pass = self._stashed_lookups, [], -1
        lookups = [entry for entry in stashed if entry[3] > 0]
        if not lookups:  # empty batches only: no row changes, but a step is counted (as one lookup's)
            self._count_step(0)
            return
        L = self.layout
        weights, slots = self._arrays("shard", len(L.groups))
        dp_weights, dp_slots = self._arrays("dp", len(L.dp_groups))
        hyper = self._next_step(0)
        bs = tuple(b for *_, b in lookups)
        cache = self._stash_programs
        key = ("summed", bs)
        if key not in cache:
            update = self._kernel(self.optimizer.op_name)
            layout, mesh = self.layout, self.mesh

            def summed(lookups, weights, slots, dp_weights, dp_slots, hyper):
                return programs.summed_backward(
                    layout, mesh, update, lookups, weights, slots, dp_weights, dp_slots, hyper, bs
                )

            # The tables and slots are updated in place: their buffers are donated.
            cache[key] = Program(summed, donate_argnums=(1, 2, 3, 4))
        new_w, new_s, new_dw, new_ds = cache[key](
            [(grad, received, dp) for grad, received, dp, _ in lookups], weights, slots, dp_weights, dp_slots, hyper
        )
        self._replace_state(new_w, new_s, new_dw, new_ds)

    def _dots_program(self, b: int) -> Program:
        """The backward program's per-id weight gradients alone (no update; nothing donated), cached."""
        cache = self._stash_programs
        key = ("dots", b)
        if key not in cache:

            def unchanged(rp, rows, samples, gains, g, table, *slots, **hyper):
                return (table, *slots)

            def dots(grad, weights, slots, dp_weights, dp_slots, received, dp, kept):
                return programs.backward(
                    self.layout, self.mesh, unchanged, grad, weights, slots, dp_weights, dp_slots, received, dp,
                    kept, {}, b,
                )[4]  # fmt: skip

            cache[key] = Program(dots)
        return cache[key]

    def _replace_state(self, new_w: list, new_s: list, new_dw: list, new_ds: list) -> None:
        """Puts a backward program's updated tables and slots into the module's tensors."""
        for prefix, ws, ss in (("shard", new_w, new_s), ("dp", new_dw, new_ds)):
            for g, (w, s) in enumerate(zip(ws, ss)):
                replace_array(getattr(self, f"{prefix}_weight_{g}"), w)
                for name, value in zip(self.optimizer.slots, s):
                    replace_array(getattr(self, f"{prefix}_{name}_{g}"), value)

    def _programs(self, b: int, with_rows: bool = False) -> tuple[Program, Program]:
        """The forward and backward programs for ``b`` samples per device (cached).

        ``with_rows``: the pair that also gives per-id weights their gradient.
        """
        cache = self.__dict__.setdefault("_program_cache", {})
        key = (b, with_rows)
        if key not in cache:
            # Through the methods, so a kernel chosen per instance (``_kernel``) is used.
            cache[key] = programs.make_programs(self._forward_fn, self._backward_fn, b, with_rows)
        return cache[key]

    # --- forward ----------------------------------------------------------------------

    @torch.compiler.disable
    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """Pooled embeddings of this process's batch ``features``.

        Uses what :meth:`prefetch` prepared when ``features`` is the KJT object
        it was given; otherwise validates and routes the batch here.

        Returns:
            ``KeyedTensor`` over the global batch (all processes' samples, in
            process order), batch-sharded on the mesh.
        """
        self._check_trainable_lookup(features)
        staged = self._take_staged(features)
        batch = staged if staged is not None else self._take_prefetched(features)
        if batch is None:
            batch = self.distribute_input(features)
        anchor = next(self.parameters())
        # Per-id weights that require grad get TorchRec's gradient from the backward program
        # (the gains carry them into the lookup as constants, as in the unsharded collection).
        # (A VBE batch was routed with its bags expanded: its weights are gathered the same way.)
        id_weights = self.router.one_batch_size(features).weights() if self._weights_need_grad(features) else None
        if staged is not None and id_weights is None and batch.per_device > 0:
            values = _StagedLookup.apply(anchor, self, self._static_entries, batch.per_device)
        else:
            values = _ShardedLookup.apply(anchor, id_weights, self, batch)
        return KeyedTensor(keys=self._embedding_names, length_per_key=self._length_per_key, values=values)

    _max_prefetched: ClassVar[int] = _MAX_PREFETCHED
