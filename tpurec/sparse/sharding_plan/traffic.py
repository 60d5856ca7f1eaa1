"""Bytes each device sends per training step to distribute a plan's inputs and outputs.

Where :class:`~tpurec.sparse.planner.estimators.TpuCostModel` turns traffic
into time, this module counts the traffic itself, collective by collective, as
``tpurec.shard`` runs a plan (docs/design.md, contract 6: "Distributed = JAX's
runtime"):

* input distribution: one ``all_to_all`` per sharding group moves every id
  (with its sample id and gain, ``id_bytes`` in all) from the device whose
  local batch holds it to the shard(s) owning its row;
* output distribution, forward: table- and column-wise shards return pooled
  rows to the batch owners with ``all_to_all``; row-wise tables with one
  shard on every device combine partial sums with ``psum_scatter``
  (reduce-scatter); other row groups (table-row-wise) send each shard's
  partial sums with ``all_to_all``;
* output gradients, backward: the transposed collectives (``all_to_all``
  back to the shards; ``all_gather`` for row-wise);
* data-parallel tables: every replica all-gathers the batch's entries and
  pooled gradients and applies the same update (``data_parallel_grad=
  "all_reduce"`` counts TorchRec's dense ring all-reduce instead:
  ``2 (P-1)/P`` of the table per device).

Counts are payload bytes a device sends to *other* devices (the chunk it keeps
is free), with ids at their expected count (``capacity_factor`` scales them
to the padded static capacity the program really ships). Ids are assumed
uniform over rows, as the cost model assumes.

Two counts answer two questions, so both exist:

* :func:`distribution_bytes` (and :func:`options_distribution_bytes` for
  the planner's own sharding options): the *payload*, from the plan alone;
  what the planner's report compares plans by, and what a SparseCore
  runtime that ships only real ids would move;
* :func:`executed_distribution_bytes`: the *buffers* ``tpurec.shard``'s
  programs move, padding included, read from the very :class:`Layout` the
  executor builds (ids padded to a static capacity, pooled rows in as many
  slots as the busiest device owns); it equals what :func:`hlo_collectives`
  reads from the compiled program.

Both read tables and sharding types the same way (``_specs_by_name`` and
:mod:`tpurec.sparse.sharding_plan.sharding_types`); only the arithmetic, payload
versus padded buffers, differs.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Sequence, Union, cast

from torchrec.distributed.planner.types import ShardingOption
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, EmbeddingBagConfig

from tpurec.sparse.sharding_plan.layout import Layout
from tpurec.sparse.sharding_plan.sharding_types import DATA_PARALLEL, OWNER_SHARDED, ROW_SHARDED, SHARDING_TYPES
from tpurec.sparse.sharding_plan.shards import table_shardings
from tpurec.sparse.sharding_plan.tables import TableSpec, as_table_spec

__all__ = [
    "DistributionBytes",
    "HloCollective",
    "PlanDistributionBytes",
    "TablePlacement",
    "distribution_bytes",
    "executed_distribution_bytes",
    "hlo_collectives",
    "options_distribution_bytes",
    "placement_distribution_bytes",
]

_DP = DATA_PARALLEL
_ROW_SHARDED = ROW_SHARDED
_OWNER_SHARDED = OWNER_SHARDED
ROW_WISE_OUTPUTS = ("psum_scatter", "sparse")
DATA_PARALLEL_GRADS = ("all_gather", "all_reduce")


@dataclass
class DistributionBytes:
    """Bytes each device sends per step, by collective; lists are indexed by rank.

    Args:
        input_ids: forward ``all_to_all`` of ids (+ sample ids and gains).
        output: forward pooled rows to the batch owners (``all_to_all``) or
            row-wise partial sums (``psum_scatter``).
        output_grad: backward, the output gradients back to the shards.
        dense_grad: data-parallel tables' gradient exchange (all-gather of
            entries and pooled gradients as ``tpurec.shard`` runs it, or a
            dense all-reduce).
    """

    input_ids: List[float]
    output: List[float]
    output_grad: List[float]
    dense_grad: List[float]

    @classmethod
    def zeros(cls, world_size: int) -> "DistributionBytes":
        """All-zero counts for ``world_size`` devices."""
        return cls(*([0.0] * world_size for _ in range(4)))

    def add_(self, other: "DistributionBytes") -> "DistributionBytes":
        """Adds ``other`` in place; returns self."""
        for name in ("input_ids", "output", "output_grad", "dense_grad"):
            mine, theirs = getattr(self, name), getattr(other, name)
            for r, b in enumerate(theirs):
                mine[r] += b
        return self

    @property
    def per_device(self) -> List[float]:
        """Input plus output distribution (both directions) per device, bytes."""
        return [a + b + c for a, b, c in zip(self.input_ids, self.output, self.output_grad)]

    @property
    def max_per_device(self) -> float:
        """The busiest device's input + output distribution bytes."""
        return max(self.per_device, default=0.0)

    def summary(self) -> Dict[str, float]:
        """Busiest device's bytes per collective kind, and of all distribution."""
        return {
            "input_ids": max(self.input_ids, default=0.0),
            "output": max(self.output, default=0.0),
            "output_grad": max(self.output_grad, default=0.0),
            "dense_grad": max(self.dense_grad, default=0.0),
            "distribution_max_per_device": self.max_per_device,
        }


