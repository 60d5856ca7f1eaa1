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

Integrity: the checkpoint records, for every table, optimizer slot and dense
tensor, a 96-bit checksum of its values (computed by XLA where the arrays live,
so every process agrees without gathering), and describes the model it came
from (collections, tables with rows, dims and dtypes, optimizer and slot names,
dense shapes) in Orbax's ``_CHECKPOINT_METADATA``. :func:`load` refuses, before
anything is written, a checkpoint that does not fit the model (with the messages
of the one-device format, :mod:`tpurec.sparse.checkpoint.integrity`), a damaged or incomplete one (a
:class:`~tpurec.sparse.checkpoint.CheckpointError` naming the file or entry),
and an interrupted save. Checkpoints written before checksums existed load
with one warning, checked by names and dims only; save them again to add the
checksums. :func:`save` removes the temporary folders that interrupted saves
left beside the new one (do not run two saves into one folder at once);
:func:`list_checkpoints` lists the committed checkpoints of a folder.

Example::

    save(sharded_model, "/ckpt/step_100")
    other = tpurec.shard(fresh_model, other_plan, other_mesh)
    load(other, "/ckpt/step_100")
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from torch import nn

from tpurec.core import array_of, replace_array
from tpurec.sparse.checkpoint import integrity
from tpurec.sparse.checkpoint.integrity import MANIFEST, CheckpointError
from tpurec.sparse.checkpoint.unsharded import list_checkpoints
from tpurec.sparse.sharding.ebc import STACK_DTYPES, ShardedEmbeddingBagCollection

__all__ = ["FORMAT", "CheckpointError", "list_checkpoints", "load", "save"]

FORMAT = "tpurec.sparse.sharding.checkpoint/1"


