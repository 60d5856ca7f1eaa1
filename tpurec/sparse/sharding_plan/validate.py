"""A whole sharding plan checked against a model's tables and a mesh, before anything is sharded.

:func:`validate_plan` matches a TorchRec ``ShardingPlan`` to a model (by
module path) or to a list of tables (by name) and checks every table's entry:
its sharding type is one tpurec runs, its ranks and shard placements lie in
the mesh, and its shards lie inside the table and cover it exactly. The
executor's own reading of one module's plan
(:func:`tpurec.sparse.sharding_plan.shards.table_shardings`) runs last, so a plan that
validates is one ``tpurec.shard`` accepts (its shards tile each table as a
grid of row and column blocks).

Example::

    validate_plan(load_plan("plan.json"), model, num_devices=8)
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Sequence, Tuple, Union

from torch import nn
from torchrec.distributed.types import ParameterSharding, ShardingPlan
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, EmbeddingBagConfig

from tpurec.sparse.sharding_plan.sharding_types import DATA_PARALLEL, SHARDING_TYPES
from tpurec.sparse.sharding_plan.shards import table_shardings
from tpurec.sparse.sharding_plan.tables import TableSpec, as_table_spec

__all__ = ["ROOT_KEY", "TPU_RUNNABLE_SHARDING_TYPES", "TableShapes", "validate_plan"]

ROOT_KEY = "<root>"
"""How plans and messages name the module path ``""`` (a model that is itself a collection)."""

TPU_RUNNABLE_SHARDING_TYPES: Tuple[str, ...] = SHARDING_TYPES
"""The sharding types a plan may hold: those ``tpurec.shard`` runs (the planner's older name)."""

TableShapes = Union[
    nn.Module,
    Sequence[Union[TableSpec, BaseEmbeddingConfig, Dict[str, Any]]],
    Mapping[str, Tuple[int, int]],
]


def _tables_of_module(module: nn.Module) -> Dict[str, Dict[str, Tuple[int, int]]]:
    """``{module path: {table: (rows, dim)}}`` of every embedding collection in ``module``."""
    found: Dict[str, Dict[str, Tuple[int, int]]] = {}
    for path, sub in module.named_modules():
        getter = getattr(sub, "embedding_bag_configs", None) or getattr(sub, "embedding_configs", None)
        if getter is None or not callable(getter):
            continue
        configs: Any = getter()
        found[path] = {c.name: (int(c.num_embeddings), int(c.embedding_dim)) for c in configs}
    return found


def _flat_tables(tables: Any) -> Dict[str, Tuple[int, int]]:
    if isinstance(tables, Mapping):
        out = {}
        for name, shape in tables.items():
            if isinstance(shape, (TableSpec, BaseEmbeddingConfig, dict)):
                spec = as_table_spec(shape)
                out[str(name)] = (spec.num_embeddings, spec.embedding_dim)
            else:
                rows, dim = shape
                out[str(name)] = (int(rows), int(dim))
        return out
    specs = [as_table_spec(t) for t in tables]
    return {s.name: (s.num_embeddings, s.embedding_dim) for s in specs}


def validate_plan(sharding_plan: ShardingPlan, model_tables: TableShapes, num_devices: int) -> None:
    """Check a plan against a model's tables and a mesh; raise before anything changes.

    Checks that every sharding type is one tpurec runs, every rank and shard
    placement lies in ``[0, num_devices)``, every table of the model is
    planned and every planned table exists, and each table's shards lie
    inside it and cover it exactly once.

    Args:
        sharding_plan: a TorchRec plan.
        model_tables: the model (each embedding collection is matched by its
            module path), or its tables (``TableSpec`` / TorchRec configs /
            ``{name: (rows, dim)}``), matched by table name in every module
            of the plan.
        num_devices: devices in the mesh.

    Raises:
        ValueError: what is wrong, with the module, table and the fix.
        TypeError: ``sharding_plan`` is not a ``ShardingPlan``.

    Example::

        validate_plan(load_plan("plan.json"), model, num_devices=8)
    """
    if not isinstance(sharding_plan, ShardingPlan):
        raise TypeError(f"expected a torchrec ShardingPlan, got {type(sharding_plan).__name__}")
    if not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"num_devices must be a positive integer, got {num_devices!r}")
    if isinstance(model_tables, nn.Module):
        expected = _tables_of_module(model_tables)
        if not expected:
            raise ValueError(
                f"{type(model_tables).__name__} holds no embedding collection (no module with "
                f"embedding_bag_configs()/embedding_configs()); nothing to shard"
            )
        for path in sharding_plan.plan:
            if path not in expected:
                raise ValueError(
                    f"plan module {path or ROOT_KEY!r} is not an embedding collection of the model; "
                    f"the model's are {sorted(p or ROOT_KEY for p in expected)}"
                )
        planned: Dict[str, Dict[str, Any]] = {
            path: dict(sharding_plan.plan.get(path, {}))  # type: ignore[arg-type]
            for path in expected
        }
    else:
        # Tables without module paths: match names over the whole plan.
        expected = {"": _flat_tables(model_tables)}
        planned = {"": {}}
        for path, module_plan in sharding_plan.plan.items():
            for name, ps in module_plan.items():  # type: ignore[attr-defined]
                if name in planned[""]:
                    raise ValueError(
                        f"table {name!r} is planned in two modules; pass the model itself so "
                        f"tables are matched by module path"
                    )
                planned[""][name] = ps
    for path, tables in expected.items():
        module_plan = planned[path]
        where_mod = f"module {path or ROOT_KEY!r}"
        missing = sorted(set(tables) - set(module_plan))
        if missing:
            raise ValueError(
                f"{where_mod}: tables {missing} are in the model but not in the plan; "
                f"plan every table (re-run the planner on this model)"
            )
        extra = sorted(set(module_plan) - set(tables))
        if extra:
            raise ValueError(
                f"{where_mod}: the plan shards tables {extra} that the model does not have "
                f"(model tables: {sorted(tables)})"
            )
        for name, ps in module_plan.items():
            _validate_table(f"{where_mod}, table {name!r}", ps, tables[name], num_devices)
        # Then the executor's own reading of the same entries (shards must tile each table as
        # a grid of row and column blocks): a plan that validates is one tpurec.shard accepts.
        configs = [
            EmbeddingBagConfig(num_embeddings=rows, embedding_dim=dim, name=name, feature_names=[name])
            for name, (rows, dim) in tables.items()
        ]
        table_shardings(configs, module_plan, num_devices)


