"""Managed collisions under ``tpurec.shard``: TorchRec's row-wise sharded MCH remap, on the host.

TorchRec shards a ``ManagedCollisionEmbeddingBagCollection`` and a
``ManagedCollisionEmbeddingCollection`` row-wise only
(``ManagedCollisionCollectionSharder.sharding_types``) and gives each rank its own
``MCHManagedCollisionModule`` for its rows of the table (``rebuild_with_output_id_range``:
a fresh module whose ``zch_size`` is the shard's rows). One step of its sharded module:

1. input dist: the raw ids (hashed by ``input_hash_func`` when the collection's
   ``need_preprocess`` is set) are cut into one block of ``ceil(input_hash_size / shards)``
   ids per rank (FBGEMM's ``block_bucketize_sparse_features``) and sent to their block's rank;
2. each rank's module profiles the ids it received (in training: history, and every
   ``eviction_interval`` steps the eviction policy admits new ids) and remaps them to rows of
   its own shard (an id it does not hold goes to the shard's last row);
3. rows whose ids were evicted are reset: FBGEMM's ``reset_embedding_weight_momentum`` first
   (with row-wise Adagrad, its ``reset_weight_momentum`` zeroes the rows' weights and row-wise
   accumulators; with any other optimizer it leaves the rows and their state as they are), then
   the table's ``init_fn`` applied to the rows; then the shard looks the remapped ids up.

Here the same happens in one process on the host: per table one TorchRec MCH module per
mesh device, built by TorchRec's ``rebuild_with_output_id_range``; the whole batch is
bucketized by the same FBGEMM op, and each module gets its block's ids in the order its rank
receives them (feature by feature, the samples of every rank in rank order). The remapped ids,
put back in the batch's order, are global rows of the table, which the sharded collection
routes to the device holding them (the device of their block).

Example::

    model = tpurec.sparse.from_torchrec(model_with_mc_ebc).to("tpu")
    model = tpurec.shard(model, plan)     # row-wise plan of the MC-EBC's tables, at its path
    pooled, remapped = model.sparse_arch(kjt)
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping, cast

import numpy as np
import torch
from torch import nn
from torchrec.modules.mc_modules import ManagedCollisionCollection as TorchrecMCC
from torchrec.modules.mc_modules import MCHManagedCollisionModule
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from tpurec.sparse.managed import REMAP_TYPES, ManagedCollisionEmbeddingBagCollection, check_host_features
from tpurec.sparse.optimizers import RowWiseAdagrad
from tpurec.sparse.sharding.ebc import ShardedEmbeddingBagCollection
from tpurec.sparse.sharding_plan.shards import TableSharding

__all__ = [
    "ShardedManagedCollisionCollection",
    "ShardedManagedCollisionEmbeddingBagCollection",
    "ShardedManagedCollisionEmbeddingCollection",
    "check_shardable",
]

_ROW_WISE = "row_wise"
# Buffers of an MCH module that are not split over the shards (TorchRec's
# ShardedManagedCollisionCollection.sharded_parameter_names leaves them out): one value per module.
_UNSPLIT_BUFFERS = ("_output_segments_tensor", "_current_iter_tensor")


def _shard_of_device(sharding: TableSharding, num_devices: int) -> list[Any]:
    """The table's shard on each mesh device, in device order (checked by :func:`check_shardable`)."""
    by_device = {p.device: p for p in sharding.pieces}
    return [by_device[d] for d in range(num_devices)]