def _padded_rows(rows: int, devices: int) -> int:
    return -(-rows // devices) * devices


@dataclasses.dataclass
class _Block:
    """One column block of a sharded table: where its rows lie in its group's local stacks.

    Attributes:
        table: the table's name.
        col_offset: its first column; ``width`` columns.
        group: the group whose stacks hold it.
        local: ``[devices, M]`` local stack row of each of the block's rows on
            that device, in table-row order (-1: none); the *extracted* array is
            ``[devices * M, width]``, device ``d``'s rows at ``d * M``.
        gather: canonical row ``r`` -> its row in the extracted array, or None when
            the two coincide (row-wise in rank order, the canonical layout itself):
            then save and load move no row between devices.
    """

    table: str
    col_offset: int
    width: int
    group: int
    local: np.ndarray
    gather: np.ndarray | None


def _blocks(module: ShardedEmbeddingBagCollection) -> list[_Block]:
    L, D = module.layout, module.layout.num_devices
    out = []
    for cfg in module.embedding_bag_configs():
        if cfg.name in L.dp_group_of:
            continue
        per_row = _padded_rows(cfg.num_embeddings, D) // D
        pieces = L.shardings[cfg.name].pieces
        for c0 in sorted({p.col_offset for p in pieces}):
            cells = sorted((p for p in pieces if p.col_offset == c0), key=lambda p: p.row_offset)
            g = next(i for i, grp in enumerate(L.groups) if cells[0] in grp.offsets)
            grp = L.groups[g]
            on = [[p for p in cells if p.device == d] for d in range(D)]
            aligned = all(len(c) <= 1 for c in on) and all(
                p.row_offset == p.device * per_row and p.rows <= per_row for p in cells
            )
            m = per_row if aligned else max(1, max(sum(p.rows for p in c) for c in on))
            local = np.full((D, m), -1, np.int32)
            first: dict[Any, int] = {}
            for d, c in enumerate(on):
                k = 0
                for p in c:
                    local[d, k : k + p.rows] = grp.offsets[p] + np.arange(p.rows)
                    first[p] = d * m + k
                    k += p.rows
            gather = None if aligned else np.concatenate([first[p] + np.arange(p.rows) for p in cells]).astype(np.int32)
            out.append(_Block(cfg.name, c0, cells[0].cols, g, local, gather))
    return out


def _local_take(array: jax.Array, index: jax.Array) -> jax.Array:
    """``array[index]`` on one device, zeros where ``index`` is -1."""
    valid = index >= 0
    rows = jnp.take(array, jnp.where(valid, index, 0), axis=0)
    return jnp.where(valid.reshape(valid.shape + (1,) * (rows.ndim - 1)), rows, jnp.zeros((), rows.dtype))


def _canonical_fn(module: ShardedEmbeddingBagCollection):
    """A function: (stacked weights, slots, dp weights, dp slots) -> {table: {"weight"|slot: [padded rows, ...]}}.

    Each device first extracts its own rows of every table (no communication);
    a row-wise table in rank order is then already canonical, so saving it
    moves no row and no device ever holds more than its shards. Other tables
    are gathered from their extracted rows (at most one table's rows at once).
    """
    L, D = module.layout, module.layout.num_devices
    kinds = module.optimizer.slots
    configs = module.embedding_bag_configs()
    blocks = _blocks(module)
    spec = P(module.axis)

    def fn(weights, slots, dp_weights, dp_slots):
        extracted: dict[int, list[jax.Array]] = {}
        for g in range(len(L.groups)):
            mine = [b for b in blocks if b.group == g]

            def extract(stacks, indices):
                return [[_local_take(a, index[0]) for a in stacks] for index in indices]

            indices = [jnp.asarray(b.local) for b in mine]
            run = jax.shard_map(
                extract,
                mesh=module.mesh,
                in_specs=([spec] * (1 + len(kinds)), [spec] * len(mine)),
                out_specs=[[spec] * (1 + len(kinds))] * len(mine),
                check_vma=False,
            )
            for b, arrays in zip(mine, run([weights[g], *slots[g]], indices)):
                extracted[id(b)] = arrays
        out: dict[str, dict[str, jax.Array]] = {}
        for cfg in configs:
            rows = cfg.num_embeddings
            padded = _padded_rows(rows, D)
            values: dict[str, jax.Array] = {}
            if cfg.name in L.dp_group_of:
                g = L.dp_group_of[cfg.name]
                first = L.dp_groups[g].offsets[cfg.name]
                values["weight"] = dp_weights[g][first : first + rows]
                for s, stack in zip(kinds, dp_slots[g]):
                    values[s] = stack[first : first + rows]
                out[cfg.name] = {
                    k: jnp.pad(v, [(0, padded - rows)] + [(0, 0)] * (v.ndim - 1)) for k, v in values.items()
                }
                continue
            parts: list[list[jax.Array]] = []
            for b in (b for b in blocks if b.table == cfg.name):
                arrays = extracted[id(b)]
                if b.gather is not None:
                    arrays = [
                        jnp.pad(jnp.take(a, b.gather, axis=0), [(0, padded - rows)] + [(0, 0)] * (a.ndim - 1))
                        for a in arrays
                    ]
                parts.append(arrays)
            values["weight"] = jnp.concatenate([p[0] for p in parts], axis=1)
            for i, (s, kind) in enumerate(kinds.items(), start=1):
                # A row-wise slot is kept once per column shard: take the first.
                values[s] = parts[0][i] if kind == "row" else jnp.concatenate([p[i] for p in parts], axis=1)
            out[cfg.name] = values
        return out

    return fn


def _stacked_fn(module: ShardedEmbeddingBagCollection):
    """The inverse of :func:`_canonical_fn` for ``module``'s layout (rows move as little as there)."""
    L = module.layout
    kinds = module.optimizer.slots
    configs = {c.name: c for c in module.embedding_bag_configs()}
    blocks = _blocks(module)
    spec = P(module.axis)
    sharded = NamedSharding(module.mesh, spec)

    def fn(canonical):
        weights, slots = [], []
        for g, grp in enumerate(L.groups):
            mine = [b for b in blocks if b.group == g]
            sources = []
            for b in mine:
                table = canonical[b.table]
                arrays = [table["weight"][:, b.col_offset : b.col_offset + b.width]]
                for s, k in kinds.items():
                    arrays.append(table[s] if k == "row" else table[s][:, b.col_offset : b.col_offset + b.width])
                if b.gather is not None:
                    inverse = np.zeros(b.local.size, np.int32)
                    inverse[b.gather] = np.arange(b.gather.size)
                    arrays = [jax.lax.with_sharding_constraint(jnp.take(a, inverse, axis=0), sharded) for a in arrays]
                sources.append(arrays)
            R, w, dtype = grp.rows_per_device, grp.width, module._stack_dtype(grp)

            def place(sources, indices, R=R, w=w, dtype=dtype):
                stacks = [jnp.zeros((R, w), dtype)] + [
                    jnp.zeros((R,) if k == "row" else (R, w), jnp.float32) for k in kinds.values()
                ]
                for arrays, index in zip(sources, indices):
                    target = jnp.where(index[0] >= 0, index[0], R)  # -1: dropped
                    stacks = [st.at[target].set(a, mode="drop") for st, a in zip(stacks, arrays)]
                return stacks

            indices = [jnp.asarray(b.local) for b in mine]
            n = 1 + len(kinds)
            run = jax.shard_map(
                place,
                mesh=module.mesh,
                in_specs=([[spec] * n] * len(mine), [spec] * len(mine)),
                out_specs=[spec] * n,
                check_vma=False,
            )
            stacks = run(sources, indices)
            weights.append(stacks[0])
            slots.append(list(stacks[1:]))
        dp_weights, dp_slots = [], []
        for dg in L.dp_groups:
            w = jnp.zeros((dg.num_rows, dg.width), module._stack_dtype(dg))
            ss = {
                s: jnp.zeros((dg.num_rows,) if k == "row" else (dg.num_rows, dg.width), jnp.float32)
                for s, k in kinds.items()
            }
            for name, first in dg.offsets.items():
                rows = configs[name].num_embeddings
                w = w.at[first : first + rows].set(canonical[name]["weight"][:rows])
                for s in kinds:
                    ss[s] = ss[s].at[first : first + rows].set(canonical[name][s][:rows])
            dp_weights.append(w)
            dp_slots.append([ss[s] for s in kinds])
        return weights, slots, dp_weights, dp_slots

    return fn


def _canonical_program(module: ShardedEmbeddingBagCollection) -> Any:
    """:func:`_canonical_fn` jitted, its outputs in the canonical layout (rows over the mesh)."""
    L = module.layout
    weights, slots = module._arrays("shard", len(L.groups))
    dp_weights, dp_slots = module._arrays("dp", len(L.dp_groups))
    shapes = jax.eval_shape(_canonical_fn(module), weights, slots, dp_weights, dp_slots)
    shardings = jax.tree.map(lambda s: _canonical_sharding(module, len(s.shape)), shapes)
    return jax.jit(_canonical_fn(module), out_shardings=shardings)


def _stacked_program(module: ShardedEmbeddingBagCollection) -> Any:
    """:func:`_stacked_fn` jitted, its outputs laid out as ``module``'s stacks."""
    L = module.layout
    spec, rep = NamedSharding(module.mesh, P(module.axis)), NamedSharding(module.mesh, P())
    n_slots = len(module.optimizer.slots)
    out_shardings = (
        [spec] * len(L.groups),
        [[spec] * n_slots] * len(L.groups),
        [rep] * len(L.dp_groups),
        [[rep] * n_slots] * len(L.dp_groups),
    )
    return jax.jit(_stacked_fn(module), out_shardings=out_shardings)


def _key(name: str) -> str:
    """A tree key for a module path or state-dict name (Orbax joins keys with dots)."""
    return name.replace(".", "~") or "~root"


def _refuse_managed(model: nn.Module) -> None:
    """Raises for a sharded managed-collision remap, whose host state this format does not hold."""
    from tpurec.sparse.sharding.managed import ShardedManagedCollisionCollection

    remaps = [path for path, m in model.named_modules() if isinstance(m, ShardedManagedCollisionCollection)]
    if remaps:
        raise NotImplementedError(
            f"sharded checkpoints do not hold the state of the managed-collision remaps {remaps} (their MCH "
            "buffers live on the host, one module per shard). Save and load model.state_dict() instead: it has "
            "the remaps' buffers and the whole tables."
        )


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
    from tpurec.core import value_of

    tree: dict[str, Any] = {"embeddings": {}, "dense": {}}
    for path, module in _modules(model).items():
        L = module.layout
        weights, slots = module._arrays("shard", len(L.groups))
        dp_weights, dp_slots = module._arrays("dp", len(L.dp_groups))
        canonical = _canonical_program(module)(weights, slots, dp_weights, dp_slots)
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

    _refuse_managed(model)
    directory = os.path.abspath(directory)
    if jax.process_index() == 0:
        _remove_leftovers(Path(directory).parent)
    tree = _tree(model)
    tree["checksums"] = _checksums(model, tree)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory, tree, custom_metadata={"tpurec": _description(model)})
        checkpointer.wait_until_finished()
    if jax.process_index() == 0:
        _write_manifest(Path(directory))
    if jax.process_count() > 1:  # nobody loads it before the manifest is there
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("tpurec sharded checkpoint manifest")