@dataclass
class PlanDistributionBytes:
    """A plan's distribution bytes: in total, per sharding group, per table.

    Args:
        total: all tables together.
        by_sharding_type: per sharding group (one set of collectives each).
        tables: per table.
    """

    total: DistributionBytes
    by_sharding_type: Dict[str, DistributionBytes] = field(default_factory=dict)
    tables: Dict[str, DistributionBytes] = field(default_factory=dict)


@dataclass
class TablePlacement:
    """Where one table's shards live, and what it is fed.

    Args:
        name: table name.
        sharding_type: TorchRec sharding type value.
        rows: rows of the whole table.
        dim: columns of the whole table.
        pooling_factors: ids per sample of each feature looked up in it.
        shard_ranks: rank of each shard (every rank for data-parallel).
        shard_dims: columns of each shard.
    """

    name: str
    sharding_type: str
    rows: int
    dim: int
    pooling_factors: List[float]
    shard_ranks: List[int]
    shard_dims: List[int]


def placement_distribution_bytes(
    table: TablePlacement,
    world_size: int,
    batch_size: float,
    id_bytes: int = 12,
    grad_bytes: int = 4,
    capacity_factor: float = 1.0,
    row_wise_output: str = "psum_scatter",
    data_parallel_grad: str = "all_gather",
) -> DistributionBytes:
    """Bytes each device sends per step for one table.

    Args:
        table: the table's placement.
        world_size: devices in the mesh.
        batch_size: GLOBAL batch (each device owns ``batch_size / world_size``).
        id_bytes: bytes per distributed id (int32 id, int32 sample id, f32 gain).
        grad_bytes: bytes per element of pooled outputs and their gradients.
        capacity_factor: static id capacity over expected ids.
        row_wise_output: ``"psum_scatter"`` (dense reduce-scatter of every
            sample's partial sum, what ``tpurec.shard`` runs) or ``"sparse"``
            (only the samples a shard's rows are hit by, with a 4-byte index
            each, as SparseCores combine them and the cost model assumes).
            Table-row-wise groups (and row-wise tables not on every device)
            return partial sums with ``all_to_all``, as ``tpurec.shard`` does.
        data_parallel_grad: ``"all_gather"`` (every replica gathers the
            batch's entries and pooled gradients, what ``tpurec.shard`` runs)
            or ``"all_reduce"`` (ring all-reduce of the dense table gradient,
            TorchRec's data parallelism, which the cost model prices).

    Returns:
        Per-rank bytes.

    Raises:
        ValueError: unknown sharding type, ``row_wise_output`` or
            ``data_parallel_grad``, or a rank outside the mesh.
    """
    if row_wise_output not in ROW_WISE_OUTPUTS:
        raise ValueError(f"row_wise_output must be one of {ROW_WISE_OUTPUTS}, got {row_wise_output!r}")
    if data_parallel_grad not in DATA_PARALLEL_GRADS:
        raise ValueError(f"data_parallel_grad must be one of {DATA_PARALLEL_GRADS}, got {data_parallel_grad!r}")
    w = world_size
    out = DistributionBytes.zeros(w)
    bad = [r for r in table.shard_ranks if not 0 <= r < w]
    if bad:
        raise ValueError(f"table {table.name!r}: ranks {bad} are outside a mesh of {w} devices")
    local_batch = batch_size / w
    features = len(table.pooling_factors)
    local_ids = local_batch * sum(table.pooling_factors) * capacity_factor
    st = table.sharding_type
    if st == _DP:
        for r in range(w):
            if data_parallel_grad == "all_gather":
                # tpurec.shard: every replica all-gathers the batch's entries
                # and pooled gradients and applies the same sparse update.
                out.dense_grad[r] = (w - 1) * (local_ids * id_bytes + local_batch * features * table.dim * grad_bytes)
            else:
                # Ring all-reduce of the whole gradient: 2 (P-1)/P of it per device.
                out.dense_grad[r] = 2.0 * (w - 1) / w * table.rows * table.dim * grad_bytes
        return out
    if st in _OWNER_SHARDED:
        for owner, shard_dim in zip(table.shard_ranks, table.shard_dims):
            # Every id of the table's features reaches every shard owner
            # (column shards all need every id).
            for d in range(w):
                if d != owner:
                    out.input_ids[d] += local_ids * id_bytes
                    # Backward: each batch owner returns its rows' gradients.
                    out.output_grad[d] += local_batch * features * shard_dim * grad_bytes
            # Forward: the owner sends every other device its samples' rows.
            out.output[owner] += (batch_size - local_batch) * features * shard_dim * grad_bytes
        return out
    if st in _ROW_SHARDED:
        group = sorted(set(table.shard_ranks))
        g = len(group)
        dim = max(table.shard_dims) if table.shard_dims else table.dim
        for d in range(w):
            # MOD sharding spreads ids evenly over the group; ids for the
            # device's own shard stay put.
            out.input_ids[d] += local_ids * id_bytes * ((g - 1) / g if d in group else 1.0)
        row = features * dim * grad_bytes
        # tpurec.shard reduce-scatters only row-wise tables with one full-width
        # shard on every device; other row groups (table-row-wise) return each
        # shard's partial sums to the batch owners with all_to_all.
        reduce_scatter = g == w and len(table.shard_ranks) == w
        for d in group:
            if row_wise_output == "psum_scatter" and reduce_scatter:
                # Reduce-scatter of a [batch, features * dim] partial-sum
                # buffer over the mesh: each device sends (w-1)/w of it.
                fwd = (w - 1) / w * batch_size * row
                bwd = fwd  # its transpose, all_gather, sends as much
            elif row_wise_output == "psum_scatter":
                fwd = (batch_size - local_batch) * row
                bwd = 0.0  # counted below, at the batch owners that send
            else:
                hit = sum(
                    batch_size * (1.0 - (1.0 - 1.0 / g) ** pf) if g > 1 else batch_size for pf in table.pooling_factors
                )
                fwd = hit * (w - 1) / w * (dim * grad_bytes + 4)
                bwd = fwd
            out.output[d] += fwd
            out.output_grad[d] += bwd
        if row_wise_output == "psum_scatter" and not reduce_scatter:
            # Backward all_to_all: each batch owner returns its samples'
            # gradients to every shard on another device.
            for d in range(w):
                others = sum(1 for s in table.shard_ranks if s != d)
                out.output_grad[d] += others * local_batch * row
        return out
    raise ValueError(
        f"table {table.name!r}: sharding type {st!r} is not one tpurec runs; choose from {list(SHARDING_TYPES)}"
    )


