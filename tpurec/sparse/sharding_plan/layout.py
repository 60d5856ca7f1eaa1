"""Where every shard lives on each device, and where its pooled rows go.

Shards of equal width share one local stack per device: a global
``[devices * rows_per_device, width]`` array sharded on its first axis, so
one lookup kernel and one pair of collectives serve every table of that width
(a "group"). Data-parallel tables of equal dim share one replicated stack.
Tables of different *kinds* (``Layout(kinds=...)``: the quantized collection's bits per value,
whose stored rows differ for one width) never share a stack.

Each device's lookup writes its pooled rows into output *slots*: slot ``k``
of a group holds one (shard, feature) pair's ``[batch_per_device, width]``
rows for every source device, so the kernel's output row of an entry is
``(source * slots + k) * batch_per_device + sample``. The first
``a2a_slots`` slots return to the batch owners with ``all_to_all``; the rest
(row-wise tables, at most one full-width shard per device; a device without
one adds zeros) with ``psum_scatter``. The batch owner then adds the received blocks into its
``[batch_per_device, sum of dims]`` output through one static column map
(``dest_columns``); its transpose is the gather that sends gradients back.
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Mapping, Sequence

import numpy as np
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from tpurec.sparse.sharding_plan.sharding_types import DATA_PARALLEL
from tpurec.sparse.sharding_plan.shards import ShardPiece, TableSharding

__all__ = ["Group", "DataParallelGroup", "TableRouting", "Layout"]

_ROW_ALIGNMENT = 8


def _round_up(n: int, to: int = _ROW_ALIGNMENT) -> int:
    return max(to, -(-n // to) * to)


@dataclasses.dataclass
class Group:
    """Sharded (non data-parallel) shards of one width and kind.

    Attributes:
        width: columns of every shard in the group.
        rows_per_device: rows of each device's local stack (padded).
        offsets: shard -> first row in its device's local stack.
        a2a_slots: per device, its (shard, feature) output slots returned by all_to_all.
        rs_slots: (table, feature) slots returned by psum_scatter (same on every device).
        kind: the kind of its tables (``Layout``'s ``kinds``; None by default).
    """

    width: int
    rows_per_device: int = 0
    offsets: dict[ShardPiece, int] = dataclasses.field(default_factory=dict)
    a2a_slots: list[list[tuple[ShardPiece, str]]] = dataclasses.field(default_factory=list)
    rs_slots: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    kind: Hashable = None

    @property
    def num_a2a(self) -> int:
        return max((len(s) for s in self.a2a_slots), default=0)

    @property
    def num_slots(self) -> int:
        return self.num_a2a + len(self.rs_slots)


@dataclasses.dataclass
class DataParallelGroup:
    """Data-parallel tables of one dim and kind, stacked and replicated on every device.

    Attributes:
        width: the tables' dim.
        offsets: table -> first row in the stack.
        num_rows: rows of the stack (padded).
        slots: (table, feature) output slots.
        kind: the kind of its tables (``Layout``'s ``kinds``; None by default).
    """

    width: int
    offsets: dict[str, int] = dataclasses.field(default_factory=dict)
    num_rows: int = 0
    slots: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    kind: Hashable = None


@dataclasses.dataclass
class TableRouting:
    """Host-side routing of one sharded table's ids (vectorised over ids).

    For column block ``c`` and row block ``r`` (found with ``searchsorted`` on
    ``row_starts``): the shard is on device ``device[c][r]``, id ``i`` is local
    row ``base[c][r] + i`` there, and feature ``f``'s slot is ``slot[c][f][r]``.
    """

    group_of_block: list[int]
    row_starts: np.ndarray
    device: list[np.ndarray]
    base: list[np.ndarray]
    slot: list[dict[str, np.ndarray]]


class Layout:
    """The static layout of a sharded EmbeddingBagCollection on ``num_devices`` devices.

    Args:
        configs: the tables, in the module's order.
        shardings: table name -> :class:`TableSharding` (see ``table_shardings``).
        num_devices: devices in the mesh.
        kinds: table name -> its kind (default: one kind); only shards of one kind and width
            share a stack.
    """

    def __init__(
        self,
        configs: Sequence[EmbeddingBagConfig],
        shardings: dict[str, TableSharding],
        num_devices: int,
        kinds: Mapping[str, Hashable] | None = None,
    ) -> None:
        self.num_devices = D = num_devices
        kind_of = {cfg.name: None if kinds is None else kinds[cfg.name] for cfg in configs}
        self.configs = list(configs)
        self.shardings = shardings
        # torchrec's output order: tables in order, their features in order, dim columns each.
        # Keyed by (table, feature): a feature looked up in several tables has a block in each.
        self.feature_columns: dict[tuple[str, str], int] = {}
        column = 0
        for cfg in self.configs:
            for f in cfg.feature_names:
                self.feature_columns[(cfg.name, f)] = column
                column += cfg.embedding_dim
        self.total_dim = column

        self.groups: list[Group] = []
        self.dp_groups: list[DataParallelGroup] = []
        group_by_width: dict[tuple[Hashable, int], int] = {}
        dp_by_width: dict[tuple[Hashable, int], int] = {}
        self.dp_group_of: dict[str, int] = {}
        self.reduce_scattered: set[str] = set()
        for cfg in self.configs:
            ts = shardings[cfg.name]
            if ts.sharding_type == DATA_PARALLEL:
                g = dp_by_width.setdefault((kind_of[cfg.name], cfg.embedding_dim), len(self.dp_groups))
                if g == len(self.dp_groups):
                    self.dp_groups.append(DataParallelGroup(cfg.embedding_dim, kind=kind_of[cfg.name]))
                dg = self.dp_groups[g]
                dg.offsets[cfg.name] = dg.num_rows
                dg.num_rows += cfg.num_embeddings
                dg.slots.extend((cfg.name, f) for f in cfg.feature_names)
                self.dp_group_of[cfg.name] = g
                continue
            # Row-wise, at most one full-width shard per device: the partial sums of
            # every device meet at the batch owner with one psum_scatter.
            # A device without a shard adds zeros to the sum.
            if (
                ts.sharding_type == "row_wise"
                and len({p.device for p in ts.pieces}) == len(ts.pieces)
                and all(p.cols == cfg.embedding_dim for p in ts.pieces)
            ):
                self.reduce_scattered.add(cfg.name)
            for p in ts.pieces:
                g = group_by_width.setdefault((kind_of[cfg.name], p.cols), len(self.groups))
                if g == len(self.groups):
                    self.groups.append(Group(p.cols, a2a_slots=[[] for _ in range(D)], kind=kind_of[cfg.name]))
        used = [[0] * D for _ in self.groups]
        for cfg in self.configs:
            ts = shardings[cfg.name]
            for p in ts.pieces:
                g = group_by_width[(kind_of[cfg.name], p.cols)]
                grp = self.groups[g]
                grp.offsets[p] = used[g][p.device]
                used[g][p.device] += p.rows
                if cfg.name not in self.reduce_scattered:
                    grp.a2a_slots[p.device].extend((p, f) for f in cfg.feature_names)
            if cfg.name in self.reduce_scattered:
                grp = self.groups[group_by_width[(kind_of[cfg.name], cfg.embedding_dim)]]
                grp.rs_slots.extend((cfg.name, f) for f in cfg.feature_names)
        for g, grp in enumerate(self.groups):
            grp.rows_per_device = _round_up(max(used[g]))
        for dg in self.dp_groups:
            dg.num_rows = _round_up(dg.num_rows)

        self.placements: dict[str, TableRouting] = {}  # table name -> how its ids are routed
        for cfg in self.configs:
            ts = shardings[cfg.name]
            if ts.sharding_type == DATA_PARALLEL:
                continue
            row_starts = np.array(sorted({p.row_offset for p in ts.pieces}), np.int64)
            col_starts = sorted({p.col_offset for p in ts.pieces})
            by_cell = {(p.row_offset, p.col_offset): p for p in ts.pieces}
            place = TableRouting([], row_starts, [], [], [])
            for c0 in col_starts:
                cells = [by_cell[(int(r0), c0)] for r0 in row_starts]
                g = group_by_width[(kind_of[cfg.name], cells[0].cols)]
                grp = self.groups[g]
                place.group_of_block.append(g)
                place.device.append(np.array([p.device for p in cells], np.int64))
                place.base.append(np.array([grp.offsets[p] - p.row_offset for p in cells], np.int64))
                slots = {}
                for f in cfg.feature_names:
                    if cfg.name in self.reduce_scattered:
                        k = grp.num_a2a + grp.rs_slots.index((cfg.name, f))
                        slots[f] = np.full(len(cells), k, np.int64)
                    else:
                        slots[f] = np.array([grp.a2a_slots[p.device].index((p, f)) for p in cells], np.int64)
                place.slot.append(slots)
            self.placements[cfg.name] = place

        self.dest_columns, self.segments = self._dest_columns()

    def _dest_columns(self) -> tuple[np.ndarray, list[int]]:
        """Output column of every received value, in the order the program lays them out.

        Per group: the all_to_all block ``[devices, a2a slots, width]``, then the
        psum_scatter block ``[rs slots, width]``; then each data-parallel group's
        ``[slots, width]``. Empty (padding) slots point at column ``total_dim``,
        a scratch column the program drops.
        """
        pad = self.total_dim
        parts: list[np.ndarray] = []
        segments: list[int] = []
        span = lambda t, f, c0, w: self.feature_columns[(t, f)] + c0 + np.arange(w)  # noqa: E731
        for grp in self.groups:
            w, K = grp.width, grp.num_a2a
            block = np.full((self.num_devices, K, w), pad, np.int64)
            for s, slots in enumerate(grp.a2a_slots):
                for k, (p, f) in enumerate(slots):
                    block[s, k] = span(p.table, f, p.col_offset, w)
            rs = np.full((len(grp.rs_slots), w), pad, np.int64)
            for j, (t, f) in enumerate(grp.rs_slots):
                rs[j] = span(t, f, 0, w)
            parts += [block.reshape(-1), rs.reshape(-1)]
            segments += [block.size, rs.size]
        for dg in self.dp_groups:
            block = (
                np.stack([span(t, f, 0, dg.width) for t, f in dg.slots])
                if dg.slots
                else np.zeros((0, dg.width), np.int64)
            )
            parts.append(block.reshape(-1))
            segments.append(block.size)
        return (np.concatenate(parts) if parts else np.zeros(0, np.int64)), segments