def load(model: nn.Module, directory: str | os.PathLike) -> None:
    """Loads a checkpoint written by :func:`save`, resharding to ``model``'s plan and mesh.

    Tables and optimizer slots are bit-identical to the saved ones; dense
    parameters and buffers are replicated on ``model``'s mesh.

    Raises:
        CheckpointError: the checkpoint is missing, damaged or incomplete (the message names the
            file or entry); nothing was changed.
        ValueError: the checkpoint's collections, tables, shapes, dtypes, optimizer or slots
            do not match the model's; nothing was changed.
        NotImplementedError: the model has a sharded managed-collision remap (its state is not
            in this format: use the model's state dict).
    """
    import orbax.checkpoint as ocp

    _refuse_managed(model)
    modules = _modules(model)
    dense = _dense(model)
    path = os.path.abspath(directory)
    _check_committed(path)
    has_manifest = _check_manifest(Path(path))
    with ocp.StandardCheckpointer() as checkpointer:
        stored_tree, description = _read_metadata(checkpointer, path)
        if description is not None and not has_manifest:
            raise integrity.unusable(f"{path}/{MANIFEST}", "missing, the save did not finish or the file was removed")
        _check_fits(path, modules, dense, stored_tree, description)  # collections, tables, slots, shapes
        target: dict[str, Any] = {"embeddings": {}, "dense": {}}
        for mpath, module in modules.items():
            saved_tables = stored_tree["embeddings"][_key(mpath)]["tables"]
            tables = {}
            D = module.layout.num_devices
            for cfg in module.embedding_bag_configs():
                entry = {}
                for key, meta in saved_tables[cfg.name].items():
                    shape = (_padded_rows(cfg.num_embeddings, D), *tuple(meta.shape)[1:])
                    entry[key] = jax.ShapeDtypeStruct(
                        shape, meta.dtype, sharding=_canonical_sharding(module, len(shape))
                    )
                tables[cfg.name] = entry
            target["embeddings"][_key(mpath)] = {"tables": tables, "step": np.zeros((), np.int64)}
        for name, t in dense.items():
            array = array_of(t)
            target["dense"][_key(name)] = jax.ShapeDtypeStruct(tuple(t.shape), array.dtype, sharding=array.sharding)
        if "checksums" in stored_tree:
            target["checksums"] = jax.tree.map(lambda _: np.zeros(3, np.uint32), _checksum_layout(modules, dense))
        restored = _restore(checkpointer, path, target)
    if "checksums" in stored_tree:
        _verify_checksums(path, modules, dense, restored)
    for mpath, module in modules.items():
        entry = restored["embeddings"][_key(mpath)]
        canonical = entry["tables"]
        weights, slots, dp_weights, dp_slots = _stacked_program(module)(canonical)
        for prefix, ws, ss in (("shard", weights, slots), ("dp", dp_weights, dp_slots)):
            for g, (w, s) in enumerate(zip(ws, ss)):
                replace_array(getattr(module, f"{prefix}_weight_{g}"), w)
                for slot_name, value in zip(module.optimizer.slots, s):
                    replace_array(getattr(module, f"{prefix}_{slot_name}_{g}"), value)
        module._step = int(np.asarray(entry["step"]))
    for name, t in dense.items():
        replace_array(t, restored["dense"][_key(name)])