def _sum_placements(
    placements: Sequence[TablePlacement], world_size: int, batch_size: float, **kwargs: Any
) -> PlanDistributionBytes:
    result = PlanDistributionBytes(DistributionBytes.zeros(world_size))
    for p in placements:
        b = placement_distribution_bytes(p, world_size, batch_size, **kwargs)
        result.tables[p.name] = b
        result.total.add_(b)
        group = result.by_sharding_type.setdefault(p.sharding_type, DistributionBytes.zeros(world_size))
        group.add_(b)
    return result


def placements_from_options(options: Sequence[ShardingOption]) -> List[TablePlacement]:
    """Table placements of TorchRec sharding options (shards with ranks)."""
    placements = []
    for o in options:
        placements.append(
            TablePlacement(
                name=o.name,
                sharding_type=o.sharding_type,
                rows=int(o.tensor.shape[0]),
                dim=int(o.tensor.shape[1]),
                pooling_factors=[float(x) for x in o.input_lengths],
                shard_ranks=[int(s.rank) for s in o.shards if s.rank is not None],
                shard_dims=[int(s.size[1]) for s in o.shards if s.rank is not None],
            )
        )
    return placements


TableLike = Union[TableSpec, BaseEmbeddingConfig, Dict[str, Any]]


def _specs_by_name(tables: Union[Sequence[TableLike], Mapping[str, TableLike]]) -> Dict[str, TableSpec]:
    """The planned tables by name, whether given as a list or a mapping (both counts read them so)."""
    if isinstance(tables, Mapping):
        return {name: as_table_spec(t) for name, t in tables.items()}
    return {s.name: s for s in (as_table_spec(t) for t in tables)}


