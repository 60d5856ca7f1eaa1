"""What both checkpoint formats check before anything is written, and how they say it.

A checkpoint that cannot be used (damaged, incomplete, partly written) is a
:class:`CheckpointError` naming the file or the entry and ending in what to do. One that does
not fit the model is a ``ValueError`` naming the first key whose presence, shape or dtype
differs, in the same words for a file and a sharded folder. A checkpoint written before
checksums existed loads with one warning per file.

Example::

    check_keys(model_keys, saved_keys)            # ValueError: missing keys [...], unexpected keys [...]
    check_shape(key, saved.shape, target.shape)   # ValueError: checkpoint entry <key> has shape ...
    raise unusable(path, "the file is damaged")   # CheckpointError: <path>: ...; use another checkpoint
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterable
from typing import Any, BinaryIO

__all__ = [
    "MANIFEST",
    "ORBAX_TEMPORARY",
    "CheckpointError",
    "check_dtype",
    "check_keys",
    "check_shape",
    "damaged_entry",
    "file_sha256",
    "optimizer_state_error",
    "unusable",
    "warn_unchecked",
]

# A sharded checkpoint's record of every file (size, sha256), written once Orbax has committed it.
MANIFEST = "tpurec_manifest.json"
# What Orbax appends to a checkpoint folder's name while writing it.
ORBAX_TEMPORARY = ".orbax-checkpoint-tmp"


class CheckpointError(ValueError):
    """A checkpoint is damaged, incomplete or does not fit the model (the message names the file or entry)."""


def unusable(where: Any, why: str) -> CheckpointError:
    """The error for a checkpoint that cannot be used: ``<where>: <why>; use another checkpoint``.

    Args:
        where: the file, folder or entry at fault.
        why: what is wrong with it.
    """
    return CheckpointError(f"{where}: {why}; use another checkpoint")


def damaged_entry(source: Any, entry: str) -> CheckpointError:
    """The error for an entry whose checksum differs from the one saved.

    Args:
        source: the checkpoint (file or folder).
        entry: the entry, as the message names it (``"entry 'model/w'"``).
    """
    return unusable(source, f"{entry} is damaged (its checksum does not match the one saved)")


def file_sha256(f: BinaryIO, length: int | None = None) -> str:
    """The sha256 of an open file's next ``length`` bytes (all of the rest when None), read in blocks."""
    digest = hashlib.sha256()
    left = -1 if length is None else length
    while left != 0:
        block = f.read(1 << 20 if left < 0 else min(left, 1 << 20))
        if not block:
            break
        digest.update(block)
        left = left - len(block) if left > 0 else left
    return digest.hexdigest()


_warned_unchecked: set[str] = set()


def warn_unchecked(source: Any, checked: str, save: str) -> None:
    """Warns, once per checkpoint, that it was written without checksums.

    Args:
        source: the checkpoint (file or folder).
        checked: how it is loaded instead (``"unchecked"``, ``"checked by names and dims only"``).
        save: the function that writes it again with checksums.
    """
    if str(source) in _warned_unchecked:
        return
    _warned_unchecked.add(str(source))
    warnings.warn(
        f"{source} was written without checksums (by an older tpurec) and is loaded {checked}; save it again "
        f"with {save} to add them",
        UserWarning,
        stacklevel=3,
    )


def check_keys(model_keys: Iterable[str], saved_keys: Iterable[str]) -> None:
    """Raises ValueError unless the checkpoint holds exactly the model's keys (the message lists both differences)."""
    mine, saved = set(model_keys), set(saved_keys)
    missing, unexpected = sorted(mine - saved), sorted(saved - mine)
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit the model: missing keys {missing}, unexpected keys {unexpected}")


def check_shape(key: str, saved: Any, model: Iterable[int]) -> None:
    """Raises ValueError when entry ``key`` has another shape than the model's.

    Args:
        key: the entry's state-dict key.
        saved: the checkpoint's shape (or, for a value that is not a tensor, its type's name).
        model: the model's shape.
    """
    want = tuple(model)
    got = tuple(saved) if not isinstance(saved, str) else saved
    if got != want:
        raise ValueError(f"checkpoint entry {key} has shape {got}, the model's is {want}")


def check_dtype(key: str, saved: Any, model: Any) -> None:
    """Raises ValueError when entry ``key`` has another dtype than the model's (compared as text)."""
    if str(saved) != str(model):
        raise ValueError(f"checkpoint entry {key} has dtype {saved}, the model's is {model}")


def optimizer_state_error(module_path: str, error: Exception | str) -> ValueError:
    """The error for an embedding collection's optimizer state that does not fit it, naming the collection."""
    return ValueError(f"embedding optimizer state of module '{module_path or '<model>'}': {error}")