def _validate_table(where: str, ps: ParameterSharding, shape: Tuple[int, int], num_devices: int) -> None:
    if ps.sharding_type not in TPU_RUNNABLE_SHARDING_TYPES:
        raise ValueError(
            f"{where}: unknown sharding type {ps.sharding_type!r}; tpurec runs {list(TPU_RUNNABLE_SHARDING_TYPES)}"
        )
    for r in ps.ranks or []:
        if not 0 <= r < num_devices:
            raise ValueError(
                f"{where}: rank {r} is outside the mesh of {num_devices} devices (ranks 0..{num_devices - 1}); "
                f"plan for this device count"
            )
    if ps.sharding_type == DATA_PARALLEL:
        return
    if ps.sharding_spec is None:
        raise ValueError(f"{where}: a {ps.sharding_type} table needs shard metadata (sharding_spec)")
    rows, dim = shape
    area = 0
    for i, s in enumerate(ps.sharding_spec.shards):  # type: ignore[attr-defined]
        rank = s.placement.rank() if s.placement is not None else None
        if rank is None or not 0 <= rank < num_devices:
            raise ValueError(
                f"{where}: shard {i} is placed on {s.placement}, outside the mesh of {num_devices} devices"
            )
        if len(s.shard_offsets) != 2 or len(s.shard_sizes) != 2:
            raise ValueError(
                f"{where}: shard {i} has offsets {list(s.shard_offsets)} and sizes {list(s.shard_sizes)}; "
                f"embedding table shards are 2-D (rows, columns)"
            )
        (r0, c0), (nr, nc) = s.shard_offsets, s.shard_sizes
        if r0 < 0 or c0 < 0 or nr < 0 or nc < 0 or r0 + nr > rows or c0 + nc > dim:
            raise ValueError(
                f"{where}: shard {i} (offsets {list(s.shard_offsets)}, sizes {list(s.shard_sizes)}) "
                f"lies outside the {rows} x {dim} table; the plan was made for other table sizes"
            )
        area += nr * nc
    if area != rows * dim:
        raise ValueError(
            f"{where}: shards cover {area} of the table's {rows * dim} elements; "
            f"the plan was made for other table sizes"
        )