# --- integrity: checksums, the model description, strict checks --------------------------------


def _fmix(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finalizer: a bijection that spreads every input bit over the output."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _digest(x: jax.Array) -> jax.Array:
    """``[3]`` uint32: two hashed sums over (position, bits) of every element, and the element count.

    A sum of per-element hashes does not depend on how the array is sharded (integer
    sums are exact), so every process computes the same value where the shards live;
    changing any one element always changes both sums (the hash is a bijection).
    """
    flat = jnp.ravel(x)
    if flat.dtype == jnp.bool_:
        bits = flat.astype(jnp.uint32)
    elif flat.dtype.itemsize == 8:
        bits = jnp.ravel(lax.bitcast_convert_type(flat, jnp.uint32))
    else:
        unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[flat.dtype.itemsize]
        bits = lax.bitcast_convert_type(flat, unsigned).astype(jnp.uint32)
    position = lax.iota(jnp.uint32, bits.shape[0])
    sums = [
        jnp.sum(_fmix(bits ^ _fmix(position * jnp.uint32(0x9E3779B1) + jnp.uint32(seed))), dtype=jnp.uint32)
        for seed in (0x1B873593, 0x7FEB352D)
    ]
    return jnp.stack([*sums, jnp.uint32(bits.shape[0])])


def _checksum_layout(modules: dict[str, ShardedEmbeddingBagCollection], dense: dict[str, Any]) -> dict[str, Any]:
    """``{"embeddings": {collection: {table: {"weight"|slot: rows}}}, "dense": {key: None}}``."""
    return {
        "embeddings": {
            _key(mpath): {
                c.name: {k: c.num_embeddings for k in ("weight", *m.optimizer.slots)} for c in m.embedding_bag_configs()
            }
            for mpath, m in modules.items()
        },
        "dense": {_key(name): -1 for name in dense},
    }


def _digests(
    modules: dict[str, ShardedEmbeddingBagCollection],
    dense: dict[str, Any],
    embeddings: dict[str, Any],
    dense_values: dict[str, Any],
) -> dict[str, Any]:
    """The checksums of canonical tables (their real rows, not the padding) and dense values, as numpy."""
    layout = _checksum_layout(modules, dense)
    values = {
        "embeddings": {
            k: {t: {s: embeddings[k][t][s] for s in slots} for t, slots in tables.items()}
            for k, tables in layout["embeddings"].items()
        },
        "dense": {k: dense_values[k] for k in layout["dense"]},
    }

    def fn(values):
        rows = jax.tree.map(lambda v, r: v if r < 0 else v[:r], values, layout)
        return jax.tree.map(_digest, rows)

    out = jax.jit(fn)(values)
    return jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), out)


