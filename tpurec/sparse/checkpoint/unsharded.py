"""One-call checkpoints: everything a resume needs, written atomically.

``model.state_dict()`` holds the tables in torchrec's key layout
(``...embedding_bags.<table>.weight``), so a checkpoint's ``"model"`` entry loads
into a torchrec model as well. The fused embedding optimizers keep slots and
step counts outside ``state_dict`` (as torchrec's fused modules do); this module
is their documented companion: :func:`save` writes the model, the slots and
step counts of every tpurec :class:`EmbeddingBagCollection`, the dense
optimizer and the RNG states to one file, and :func:`load` restores all of it,
after checking that everything fits, so a bad checkpoint changes nothing.

Example::

    from tpurec.sparse import checkpoint
    checkpoint.save("ckpt.pt", model, dense_optimizer)   # every N steps
    ...
    checkpoint.load("ckpt.pt", model, dense_optimizer)   # resume: bit for bit the same run

File layout (a ``torch.save`` dict, CPU tensors only)::

    {"format": "tpurec.sparse.checkpoint/1",
     "model": model.state_dict(),
     "embedding_optimizers": {"<module path>": ebc.optimizer_state_dict()},
     "optimizer": dense_optimizer.state_dict() or None,
     "rng": {"cpu": torch.get_rng_state(), "tpu": [torch.tpu.get_rng_state(i), ...]},
     "extra": {...},
     "checksums": {"<entry>": "<sha256 of its dtype, shape and bytes>", ...}}

Integrity: every entry (each tensor and each plain value, by its path such as
``model/<key>``) has a sha256 in ``"checksums"``, and :func:`save` also records
the sha256 of the whole file in the zip comment at its end (an ordinary zip
feature; ``torch.load`` reads the file as before). :func:`load` checks both
before anything is written: a damaged, truncated or partly written file is a
:class:`CheckpointError` naming the file (and the entry, when one entry is
damaged), and the model is left unchanged.

Checkpoints written before checksums existed (no ``"checksums"`` entry, no file
hash) still load, unchecked, with a warning; save them again with :func:`save`
to add the checksums.

:func:`save` removes the temporary files that interrupted saves left in the
folder; :func:`list_checkpoints` lists the committed checkpoints of a folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import tempfile
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tpurec.sparse.checkpoint.integrity import (
    MANIFEST,
    ORBAX_TEMPORARY,
    CheckpointError,
    check_keys,
    check_shape,
    damaged_entry,
    file_sha256,
    optimizer_state_error,
    unusable,
    warn_unchecked,
)
from tpurec.sparse.modules import EmbeddingBagCollection

__all__ = ["FORMAT", "CheckpointError", "list_checkpoints", "load", "load_state_dict", "save", "state_dict"]

FORMAT = "tpurec.sparse.checkpoint/1"

# The zip comment that carries the whole file's sha256 (see _seal).
_SEAL = b"tpurec-sha256:"
_SEAL_LENGTH = len(_SEAL) + 64
_EOCD = b"PK\x05\x06"  # the zip's end-of-central-directory record: 22 bytes, then the comment
# mkstemp's names for the temporary files of save(): ".<name>.<8 random characters>.tmp"
_TEMPORARY = re.compile(r"^\..+\.[A-Za-z0-9_]{8}\.tmp$")


def _digest(value: Any) -> str:
    """The sha256 of one entry: a tensor's dtype, shape and bytes, or a plain value's type and repr."""
    h = hashlib.sha256()
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"tensor|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, Mapping):
        h.update(f"{type(value).__name__}|{len(value)}".encode())  # keys are in the paths below it
    elif isinstance(value, (list, tuple)):
        h.update(f"{type(value).__name__}|{len(value)}".encode())
    else:
        h.update(f"{type(value).__name__}|{value!r}".encode())
    return h.hexdigest()


def _entries(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every container and leaf of a checkpoint, by path (``model/<key>``, ``optimizer/state/0/exp_avg``...)."""
    yield prefix or "/", value
    if isinstance(value, Mapping):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return
    for key, item in items:
        yield from _entries(item, f"{prefix}/{key if isinstance(key, str) else repr(key)}")