def distribution_bytes(
    sharding_plan: ShardingPlan,
    tables: Union[Sequence[TableLike], Mapping[str, TableLike]],
    world_size: int,
    batch_size: int,
    *,
    id_bytes: int = 12,
    grad_bytes: int = 4,
    capacity_factor: float = 1.0,
    row_wise_output: str = "psum_scatter",
    data_parallel_grad: str = "all_gather",
) -> PlanDistributionBytes:
    """Bytes each device sends per training step to run ``sharding_plan``.

    Args:
        sharding_plan: a TorchRec plan (from :func:`plan`, :func:`load_plan`
            or TorchRec's planner).
        tables: the planned tables (:class:`TableSpec`, TorchRec configs or
            dicts; TorchRec configs count 1 id per sample and feature), by
            name or as a list.
        world_size: devices in the mesh.
        batch_size: GLOBAL batch size.
        id_bytes: bytes per distributed id (id, sample id, gain).
        grad_bytes: bytes per element of pooled outputs and gradients.
        capacity_factor: static id capacity over expected ids (the program
            pads id buffers to it).
        row_wise_output: see :func:`placement_distribution_bytes`.
        data_parallel_grad: see :func:`placement_distribution_bytes`.

    Returns:
        Totals, per sharding group and per table; lists are per rank.

    Raises:
        ValueError: a planned table is missing from ``tables``, a rank lies
            outside the mesh, or a sharding type is unknown.

    Example::

        sp, report = plan(load_tables("examples/planner/mlperf_dlrm_dcnv2.json"), "v6e-64", 55296)
        comm = distribution_bytes(sp, load_tables("examples/planner/mlperf_dlrm_dcnv2.json"), 64, 55296)
        comm.total.max_per_device  # bytes the busiest device sends per step
    """
    specs = _specs_by_name(tables)
    placements: List[TablePlacement] = []
    for module_path, module_plan in sharding_plan.plan.items():
        for name, ps in module_plan.items():  # type: ignore[attr-defined]
            spec = specs.get(name)
            if spec is None:
                raise ValueError(
                    f"plan table {name!r} (module {module_path!r}) is not among the tables given "
                    f"({sorted(specs)}); pass every planned table"
                )
            pfs = [float(spec.pooling_factor)] * len(spec.features())
            if ps.sharding_type == _DP or ps.sharding_spec is None:
                ranks = list(ps.ranks) if ps.ranks else list(range(world_size))
                dims = [spec.embedding_dim] * len(ranks)
            else:
                shards = ps.sharding_spec.shards  # type: ignore[attr-defined]
                ranks = [int(s.placement.rank()) for s in shards]
                dims = [int(s.shard_sizes[1]) for s in shards]
            placements.append(
                TablePlacement(name, ps.sharding_type, spec.num_embeddings, spec.embedding_dim, pfs, ranks, dims)
            )
    return _sum_placements(
        placements,
        world_size,
        float(batch_size),
        id_bytes=id_bytes,
        grad_bytes=grad_bytes,
        capacity_factor=capacity_factor,
        row_wise_output=row_wise_output,
        data_parallel_grad=data_parallel_grad,
    )


def options_distribution_bytes(
    options: Sequence[ShardingOption],
    world_size: int,
    batch_size: float,
    id_bytes: int = 12,
    grad_bytes: int = 4,
    row_wise_output: str = "psum_scatter",
    data_parallel_grad: str = "all_gather",
) -> PlanDistributionBytes:
    """:func:`distribution_bytes` of TorchRec sharding options (the planner's own result)."""
    return _sum_placements(
        placements_from_options(options),
        world_size,
        batch_size,
        id_bytes=id_bytes,
        grad_bytes=grad_bytes,
        row_wise_output=row_wise_output,
        data_parallel_grad=data_parallel_grad,
    )