def _checksums(model: nn.Module, tree: dict[str, Any]) -> dict[str, Any]:
    modules, dense = _modules(model), _dense(model)
    embeddings = {k: v["tables"] for k, v in tree["embeddings"].items()}
    return _digests(modules, dense, embeddings, tree["dense"])


def _table_dtype(config: Any) -> str:
    """The dtype of a table's stored values (its ``data_type``'s: float32, float16 or bfloat16)."""
    return np.dtype(STACK_DTYPES[config.data_type]).name


def _optimizer_name(module: ShardedEmbeddingBagCollection) -> str:
    return type(module.optimizer).__name__


def _description(model: nn.Module) -> dict[str, Any]:
    """What the checkpoint holds, for the strict checks of :func:`load` (JSON, in ``_CHECKPOINT_METADATA``)."""
    from tpurec.core import value_of

    collections = {}
    for mpath, m in _modules(model).items():
        collections[_key(mpath)] = {
            "path": mpath,
            "optimizer": _optimizer_name(m),
            "slots": list(m.optimizer.slots),
            "tables": {
                c.name: {"rows": c.num_embeddings, "dim": c.embedding_dim, "dtype": _table_dtype(c)}
                for c in m.embedding_bag_configs()
            },
        }
    dense = {}
    for name, t in _dense(model).items():
        dense[_key(name)] = {"name": name, "shape": list(t.shape), "dtype": str(value_of(t, "checkpoint").dtype)}
    return {"format": FORMAT, "collections": collections, "dense": dense}


