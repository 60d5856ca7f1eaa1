"""TorchRec sharding plans to and from JSON, and checking a plan against a model.

``tpurec plan --json plan.json`` (``python -m tpurec.sparse.planner``) writes
``{"report": ..., "plan": ...}``; :func:`load_plan` reads the ``plan`` part
back into the TorchRec ``ShardingPlan`` the planner returned, equal field by
field. :func:`validate_plan` checks a plan against the tables a model holds
and the devices of a mesh before anything is sharded.

JSON layout of the plan: ``{module path ("<root>" for ""): {table:
{"sharding_type", "compute_kernel", "ranks", "shards": [{"sizes",
"offsets", "placement"}] or null, and the optional ParameterSharding fields
"enforce_hbm", "stochastic_rounding", "bounds_check_mode", "output_dtype"
when set}}}``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from torch import nn
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
from torchrec.distributed.types import (
    BoundsCheckMode,
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
)
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.types import DataType

from tpurec.sparse.planner.types import TableSpec, as_table_spec

__all__ = [
    "TPU_RUNNABLE_SHARDING_TYPES",
    "load_plan",
    "plan_from_json",
    "plan_to_json",
    "save_plan",
    "validate_plan",
]

ROOT_KEY = "<root>"

# Sharding types tpurec.shard runs (issue 9, item 2).
TPU_RUNNABLE_SHARDING_TYPES: Tuple[str, ...] = (
    ShardingType.DATA_PARALLEL.value,
    ShardingType.TABLE_WISE.value,
    ShardingType.ROW_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.TABLE_ROW_WISE.value,
    ShardingType.TABLE_COLUMN_WISE.value,
)


def _ensure_tpu_device() -> None:
    # Shard placements name "tpu:N"; torch only parses them once tpurec has
    # registered the device name.
    import tpurec  # noqa: F401


def plan_to_json(sharding_plan: ShardingPlan) -> Dict[str, Any]:
    """A TorchRec ``ShardingPlan`` as a JSON-ready dict (see the module docstring).

    Args:
        sharding_plan: the plan.

    Returns:
        ``{module path: {table: {...}}}``.

    Raises:
        ValueError: the plan uses fields TPU plans never set (cache or
            key-value parameters), which this format does not carry.
    """
    out: Dict[str, Any] = {}
    for path, module_plan in sharding_plan.plan.items():
        tables: Dict[str, Any] = {}
        for name, ps in module_plan.items():  # type: ignore[attr-defined]
            if ps.cache_params is not None or ps.key_value_params is not None:
                raise ValueError(
                    f"table {name!r}: cache_params/key_value_params (UVM caching, SSD) have no TPU "
                    f"meaning and are not written; clear them before saving"
                )
            shards = None
            if ps.sharding_spec is not None:
                shards = [
                    {
                        "sizes": list(s.shard_sizes),
                        "offsets": list(s.shard_offsets),
                        "placement": str(s.placement),
                    }
                    for s in ps.sharding_spec.shards  # type: ignore[attr-defined]
                ]
            entry: Dict[str, Any] = {
                "sharding_type": ps.sharding_type,
                "compute_kernel": ps.compute_kernel,
                "ranks": list(ps.ranks) if ps.ranks is not None else None,
                "shards": shards,
            }
            if ps.enforce_hbm is not None:
                entry["enforce_hbm"] = bool(ps.enforce_hbm)
            if ps.stochastic_rounding is not None:
                entry["stochastic_rounding"] = bool(ps.stochastic_rounding)
            if ps.bounds_check_mode is not None:
                entry["bounds_check_mode"] = ps.bounds_check_mode.name
            if ps.output_dtype is not None:
                entry["output_dtype"] = ps.output_dtype.name
            tables[name] = entry
        out[path or ROOT_KEY] = tables
    return out


def _int_list(value: Any, what: str) -> List[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{what} must be a list of integers, got {value!r}")
    return list(value)


def plan_from_json(obj: Mapping[str, Any]) -> ShardingPlan:
    """The TorchRec ``ShardingPlan`` of :func:`plan_to_json` output.

    Args:
        obj: ``{module path: {table: {...}}}``, or the CLI's whole document
            (``{"report": ..., "plan": ...}``).

    Returns:
        The plan.

    Raises:
        ValueError: a field is missing or malformed; the message names the
            module and table.
    """
    _ensure_tpu_device()
    if not isinstance(obj, Mapping):
        raise ValueError(f"a plan must be a JSON object, got {type(obj).__name__}")
    if "plan" in obj and isinstance(obj["plan"], Mapping):
        obj = obj["plan"]
    plan: Dict[str, EmbeddingModuleShardingPlan] = {}
    for path, tables in obj.items():
        if not isinstance(tables, Mapping):
            raise ValueError(f"module {path!r}: expected an object of tables, got {type(tables).__name__}")
        module_plan = EmbeddingModuleShardingPlan()
        for name, entry in tables.items():
            where = f"module {path!r}, table {name!r}"
            if not isinstance(entry, Mapping):
                raise ValueError(f"{where}: expected an object, got {type(entry).__name__}")
            missing = {"sharding_type", "compute_kernel"} - set(entry)
            if missing:
                raise ValueError(f"{where}: missing {sorted(missing)}")
            spec: Optional[EnumerableShardingSpec] = None
            if entry.get("shards") is not None:
                shards = []
                for i, s in enumerate(entry["shards"]):
                    if not isinstance(s, Mapping) or {"sizes", "offsets", "placement"} - set(s):
                        raise ValueError(f"{where}: shard {i} needs 'sizes', 'offsets' and 'placement'")
                    try:
                        shards.append(
                            ShardMetadata(
                                shard_offsets=_int_list(s["offsets"], f"{where}: shard {i} offsets"),
                                shard_sizes=_int_list(s["sizes"], f"{where}: shard {i} sizes"),
                                placement=str(s["placement"]),
                            )
                        )
                    except (RuntimeError, TypeError) as e:
                        raise ValueError(f"{where}: shard {i}: {e}") from e
                spec = EnumerableShardingSpec(shards)
            ranks = entry.get("ranks")
            try:
                bounds = entry.get("bounds_check_mode")
                dtype = entry.get("output_dtype")
                module_plan[name] = ParameterSharding(
                    sharding_type=str(entry["sharding_type"]),
                    compute_kernel=str(entry["compute_kernel"]),
                    ranks=_int_list(ranks, f"{where}: ranks") if ranks is not None else None,
                    sharding_spec=spec,
                    enforce_hbm=entry.get("enforce_hbm"),
                    stochastic_rounding=entry.get("stochastic_rounding"),
                    bounds_check_mode=BoundsCheckMode[bounds] if bounds is not None else None,
                    output_dtype=DataType[dtype] if dtype is not None else None,
                )
            except KeyError as e:
                raise ValueError(f"{where}: unknown enum value {e}") from e
        plan["" if path == ROOT_KEY else str(path)] = module_plan
    return ShardingPlan(plan)  # type: ignore[arg-type]


def load_plan(path: Union[str, os.PathLike]) -> ShardingPlan:
    """Read a plan written by ``tpurec plan --json`` (or :func:`save_plan`).

    Args:
        path: the JSON file.

    Returns:
        The TorchRec ``ShardingPlan``, equal to the one the planner returned.

    Raises:
        ValueError: the file is not a plan.

    Example::

        from tpurec.sparse.planner import load_plan
        sharding_plan = load_plan("plan.json")
    """
    with open(path) as f:
        try:
            obj = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{os.fspath(path)} is not JSON: {e}") from e
    return plan_from_json(obj)


def save_plan(sharding_plan: ShardingPlan, path: Union[str, os.PathLike], report: Any = None) -> None:
    """Write a plan (and optionally its report) as ``tpurec plan --json`` does.

    Written to a temporary file and renamed, so a reader never sees half a plan.

    Args:
        sharding_plan: the plan.
        path: destination.
        report: a :class:`PlanReport` to store next to it.
    """
    doc: Dict[str, Any] = {"plan": plan_to_json(sharding_plan)}
    if report is not None:
        doc = {"report": report.to_dict(), **doc}
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


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
        found[path] = {c.name: (int(c.num_embeddings), int(c.embedding_dim)) for c in getter()}
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
        planned = {path: dict(sharding_plan.plan.get(path, {})) for path in expected}  # type: ignore[arg-type]
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
    if ps.sharding_type == ShardingType.DATA_PARALLEL.value:
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