# ---- what a compiled program's collectives move (from its HLO) ------------ #

_HLO_ELEM_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_HLO_COLLECTIVES = ("all-to-all", "reduce-scatter", "all-gather", "all-reduce", "collective-permute")
_HLO_LINE = re.compile(
    r"=\s*(?P<shape>\(.*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+(?P<op>"
    + "|".join(_HLO_COLLECTIVES)
    + r")(?:-start)?\("
)
_HLO_ARRAY = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")


@dataclass
class HloCollective:
    """One collective of an HLO module.

    Args:
        kind: ``all-to-all``, ``reduce-scatter``, ``all-gather``,
            ``all-reduce`` or ``collective-permute``.
        result_bytes: bytes of its result on one device.
        group_size: devices in each of its replica groups.
        sent_bytes: bytes one device sends to others (optimal algorithm:
            all-to-all and reduce-scatter send all but the kept chunk,
            all-gather sends its chunk to every other member, all-reduce is a
            reduce-scatter plus an all-gather).
    """

    kind: str
    result_bytes: int
    group_size: int
    sent_bytes: float


def _shape_bytes(shape: str) -> int:
    total = 0
    for dtype, dims in _HLO_ARRAY.findall(shape):
        if dtype not in _HLO_ELEM_BYTES:
            continue  # tokens, opaque
        n = 1
        for d in dims.split(","):
            if d:
                n *= int(d)
        total += n * _HLO_ELEM_BYTES[dtype]
    return total


def _group_size(line: str, num_devices: int) -> int:
    m = re.search(r"replica_groups=\{(\{[0-9,]*\})", line)
    if m:
        members = [x for x in m.group(1).strip("{}").split(",") if x]
        return len(members) or num_devices
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=", line)
    if m:
        # Iota form [groups, size]<=[...]: the last dimension is the group size.
        return int(m.group(1).split(",")[-1])
    return num_devices


def hlo_collectives(hlo_text: str, num_devices: int) -> List[HloCollective]:
    """The collectives written in an HLO module's text, with the bytes each device sends.

    Use the HLO of the lowered program (``jax.jit(f).lower(...).as_text(dialect="hlo")``):
    it holds the collectives the program asks for on every backend (XLA:CPU
    later rewrites some, TPU keeps them). A collective inside a loop body is
    counted once.

    Args:
        hlo_text: HLO module text.
        num_devices: devices of the program (for collectives without
            explicit replica groups).

    Returns:
        The collectives in program order.

    Example::

        text = jax.jit(step).lower(*args).as_text(dialect="hlo")
        sum(c.sent_bytes for c in hlo_collectives(text, 8) if c.kind == "all-to-all")
    """
    found = []
    for line in hlo_text.splitlines():
        m = _HLO_LINE.search(line)
        if not m:
            continue
        kind = m.group("op")
        size = _shape_bytes(m.group("shape"))
        n = _group_size(line, num_devices)
        frac = (n - 1) / n if n > 0 else 0.0
        if kind in ("all-to-all", "all-gather"):
            sent = size * frac
        elif kind == "reduce-scatter":
            sent = size * (n - 1)
        elif kind == "all-reduce":
            sent = 2.0 * size * frac
        else:
            sent = float(size)
        found.append(HloCollective(kind, size, n, sent))
    return found


# ---- what tpurec.shard's programs send, static buffers included ----------- #

_ALIGN = 8  # tpurec.shard rounds id capacities up to a multiple of 8


