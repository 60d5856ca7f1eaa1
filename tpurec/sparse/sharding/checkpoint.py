"""Sharded checkpoints of sharded models (Orbax), resharded on load.

A checkpoint stores every table and optimizer slot as one logical array in a
*canonical* layout: ``[rows, dim]`` (rows padded to a multiple of the device
count) sharded by rows over the mesh, whatever the plan. Each process writes
only its devices' shards (Orbax/TensorStore); Orbax commits the folder
atomically (temporary name, renamed when every process has finished).

Loading lays the canonical arrays out for the *current* plan and mesh, so a
model saved table-wise on 8 devices loads row-wise on 4: the moves between
layouts are gathers and scatters inside one XLA program each, so values are
bit-identical. Dense parameters and buffers are stored replicated.

Example::

    save(sharded_model, "/ckpt/step_100")
    other = tpurec.shard(fresh_model, other_plan, other_mesh)
    load(other, "/ckpt/step_100")
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from torch import nn

from tpurec.core.tensor import array_of, replace_array
from tpurec.sparse.sharding.ebc import ShardedEmbeddingBagCollection

__all__ = ["save", "load"]


def _padded_rows(rows: int, devices: int) -> int:
    return -(-rows // devices) * devices


def _canonical_fn(module: ShardedEmbeddingBagCollection):
    """A function: (stacked weights, slots, dp weights, dp slots) -> {table: {"weight"|slot: [padded rows, ...]}}."""
    L, D = module.layout, module.layout.num_devices
    kinds = module.optimizer.slots
    configs = module.embedding_bag_configs()

    def fn(weights, slots, dp_weights, dp_slots):
        out: dict[str, dict[str, jax.Array]] = {}
        for cfg in configs:
            rows = cfg.num_embeddings
            pad = _padded_rows(rows, D) - rows
            values: dict[str, jax.Array] = {}
            if cfg.name in L.dp_group_of:
                g = L.dp_group_of[cfg.name]
                first = L.dp_groups[g].offsets[cfg.name]
                values["weight"] = dp_weights[g][first : first + rows]
                for s, stack in zip(kinds, dp_slots[g]):
                    values[s] = stack[first : first + rows]
            else:
                pieces = module.layout.shardings[cfg.name].pieces
                column_blocks = sorted({p.col_offset for p in pieces})
                blocks: dict[str, list[jax.Array]] = {"weight": [], **{s: [] for s in kinds}}
                for c0 in column_blocks:
                    cells = sorted((p for p in pieces if p.col_offset == c0), key=lambda p: p.row_offset)
                    g = next(i for i, grp in enumerate(L.groups) if cells[0] in grp.offsets)
                    grp = L.groups[g]
                    index = np.concatenate([p.device * grp.rows_per_device + grp.offsets[p] + np.arange(p.rows) for p in cells])
                    blocks["weight"].append(jnp.take(weights[g], index, axis=0))
                    for (s, kind), stack in zip(kinds.items(), slots[g]):
                        # A row-wise slot is kept once per column shard: take the first.
                        if kind != "row" or c0 == 0:
                            blocks[s].append(jnp.take(stack, index, axis=0))
                values["weight"] = jnp.concatenate(blocks["weight"], axis=1)
                for s, kind in kinds.items():
                    values[s] = blocks[s][0] if kind == "row" else jnp.concatenate(blocks[s], axis=1)
            out[cfg.name] = {k: jnp.pad(v, [(0, pad)] + [(0, 0)] * (v.ndim - 1)) for k, v in values.items()}
        return out

    return fn


def _stacked_fn(module: ShardedEmbeddingBagCollection):
    """The inverse of :func:`_canonical_fn` for ``module``'s layout."""
    L = module.layout
    kinds = module.optimizer.slots
    configs = {c.name: c for c in module.embedding_bag_configs()}

    def fn(canonical):
        weights, slots = [], []
        for grp in L.groups:
            n = L.num_devices * grp.rows_per_device
            w = jnp.zeros((n, grp.width), jnp.float32)
            ss = {s: jnp.zeros((n,) if k == "row" else (n, grp.width), jnp.float32) for s, k in kinds.items()}
            for p, offset in grp.offsets.items():
                index = p.device * grp.rows_per_device + offset + np.arange(p.rows)
                rows = slice(p.row_offset, p.row_offset + p.rows)
                cols = slice(p.col_offset, p.col_offset + p.cols)
                w = w.at[index].set(canonical[p.table]["weight"][rows, cols])
                for s, k in kinds.items():
                    value = canonical[p.table][s]
                    ss[s] = ss[s].at[index].set(value[rows] if k == "row" else value[rows, cols])
            weights.append(w)
            slots.append([ss[s] for s in kinds])
        dp_weights, dp_slots = [], []
        for dg in L.dp_groups:
            w = jnp.zeros((dg.num_rows, dg.width), jnp.float32)
            ss = {s: jnp.zeros((dg.num_rows,) if k == "row" else (dg.num_rows, dg.width), jnp.float32) for s, k in kinds.items()}
            for name, first in dg.offsets.items():
                rows = configs[name].num_embeddings
                w = w.at[first : first + rows].set(canonical[name]["weight"][:rows])
                for s in kinds:
                    ss[s] = ss[s].at[first : first + rows].set(canonical[name][s][:rows])
            dp_weights.append(w)
            dp_slots.append([ss[s] for s in kinds])
        return weights, slots, dp_weights, dp_slots

    return fn


def _key(name: str) -> str:
    """A tree key for a module path or state-dict name (Orbax joins keys with dots)."""
    return name.replace(".", "~") or "~root"


