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
from typing import Any, Dict, List, Mapping, Optional, Union

from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
from torchrec.distributed.types import (
    BoundsCheckMode,
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingPlan,
)
from torchrec.types import DataType

# Checking a plan against a model belongs to the leaf the executor shares; the old names stay here.
from tpurec.sparse.sharding_plan.validate import ROOT_KEY, TPU_RUNNABLE_SHARDING_TYPES, validate_plan

__all__ = [
    "TPU_RUNNABLE_SHARDING_TYPES",
    "load_plan",
    "plan_from_json",
    "plan_to_json",
    "save_plan",
    "validate_plan",
]


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
    # Shard placements name "tpu:N", which torch parses once the device name is
    # registered: importing the tpurec package (always done before this module) did that.
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
