"""Checkpoints of a DLRM run: one file, written atomically.

On one device the checkpoint is ``tpurec.sparse.checkpoint``'s file (``checkpoint.pt``): the
model's ``state_dict`` (TorchRec's keys), each tpurec ``EmbeddingBagCollection``'s fused
optimizer slots and step counts, the dense optimizer's ``state_dict``, the torch RNG states,
checksums, and as its ``extra`` entry where the run is (epoch, step), the loss/AUC history and
numpy's global generator state (TorchRec's Criteo readers shuffle with it). It is written next to
its final name and then renamed, so a crash mid-write leaves the previous checkpoint intact, and
it is checked whole before anything is loaded.

A model sharded by ``tpurec.shard`` (``--num_devices > 1``) is saved in
tpurec's sharded format instead (:mod:`tpurec.sparse.checkpoint.sharded`,
Orbax: tables, optimizer slots, step counts and the dense parameters, each
device's shards written by its process) plus a small ``state.pt`` with the
dense optimizer, the position, the history and numpy's generator state. Both
go into a temporary folder that is renamed to ``sharded-<n>`` when complete;
then ``sharded.json`` (written and renamed like ``checkpoint.pt``) is pointed
at it and older folders are removed. A crash at any point leaves
``sharded.json`` naming a complete checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from typing import Any

import numpy as np
import torch
from torch import nn

from tpurec.sparse import checkpoint as sparse_checkpoint
from dlrm.flags import ConfigError

FILE_NAME = "checkpoint.pt"
# The sharded format: a pointer file naming the newest complete checkpoint folder.
SHARDED_POINTER = "sharded.json"
SHARDED_PREFIX = "sharded-"
SHARDED_TABLES = "tables"  # the Orbax folder inside a sharded checkpoint
SHARDED_STATE = "state.pt"  # dense optimizer, progress, numpy state


def _numpy_state_to_plain(state: Any) -> dict[str, Any]:
    """numpy's generator state as tensors and numbers (what ``torch.load(weights_only=True)`` reads)."""
    kind, keys, pos, has_gauss, cached_gaussian = state
    return {
        "kind": kind,
        "keys": torch.from_numpy(np.asarray(keys).astype(np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached_gaussian),
    }


def _numpy_state_from_plain(plain: dict[str, Any]) -> tuple:
    return (plain["kind"], plain["keys"].numpy().astype(np.uint32), plain["pos"], plain["has_gauss"],
            plain["cached_gaussian"])  # fmt: skip


def _to_host(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _to_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_host(v) for v in value)
    return value


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` went through ``tpurec.shard`` (holds sharded embedding collections)."""
    from tpurec.sparse.sharding import ShardedEmbeddingBagCollection

    return any(isinstance(m, ShardedEmbeddingBagCollection) for m in model.modules())


def _write_atomically(path: str, write: Any) -> None:
    """Calls ``write(file)`` on a temporary file next to ``path``, syncs it, and renames it to ``path``."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _sync_directory(directory: str) -> None:
    """Makes renames inside ``directory`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sharded_path(directory: str) -> str | None:
    """The folder of the newest complete sharded checkpoint in ``directory``, or None."""
    pointer = os.path.join(directory, SHARDED_POINTER)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        folder = json.load(f)["folder"]
    return os.path.join(directory, folder)


def _save_sharded(
    directory: str, model: nn.Module, dense_optimizer: torch.optim.Optimizer, progress: dict[str, Any], numpy_state: Any
) -> str:
    from tpurec.sparse.checkpoint import sharded

    # A unique name: a crashed save's leftovers never collide with this one.
    tmp = os.path.join(directory, f".{SHARDED_PREFIX}tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        os.makedirs(tmp)
        sharded.save(model, os.path.join(tmp, SHARDED_TABLES))  # Orbax commits this folder itself
        state = {
            "dense_optimizer": _to_host(dense_optimizer.state_dict()),
            "progress": progress,
            "numpy_random_state": numpy_state,
        }
        _write_atomically(os.path.join(tmp, SHARDED_STATE), lambda f: torch.save(state, f))
        folder = f"{SHARDED_PREFIX}{time.time_ns()}"
        os.replace(tmp, os.path.join(directory, folder))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _sync_directory(directory)
    # Only now does the checkpoint become the one --resume reads.
    _write_atomically(
        os.path.join(directory, SHARDED_POINTER), lambda f: f.write(json.dumps({"folder": folder}).encode())
    )
    _sync_directory(directory)
    for name in os.listdir(directory):  # older checkpoints and leftovers of crashed saves
        if name != folder and (name.startswith(SHARDED_PREFIX) or name.startswith(f".{SHARDED_PREFIX}tmp-")):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    return os.path.join(directory, folder)


def _load_sharded(directory: str, model: nn.Module, dense_optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from tpurec.sparse.checkpoint import sharded
    from tpurec.sparse.sharding import replicate

    path = sharded_path(directory)
    if path is None:
        hint = (
            " (it holds a one-device checkpoint: resume with --num_devices 1)"
            if os.path.isfile(os.path.join(directory, FILE_NAME))
            else f"; run once with --checkpoint_dir {directory} first"
        )
        raise ConfigError(f"--resume: no sharded checkpoint ({SHARDED_POINTER}) in {directory}{hint}")
    try:
        state = torch.load(os.path.join(path, SHARDED_STATE), map_location="cpu", weights_only=False)
        sharded.load(model, os.path.join(path, SHARDED_TABLES))
        dense_optimizer.load_state_dict(state["dense_optimizer"])
    except (RuntimeError, KeyError, EOFError, OSError, ValueError) as e:
        raise ConfigError(f"--resume: checkpoint {path} does not fit this model/flags: {_first_line(e)}") from None
    # torch moves the loaded slots to their parameter's device, one device: copy them
    # onto the mesh like the (replicated) dense parameters they belong to.
    for slots in dense_optimizer.state.values():
        for value in slots.values():
            if isinstance(value, torch.Tensor) and value.device.type == "tpu":
                replicate(value, model.mesh)
    return {"progress": state["progress"], "numpy_random_state": state["numpy_random_state"]}


def save(
    directory: str,
    model: nn.Module,
    dense_optimizer: torch.optim.Optimizer,
    progress: dict[str, Any],
    numpy_state: Any = None,
) -> str:
    """Writes the checkpoint of ``model`` and its optimizers to ``directory``.

    A sharded model (``tpurec.shard``) is written in tpurec's sharded format
    (see the module docstring), any other as one ``checkpoint.pt``.

    Args:
        directory: the checkpoint directory (created if missing).
        model: the model.
        dense_optimizer: the dense optimizer.
        progress: where the run is and its history (JSON-like).
        numpy_state: numpy's global generator state to resume with (default: the current one).

    Returns:
        The checkpoint's path (a file, or a folder for a sharded model).
    """
    os.makedirs(directory, exist_ok=True)
    if numpy_state is None:
        numpy_state = np.random.get_state()
    if is_sharded(model):
        return _save_sharded(directory, model, dense_optimizer, progress, numpy_state)
    path = os.path.join(directory, FILE_NAME)
    extra = {"progress": progress, "numpy_random_state": _numpy_state_to_plain(numpy_state)}
    return str(sparse_checkpoint.save(path, model, dense_optimizer, extra=extra))


def load(directory: str, model: nn.Module, dense_optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restores ``model`` and its optimizers from ``directory``'s checkpoint.

    Returns:
        ``{"progress": ..., "numpy_random_state": ...}`` as saved.

    Raises:
        ConfigError: no checkpoint there, or it does not fit the model.
    """
    if is_sharded(model):
        return _load_sharded(directory, model, dense_optimizer)
    path = os.path.join(directory, FILE_NAME)
    if not os.path.isfile(path):
        hint = (
            " (it holds a sharded checkpoint: resume with --num_devices > 1)"
            if os.path.isfile(os.path.join(directory, SHARDED_POINTER))
            else f"; run once with --checkpoint_dir {directory} first"
        )
        raise ConfigError(f"--resume: no checkpoint at {path}{hint}")
    try:
        # Everything (model, table slots and step counts, dense optimizer) is checked, then loaded.
        extra = sparse_checkpoint.load(path, model, dense_optimizer)
    except sparse_checkpoint.CheckpointError as e:
        raise ConfigError(f"--resume: {_first_line(e)}") from None
    except ValueError as e:
        raise ConfigError(f"--resume: checkpoint {path} does not fit this model/flags: {_first_line(e)}") from None
    return {"progress": extra["progress"], "numpy_random_state": _numpy_state_from_plain(extra["numpy_random_state"])}


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