def executed_distribution_bytes(
    sharding_plan: ShardingPlan,
    tables: Union[Sequence[TableLike], Mapping[str, TableLike]],
    world_size: int,
    batch_size: int,
    *,
    capacity: Union[int, None] = None,
    capacity_factor: float = 1.0,
    id_bytes: int = 12,
    grad_bytes: int = 4,
) -> Dict[str, float]:
    """Bytes every device sends per step in ``tpurec.shard``'s programs, padding included.

    Read from the :class:`tpurec.sparse.sharding.Layout` that ``tpurec.shard``
    builds for the plan: shards are laid out in groups of equal width; each
    group's collectives move static buffers: ids in ``[devices, capacity]``
    blocks to every device, pooled rows in ``[devices, slots, batch, width]``
    blocks with as many slots as the busiest device owns, row-wise tables
    with one full-width shard per device by ``psum_scatter`` (``all_gather``
    back); data-parallel tables of one width all-gather their entries and
    pooled gradients. The programs are SPMD, so every device sends the same.
    :func:`distribution_bytes` counts the payload; this counts the buffers.

    Args:
        sharding_plan: the plan (one module's tables are laid out together).
        tables: the planned tables (as for :func:`distribution_bytes`).
        world_size: devices in the mesh.
        batch_size: GLOBAL batch size.
        capacity: the fixed per-destination id capacity passed to
            ``tpurec.shard`` (rounded up to a multiple of 8 as it does); None:
            the expected ids of the busiest destination times
            ``capacity_factor``, rounded up to a power of two as
            ``tpurec.shard`` grows it.
        capacity_factor: margin over the expected ids when ``capacity`` is None.
        id_bytes: bytes per id entry (row, sample, gain).
        grad_bytes: bytes per pooled element.

    Returns:
        Bytes per device by collective: ``ids_all_to_all``,
        ``output_all_to_all``, ``output_psum_scatter``, ``grad_all_to_all``,
        ``grad_all_gather``, ``data_parallel_all_gather``, and ``total``.

    Raises:
        ValueError: a planned table is missing from ``tables``, or the plan
            has several modules (pass one module's plan at a time).
    """
    specs = _specs_by_name(tables)
    if len(sharding_plan.plan) != 1:
        raise ValueError(
            f"the plan has {len(sharding_plan.plan)} modules; each module is laid out on its own, "
            f"pass one module's plan at a time"
        )
    (module_plan,) = sharding_plan.plan.values()
    d, b = world_size, batch_size / world_size

    def rounded(need: float) -> int:
        if capacity is not None:
            # A fixed capacity is rounded up to a multiple of 8.
            return max(_ALIGN, -(-int(capacity) // _ALIGN) * _ALIGN)
        # Grown on demand: the next power of two (at least 8).
        return max(_ALIGN, 2 ** math.ceil(math.log2(max(need * capacity_factor, 1.0))))

    # The layout tpurec.shard builds for this plan.
    for name in module_plan:  # type: ignore[attr-defined]
        if name not in specs:
            raise ValueError(f"plan table {name!r} is not among the tables given ({sorted(specs)})")
    configs = [
        EmbeddingBagConfig(
            num_embeddings=specs[n].num_embeddings,
            embedding_dim=specs[n].embedding_dim,
            name=n,
            feature_names=specs[n].features(),
        )
        for n in module_plan  # type: ignore[attr-defined]
    ]
    layout = Layout(configs, table_shardings(configs, cast(Mapping[str, Any], module_plan), d), d)
    # Expected ids per device and step, uniform over each table's rows.
    local_ids = {n: b * specs[n].pooling_factor * len(specs[n].features()) for n in specs}
    out = {
        k: 0.0
        for k in (
            "ids_all_to_all",
            "output_all_to_all",
            "output_psum_scatter",
            "grad_all_to_all",
            "grad_all_gather",
            "data_parallel_all_gather",
        )
    }
    for grp in layout.groups:
        ids = [0.0] * d
        for piece in grp.offsets:
            ids[piece.device] += local_ids[piece.table] * piece.rows / specs[piece.table].num_embeddings
        cap, a2a, rs = rounded(max(ids)), grp.num_a2a, len(grp.rs_slots)
        out["ids_all_to_all"] += (d - 1) * cap * id_bytes
        out["output_all_to_all"] += (d - 1) * a2a * b * grp.width * grad_bytes
        out["grad_all_to_all"] += (d - 1) * a2a * b * grp.width * grad_bytes
        out["output_psum_scatter"] += (d - 1) * rs * b * grp.width * grad_bytes
        out["grad_all_gather"] += (d - 1) * rs * b * grp.width * grad_bytes
    for dg in layout.dp_groups:
        cap = rounded(sum(local_ids[t] for t in dg.offsets))
        out["data_parallel_all_gather"] += (d - 1) * (cap * id_bytes + len(dg.slots) * b * dg.width * grad_bytes)
    out["total"] = sum(out.values())
    return out