def _modules(model: nn.Module) -> dict[str, ShardedEmbeddingBagCollection]:
    found = {path: m for path, m in model.named_modules() if isinstance(m, ShardedEmbeddingBagCollection)}
    if not found:
        raise ValueError("the model has no ShardedEmbeddingBagCollection: shard it with tpurec.shard first")
    return found


def _dense(model: nn.Module) -> dict[str, Any]:
    """Dense parameters and buffers (not inside sharded collections), by state-dict key."""
    inside = {id(t) for m in _modules(model).values() for t in list(m.parameters()) + list(m.buffers())}
    named = list(model.named_parameters()) + list(model.named_buffers())
    return {name: t for name, t in named if id(t) not in inside}


def _canonical_sharding(module: ShardedEmbeddingBagCollection, ndim: int) -> NamedSharding:
    return NamedSharding(module.mesh, P(module.axis, *([None] * (ndim - 1))))


def _tree(model: nn.Module) -> dict[str, Any]:
    from tpurec.core.dispatch import value_of

    tree: dict[str, Any] = {"embeddings": {}, "dense": {}}
    for path, module in _modules(model).items():
        L = module.layout
        weights, slots = module._arrays("shard", len(L.groups))
        dp_weights, dp_slots = module._arrays("dp", len(L.dp_groups))
        shapes = jax.eval_shape(_canonical_fn(module), weights, slots, dp_weights, dp_slots)
        shardings = jax.tree.map(lambda s: _canonical_sharding(module, len(s.shape)), shapes)
        canonical = jax.jit(_canonical_fn(module), out_shardings=shardings)(weights, slots, dp_weights, dp_slots)
        tree["embeddings"][_key(path)] = {"tables": canonical, "step": np.array(module._step, np.int64)}
    for name, t in _dense(model).items():
        tree["dense"][_key(name)] = value_of(t, "checkpoint")
    return tree


def save(model: nn.Module, directory: str | os.PathLike) -> None:
    """Writes a sharded checkpoint of ``model`` (every process calls it).

    Args:
        model: a model returned by :func:`tpurec.shard`.
        directory: a folder that does not exist yet (Orbax refuses to overwrite).
    """
    import orbax.checkpoint as ocp

    tree = _tree(model)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.abspath(directory), tree)
        checkpointer.wait_until_finished()


def load(model: nn.Module, directory: str | os.PathLike) -> None:
    """Loads a checkpoint written by :func:`save`, resharding to ``model``'s plan and mesh.

    Tables and optimizer slots are bit-identical to the saved ones; dense
    parameters and buffers are replicated on ``model``'s mesh.

    Raises:
        ValueError: the checkpoint's collections or tables do not match the model's.
    """
    import orbax.checkpoint as ocp

    modules = _modules(model)
    dense = _dense(model)
    path = os.path.abspath(directory)
    with ocp.StandardCheckpointer() as checkpointer:
        stored = checkpointer.metadata(path)
        stored_tree = getattr(stored, "item_metadata", stored)
        stored_tree = getattr(stored_tree, "tree", stored_tree)
        saved_paths = set(stored_tree["embeddings"])
        mine = {_key(path_) for path_ in modules}
        if saved_paths != mine:
            raise ValueError(f"the checkpoint holds sharded collections {sorted(saved_paths)}, the model {sorted(mine)}")
        target: dict[str, Any] = {"embeddings": {}, "dense": {}}
        for mpath, module in modules.items():
            saved_tables = stored_tree["embeddings"][_key(mpath)]["tables"]
            names = {c.name for c in module.embedding_bag_configs()}
            if set(saved_tables) != names:
                raise ValueError(f"collection '{mpath}': the checkpoint has tables {sorted(saved_tables)}, the model {sorted(names)}")
            tables = {}
            D = module.layout.num_devices
            for cfg in module.embedding_bag_configs():
                entry = {}
                for key, meta in saved_tables[cfg.name].items():
                    shape = (_padded_rows(cfg.num_embeddings, D), *tuple(meta.shape)[1:])
                    entry[key] = jax.ShapeDtypeStruct(shape, meta.dtype, sharding=_canonical_sharding(module, len(shape)))
                tables[cfg.name] = entry
            target["embeddings"][_key(mpath)] = {"tables": tables, "step": np.zeros((), np.int64)}
        for name, t in dense.items():
            array = array_of(t)
            target["dense"][_key(name)] = jax.ShapeDtypeStruct(tuple(t.shape), array.dtype, sharding=array.sharding)
        # strict=False: the row padding depends on the device count, which may differ.
        restored = checkpointer.restore(path, target, strict=False)
    for mpath, module in modules.items():
        entry = restored["embeddings"][_key(mpath)]
        canonical = entry["tables"]
        L = module.layout
        spec, rep = NamedSharding(module.mesh, P(module.axis)), NamedSharding(module.mesh, P())
        n_slots = len(module.optimizer.slots)
        out_shardings = ([spec] * len(L.groups), [[spec] * n_slots] * len(L.groups), [rep] * len(L.dp_groups), [[rep] * n_slots] * len(L.dp_groups))
        weights, slots, dp_weights, dp_slots = jax.jit(_stacked_fn(module), out_shardings=out_shardings)(canonical)
        for prefix, ws, ss in (("shard", weights, slots), ("dp", dp_weights, dp_slots)):
            for g, (w, s) in enumerate(zip(ws, ss)):
                replace_array(getattr(module, f"{prefix}_weight_{g}"), w)
                for slot_name, value in zip(module.optimizer.slots, s):
                    replace_array(getattr(module, f"{prefix}_{slot_name}_{g}"), value)
        module._step = int(np.asarray(entry["step"]))
    for name, t in dense.items():
        replace_array(t, restored["dense"][_key(name)])