def check_shardable(
    where: str,
    bags: Any,
    shardings: Mapping[str, TableSharding],
    num_devices: int,
) -> None:
    """Raises unless a managed-collision module can be sharded as TorchRec shards it, exactly, with ``shardings``.

    Args:
        where: the module's path, for messages.
        bags: the tpurec ``EmbeddingBagCollection`` behind its remap (the EBC itself, or an
            ``EmbeddingCollection``'s inner one), not sharded yet.
        shardings: its tables' shardings on the mesh.
        num_devices: the mesh's devices.

    Raises:
        ValueError: a table not sharded row-wise into one non-empty, full-width shard per device
            (TorchRec's sharder refuses the same plans).
        NotImplementedError: a weighted collection (see the message).
    """
    not_row_wise = {t: s.sharding_type for t, s in shardings.items() if s.sharding_type != _ROW_WISE}
    if not_row_wise:
        raise ValueError(
            f"the managed-collision collection {where} has tables planned {not_row_wise}: TorchRec shards "
            "managed-collision tables row-wise only (its managed-collision sharders offer "
            "no other sharding type), each row-wise shard remapping its own slice of zch_size. Plan every table "
            "of it with row_wise()."
        )
    configs = {c.name: c for c in bags.embedding_bag_configs()}
    for table, sharding in shardings.items():
        devices = sorted(p.device for p in sharding.pieces)
        full_width = all(p.cols == configs[table].embedding_dim for p in sharding.pieces)
        if devices != list(range(num_devices)) or not full_width:
            raise ValueError(
                f"table {table!r} of the managed-collision collection {where} ({configs[table].num_embeddings} rows) "
                f"has row-wise shards on devices {devices}: TorchRec's sharded managed-collision module needs one "
                f"shard of at least one row on each of the {num_devices} devices (each remaps one block of the id "
                "space into its rows). Use a table of at least as many rows as devices, planned with row_wise()."
            )
    if bags.is_weighted():
        raise NotImplementedError(
            f"tpurec.shard cannot shard the weighted managed-collision collection {where}: TorchRec's sharded "
            "managed-collision module drops the per-id weights when it remaps (its input dist builds the remapped "
            "batch without them), so its lookups are not those of the unsharded module. Train it unsharded."
        )