def _check_committed(path: str) -> None:
    """Raises CheckpointError unless ``path`` is a checkpoint folder whose save finished."""
    folder = Path(path)
    if integrity.ORBAX_TEMPORARY in folder.name:
        raise integrity.unusable(path, "the temporary folder of a save that did not finish, not a checkpoint")
    if not folder.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    for name in ("_CHECKPOINT_METADATA", "_METADATA", "manifest.ocdbt"):
        if not (folder / name).is_file():
            raise integrity.unusable(folder / name, "missing, the checkpoint is incomplete or damaged")


def _read_metadata(checkpointer: Any, path: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The stored tree's array metadata and the model description (None for older checkpoints)."""
    try:
        stored = checkpointer.metadata(path)
    except Exception as e:  # Orbax reports unreadable metadata in many ways
        raise CheckpointError(
            f"{path}/_CHECKPOINT_METADATA or _METADATA: unreadable, the checkpoint is damaged ({type(e).__name__}: {e})"
        ) from e
    stored_tree = getattr(stored, "item_metadata", stored)
    stored_tree = getattr(stored_tree, "tree", stored_tree)
    if (
        not isinstance(stored_tree, dict)
        or not isinstance(stored_tree.get("embeddings"), dict)
        or not isinstance(stored_tree.get("dense"), dict)
    ):
        raise integrity.unusable(f"{path}/_METADATA", "damaged or not a tpurec sharded checkpoint")
    custom = getattr(stored, "custom_metadata", None) or {}
    description = custom.get("tpurec") if isinstance(custom, dict) else None
    if description is None:
        if "checksums" in stored_tree:
            raise CheckpointError(
                f"{path}/_CHECKPOINT_METADATA: the model description is missing, the checkpoint is damaged"
            )
        integrity.warn_unchecked(path, "checked by names and dims only", "tpurec.sparse.checkpoint.sharded.save")
        return stored_tree, None
    if not isinstance(description, dict) or description.get("format") != FORMAT or "checksums" not in stored_tree:
        raise integrity.unusable(f"{path}/_CHECKPOINT_METADATA", f"damaged (not a {FORMAT} description)")
    return stored_tree, description


def _check_fits(
    path: str,
    modules: dict[str, ShardedEmbeddingBagCollection],
    dense: dict[str, Any],
    stored_tree: dict[str, Any],
    description: dict[str, Any] | None,
) -> None:
    """Raises ValueError unless the checkpoint holds exactly the model's tables, slots and dense tensors.

    The messages are those of the one-device format (:mod:`tpurec.sparse.checkpoint.integrity`).
    """
    from tpurec.core import value_of

    saved_paths, mine = set(stored_tree["embeddings"]), {_key(p) for p in modules}
    if saved_paths != mine:
        raise ValueError(f"the checkpoint holds sharded collections {sorted(saved_paths)}, the model {sorted(mine)}")
    for mpath, module in modules.items():
        key = _key(mpath)
        saved_tables = stored_tree["embeddings"][key].get("tables")
        names = {c.name for c in module.embedding_bag_configs()}
        if not isinstance(saved_tables, dict) or set(saved_tables) != names:
            got = sorted(saved_tables) if isinstance(saved_tables, dict) else saved_tables
            raise ValueError(f"collection '{mpath}': the checkpoint has tables {got}, the model {sorted(names)}")
        saved = None if description is None else description["collections"].get(key)
        mine_name = _optimizer_name(module)
        if saved is not None and saved.get("optimizer") != mine_name:
            raise integrity.optimizer_state_error(
                mpath,
                f"the optimizer state is of {saved.get('optimizer')}, but this EmbeddingBagCollection uses "
                f"{mine_name}; build the module with the optimizer the checkpoint was trained with",
            )
        slots = sorted(module.optimizer.slots)
        for cfg in module.embedding_bag_configs():
            state_key = f"{mpath}.embedding_bags.{cfg.name}.weight" if mpath else f"embedding_bags.{cfg.name}.weight"
            got_slots = sorted(k for k in saved_tables[cfg.name] if k != "weight")
            if "weight" not in saved_tables[cfg.name] or got_slots != slots:
                raise integrity.optimizer_state_error(
                    mpath, f"the optimizer state of {state_key} has slots {got_slots}, but {mine_name} needs {slots}"
                )
            meta = saved_tables[cfg.name]["weight"]
            rows = cfg.num_embeddings
            if saved is not None:
                table = saved["tables"][cfg.name]
                rows = table["rows"]
                integrity.check_dtype(state_key, table["dtype"], _table_dtype(cfg))
                integrity.check_dtype(state_key, meta.dtype, _table_dtype(cfg))
            integrity.check_shape(state_key, (rows, *tuple(meta.shape)[1:]), (cfg.num_embeddings, cfg.embedding_dim))
    # Keys as the state dict names them (the tree's keys stand "~" for ".").
    integrity.check_keys(dense, (k.replace("~", ".") for k in stored_tree["dense"]))
    for name, t in dense.items():
        meta = stored_tree["dense"][_key(name)]
        integrity.check_shape(name, meta.shape, t.shape)
        integrity.check_dtype(name, np.dtype(meta.dtype), np.dtype(value_of(t, "checkpoint").dtype))


def _restore(checkpointer: Any, path: str, target: dict[str, Any]) -> dict[str, Any]:
    try:
        # strict=False: the row padding depends on the device count, which may differ.
        return checkpointer.restore(path, target, strict=False)
    except Exception as e:  # TensorStore and Orbax report damaged files in many ways
        raise CheckpointError(
            f"{path}: a file of the checkpoint is damaged or missing ({type(e).__name__}: {e})"
        ) from e


def _verify_checksums(
    path: str, modules: dict[str, ShardedEmbeddingBagCollection], dense: dict[str, Any], restored: dict[str, Any]
) -> None:
    """Raises CheckpointError naming the first restored entry whose checksum differs from the saved one."""
    embeddings = {k: v["tables"] for k, v in restored["embeddings"].items()}
    found = _digests(modules, dense, embeddings, restored["dense"])
    saved = restored["checksums"]
    for mpath in modules:
        key = _key(mpath)
        for table, slots in found["embeddings"][key].items():
            for slot, digest in slots.items():
                if not np.array_equal(np.asarray(saved["embeddings"][key][table][slot]), digest):
                    raise integrity.damaged_entry(path, f"entry '{mpath}' table '{table}' {slot}")
    for name in dense:
        if not np.array_equal(np.asarray(saved["dense"][_key(name)]), found["dense"][_key(name)]):
            raise integrity.damaged_entry(path, f"entry '{name}'")


def _remove_leftovers(folder: Path) -> None:
    """Removes the temporary folders of saves that did not finish (Orbax never reuses them)."""
    if not folder.is_dir():
        return
    for entry in folder.iterdir():
        if integrity.ORBAX_TEMPORARY in entry.name and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)


