"""Host routing of a sharded EmbeddingBagCollection (TorchRec's input distribution, host side).

Per step and process, before any program runs: this process's KJT is validated
(``read_kjt``), each id is routed to the shard holding its row (source device,
destination shard, output slot), and the entries are packed into fixed-capacity
``[local devices, devices, capacity]`` arrays per group (``[local devices,
capacity]`` per data-parallel group), made global arrays on the mesh. Host numpy
and asynchronous copies only: safe on :class:`~tpurec.sparse.TrainPipeline`'s
worker thread. The programs that consume these arrays are in ``programs.py``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tpurec.sparse.batching import expand_bags, read_batching
from tpurec.sparse.lookup import Prepared
from tpurec.sparse.preprocess import read_kjt
from tpurec.sparse.sharding.fingerprint import agree_on_step
from tpurec.sparse.sharding_plan.layout import Layout
from tpurec.sparse.types import PAD_ID, CapacityError, StackedTable

__all__ = ["ALIGN", "InputRouter", "MeshBatch", "Prefetched", "Routed"]

ALIGN = 8
"""Capacities are multiples of this many entries."""


@dataclasses.dataclass
class Routed:
    """A validated batch with every entry's route (host arrays; before capacities are applied).

    Attributes:
        per_device: samples per device.
        groups: per sharded group, then per data-parallel group:
            ``(key, rows, out, gains, origin, counts, destinations)`` where ``key`` is
            ``local source device * destinations + destination``, ``origin`` the
            index of the entry's id in the KJT's values, ``counts`` the histogram of ``key``.
        needs: per group, the most entries one source sends one destination.
        num_ids: ids in this process's KJT.
        features: per group, each entry's index into :attr:`InputRouter.features`
            (which table and feature it looks up; for error messages).
    """

    per_device: int
    groups: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]]
    needs: list[int]
    num_ids: int = 0
    features: list[np.ndarray] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class MeshBatch:
    """One process's batch, routed and packed into fixed-capacity entry arrays on the mesh.

    Each ``(rows, samples, gains)`` triple holds one group's entries: the row each entry reads
    in the group's local stack, the output row it adds to and its weight (padding entries
    read no row). Fields read by key too (``batch["groups"]``), as a mapping of them.

    Attributes:
        per_device: samples per device.
        groups: per sharded group, global ``[local devices, devices, capacity]`` arrays.
        dp: per data-parallel group, global ``[local devices, capacity]`` arrays.
        origins: per group (sharded, then data-parallel), ``(entry positions, KJT value
            indices)`` host arrays: which id of this process's KJT each kept entry came from.
        num_ids: ids in this process's KJT.
        dropped: feature -> entries ``overflow="drop"`` left out (features with drops only).
    """

    per_device: int
    groups: list[tuple[jax.Array, jax.Array, jax.Array]]
    dp: list[tuple[jax.Array, jax.Array, jax.Array]]
    origins: list[tuple[np.ndarray, np.ndarray]]
    num_ids: int
    dropped: dict[str, int]

    def __getitem__(self, key: str) -> Any:
        """The field named ``key``.

        Raises:
            KeyError: no field has that name.
        """
        if key not in {f.name for f in dataclasses.fields(self)}:
            raise KeyError(key)
        return getattr(self, key)


@dataclasses.dataclass
class Prefetched(Prepared):
    """What a sharded collection's ``prefetch`` prepared for one KJT object.

    ``batch`` (on the mesh) and ``dropped`` when the arrays could be built on
    the worker; else only ``routed`` (several processes: the capacity agreement
    is a collective, so it runs in the step, in the same order on every process).
    """

    routed: Routed | None = None
    batch: MeshBatch | None = None
    dropped: int = 0


class InputRouter:
    """Routes this process's batches to the shards of one sharded collection.

    Args:
        configs: the collection's tables.
        stacks: one unstacked table per config (what ``read_kjt`` validates against).
        layout: where every table piece lives on the mesh.
        mesh: the device mesh.
        is_weighted: the collection takes per-id weights.
        capacity: entries each source device may send each destination per
            group and step (rounded up to :data:`ALIGN`); None grows it on
            demand to powers of two.
        overflow: ``"error"`` or ``"drop"`` when a batch exceeds ``capacity``.
        mean_per_row_block: a MEAN table's bag is averaged per row block (the ids of the bag that
            one row shard holds, divided by their count; the shards' means are then summed), as
            TorchRec's sharded inference pools row-wise MEAN tables. False: by the bag's length.

    Raises:
        ValueError: this process's devices are not a contiguous run of the mesh.
    """

    # Routers made so far: a router's number names its per-step agreement (processes make
    # their sharded collections in the same order, which tpurec.shard's agreement checks).
    created = 0

    def __init__(
        self,
        configs: Sequence[EmbeddingBagConfig],
        stacks: Sequence[StackedTable],
        layout: Layout,
        mesh: Mesh,
        is_weighted: bool,
        capacity: int | None,
        overflow: Literal["error", "drop"],
        mean_per_row_block: bool = False,
    ) -> None:
        self.configs = list(configs)
        self.mean_per_row_block = mean_per_row_block
        self.stacks = list(stacks)
        self.layout = layout
        self.is_weighted = is_weighted
        self.fixed_capacity = None if capacity is None else -(-capacity // ALIGN) * ALIGN
        self.overflow = overflow
        self.number = InputRouter.created
        InputRouter.created += 1
        self.steps = 0  # batches packed (the per-step agreement's step)
        # Automatic capacities per group (sharded groups, then data-parallel ones); they only grow.
        self.capacities = [ALIGN] * (len(layout.groups) + len(layout.dp_groups))
        # Which mesh positions this process feeds: its local batch is split over them in order.
        me = jax.process_index()
        positions = [i for i, d in enumerate(mesh.devices.flat) if d.process_index == me]
        if not positions or positions != list(range(positions[0], positions[0] + len(positions))):
            raise ValueError(
                f"process {me}'s devices must be a contiguous run of the mesh's devices (mesh positions {positions}); "
                "order the mesh by process"
            )
        self.first_device, self.local_devices = positions[0], len(positions)
        self.sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
        # (table, feature) of each routed feature, in routing order (Routed.features indexes it).
        self.features = [(cfg.name, f) for cfg in self.configs for f in cfg.feature_names]

    def one_batch_size(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """A variable-batch (VBE) or ``inverse_indices`` batch as one of a single batch size.

        TorchRec pools each bag once and expands the pooled rows by ``inverse_indices``; here the
        bags are expanded on the host instead (:func:`~tpurec.sparse.batching.expand_bags`), which
        pools and differentiates to the same values and lets the batch be routed as any other.
        """
        vbe, inverse = features.variable_stride_per_key(), features.inverse_indices_or_none()
        if not vbe and inverse is None:
            return features
        # Every rule first (inverse_indices included), so a bad batch names what is wrong.
        read_kjt(features, self.stacks, is_weighted=self.is_weighted, variable_batch=True)
        batching = read_batching(features, variable_batch=True)
        if batching.inverse_indices is not None:
            return expand_bags(features, batching)
        if not vbe:
            return features  # empty inverse_indices: TorchRec ignores them too
        # Every feature has the same number of bags: the batch already has one size.
        return KeyedJaggedTensor(
            keys=list(features.keys()),
            values=features.values(),
            weights=features.weights_or_none(),
            lengths=features.lengths(),
            stride=batching.bags_per_key[0] if batching.bags_per_key else 0,
        )

    def route(self, features: KeyedJaggedTensor) -> Routed:
        """Validates ``features`` and finds every entry's source device, shard and output slot.

        Host numpy only: no collective, no state change (safe on a worker thread).

        Raises:
            ValueError: a malformed batch, or a local batch that does not split
                evenly over this process's devices.
        """
        L, D = self.layout, self.layout.num_devices
        features = self.one_batch_size(features)
        local_batch, feats = read_kjt(features, self.stacks, is_weighted=self.is_weighted)
        n_local = self.local_devices
        if local_batch % n_local:
            raise ValueError(
                f"the local batch of {local_batch} samples does not split evenly over this process's {n_local} devices; "
                f"use a multiple of {n_local}"
            )
        b = local_batch // n_local
        first = self.first_device
        n_groups = len(L.groups)
        # Where each feature's ids start in the KJT's values (and weights): keys are in KJT order.
        starts, num_ids = {}, 0
        for key in features.keys():
            starts[key] = num_ids
            num_ids += feats[key].ids.shape[0]
        parts: list[list[tuple[np.ndarray, ...]]] = [[] for _ in range(n_groups + len(L.dp_groups))]
        which: list[list[np.ndarray]] = [[] for _ in parts]
        code = -1  # the (table, feature)'s index in self.features
        for cfg in self.configs:
            for f in cfg.feature_names:
                code += 1
                fb = feats[f]
                samples = np.repeat(np.arange(local_batch, dtype=np.int64), fb.lengths)
                gains = np.ones(fb.ids.shape[0], np.float64) if fb.weights is None else fb.weights.astype(np.float64)
                if cfg.pooling == PoolingType.MEAN and self.mean_per_row_block and cfg.name in L.placements:
                    # Each row block's ids of a bag averaged on their own (see __init__).
                    row_starts = L.placements[cfg.name].row_starts
                    cell = samples * row_starts.shape[0] + np.searchsorted(row_starts, fb.ids, side="right") - 1
                    gains = gains / np.bincount(cell)[cell]
                elif cfg.pooling == PoolingType.MEAN:
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
                    which[n_groups + g].append(np.full(src.shape[0], code, np.int32))
                    continue
                place = L.placements[cfg.name]
                block = np.searchsorted(place.row_starts, fb.ids, side="right") - 1
                for c, g in enumerate(place.group_of_block):
                    dst = place.device[c][block]
                    rows = place.base[c][block] + fb.ids
                    out = (src * L.groups[g].num_slots + place.slot[c][f][block]) * b + within
                    parts[g].append((src - first, dst, rows, out, gains, origin))
                    which[g].append(np.full(src.shape[0], code, np.int32))
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
        codes = [np.concatenate(w) if w else np.zeros(0, np.int32) for w in which]
        return Routed(per_device=b, groups=packed, needs=needs, num_ids=num_ids, features=codes)

    def pack(self, routed: Routed) -> tuple[MeshBatch, int]:
        """Fixed-capacity entry arrays of a routed batch, sent to the mesh (asynchronous copies).

        Returns:
            ``(batch, dropped)``: the batch on the mesh, and how many entries
            ``overflow="drop"`` left out in all.

        Raises:
            CapacityError: a fixed capacity overflows with ``overflow="error"``.
        """
        D, n_local, n_groups = self.layout.num_devices, self.local_devices, len(self.layout.groups)
        capacities = self.capacities_for(routed.needs, routed)
        dropped = 0
        by_feature = np.zeros(len(self.features), np.int64)
        result_groups, result_dp, origins = [], [], []
        for j, (key, rows, out, gains, origin, counts, destinations) in enumerate(routed.groups):
            C = capacities[j]
            order = np.argsort(key, kind="stable")
            key, rows, out, gains, origin = key[order], rows[order], out[order], gains[order], origin[order]
            starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
            position = np.arange(key.shape[0]) - starts[key]
            keep = position < C
            dropped += int((~keep).sum())
            if routed.features and not keep.all():
                by_feature += np.bincount(routed.features[j][order][~keep], minlength=len(self.features))
            flat = key[keep] * C + position[keep]
            shape = (n_local, D, C) if destinations == D else (n_local, C)
            size = int(np.prod(shape))
            r = np.full(size, PAD_ID, np.int32)
            s = np.full(size, PAD_ID, np.int32)
            v = np.zeros(size, np.float32)
            r[flat], s[flat], v[flat] = rows[keep], out[keep], gains[keep]
            arrays = (
                self.to_global(r.reshape(shape)),
                self.to_global(s.reshape(shape)),
                self.to_global(v.reshape(shape)),
            )
            (result_groups if j < n_groups else result_dp).append(arrays)
            # (this process's flat entry position, KJT value index) of each kept entry: maps the
            # per-entry gradients of per-id weights back to the KJT's weights.
            origins.append((flat, origin[keep]))
        batch = MeshBatch(
            per_device=routed.per_device,
            groups=result_groups,
            dp=result_dp,
            origins=origins,
            num_ids=routed.num_ids,
            dropped={self.features[c][1]: int(n) for c, n in enumerate(by_feature.tolist()) if n},
        )
        return batch, dropped

    def capacities_for(self, needs: list[int], routed: Routed | None = None) -> list[int]:
        """Per-group capacities for a batch needing ``needs`` entries (all processes agree).

        Raises:
            CapacityError: a fixed capacity overflows with ``overflow="error"``; the
                message names the table, feature and (source device, destination
                shard) of ``routed``'s fullest pair and the capacity that fits.
        """
        local_needs = list(needs)
        if jax.process_count() > 1:
            self.steps += 1
            local_batch = -1 if routed is None else routed.per_device * self.local_devices
            # Through the coordinator's store (tpurec.distributed.initialize): also checks the local
            # batch sizes, and a lost or finished process is an error instead of a collective that waits.
            everyone = agree_on_step(self.number, self.steps, local_batch, [int(n) for n in needs])
            if len(everyone) == 1:  # JAX started without tpurec.distributed.initialize: no store exchange
                from jax.experimental import multihost_utils

                everyone = multihost_utils.process_allgather(np.array(needs, np.int64)).tolist()
            needs = [max(int(x) for x in column) for column in zip(*everyone)]
        if self.fixed_capacity is not None:
            over = [n for n in needs if n > self.fixed_capacity]
            if over and self.overflow == "error":
                raise CapacityError(self._overflow_message(needs, local_needs, routed))
            return [self.fixed_capacity] * len(needs)
        # The pipeline's worker thread may grow capacities while a step packs a
        # batch inline: each batch gets capacities computed from its own needs
        # (never re-read from the shared list), and the shared list only grows.
        capacities = [
            c if n <= c else max(ALIGN, 2 ** math.ceil(math.log2(n))) for c, n in zip(list(self.capacities), needs)
        ]
        self.capacities = [max(a, c) for a, c in zip(self.capacities, capacities)]
        return capacities

    def _overflow_message(self, needs: list[int], local_needs: list[int], routed: Routed | None) -> str:
        """Why a batch does not fit the fixed capacity: the fullest (source device, destination) pair."""
        C = self.fixed_capacity
        fits = -(-max(needs) // ALIGN) * ALIGN
        advice = (
            f"pass capacity={fits} (or more) to tpurec.shard, or overflow='drop' to drop the extra entries "
            "(counted in dropped_entries())"
        )
        j = int(np.argmax(local_needs)) if local_needs else 0
        if routed is None or not local_needs or local_needs[j] <= C:
            # The fullest pair is on another process: its own error names it.
            return (
                f"a device of another process sends up to {max(needs)} entries to one shard this step but "
                f"capacity={C}; {advice}"
            )
        key, _, _, _, _, counts, destinations = routed.groups[j]
        pair = int(np.argmax(counts))
        source = self.first_device + pair // destinations
        codes = routed.features[j][key == pair]
        share = np.bincount(codes, minlength=len(self.features))
        parts = [
            f"table '{self.features[c][0]}' feature '{self.features[c][1]}' ({int(share[c])})"
            for c in np.argsort(-share, kind="stable")
            if share[c]
        ]
        if j < len(self.layout.groups):
            where = f"device {source} sends {int(counts[pair])} entries to the shard on device {pair % destinations}"
        else:
            where = f"device {source} looks up {int(counts[pair])} entries in its data-parallel replica"
        return f"{where} this step but capacity={C}: {', '.join(parts)}; {advice}"

    def to_global(self, local: np.ndarray) -> jax.Array:
        """This process's ``[local devices, ...]`` entries as a global array sharded on the mesh."""
        if jax.process_count() == 1:
            return jax.device_put(local, self.sharding)
        return jax.make_array_from_process_local_data(self.sharding, local)