def _checksums(checkpoint: Mapping[str, Any]) -> dict[str, str]:
    body = {k: v for k, v in checkpoint.items() if k != "checksums"}
    return {path: _digest(value) for path, value in _entries(body)}


def _verify_checksums(checkpoint: Mapping[str, Any], source: str) -> None:
    """Raises CheckpointError naming the first entry whose checksum differs (or that is missing or extra)."""
    saved = checkpoint["checksums"]
    if not isinstance(saved, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in saved.items()):
        raise unusable(source, "the checksums entry is damaged")
    found = _checksums(checkpoint)
    for path in sorted(set(saved) | set(found)):
        if path not in found:
            raise unusable(source, f"entry '{path}' is missing (the checkpoint is damaged)")
        if path not in saved:
            raise unusable(source, f"entry '{path}' has no checksum (the checkpoint is damaged)")
        if saved[path] != found[path]:
            raise damaged_entry(source, f"entry '{path}'")


def _to_cpu(value: Any) -> Any:
    """A copy of ``value`` with every tensor detached and on the CPU (nested dicts, lists, tuples)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, Mapping):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _embedding_modules(model: nn.Module) -> dict[str, EmbeddingBagCollection]:
    return {name: m for name, m in model.named_modules() if isinstance(m, EmbeddingBagCollection)}


def _rng_state() -> dict[str, Any]:
    tpu = getattr(torch, "tpu", None)
    tpu_states = [tpu.get_rng_state(i) for i in range(tpu.device_count())] if tpu is not None else []
    return {"cpu": torch.get_rng_state(), "tpu": tpu_states}


def _set_rng_state(rng: Mapping[str, Any]) -> None:
    torch.set_rng_state(rng["cpu"])
    tpu = getattr(torch, "tpu", None)
    if tpu is not None:
        for i, state in enumerate(rng.get("tpu", [])[: tpu.device_count()]):
            tpu.set_rng_state(state, i)


def state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Everything a resume needs, as one dict of CPU tensors.

    Args:
        model: the model (any module containing tpurec ``EmbeddingBagCollection``\\ s).
        optimizer: the dense optimizer, if any.
        extra: plain user data (numbers, strings, lists, dicts, tensors: what
            ``torch.load(weights_only=True)`` reads), e.g. the epoch.

    Returns:
        The checkpoint dict (see the module docstring for its layout).
    """
    checkpoint = {
        "format": FORMAT,
        "model": _to_cpu(model.state_dict()),
        "embedding_optimizers": {
            name: _to_cpu(m.optimizer_state_dict()) for name, m in _embedding_modules(model).items()
        },
        "optimizer": None if optimizer is None else _to_cpu(optimizer.state_dict()),
        "rng": _rng_state(),
        "extra": dict(extra or {}),
    }
    checkpoint["checksums"] = _checksums(checkpoint)
    return checkpoint


@contextlib.contextmanager
def _optimizer_state_follows(modules: Mapping[str, EmbeddingBagCollection]) -> Iterator[None]:
    for m in modules.values():
        m._optimizer_state_follows = True
    try:
        yield
    finally:
        for m in modules.values():
            m._optimizer_state_follows = False


def _check_model_state(model: nn.Module, state: Mapping[str, Any]) -> None:
    """Raises ValueError unless ``state`` has exactly the model's keys and shapes."""
    mine = model.state_dict()
    check_keys(mine, state)
    for key, target in mine.items():
        value = state[key]
        if isinstance(target, torch.Tensor):
            check_shape(key, value.shape if isinstance(value, torch.Tensor) else type(value).__name__, target.shape)