def _file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return integrity.file_sha256(f)


def _write_manifest(folder: Path) -> None:
    """Records every file of a committed checkpoint (size, sha256), atomically, in :data:`MANIFEST`."""
    files = {}
    for file in sorted(folder.rglob("*")):
        if file.is_file() and file.name != MANIFEST:
            files[file.relative_to(folder).as_posix()] = {"size": file.stat().st_size, "sha256": _file_sha256(file)}
    data = json.dumps({"format": FORMAT, "files": files}, indent=1).encode()
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{MANIFEST}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / MANIFEST)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _check_manifest(folder: Path) -> bool:
    """Checks every file against the manifest; False when there is none (an older checkpoint).

    Raises:
        CheckpointError: the manifest is damaged, or a file is missing, cut or changed (named).
    """
    manifest = folder / MANIFEST
    if not manifest.exists():
        return False
    try:
        record = json.loads(manifest.read_text())
        files = record["files"]
        if record.get("format") != FORMAT or not isinstance(files, dict):
            raise ValueError("not a tpurec manifest")
        entries = [(name, int(entry["size"]), str(entry["sha256"])) for name, entry in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise integrity.unusable(manifest, f"damaged ({type(e).__name__}: {e})") from e
    for name, size, sha256 in entries:
        file = folder / name
        if not file.is_file():
            raise integrity.unusable(file, "missing, the checkpoint is incomplete")
        if file.stat().st_size != size:
            raise integrity.unusable(file, f"{file.stat().st_size} bytes, {size} were saved (a cut or damaged file)")
        if _file_sha256(file) != sha256:
            raise integrity.unusable(file, "damaged (its sha256 does not match the one saved)")
    return True
