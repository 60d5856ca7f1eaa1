"""TorchRec sharding plans -> per-table shard specs on a device mesh.

A TorchRec ``ParameterSharding`` names a sharding type, the ranks holding the
table and (except for data parallel) one ``ShardMetadata`` per shard: row and
column offsets and sizes and a placement ``rank:<r>/<device>``. Rank ``r`` is
position ``r`` of the mesh's devices in row-major order.

Every check runs here, before a module is touched, so a bad plan changes no
state: unknown sharding types, ranks outside the mesh, tables of the plan that
the model does not have, tables of the model without a plan entry, and shards
that do not tile their table.

Example::

    specs = table_shardings(ebc.embedding_bag_configs(), module_plan, num_devices=8)
    specs["t0"].pieces   # (ShardPiece(table="t0", row_offset=0, rows=100, ...),)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from torchrec.modules.embedding_configs import EmbeddingBagConfig

from tpurec.sparse.sharding_plan.sharding_types import DATA_PARALLEL, SHARDING_TYPES

__all__ = ["SHARDING_TYPES", "ShardPiece", "TableSharding", "table_shardings", "module_plans"]


@dataclasses.dataclass(frozen=True)
class ShardPiece:
    """One shard of a table: a block of rows and columns on one mesh device.

    Args:
        table: table name.
        row_offset: first row of the table in this shard.
        rows: rows in the shard.
        col_offset: first column of the table in this shard.
        cols: columns in the shard.
        device: position of the owning device in the mesh (the plan's rank).
    """

    table: str
    row_offset: int
    rows: int
    col_offset: int
    cols: int
    device: int


@dataclasses.dataclass(frozen=True)
class TableSharding:
    """How one table is laid out on the mesh.

    Args:
        table: table name.
        sharding_type: one of :data:`SHARDING_TYPES`.
        pieces: its shards (empty for ``data_parallel``: a copy on every device).
    """

    table: str
    sharding_type: str
    pieces: tuple[ShardPiece, ...]


def _value(x: Any) -> str:
    return getattr(x, "value", x)


def _rank_of(placement: Any, table: str) -> int:
    """The rank of a ``ShardMetadata.placement`` (``_remote_device`` or ``"rank:r/dev"``)."""
    rank = getattr(placement, "rank", None)
    if callable(rank):
        r: Any = rank()
        if r is not None:
            return int(r)
    text = str(placement)
    if text.startswith("rank:"):
        try:
            return int(text[len("rank:") :].split("/", 1)[0])
        except ValueError:
            pass
    raise ValueError(f"table '{table}': shard placement {text!r} names no rank (expected 'rank:<r>/<device>')")


def table_shardings(
    configs: Sequence[EmbeddingBagConfig], module_plan: Mapping[str, Any], num_devices: int
) -> dict[str, TableSharding]:
    """Reads one module's plan into :class:`TableSharding` per table, checking it.

    Args:
        configs: the module's table configs.
        module_plan: table name -> torchrec ``ParameterSharding`` (an
            ``EmbeddingModuleShardingPlan``).
        num_devices: devices of the mesh (valid ranks are ``[0, num_devices)``).

    Returns:
        table name -> :class:`TableSharding`, in the order of ``configs``.

    Raises:
        ValueError: the plan names a table the module lacks, misses one of its
            tables, uses an unknown sharding type, places a shard outside the
            mesh, or has shards that do not tile the table exactly.
    """
    by_name = {c.name: c for c in configs}
    extra = [name for name in module_plan if name not in by_name]
    if extra:
        raise ValueError(
            f"the plan shards tables {extra} that the module does not have (its tables: {sorted(by_name)})"
        )
    missing = [name for name in by_name if name not in module_plan]
    if missing:
        raise ValueError(
            f"the plan has no entry for tables {missing} of the module; give every table a sharding "
            "(data_parallel keeps a copy on every device)"
        )
    out: dict[str, TableSharding] = {}
    for name, cfg in by_name.items():
        ps = module_plan[name]
        kind = _value(getattr(ps, "sharding_type", None))
        if kind not in SHARDING_TYPES:
            raise ValueError(f"table '{name}': unknown sharding type {kind!r}; tpurec runs {list(SHARDING_TYPES)}")
        ranks = list(getattr(ps, "ranks", None) or [])
        bad = [r for r in ranks if not 0 <= int(r) < num_devices]
        if bad:
            raise ValueError(
                f"table '{name}' ({kind}) is placed on ranks {bad} outside the mesh of {num_devices} devices "
                f"(valid ranks: 0..{num_devices - 1}); plan for this mesh's device count"
            )
        if kind == DATA_PARALLEL:
            out[name] = TableSharding(name, kind, ())
            continue
        spec = getattr(ps, "sharding_spec", None)
        shards = getattr(spec, "shards", None)
        if not shards:
            raise ValueError(f"table '{name}' ({kind}) has no shard metadata in its plan entry")
        pieces = []
        for md in shards:
            rank = _rank_of(md.placement, name)
            if not 0 <= rank < num_devices:
                raise ValueError(
                    f"table '{name}' ({kind}) has a shard on rank {rank}, outside the mesh of {num_devices} devices "
                    f"(valid ranks: 0..{num_devices - 1}); plan for this mesh's device count"
                )
            (r0, c0), (nr, nc) = md.shard_offsets, md.shard_sizes
            if (nr == 0 or nc == 0) and 0 <= r0 <= cfg.num_embeddings and 0 <= c0 <= cfg.embedding_dim:
                continue  # an empty shard (torchrec's row-wise split of a small table): nothing to hold
            if nr < 0 or nc < 0 or r0 < 0 or c0 < 0 or r0 + nr > cfg.num_embeddings or c0 + nc > cfg.embedding_dim:
                raise ValueError(
                    f"table '{name}' ({kind}): shard at offsets {[r0, c0]} of size {[nr, nc]} is outside the table "
                    f"[{cfg.num_embeddings}, {cfg.embedding_dim}]"
                )
            pieces.append(ShardPiece(name, int(r0), int(nr), int(c0), int(nc), rank))
        _check_tiling(name, kind, pieces, cfg)
        out[name] = TableSharding(name, kind, tuple(pieces))
    return out


def _check_tiling(name: str, kind: str, pieces: list[ShardPiece], cfg: EmbeddingBagConfig) -> None:
    """Shards must form a grid of row blocks x column blocks covering the table once."""
    row_starts = sorted({p.row_offset for p in pieces})
    col_starts = sorted({p.col_offset for p in pieces})
    rows_of = {p.row_offset: p.rows for p in pieces}
    cols_of = {p.col_offset: p.cols for p in pieces}
    grid = {(p.row_offset, p.col_offset) for p in pieces}
    consistent = all(rows_of[p.row_offset] == p.rows and cols_of[p.col_offset] == p.cols for p in pieces)
    rows_tile = row_starts[0] == 0 and all(a + rows_of[a] == b for a, b in zip(row_starts, row_starts[1:]))
    rows_tile = rows_tile and row_starts[-1] + rows_of[row_starts[-1]] == cfg.num_embeddings
    cols_tile = col_starts[0] == 0 and all(a + cols_of[a] == b for a, b in zip(col_starts, col_starts[1:]))
    cols_tile = cols_tile and col_starts[-1] + cols_of[col_starts[-1]] == cfg.embedding_dim
    if not (consistent and rows_tile and cols_tile and len(grid) == len(pieces) == len(row_starts) * len(col_starts)):
        raise ValueError(
            f"table '{name}' ({kind}): its shards do not tile the [{cfg.num_embeddings}, {cfg.embedding_dim}] table "
            f"exactly once as a grid of row and column blocks: {[(p.row_offset, p.rows, p.col_offset, p.cols) for p in pieces]}"
        )


def module_plans(plan: Any) -> dict[str, Mapping[str, Any]]:
    """Module path -> table plan, from a torchrec ``ShardingPlan`` or a mapping.

    Args:
        plan: a ``ShardingPlan`` (``plan.plan``), a mapping of module paths to
            ``EmbeddingModuleShardingPlan``, or one ``EmbeddingModuleShardingPlan``
            (table name -> ``ParameterSharding``) for a model that is itself an
            EmbeddingBagCollection (path ``""``).
    """
    inner = getattr(plan, "plan", plan)
    if not isinstance(inner, Mapping):
        raise TypeError(f"plan must be a torchrec ShardingPlan or a mapping, got {type(plan).__name__}")
    values = list(inner.values())
    if values and all(hasattr(v, "sharding_type") for v in values):
        return {"": inner}
    return dict(inner)
