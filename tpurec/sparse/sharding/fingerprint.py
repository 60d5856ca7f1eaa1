"""The processes of a job agree on the sharded model before its first collective.

Processes whose models differ (a table with 40 rows on one and 50 on another, another plan,
other dense layer sizes) would otherwise train on without an error, each on its own idea of
the model, or abort inside gloo with a message about buffer sizes. :func:`agree_on_model`
exchanges a fingerprint of everything every process must share (tables, dims, pooling,
features, the plan's shards, capacities, the embedding optimizer and its settings, the dense
parameters' names, shapes and dtypes, the mesh) through the coordinator's key-value store;
every process raises the same :class:`~tpurec.distributed.peers.PeerMismatch` naming the first
difference. :func:`agree_on_step` does the same each step for what can change per step (the
local batch size) together with the entries each process sends, which the capacities need.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from tpurec.distributed import peers

__all__ = ["agree_on_model", "agree_on_step", "first_difference", "model_fingerprint"]


def model_fingerprint(
    collections: Mapping[str, Any],
    shardings: Mapping[str, Mapping[str, Any]],
    dense: Iterable[tuple[str, Any]],
    *,
    mesh_shape: tuple[int, ...],
    capacity: int | None,
    overflow: str,
    optimizer: Any,
    seed: int | None = None,
) -> dict[str, Any]:
    """What every process of a job must share about a model ``tpurec.shard`` is about to shard (JSON-able).

    Args:
        collections: module path -> the unsharded tpurec collection.
        shardings: module path -> table name -> ``TableSharding``.
        dense: (name, tensor) of every parameter and buffer outside the collections.
        mesh_shape: the mesh's shape.
        capacity: the ``capacity`` argument of ``tpurec.shard``.
        overflow: its ``overflow`` argument.
        optimizer: the fused embedding optimizer given to ``tpurec.shard`` (or None).
        seed: the seed that creates tables born on ``meta`` (None: no table is on ``meta``);
            each process creates its own shards, so a different seed would be a different model.
    """
    fp: dict[str, Any] = {"mesh": list(mesh_shape), "capacity": capacity, "overflow": overflow}
    if seed is not None:
        fp["seed of the tables on meta"] = seed
    if optimizer is not None:
        fp["optimizer"] = _optimizer(optimizer)
    for path, ebc in collections.items():
        tables = {}
        for c in ebc.embedding_bag_configs():
            plan = shardings[path][c.name]
            tables[c.name] = {
                "rows": int(c.num_embeddings),
                "dim": int(c.embedding_dim),
                "dtype": str(getattr(c.data_type, "name", c.data_type)),
                "pooling": str(getattr(c.pooling, "name", c.pooling)),
                "features": list(c.feature_names),
                "sharding": plan.sharding_type,
                "shards": [[p.row_offset, p.rows, p.col_offset, p.cols, p.device] for p in plan.pieces],
            }
        fp[f"collection {path or '(the model)'}"] = {
            "tables": tables,
            "weighted": bool(ebc.is_weighted()),
            "optimizer": _optimizer(ebc.optimizer) if getattr(ebc, "optimizer", None) is not None else None,
        }
    fp["dense"] = {name: f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}" for name, t in dense}
    return fp


def _optimizer(optimizer: Any) -> dict[str, Any]:
    return {"kind": type(optimizer).__name__, "settings": {k: repr(v) for k, v in sorted(vars(optimizer).items())}}


def first_difference(a: Any, b: Any, path: str = "") -> tuple[str, Any, Any] | None:
    """The first place (a dotted path) where ``a`` and ``b`` differ, with both values; None when equal.

    Mappings are walked in ``a``'s key order, then keys only in ``b``; a key missing on one
    side shows as ``"(none)"``.
    """
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            where = f"{path}.{key}" if path else str(key)
            if key not in b or key not in a:
                return where, a.get(key, "(none)"), b.get(key, "(none)")
            found = first_difference(a[key], b[key], where)
            if found is not None:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{path}[{i}]")
            if found is not None:
                return found
        return None
    return None if a == b else (path, a, b)


def _compare(values: list[Any], what: str, advice: str) -> None:
    """Raises the same PeerMismatch on every process when some process's value differs from process 0's."""
    for r, value in enumerate(values[1:], start=1):
        found = first_difference(values[0], value)
        if found is not None:
            where, mine, theirs = found
            raise peers.PeerMismatch(
                f"the processes of this job disagree on {what}: {where} is {mine} on process 0 but {theirs} on "
                f"process {r}; {advice}"
            )


def agree_on_model(fingerprint: dict[str, Any]) -> None:
    """Checks that every process shards the same model the same way (a no-op in a one-process job).

    Raises:
        PeerMismatch: on every process, naming the first difference.
        PeerLost, PeerTimeout: a process is gone or did not get here.
    """
    if peers.active() is None:
        return
    values = peers.exchange("tpurec.shard", fingerprint)
    _compare(
        values,
        "the model given to tpurec.shard",
        "every process must build the same model (tables, dense layers), plan and tpurec.shard arguments",
    )


def agree_on_step(collection: int, step: int, local_batch: int, needs: list[int]) -> list[list[int]]:
    """Each step of a sharded collection: checks that every process feeds the same local batch size.

    Args:
        collection: which sharded collection (creation order, the same in every process).
        step: the collection's step (from 1).
        local_batch: this process's samples.
        needs: the entries this process sends per group (the capacities are their maximum).

    Returns:
        Every process's ``needs``, in process order.

    Raises:
        PeerMismatch: on every process, when the local batch sizes differ.
        PeerLost, PeerTimeout: a process is gone, failed or finished before this step.
    """
    if peers.active() is None:
        return [needs]
    peers.set_step(step)
    values = peers.exchange(f"step/{collection}", {"local batch size": local_batch, "needs": needs}, step=step)
    _compare(
        [{"local batch size": v["local batch size"]} for v in values],
        f"the batch of step {step}",
        "every process must feed the same number of samples each step",
    )
    return [v["needs"] for v in values]