class ShardedManagedCollisionCollection(nn.Module):
    """TorchRec's ``ManagedCollisionCollection`` remapping per row-wise shard, on the host.

    Holds, per table, one TorchRec ``MCHManagedCollisionModule`` per mesh device (its rows of the
    table), made by TorchRec's ``rebuild_with_output_id_range`` of the unsharded module: fresh,
    as in TorchRec's sharded module (the unsharded module's admitted ids are not carried over).
    The per-shard modules stay on the host: they are not submodules, so device moves and dtype
    conversions of the model leave them alone.

    The state dict has the unsharded collection's keys and shapes: each split buffer is the
    shards' buffers in device order (TorchRec's sharded layout), ``_current_iter_tensor`` and
    ``_output_segments_tensor`` are the first shard's (every shard has the same).

    Args:
        mcc: the unsharded collection (TorchRec's, or tpurec's host-pinned one).
        shardings: table -> its row-wise sharding (one shard per device, checked by
            :func:`check_shardable`).
        num_devices: the mesh's devices.
    """

    def __init__(self, mcc: TorchrecMCC, shardings: Mapping[str, TableSharding], num_devices: int) -> None:
        super().__init__()
        self.need_preprocess = bool(mcc.need_preprocess)
        self._embedding_configs = list(mcc.embedding_configs())
        self._feature_names: list[str] = list(mcc._feature_names)
        self._table_to_features: dict[str, list[str]] = {t: list(f) for t, f in mcc._table_to_features.items()}
        self._num_devices = num_devices
        # table -> [its module on device d]; plain attributes, so no device move reaches them.
        self._shard_modules: dict[str, list[MCHManagedCollisionModule]] = {}
        self._block_sizes: dict[str, int] = {}
        self._rows: dict[str, list[int]] = {}
        admitted = []
        for table, unsharded in mcc._managed_collision_modules.items():
            unsharded = cast(MCHManagedCollisionModule, unsharded)
            pieces = _shard_of_device(shardings[table], num_devices)
            num_rows = unsharded.output_size()
            # TorchRec: output segments are the shards' first rows (plan order) and the table's end.
            segments = [p.row_offset for p in shardings[table].pieces] + [num_rows]
            modules = [
                cast(
                    MCHManagedCollisionModule,
                    unsharded.rebuild_with_output_id_range(
                        output_id_range=(p.row_offset, p.row_offset + p.rows),
                        output_segments=segments,
                        device=torch.device("cpu"),
                    ),
                )
                for p in pieces
            ]
            for m in modules:
                m.train(mcc.training)
            self._shard_modules[table] = modules
            self._rows[table] = [p.rows for p in pieces]
            # RwSparseFeaturesDist: blocks of ceil(input size / buckets) ids, buckets = shards.
            self._block_sizes[table] = -(-modules[0].input_size() // modules[0].buckets())
            if bool((unsharded._mch_sorted_raw_ids != torch.iinfo(torch.int64).max).any()):
                admitted.append(table)
        if admitted:
            warnings.warn(
                f"tpurec.shard: the managed-collision modules of tables {admitted} had admitted ids; the sharded "
                "collection starts with empty remaps, one per row-wise shard, as TorchRec's sharded module does "
                "(the unsharded remap does not split by shard). Load a state dict saved by a sharded model to "
                "resume one.",
                stacklevel=4,
            )

    def embedding_configs(self) -> list[Any]:
        """The tables' configs (TorchRec's method)."""
        return self._embedding_configs

    def shard_modules(self, table: str) -> list[MCHManagedCollisionModule]:
        """Table ``table``'s MCH module of each device, in device order (their state is the remap's)."""
        return list(self._shard_modules[table])

    def train(self, mode: bool = True) -> "ShardedManagedCollisionCollection":
        """Sets training mode here and in every per-shard module (training profiles and evicts)."""
        super().train(mode)
        for modules in self._shard_modules.values():
            for m in modules:
                m.train(mode)
        return self

    # --- remap ------------------------------------------------------------------------

    def forward(self, features: KeyedJaggedTensor, variable_batch: bool = False) -> KeyedJaggedTensor:
        """Remaps ``features`` (CPU, raw ids) as TorchRec's row-wise sharded collection does.

        In training each per-shard module also profiles its ids and may evict; read the evicted
        rows with :meth:`evict` after the call.

        Args:
            features: KJT of raw ids on the CPU.
            variable_batch: take a variable batch per feature (VBE) and ``inverse_indices``, as
                TorchRec's sharded managed-collision ``EmbeddingBagCollection`` does: each feature's
                own bags are remapped (an id once per bag, not once per output sample), and the
                result keeps the batch's bags per feature and ``inverse_indices``.

        Returns:
            KJT of this collection's features (in table order) with global rows of their tables,
            the batch's lengths (and with ``variable_batch`` its bags per feature and
            ``inverse_indices``) and no weights.

        Raises:
            ValueError: ``features`` lacks one of the collection's features, or is not on the CPU.
            NotImplementedError: a variable-batch (VBE) batch or one with ``inverse_indices`` without
                ``variable_batch``.
        """
        check_host_features(features)
        vbe = features.variable_stride_per_key()
        inverse = features.inverse_indices_or_none()
        if (vbe or inverse is not None) and not variable_batch:
            raise NotImplementedError(
                "tpurec's sharded managed-collision EmbeddingCollection takes batches of one batch size; this KJT "
                "has a variable batch per feature (VBE) or inverse_indices. Pass every feature with the same stride."
            )
        missing = [f for f in self._feature_names if f not in features.keys()]
        if missing:
            raise ValueError(
                f"the KeyedJaggedTensor has no features {missing} of the managed-collision collection "
                f"(it has {list(features.keys())})"
            )
        jts = features.to_dict()
        values: list[torch.Tensor] = []
        lengths: list[torch.Tensor] = []
        for config in self._embedding_configs:  # (the order of _feature_names)
            table, modules = config.name, self._shard_modules[config.name]
            names = self._table_to_features[table]
            table_lengths = torch.cat([jts[f].lengths() for f in names])
            table_ids = torch.cat([jts[f].values() for f in names])
            if self.need_preprocess:  # (as TorchRec's input dist: the first shard's hash, the same on all)
                table_ids = (
                    modules[0]
                    .preprocess({table: JaggedTensor(values=table_ids, lengths=table_lengths)})[table]
                    .values()
                )
            bags = [int(jts[f].lengths().numel()) for f in names] if vbe else None
            values.append(self._remap_table(table, table_ids, table_lengths, len(names), bags))
            lengths.append(table_lengths)
        keys = list(self._feature_names)
        batching: dict[str, Any] = {}
        if vbe:
            per_rank = dict(zip(features.keys(), features.stride_per_key_per_rank()))
            batching["stride_per_key_per_rank"] = [list(per_rank[f]) for f in keys]
        else:
            batching["stride"] = features.stride()
        if inverse is not None:
            names, index = inverse
            row = {name: i for i, name in enumerate(names)}  # (a repeated name: its last row, as TorchRec reads)
            missing_rows = [f for f in keys if f not in row]
            if missing_rows:
                raise ValueError(f"inverse_indices name {list(names)}, not the features {missing_rows}")
            batching["inverse_indices"] = (keys, index[[row[f] for f in keys]])
        return KeyedJaggedTensor(
            keys=keys,
            values=torch.cat(values) if values else torch.zeros(0, dtype=torch.int64),
            lengths=torch.cat(lengths) if lengths else torch.zeros(0, dtype=torch.int32),
            **batching,
        )

    def _remap_table(
        self, table: str, ids: torch.Tensor, lengths: torch.Tensor, num_features: int, bags: list[int] | None = None
    ) -> torch.Tensor:
        """One table's ids (its features' ids in a row) remapped by the shards owning their blocks;
        ``bags``: each feature's bag count where they differ (a VBE batch)."""
        D = self._num_devices
        # RwSparseFeaturesDist's bucketization (keep_original_indices: raw ids travel).
        block = torch.tensor([self._block_sizes[table]] * num_features, dtype=ids.dtype)
        buckets = torch.tensor([D] * num_features, dtype=ids.dtype)
        bucket_lengths, bucket_ids, _, _, unbucketize = torch.ops.fbgemm.block_bucketize_sparse_features(
            lengths.view(-1),
            ids,
            bucketize_pos=False,
            sequence=True,
            block_sizes=block,
            total_num_blocks=buckets,
            my_size=D,
            weights=None,
            batch_size_per_feature=None if bags is None else torch.tensor(bags, dtype=ids.dtype),
            max_B=-1 if bags is None else max(bags, default=0),
            block_bucketize_pos=None,
            keep_orig_idx=True,
        )
        per_bucket = bucket_lengths.view(D, -1)
        counts = per_bucket.sum(dim=1).tolist()
        remapped = []
        start = 0
        for d, module in enumerate(self._shard_modules[table]):
            # What rank d receives: each feature's ids of its block, samples in the global batch's order.
            jt = {table: JaggedTensor(values=bucket_ids[start : start + counts[d]], lengths=per_bucket[d])}
            start += counts[d]
            jt = module.profile(jt)
            remapped.append(module.remap(jt)[table].values())
        assert unbucketize is not None  # (sequence=True)
        return torch.cat(remapped)[unbucketize]

    def evict(self) -> dict[str, np.ndarray | None]:
        """The rows each table's shards evicted in the last forward (global rows), or None.

        Each module reports an eviction once (TorchRec's ``evict``); call once per forward.
        """
        out: dict[str, np.ndarray | None] = {}
        for table, modules in self._shard_modules.items():
            found = [m.evict() for m in modules]
            rows = [r.reshape(-1).numpy() for r in found if r is not None]
            out[table] = np.concatenate(rows).astype(np.int64) if rows else None
        return out

    def open_slots(self) -> dict[str, torch.Tensor]:
        """Unused slots of each table, summed over its shards."""
        return {t: torch.stack([m.open_slots() for m in ms]).sum(0) for t, ms in self._shard_modules.items()}

    # --- state dict: the unsharded keys, shards concatenated in device order ---------------

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for table, modules in self._shard_modules.items():
            states = [m.state_dict() for m in modules]
            for name, first in states[0].items():
                key = f"{prefix}_managed_collision_modules.{table}.{name}"
                destination[key] = first if name in _UNSPLIT_BUFFERS else torch.cat([s[name] for s in states])

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        expected = set()
        for table, modules in self._shard_modules.items():
            base = f"{prefix}_managed_collision_modules.{table}."
            names = list(modules[0].state_dict())
            expected.update(base + n for n in names)
            absent = [base + n for n in names if base + n not in state_dict]
            if absent:
                missing_keys.extend(absent)
                continue
            rows = self._rows[table]
            locals_: list[dict[str, torch.Tensor]] = [{} for _ in modules]
            bad = False
            for name in names:
                value = state_dict[base + name]
                if name in _UNSPLIT_BUFFERS:
                    for local in locals_:
                        local[name] = value
                    continue
                if value.shape[0] != sum(rows):
                    error_msgs.append(
                        f"size mismatch for {base + name}: checkpoint {tuple(value.shape)}, model ({sum(rows)},)"
                    )
                    bad = True
                    continue
                for local, part in zip(locals_, torch.split(value, rows)):
                    local[name] = part
            if not bad:
                for module, local in zip(modules, locals_):
                    # TorchRec's own load (its post hook re-sorts the remap: validate_state).
                    module.load_state_dict(local)
        if strict:
            unexpected_keys.extend(
                k for k in state_dict if k.startswith(prefix + "_managed_collision_modules.") and k not in expected
            )


REMAP_TYPES.append(ShardedManagedCollisionCollection)  # its features are remapped in its forward too


class _ShardedManagedCollisionModule(nn.Module):
    """What both sharded managed-collision modules do: remap per shard, reset evicted rows, look up.

    Args:
        source: the unsharded tpurec module (its remap settings; its state is not carried over).
        embedding_module: its embedding collection, whose lookups are sharded.
        bags: the sharded pooled collection holding the tables (``embedding_module`` itself, or
            a sequence collection's inner one).
        shardings: the tables' row-wise shardings.
        num_devices: the mesh's devices.
    """

    def __init__(
        self,
        source: Any,
        embedding_module: nn.Module,
        bags: ShardedEmbeddingBagCollection,
        shardings: Mapping[str, TableSharding],
        num_devices: int,
    ) -> None:
        super().__init__()
        self._managed_collision_collection = ShardedManagedCollisionCollection(
            source._managed_collision_collection, shardings, num_devices
        )
        self._embedding_module = embedding_module
        self._return_remapped_features = bool(source._return_remapped_features)
        self._allow_in_place_embed_weight_update = bool(source._allow_in_place_embed_weight_update)
        self._bags = [bags]  # (a list: not registered a second time)
        self._init_fns = {c.name: c.init_fn for c in bags.embedding_bag_configs()}
        self._dims = {c.name: c.embedding_dim for c in bags.embedding_bag_configs()}
        self.train(source.training)

    _variable_batch: bool = False
    """Whether the collection takes VBE batches (TorchRec's sharded pooled one does)."""

    def _remap_and_look_up(self, features: KeyedJaggedTensor) -> tuple[Any, KeyedJaggedTensor | None]:
        if self._variable_batch and self._return_remapped_features and features.variable_stride_per_key():
            raise NotImplementedError(
                "VBE is not supported currently for return_remapped_features=True (TorchRec's sharded "
                "managed-collision EmbeddingBagCollection refuses the same): build the module with "
                "return_remapped_features=False, or give every feature the same batch size"
            )
        remapped = self._managed_collision_collection(features, variable_batch=self._variable_batch)
        self._reset_evicted(self._managed_collision_collection.evict())
        looked_up = self._embedding_module(remapped)
        return looked_up, (remapped if self._return_remapped_features else None)

    @torch.no_grad()
    def _reset_evicted(self, evictions: Mapping[str, np.ndarray | None]) -> None:
        """Resets the evicted rows as TorchRec's sharded ``_evict`` does.

        TorchRec first calls its TBE's ``reset_embedding_weight_momentum`` on the rows: with
        row-wise Adagrad (FBGEMM's ``EXACT_ROWWISE_ADAGRAD``) its ``reset_weight_momentum`` sets
        their weights and row-wise accumulators to zero; with any other optimizer it changes
        nothing. Then each row gets the table's ``init_fn`` of its values (of the zeros with
        row-wise Adagrad). Here the same on the rows' shards: with row-wise Adagrad the
        accumulators are zeroed and ``init_fn`` is applied to zero rows; otherwise the state is
        kept and ``init_fn`` gets the current rows. A table without an ``init_fn`` keeps the
        rows ``reset_weight_momentum`` left. These are the evicted table's own rows: TorchRec
        passes the op the table's position among its TBE's tables where the op reads the
        position of the table's first feature, so after a table of several features in the
        same TBE it resets rows of another table (docs/sharding.md).

        Args:
            evictions: table -> its evicted rows (global rows), or None.
        """
        bags = self._bags[0]
        reset_state = isinstance(bags.optimizer, RowWiseAdagrad)
        for table, rows in evictions.items():
            if rows is None or rows.size == 0:
                continue
            init_fn = self._init_fns[table]
            if reset_state:  # (reset_weight_momentum: the rows' weights are zero before init_fn)
                current = torch.zeros(rows.size, self._dims[table], dtype=torch.float32)
            else:
                current = torch.from_numpy(bags.rows_of(table, rows))
            new = init_fn(current) if init_fn is not None else None
            new = current if new is None else new
            bags.write_rows(table, rows, new.detach().cpu().numpy(), zero_slots=reset_state)


class ShardedManagedCollisionEmbeddingBagCollection(_ShardedManagedCollisionModule):
    """TorchRec's sharded ``ManagedCollisionEmbeddingBagCollection``: per-shard remap, resets, sharded lookup.

    Built by :func:`tpurec.shard` from a tpurec
    :class:`~tpurec.sparse.managed.ManagedCollisionEmbeddingBagCollection` whose tables are planned
    row-wise. Each forward remaps the batch (:class:`ShardedManagedCollisionCollection`), resets
    the rows evicted in that remap (the table's ``init_fn`` applied to the evicted rows on the
    host, in table order and then device order; with row-wise Adagrad their accumulators zeroed
    and ``init_fn`` applied to zero rows, as FBGEMM's ``reset_weight_momentum`` does, with other
    optimizers their state kept), then looks the remapped ids up in the sharded collection. A random
    ``init_fn`` draws from this process's torch generator, where TorchRec's ranks draw from their
    own; a deterministic one gives TorchRec's rows.

    Args:
        source: the unsharded tpurec module (its remap settings; its state is not carried over).
        embedding_bag_collection: its collection, sharded.
        shardings: the tables' row-wise shardings.
        num_devices: the mesh's devices.
    """

    def __init__(
        self,
        source: ManagedCollisionEmbeddingBagCollection,
        embedding_bag_collection: ShardedEmbeddingBagCollection,
        shardings: Mapping[str, TableSharding],
        num_devices: int,
    ) -> None:
        super().__init__(source, embedding_bag_collection, embedding_bag_collection, shardings, num_devices)

    _variable_batch = True

    @property
    def _embedding_bag_collection(self) -> ShardedEmbeddingBagCollection:
        """The sharded collection (TorchRec's name for it)."""
        return self._bags[0]

    @torch.compiler.disable
    def forward(
        self, features: KeyedJaggedTensor, mutate_miss_lengths: bool = True
    ) -> tuple[KeyedTensor, KeyedJaggedTensor | None]:
        """Remaps ``features`` (CPU, raw ids, this process's batch), resets evicted rows, looks up.

        Args:
            features: KJT of raw ids on the CPU; a variable batch per feature (VBE) and
                ``inverse_indices`` as TorchRec's sharded module takes them: each feature's bags are
                remapped as they are, and the lookup expands them to the output samples (VBE with
                ``return_remapped_features`` raises ``NotImplementedError``, as TorchRec's does).
            mutate_miss_lengths: accepted for TorchRec's signature (MCH modules do not read it).

        Returns:
            ``(pooled KeyedTensor, remapped KJT or None)``: the remapped KJT (global rows, the batch's
            bags per feature) when the module was built with ``return_remapped_features``.
        """
        return self._remap_and_look_up(features)


class ShardedManagedCollisionEmbeddingCollection(_ShardedManagedCollisionModule):
    """TorchRec's sharded ``ManagedCollisionEmbeddingCollection``: per-shard remap, resets, sharded lookup.

    As :class:`ShardedManagedCollisionEmbeddingBagCollection`, over a sequence
    ``EmbeddingCollection`` whose inner collection is sharded; ``Dict[str, JaggedTensor]`` out.
    TorchRec's ``EmbeddingCollectionSharder`` without index dedup (its default): each shard's
    module sees every id, repeats included.

    Args:
        source: the unsharded tpurec module (its remap settings; its state is not carried over).
        embedding_collection: its sequence collection, whose inner collection is sharded.
        shardings: the tables' row-wise shardings.
        num_devices: the mesh's devices.
    """

    def __init__(
        self,
        source: Any,
        embedding_collection: nn.Module,
        shardings: Mapping[str, TableSharding],
        num_devices: int,
    ) -> None:
        bags = cast(ShardedEmbeddingBagCollection, embedding_collection.get_submodule("_bags"))
        super().__init__(source, embedding_collection, bags, shardings, num_devices)

    @property
    def _embedding_collection(self) -> nn.Module:
        """The sequence collection (TorchRec's name for it)."""
        return self._embedding_module

    @torch.compiler.disable
    def forward(
        self, features: KeyedJaggedTensor, mutate_miss_lengths: bool = True
    ) -> tuple[dict[str, JaggedTensor], KeyedJaggedTensor | None]:
        """Remaps ``features`` (CPU, raw ids, this process's batch), resets evicted rows, looks up.

        Returns:
            ``(feature -> JaggedTensor of embeddings, remapped KJT or None)``.
        """
        return self._remap_and_look_up(features)