def load_state_dict(
    model: nn.Module,
    checkpoint: Mapping[str, Any],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Restores what :func:`state_dict` returned.

    Everything is checked first (format, checksums, model keys and shapes,
    embedding optimizer kinds, slots and shapes, presence of the dense optimizer
    state), then written.

    Args:
        model: the model to restore, built as the saved one was.
        checkpoint: the dict from :func:`state_dict` (or :func:`torch.load` of a saved file).
        optimizer: the dense optimizer to restore (required if one was saved).
        restore_rng: also restore the CPU and tpu RNG states.

    Returns:
        The checkpoint's ``extra`` dict.

    Raises:
        CheckpointError: a damaged entry (the message names it); nothing was changed.
        ValueError: the checkpoint does not fit ``model`` / ``optimizer``; nothing was changed.
    """
    return _load_checked(model, checkpoint, optimizer, restore_rng=restore_rng, source="the checkpoint")


def _check_integrity(checkpoint: Any, source: str) -> None:
    """Raises unless ``checkpoint`` is of this format with every checksum matching (old ones: a warning)."""
    if not isinstance(checkpoint, Mapping) or checkpoint.get("format") != FORMAT:
        found = checkpoint.get("format") if isinstance(checkpoint, Mapping) else type(checkpoint).__name__
        raise ValueError(f"not a {FORMAT} checkpoint (format: {found!r}); write one with tpurec.sparse.checkpoint.save")
    if "checksums" in checkpoint:
        _verify_checksums(checkpoint, source)
    else:
        warn_unchecked(source, "unchecked", "tpurec.sparse.checkpoint.save")
    for key in ("model", "embedding_optimizers", "optimizer"):
        if key not in checkpoint:
            raise unusable(source, f"entry '/{key}' is missing (the checkpoint is damaged)")


def _load_checked(
    model: nn.Module,
    checkpoint: Mapping[str, Any],
    optimizer: torch.optim.Optimizer | None,
    *,
    restore_rng: bool,
    source: str,
) -> dict[str, Any]:
    _check_integrity(checkpoint, source)
    _check_model_state(model, checkpoint["model"])
    modules = _embedding_modules(model)
    saved = checkpoint["embedding_optimizers"]
    if set(saved) != set(modules):
        raise ValueError(
            f"checkpoint has embedding optimizer states for modules {sorted(saved)}, the model has {sorted(modules)}"
        )
    if (checkpoint["optimizer"] is None) != (optimizer is None):
        raise ValueError(
            "the checkpoint has a dense optimizer state but no optimizer was passed"
            if optimizer is None
            else "an optimizer was passed but the checkpoint has no dense optimizer state"
        )
    # Every module's state is checked before any module is written.
    for name, module in modules.items():
        try:
            module.check_optimizer_state_dict(saved[name])
        except ValueError as e:
            raise optimizer_state_error(name, e) from e
    if optimizer is not None:
        _validate_dense_optimizer(optimizer, checkpoint["optimizer"])
    with _optimizer_state_follows(modules):
        model.load_state_dict(checkpoint["model"])
    for name, module in modules.items():
        module.load_optimizer_state_dict(saved[name])
    if optimizer is not None:
        optimizer.load_state_dict(checkpoint["optimizer"])
    if restore_rng and checkpoint.get("rng") is not None:
        _set_rng_state(checkpoint["rng"])
    return dict(checkpoint.get("extra", {}))


def _validate_dense_optimizer(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    groups = state.get("param_groups") if isinstance(state, Mapping) else None
    if groups is None or len(groups) != len(optimizer.param_groups):
        raise ValueError("the dense optimizer state does not fit the optimizer (different parameter groups)")
    for saved, group in zip(groups, optimizer.param_groups):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"the dense optimizer state has a group of {len(saved['params'])} parameters, the optimizer "
                f"{len(group['params'])}"
            )


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Writes :func:`state_dict` to ``path`` atomically, with checksums.

    The file is written under a temporary name in the same folder, sealed with
    the sha256 of its bytes, flushed to disk, then renamed over ``path``: a crash
    mid-write leaves the previous checkpoint intact, never a torn file.
    Temporary files that earlier, interrupted saves left in the folder are removed.

    Args:
        path: the checkpoint file.
        model: see :func:`state_dict`.
        optimizer: see :func:`state_dict`.
        extra: see :func:`state_dict`.

    Returns:
        The path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(path.parent)
    checkpoint = state_dict(model, optimizer, extra)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w+b") as f:
            # Held until the rename: a later save's clean-up never removes a file being written.
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            torch.save(checkpoint, f)
            f.flush()
            _seal(f)
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def _seal(f: Any) -> None:
    """Appends the sha256 of the file's bytes as its zip comment (``f`` holds one zip, at its end)."""
    f.seek(-22, os.SEEK_END)
    end = f.read(22)
    if end[:4] != _EOCD or end[-2:] != b"\0\0":
        raise RuntimeError("torch.save wrote no zip end record; cannot seal the checkpoint")
    f.seek(-2, os.SEEK_END)
    f.write(_SEAL_LENGTH.to_bytes(2, "little"))
    f.flush()
    f.seek(0)
    digest = file_sha256(f, os.fstat(f.fileno()).st_size)
    f.seek(0, os.SEEK_END)
    f.write(_SEAL + digest.encode())


def _check_seal(path: Path) -> bool:
    """True when ``path`` carries a file hash and it matches; False when it has none (an older file).

    Raises:
        CheckpointError: the file hash does not match (a damaged or partly written file).
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 22 + _SEAL_LENGTH:
            return False
        f.seek(size - _SEAL_LENGTH - 22)
        end = f.read(22 + _SEAL_LENGTH)
        if end[:4] != _EOCD or end[22 : 22 + len(_SEAL)] != _SEAL:
            return False
        f.seek(0)
        if file_sha256(f, size - _SEAL_LENGTH) != end[22 + len(_SEAL) :].decode("ascii", "replace"):
            raise unusable(path, "the file is damaged (its sha256 does not match the one recorded when it was saved)")
    return True


def _remove_leftovers(folder: Path) -> None:
    """Removes temporary files of interrupted saves (one being written is locked, and kept)."""
    for candidate in folder.iterdir():
        if not _TEMPORARY.match(candidate.name) or not candidate.is_file():
            continue
        try:
            with open(candidate, "rb") as f:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                candidate.unlink()
        except OSError:
            continue  # being written by another save, or already gone


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Restores a checkpoint written by :func:`save` (see :func:`load_state_dict`).

    The file's hash and every entry's checksum are checked before anything is written.

    Args:
        path: the checkpoint file.
        model: the model, built as the saved one was (on any device).
        optimizer: the dense optimizer (required if one was saved).
        restore_rng: also restore the RNG states.

    Returns:
        The ``extra`` dict given to :func:`save`.

    Raises:
        CheckpointError: the file is missing, damaged or incomplete (the message names it); nothing was changed.
        ValueError: the checkpoint does not fit ``model`` / ``optimizer``; nothing was changed.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    sealed = _check_seal(path)
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch reports a damaged zip or pickle in many ways
        raise CheckpointError(
            f"{path}: not a readable checkpoint, the file is damaged ({type(e).__name__}: {e})"
        ) from e
    if isinstance(checkpoint, Mapping) and "checksums" in checkpoint and not sealed:
        raise unusable(path, "the file hash written by save is missing (a truncated or damaged file)")
    return _load_checked(model, checkpoint, optimizer, restore_rng=restore_rng, source=str(path))


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """The committed checkpoints in ``directory``, oldest first (newest last).

    Lists the files written by :func:`save` and the folders written by
    :func:`tpurec.sparse.checkpoint.sharded.save`; leaves out the temporary files
    and folders of saves that did not finish. A listed checkpoint is still checked
    when it is loaded.

    Args:
        directory: the folder to look in.

    Returns:
        Their paths, by modification time (then name).
    """
    found = []
    for entry in Path(directory).iterdir():
        if entry.name.startswith(".") or entry.name.endswith(".tmp") or ORBAX_TEMPORARY in entry.name:
            continue
        if (entry.is_file() and zipfile.is_zipfile(entry)) or (entry.is_dir() and _committed_sharded(entry)):
            found.append(entry)
    return sorted(found, key=lambda p: (p.stat().st_mtime_ns, p.name))


def _committed_sharded(folder: Path) -> bool:
    """A sharded checkpoint whose save finished: with its manifest (or an older one, committed by Orbax)."""
    if (folder / MANIFEST).is_file():
        return True
    try:
        custom = json.loads((folder / "_CHECKPOINT_METADATA").read_text()).get("custom_metadata") or {}
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(custom, dict) and "tpurec" not in custom  # a newer one without its manifest did not finish
