"""A tpurec EmbeddingBagCollection sharded over a device mesh.

Per step (see docs/sharding.md):

* host, per process: the local batch is validated (``read_kjt``) and each of
  its ids is routed to the shards holding its row: fixed-capacity
  ``[local devices, devices, capacity]`` arrays per group (source device,
  destination device, entry), made global arrays on the mesh. Under
  :class:`~tpurec.sparse.TrainPipeline` this runs in :meth:`prefetch` on the
  pipeline's worker thread for batch ``i + 1`` while step ``i`` runs;
* forward program (SPMD, ``shard_map``): ``all_to_all`` moves the entries to
  their owners, each device runs the lookup kernel (the native XLA:CPU kernel
  on CPU, SparseCore on TPU) on its local stack, and pooled rows return to the
  batch owners (``all_to_all``; ``psum_scatter`` for row-wise tables);
  data-parallel tables are looked up locally;
* backward program: the same collectives reversed bring each shard the
  gradients of its pooled rows, and every shard applies the fused optimizer to
  its rows in place (buffers donated). Data-parallel replicas all-gather the
  batch's entries and gradients and apply the same update.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Any, Literal, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from torch import nn
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface, get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from tpurec.core import runtime
from tpurec.sparse.ops import kernel_for
from tpurec.sparse.modules import EmbeddingBagCollection
from tpurec.sparse.optimizers import EmbeddingOptimizer
from tpurec.sparse.preprocess import read_kjt, shared_features, stack_tables
from tpurec.sparse.sharding.layout import Layout
from tpurec.sparse.sharding.specs import TableSharding
from tpurec.sparse.types import PAD_ID, CapacityError, StackedTable
from tpurec.core.tensor import replace_array, wrap

__all__ = ["ShardedEmbeddingBagCollection"]

_ALIGN = 8


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


_MAX_PREFETCHED = 8
"""Batches :meth:`ShardedEmbeddingBagCollection.prefetch` keeps for forward (a pipeline needs 1-2)."""


@dataclasses.dataclass
class _Routed:
    """A validated batch with every entry's route (host arrays; before capacities are applied).

    Attributes:
        per_device: samples per device.
        groups: per sharded group, then per data-parallel group:
            ``(key, rows, out, gains, origin, counts, destinations)`` where ``key`` is
            ``local source device * destinations + destination``, ``origin`` the
            index of the entry's id in the KJT's values, ``counts`` the histogram of ``key``.
        num_ids: ids in this process's KJT.
        needs: per group, the most entries one source sends one destination.
    """

    per_device: int
    groups: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]]
    needs: list[int]
    num_ids: int = 0


@dataclasses.dataclass
class _Prefetched:
    """What :meth:`ShardedEmbeddingBagCollection.prefetch` prepared for one KJT object.

    ``batch`` (on the mesh) and ``dropped`` when the arrays could be built on
    the worker; else only ``routed`` (several processes: the capacity agreement
    is a collective, so it runs in the step, in the same order on every process).
    """

    features: KeyedJaggedTensor
    routed: _Routed | None = None
    batch: dict[str, Any] | None = None
    dropped: int = 0


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
        module._pending_lookups.add(ctx)  # until its backward runs or its graph is freed
        return out

    @staticmethod
    def backward(ctx, grad_output):
        ctx.module._pending_lookups.discard(ctx)
        id_grad = ctx.module._run_backward(ctx.saved, grad_output)
        if ctx.id_weights is not None:
            device, dtype = ctx.id_weights
            id_grad = torch.from_numpy(id_grad).to(device=device, dtype=dtype)
        # The tables are updated in place: they get no .grad (a dense optimizer skips them).
        return None, id_grad, None, None


class ShardedEmbeddingBagCollection(EmbeddingBagCollectionInterface):
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
            the dropped entries in ``dropped``).

    Example::

        sharded = ShardedEmbeddingBagCollection(ebc, table_shardings(configs, plan, 8), mesh)
        kt = sharded(kjt)
    """

    def __init__(
        self,
        source: Any,
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
        configs: list[EmbeddingBagConfig] = list(source.embedding_bag_configs())
        for feature, tables in shared_features(configs).items():
            raise NotImplementedError(
                f"feature {feature!r} is looked up in tables {tables}: the sharded EmbeddingBagCollection routes "
                "each feature to one table; keep this collection unsharded (tpurec.sparse.EmbeddingBagCollection "
                "looks such features up as TorchRec does) or give each table its own feature"
            )
        low = [f"{c.name} ({c.data_type.name})" for c in configs if c.data_type != DataType.FP32]
        if low:
            # The sharded tables and slots are float32 global arrays: FP16/BF16 tables would be
            # widened and then train differently from the unsharded module and FBGEMM.
            raise NotImplementedError(
                f"sharding FP16/BF16 tables is not supported yet (tables {low}): tpurec.shard keeps float32 "
                "tables. Train them unsharded (tpurec.sparse.EmbeddingBagCollection), or use FP32 tables."
            )
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
        self.optimizer: EmbeddingOptimizer = source.optimizer
        # As the unsharded collection's (docs/torchrec_semantics.md): "torch" (the optimizer came
        # from apply_optimizer_in_backward) refuses a second lookup before the first one's backward.
        self.optimizer_semantics: Literal["fbgemm", "torch"] = getattr(source, "optimizer_semantics", "fbgemm")
        self._pending_lookups: weakref.WeakSet[Any] = weakref.WeakSet()
        self.mesh = mesh
        self.axis = tuple(mesh.axis_names)
        self.layout = Layout(configs, dict(shardings), mesh.devices.size)
        self.fixed_capacity = None if capacity is None else -(-capacity // _ALIGN) * _ALIGN
        self.overflow = overflow
        self.dropped = 0
        self._capacities = [_ALIGN] * (len(self.layout.groups) + len(self.layout.dp_groups))
        self._step = max(getattr(source, "_steps", [0]) or [0])
        self._stacks = stack_tables(configs, stack=False)
        # id(kjt) -> what prefetch() (TrainPipeline's worker thread) prepared for
        # that KJT object; taken by forward() of the same object.
        self._prefetched: dict[int, _Prefetched] = {}
        self._embedding_names = [n for names in get_embedding_names_by_table(configs) for n in names]
        self._length_per_key = [t.embedding_dim for t in configs for _ in t.feature_names]

        # Which mesh positions this process feeds: its local batch is split over them in order.
        me = jax.process_index()
        positions = [i for i, d in enumerate(mesh.devices.flat) if d.process_index == me]
        if not positions or positions != list(range(positions[0], positions[0] + len(positions))):
            raise ValueError(
                f"process {me}'s devices must be a contiguous run of the mesh's devices (mesh positions {positions}); "
                "order the mesh by process"
            )
        self._first_device, self._local_devices = positions[0], len(positions)
        self._sharded = NamedSharding(mesh, P(self.axis))
        self._replicated = NamedSharding(mesh, P())

        host_tables = {c.name: source.table_weight(c.name).detach().cpu().numpy().astype(np.float32) for c in configs}
        opt_state = source.optimizer_state_dict()["state"]
        host_slots = {
            c.name: {s: opt_state[f"embedding_bags.{c.name}.weight"][s].detach().cpu().numpy().astype(np.float32)
                     for s in self.optimizer.slots}
            for c in configs
        }
        self._load_host_tables(host_tables, host_slots, register=True)
        runtime.mesh_arrays_in_use()

    # --- state ------------------------------------------------------------------

    def _load_host_tables(
        self, tables: Mapping[str, np.ndarray], slots: Mapping[str, Mapping[str, np.ndarray]], register: bool = False
    ) -> None:
        """Lays full host tables (and optimizer slots) out on the mesh."""
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
                    stacks[s][start : start + p.rows] = value[rows] if k == "row" else value[rows, p.col_offset : p.col_offset + p.cols]
            arrays[f"shard_weight_{g}"] = _global_from_host(stacks[None], self._sharded)
            for s in kinds:
                arrays[f"shard_{s}_{g}"] = _global_from_host(stacks[s], self._sharded)
        for g, dg in enumerate(L.dp_groups):
            stacks = {None: blank(dg.num_rows, dg.width, None), **{s: blank(dg.num_rows, dg.width, k) for s, k in kinds.items()}}
            for name, offset in dg.offsets.items():
                n = tables[name].shape[0]
                stacks[None][offset : offset + n] = tables[name]
                for s in kinds:
                    stacks[s][offset : offset + n] = slots[name][s]
            arrays[f"dp_weight_{g}"] = _global_from_host(stacks[None], self._replicated)
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

    def _arrays(self, prefix: str, count: int) -> tuple[list[jax.Array], list[list[jax.Array]]]:
        from tpurec.core.dispatch import value_of

        weights = [value_of(getattr(self, f"{prefix}_weight_{g}")) for g in range(count)]
        slots = [[value_of(getattr(self, f"{prefix}_{s}_{g}")) for s in self.optimizer.slots] for g in range(count)]
        return weights, slots

    def table_weight(self, name: str) -> np.ndarray:
        """Table ``name``'s full ``[rows, dim]`` values on the host (a copy)."""
        return self.full_tables()[0][name]

    def full_tables(self) -> tuple[dict[str, np.ndarray], dict[str, dict[str, np.ndarray]]]:
        """Every table and optimizer slot, assembled from the shards on the host.

        Returns:
            ``(tables, slots)``: table name -> ``[rows, dim]``; table name ->
            slot name -> ``[rows]`` (row-wise slots) or ``[rows, dim]``. For a
            column-wise table a row-wise slot comes from its first column shard.
        """
        L = self.layout
        kinds = self.optimizer.slots
        tables = {c.name: np.zeros((c.num_embeddings, c.embedding_dim), np.float32) for c in self._embedding_bag_configs}
        dims = {c.name: c.embedding_dim for c in self._embedding_bag_configs}
        slots = {
            c.name: {s: np.zeros((c.num_embeddings,) if k == "row" else (c.num_embeddings, c.embedding_dim), np.float32) for s, k in kinds.items()}
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
        # sharded and unsharded models (sharded checkpoints: see checkpoint.py).
        tables, _ = self.full_tables()
        for name, value in tables.items():
            destination[prefix + f"embedding_bags.{name}.weight"] = torch.from_numpy(value)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
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
                error_msgs.append(f"size mismatch for {key}: checkpoint {tuple(value.shape)}, model {tables[cfg.name].shape}")
                continue
            tables[cfg.name] = value.detach().cpu().numpy().astype(np.float32)
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
        mine = type(self.optimizer).__name__
        if not isinstance(state_dict, Mapping) or "steps" not in state_dict or "state" not in state_dict:
            keys = sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict).__name__
            raise ValueError(f"an embedding optimizer state needs 'steps' and 'state' (from optimizer_state_dict()), got {keys}")
        if state_dict.get("optimizer", mine) != mine:
            raise ValueError(
                f"the optimizer state is of {state_dict['optimizer']}, but this collection uses {mine}; shard a "
                "module built with the optimizer the checkpoint was trained with"
            )
        steps = state_dict["steps"]
        if not isinstance(steps, (list, tuple)) or not steps or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in steps
        ):
            raise ValueError(f"steps must be a non-empty list of non-negative ints, got {steps!r}")
        state = state_dict["state"]
        expected = {f"embedding_bags.{name}.weight": name for name in slots}
        if not isinstance(state, Mapping) or set(state) != set(expected):
            got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"the optimizer state has tables {got}, this collection has {sorted(expected)}")
        new_slots: dict[str, dict[str, np.ndarray]] = {}
        for key, name in expected.items():
            entry = state[key]
            if not isinstance(entry, Mapping) or set(entry) != set(slots[name]):
                got = sorted(entry) if isinstance(entry, Mapping) else type(entry).__name__
                raise ValueError(f"the optimizer state of {key} has slots {got}, but {mine} needs {sorted(slots[name])}")
            new_slots[name] = {}
            for slot, target in slots[name].items():
                value = entry[slot]
                if not isinstance(value, torch.Tensor) or tuple(value.shape) != target.shape or not value.dtype.is_floating_point:
                    got = (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else type(value).__name__
                    raise ValueError(f"slot {slot} of {key}: expected a float tensor of shape {target.shape}, got {got}")
                new_slots[name][slot] = value.detach().cpu().numpy().astype(np.float32)
        self._load_host_tables(tables, new_slots)
        self._step = max(steps)

    # --- torchrec interface ---------------------------------------------------------

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._embedding_bag_configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    @property
    def stacks(self) -> list[StackedTable]:
        """One unstacked table per config (what ``read_kjt`` validates a batch against)."""
        return list(self._stacks)

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
            entry = _Prefetched(features, routed=routed)
        else:
            batch, dropped = self._pack(routed)
            entry = _Prefetched(features, batch=batch, dropped=dropped)
        self._prefetched[id(features)] = entry
        # A model that hands a different KJT object to this module never takes
        # its prefetched batches: keep only the newest few, not every batch.
        # (A snapshot of the keys: the step's thread may pop one meanwhile.)
        for key in list(self._prefetched)[:-_MAX_PREFETCHED]:
            self._prefetched.pop(key, None)

    def clear_prefetched(self) -> None:
        """Drops batches prepared by :meth:`prefetch` that no step used."""
        self._prefetched.clear()

    def _take_prefetched(self, features: KeyedJaggedTensor) -> dict[str, Any] | None:
        """The prepared batch of this KJT object (counting its drops), or None."""
        entry = self._prefetched.pop(id(features), None)
        if entry is None or entry.features is not features:
            return None
        if entry.batch is None:
            assert entry.routed is not None
            entry.batch, entry.dropped = self._pack(entry.routed)
        self.dropped += entry.dropped
        return entry.batch

    def distribute_input(self, features: KeyedJaggedTensor) -> dict[str, Any]:
        """Validates this process's batch and builds the global entry arrays.

        Nothing changes on a bad batch except (with automatic capacities) a
        larger capacity for the next batches. Entries dropped by
        ``overflow="drop"`` are added to ``dropped``.

        Returns:
            ``{"per_device": samples per device, "groups": [(rows, samples, gains)],
            "dp": [(rows, samples, gains)], "origins": [(entry positions, KJT value
            indices)], "num_ids": ids in the KJT}``: global arrays, and (origins) host
            arrays saying which KJT id each of this process's entries came from.

        Raises:
            ValueError: a malformed batch (the message says what is wrong), or a
                local batch that does not split evenly over this process's devices.
            CapacityError: a fixed ``capacity`` overflows with ``overflow="error"``.
        """
        batch, dropped = self._pack(self._route(features))
        self.dropped += dropped
        return batch

    def _route(self, features: KeyedJaggedTensor) -> _Routed:
        """Validates ``features`` and finds every entry's source device, shard and output slot.

        Host numpy only: no collective, no state change (safe on a worker thread).
        """
        L, D = self.layout, self.layout.num_devices
        local_batch, feats = read_kjt(features, self._stacks, is_weighted=self._is_weighted)  # refuses VBE
        if features.inverse_indices_or_none() is not None:
            raise NotImplementedError(
                "the KeyedJaggedTensor has inverse_indices, which TorchRec's EmbeddingBagCollection uses to expand "
                "the pooled rows, but the sharded EmbeddingBagCollection does not; expand the batch first or look "
                "it up with the unsharded tpurec.sparse.EmbeddingBagCollection"
            )
        n_local = self._local_devices
        if local_batch % n_local:
            raise ValueError(
                f"the local batch of {local_batch} samples does not split evenly over this process's {n_local} devices; "
                f"use a multiple of {n_local}"
            )
        b = local_batch // n_local
        first = self._first_device
        n_groups = len(L.groups)
        # Where each feature's ids start in the KJT's values (and weights): keys are in KJT order.
        starts, num_ids = {}, 0
        for key in features.keys():
            starts[key] = num_ids
            num_ids += feats[key].ids.shape[0]
        parts: list[list[tuple[np.ndarray, ...]]] = [[] for _ in range(n_groups + len(L.dp_groups))]
        for cfg in self._embedding_bag_configs:
            for f in cfg.feature_names:
                fb = feats[f]
                samples = np.repeat(np.arange(local_batch, dtype=np.int64), fb.lengths)
                gains = np.ones(fb.ids.shape[0], np.float64) if fb.weights is None else fb.weights.astype(np.float64)
                if cfg.pooling == PoolingType.MEAN:
                    gains = gains / np.repeat(fb.lengths, fb.lengths)
                src, within = samples // b + first, samples % b
                origin = starts[f] + np.arange(fb.ids.shape[0], dtype=np.int64)
                if cfg.name in L.dp_group_of:
                    g = L.dp_group_of[cfg.name]
                    dg = L.dp_groups[g]
                    k = dg.slots.index((cfg.name, f))
                    rows = dg.offsets[cfg.name] + fb.ids
                    # Sample ids are global (source-major), so replicas can all-gather them.
                    out = (src * len(dg.slots) + k) * b + within
                    parts[n_groups + g].append((src - first, np.zeros_like(src), rows, out, gains, origin))
                    continue
                place = L.placements[cfg.name]
                block = np.searchsorted(place.row_starts, fb.ids, side="right") - 1
                for c, g in enumerate(place.group_of_block):
                    dst = place.device[c][block]
                    rows = place.base[c][block] + fb.ids
                    out = (src * L.groups[g].num_slots + place.slot[c][f][block]) * b + within
                    parts[g].append((src - first, dst, rows, out, gains, origin))
        packed = []
        needs = []
        for j, chunks in enumerate(parts):
            destinations = D if j < n_groups else 1
            if chunks:
                src, dst, rows, out, gains, origin = (np.concatenate(x) for x in zip(*chunks))
            else:
                src = dst = rows = out = origin = np.zeros(0, np.int64)
                gains = np.zeros(0, np.float64)
            key = src * destinations + dst
            counts = np.bincount(key, minlength=n_local * destinations)
            needs.append(int(counts.max()) if counts.size else 0)
            packed.append((key, rows, out, gains, origin, counts, destinations))
        return _Routed(per_device=b, groups=packed, needs=needs, num_ids=num_ids)

    def _pack(self, routed: _Routed) -> tuple[dict[str, Any], int]:
        """Fixed-capacity entry arrays of a routed batch, sent to the mesh (asynchronous copies).

        Returns:
            ``(batch, dropped)``: the batch as :meth:`distribute_input` returns
            it, and how many entries ``overflow="drop"`` left out.
        """
        D, n_local, n_groups = self.layout.num_devices, self._local_devices, len(self.layout.groups)
        capacities = self._capacities_for(routed.needs)
        dropped = 0
        result_groups, result_dp, origins = [], [], []
        for j, (key, rows, out, gains, origin, counts, destinations) in enumerate(routed.groups):
            C = capacities[j]
            order = np.argsort(key, kind="stable")
            key, rows, out, gains, origin = key[order], rows[order], out[order], gains[order], origin[order]
            starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
            position = np.arange(key.shape[0]) - starts[key]
            keep = position < C
            dropped += int((~keep).sum())
            flat = key[keep] * C + position[keep]
            shape = (n_local, D, C) if destinations == D else (n_local, C)
            size = int(np.prod(shape))
            r = np.full(size, PAD_ID, np.int32)
            s = np.full(size, PAD_ID, np.int32)
            v = np.zeros(size, np.float32)
            r[flat], s[flat], v[flat] = rows[keep], out[keep], gains[keep]
            arrays = tuple(self._to_global(x.reshape(shape)) for x in (r, s, v))
            (result_groups if j < n_groups else result_dp).append(arrays)
            # (this process's flat entry position, KJT value index) of each kept entry: maps the
            # per-entry gradients of per-id weights back to the KJT's weights.
            origins.append((flat, origin[keep]))
        batch = {"per_device": routed.per_device, "groups": result_groups, "dp": result_dp}
        batch["origins"], batch["num_ids"] = origins, routed.num_ids
        return batch, dropped

    def _capacities_for(self, needs: list[int]) -> list[int]:
        """Per-group capacities for a batch needing ``needs`` entries (all processes agree)."""
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            needs = [int(x) for x in np.max(multihost_utils.process_allgather(np.array(needs, np.int64)), axis=0)]
        if self.fixed_capacity is not None:
            over = [n for n in needs if n > self.fixed_capacity]
            if over and self.overflow == "error":
                raise CapacityError(
                    f"a device sends up to {max(over)} entries to one shard this step but capacity={self.fixed_capacity}; "
                    "raise capacity, or pass overflow='drop' to drop (and count) the extra entries"
                )
            return [self.fixed_capacity] * len(needs)
        # The pipeline's worker thread may grow capacities while a step packs a
        # batch inline: each batch gets capacities computed from its own needs
        # (never re-read from the shared list), and the shared list only grows.
        capacities = [
            c if n <= c else max(_ALIGN, 2 ** math.ceil(math.log2(n))) for c, n in zip(list(self._capacities), needs)
        ]
        self._capacities = [max(a, c) for a, c in zip(self._capacities, capacities)]
        return capacities

    def _to_global(self, local: np.ndarray) -> jax.Array:
        if jax.process_count() == 1:
            return jax.device_put(local, self._sharded)
        return jax.make_array_from_process_local_data(self._sharded, local)

    # --- programs -------------------------------------------------------------------

    def _kernel(self, name: str):
        return kernel_for(name)

    def _forward_fn(self, weights, dp_weights, groups, dp, b: int, with_rows: bool = False):
        """The forward program: ids to owners, lookups, pooled rows back to batch owners.

        With ``with_rows`` it also returns, per group, every received entry's table row
        as it is now (kept on its shard for the backward's per-id weight gradients).
        """
        L, D, axis = self.layout, self.layout.num_devices, self.axis
        lookup = self._kernel("sparse_dense_matmul")
        dest = jnp.asarray(L.dest_columns, jnp.int32)

        def entry_rows(table, rows):
            return table[jnp.where(rows == PAD_ID, 0, rows)]

        def body(weights, dp_weights, groups, dp):
            received, flats, kept = [], [], []
            for grp, table, (rows, samples, gains) in zip(L.groups, weights, groups):
                K, K2 = grp.num_slots, grp.num_a2a
                # [1, dest, C] -> [source, 1, C]: every device gets the entries of its shards.
                rows, samples, gains = (jax.lax.all_to_all(x, axis, 1, 0, tiled=True).reshape(-1) for x in (rows, samples, gains))
                received.append((rows, samples, gains))
                if with_rows:
                    kept.append(entry_rows(table, rows))
                rp = jnp.full((1,), rows.shape[0], jnp.int32)
                pooled = lookup(rp, rows, samples, gains, table, batch_size=D * K * b).reshape(D, K, b, grp.width)
                if K2:
                    back = jax.lax.all_to_all(pooled[:, :K2], axis, 0, 0, tiled=True)
                    flats.append(back.transpose(2, 0, 1, 3).reshape(b, -1))
                if K > K2:
                    summed = jax.lax.psum_scatter(pooled[:, K2:], axis, scatter_dimension=0, tiled=True)
                    flats.append(summed[0].transpose(1, 0, 2).reshape(b, -1))
            me = jax.lax.axis_index(axis)
            for dg, table, (rows, samples, gains) in zip(L.dp_groups, dp_weights, dp):
                K = len(dg.slots)
                rows, samples, gains = rows.reshape(-1), samples.reshape(-1), gains.reshape(-1)
                local = jnp.where(rows == PAD_ID, PAD_ID, samples - me * K * b)
                rp = jnp.full((1,), rows.shape[0], jnp.int32)
                pooled = lookup(rp, rows, local, gains, table, batch_size=K * b).reshape(K, b, dg.width)
                flats.append(pooled.transpose(1, 0, 2).reshape(b, -1))
                if with_rows:
                    kept.append(entry_rows(table, rows))
            values = jnp.concatenate(flats, axis=1)
            out = jnp.zeros((b, L.total_dim + 1), values.dtype).at[:, dest].add(values)[:, : L.total_dim]
            return out, received, kept

        spec = P(self.axis)
        n_kept = len(groups) + len(dp) if with_rows else 0
        fn = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=([spec] * len(weights), [P()] * len(dp_weights), [(spec,) * 3] * len(groups), [(spec,) * 3] * len(dp)),
            out_specs=(spec, [(spec,) * 3] * len(groups), [spec] * n_kept),
            check_vma=False,
        )
        return fn(weights, dp_weights, groups, dp)

    def _backward_fn(self, grad, weights, slots, dp_weights, dp_slots, received, dp, kept, hyper, b: int):
        """The backward program: gradients back to the shards, fused optimizer on each.

        With ``kept`` (the forward's entry rows, ``with_rows``) it also returns each
        entry's ``row . gradient of its bag``, the gradient of its gain (TorchRec's
        gradient of a per-id weight with SUM pooling), back on the entry's source
        device: ``[source, destination, C]`` per sharded group, ``[device, C]`` per
        data-parallel group.
        """
        L, D, axis = self.layout, self.layout.num_devices, self.axis
        update = self._kernel(self.optimizer.op_name)
        dest = jnp.asarray(L.dest_columns, jnp.int32)
        segments = np.cumsum(L.segments)[:-1].tolist()

        def entry_dots(rows_of_entries, rows, samples, g):
            """Each entry's row . its bag's gradient (0 for padding entries)."""
            bag = g[jnp.where(rows == PAD_ID, 0, samples)]
            return jnp.where(rows == PAD_ID, 0.0, jnp.sum(rows_of_entries * bag, axis=-1))

        def body(grad, weights, slots, dp_weights, dp_slots, received, dp, kept, hyper):
            extended = jnp.concatenate([grad, jnp.zeros((b, 1), grad.dtype)], axis=1)
            pieces = jnp.split(extended[:, dest], segments, axis=1) if segments else [extended[:, dest]]
            it = iter(pieces)
            kept_rows = iter(kept)
            new_w, new_s, dots = [], [], []
            for grp, table, table_slots, (rows, samples, gains) in zip(L.groups, weights, slots, received):
                K, K2, w = grp.num_slots, grp.num_a2a, grp.width
                a2a, rs = next(it), next(it)
                blocks = []
                if K2:
                    sent = a2a.reshape(b, D, K2, w).transpose(1, 2, 0, 3)
                    blocks.append(jax.lax.all_to_all(sent, axis, 0, 0, tiled=True))
                if K > K2:
                    mine = rs.reshape(b, K - K2, w).transpose(1, 0, 2)
                    blocks.append(jax.lax.all_gather(mine, axis, axis=0, tiled=False))
                g = jnp.concatenate(blocks, axis=1).reshape(D * K * b, w)
                if kept:
                    # [source * C] on the owner -> [1, destination, C] back on each source.
                    d = entry_dots(next(kept_rows), rows, samples, g).reshape(D, 1, -1)
                    dots.append(jax.lax.all_to_all(d, axis, 0, 1, tiled=True))
                rp = jnp.full((1,), rows.shape[0], jnp.int32)
                out = update(rp, rows, samples, gains, g, table, *table_slots, **hyper)
                out = out if isinstance(out, (tuple, list)) else (out,)
                new_w.append(out[0])
                new_s.append(list(out[1:]))
            new_dw, new_ds = [], []
            for dg, table, table_slots, (rows, samples, gains) in zip(L.dp_groups, dp_weights, dp_slots, dp):
                K, w = len(dg.slots), dg.width
                mine = next(it).reshape(b, K, w).transpose(1, 0, 2)
                if kept:
                    me = jax.lax.axis_index(axis)
                    flat_rows, flat_samples = rows.reshape(-1), samples.reshape(-1)
                    local = jnp.where(flat_rows == PAD_ID, 0, flat_samples - me * K * b)
                    dots.append(entry_dots(next(kept_rows), flat_rows, local, mine.reshape(K * b, w)).reshape(1, -1))
                # Every replica sees the whole batch's entries and gradients: the same update everywhere.
                g = jax.lax.all_gather(mine, axis, axis=0, tiled=True).reshape(D * K * b, w)
                rows, samples, gains = (jax.lax.all_gather(x.reshape(-1), axis, axis=0, tiled=True) for x in (rows, samples, gains))
                rp = jnp.full((1,), rows.shape[0], jnp.int32)
                out = update(rp, rows, samples, gains, g, table, *table_slots, **hyper)
                out = out if isinstance(out, (tuple, list)) else (out,)
                new_dw.append(out[0])
                new_ds.append(list(out[1:]))
            return new_w, new_s, new_dw, new_ds, dots

        spec = P(self.axis)
        n_slots = len(self.optimizer.slots)
        fn = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(
                spec,
                [spec] * len(weights),
                [[spec] * n_slots] * len(slots),
                [P()] * len(dp_weights),
                [[P()] * n_slots] * len(dp_slots),
                [(spec,) * 3] * len(received),
                [(spec,) * 3] * len(dp),
                [spec] * len(kept),
                {k: P() for k in hyper},
            ),
            out_specs=(
                [spec] * len(weights),
                [[spec] * n_slots] * len(slots),
                [P()] * len(dp_weights),
                [[P()] * n_slots] * len(dp_slots),
                [spec] * len(kept),
            ),
            check_vma=False,
        )
        return fn(grad, weights, slots, dp_weights, dp_slots, received, dp, kept, hyper)

    def _run_forward(self, batch: dict[str, Any], with_rows: bool = False) -> tuple[torch.Tensor, tuple]:
        L = self.layout
        weights, _ = self._arrays("shard", len(L.groups))
        dp_weights, _ = self._arrays("dp", len(L.dp_groups))
        b = batch["per_device"]
        program = self._programs(b, with_rows)[0]
        out, received, kept = program(weights, dp_weights, batch["groups"], batch["dp"])
        origins = (batch["origins"], batch["num_ids"]) if with_rows else None
        return wrap(out, 0), (received, batch["dp"], kept, origins, b)

    def _run_backward(self, saved: tuple, grad_output: torch.Tensor) -> np.ndarray | None:
        """Runs the backward program; returns the per-id weights' gradient (KJT order) when asked for."""
        from tpurec.core.dispatch import value_of

        received, dp, kept, origins, b = saved
        L = self.layout
        grad = value_of(grad_output.contiguous(), "sharded embedding backward")
        weights, slots = self._arrays("shard", len(L.groups))
        dp_weights, dp_slots = self._arrays("dp", len(L.dp_groups))
        self._step += 1
        hyper = {k: float(v) for k, v in self.optimizer.hyperparameters(self._step).items()}
        program = self._programs(b, origins is not None)[1]
        new_w, new_s, new_dw, new_ds, dots = program(grad, weights, slots, dp_weights, dp_slots, received, dp, kept, hyper)
        for prefix, ws, ss in (("shard", new_w, new_s), ("dp", new_dw, new_ds)):
            for g, (w, s) in enumerate(zip(ws, ss)):
                replace_array(getattr(self, f"{prefix}_weight_{g}"), w)
                for name, value in zip(self.optimizer.slots, s):
                    replace_array(getattr(self, f"{prefix}_{name}_{g}"), value)
        if origins is None:
            return None
        entries, num_ids = origins
        id_grad = np.zeros(num_ids, np.float64)
        for (flat, origin), group_dots in zip(entries, dots):
            # This process's rows of the [source device, ...] array: its own entries, in the
            # flat order _pack numbered them. A column-wise id adds one term per column block.
            shards = sorted(group_dots.addressable_shards, key=lambda shard: shard.index[0].start or 0)
            local = np.concatenate([np.asarray(shard.data) for shard in shards])
            np.add.at(id_grad, origin, local.reshape(-1)[flat].astype(np.float64))
        return id_grad.astype(np.float32)

    def _programs(self, b: int, with_rows: bool = False) -> tuple[runtime.Program, runtime.Program]:
        """The forward and backward programs for ``b`` samples per device (cached).

        ``with_rows``: the pair that also gives per-id weights their gradient.
        """
        cache = self.__dict__.setdefault("_program_cache", {})
        key = (b, with_rows)
        if key not in cache:
            cache[key] = (
                runtime.Program(lambda *a: self._forward_fn(*a, b=b, with_rows=with_rows)),
                runtime.Program(lambda *a: self._backward_fn(*a, b=b), donate_argnums=(1, 2, 3, 4)),
            )
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
        batch = self._take_prefetched(features)
        if batch is None:
            batch = self.distribute_input(features)
        anchor = next(self.parameters())
        # Per-id weights that require grad get TorchRec's gradient from the backward program
        # (the gains carry them into the lookup as constants, as in the unsharded collection).
        id_weights = features.weights() if self._weights_need_grad(features) else None
        values = _ShardedLookup.apply(anchor, id_weights, self, batch)
        return KeyedTensor(keys=self._embedding_names, length_per_key=self._length_per_key, values=values)

    # The unsharded collection's rules, on the same attributes (one text for both).
    _weights_need_grad = EmbeddingBagCollection._weights_need_grad
    _check_trainable_lookup = EmbeddingBagCollection._check_trainable_lookup
