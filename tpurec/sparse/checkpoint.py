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
     "extra": {...}}
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from tpurec.sparse.modules import EmbeddingBagCollection

__all__ = ["FORMAT", "state_dict", "load_state_dict", "save", "load"]

FORMAT = "tpurec.sparse.checkpoint/1"


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


def state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Everything a resume needs, as one dict of CPU tensors.

    Args:
        model: the model (any module containing tpurec ``EmbeddingBagCollection``\\ s).
        optimizer: the dense optimizer, if any.
        extra: plain user data (numbers, strings, lists, dicts, tensors: what
            ``torch.load(weights_only=True)`` reads), e.g. the epoch.

    Returns:
        The checkpoint dict (see the module docstring for its layout).
    """
    return {
        "format": FORMAT,
        "model": _to_cpu(model.state_dict()),
        "embedding_optimizers": {name: _to_cpu(m.optimizer_state_dict()) for name, m in _embedding_modules(model).items()},
        "optimizer": None if optimizer is None else _to_cpu(optimizer.state_dict()),
        "rng": _rng_state(),
        "extra": dict(extra or {}),
    }


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
    missing = sorted(set(mine) - set(state))
    unexpected = sorted(set(state) - set(mine))
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit the model: missing keys {missing}, unexpected keys {unexpected}")
    for key, target in mine.items():
        value = state[key]
        if isinstance(target, torch.Tensor) and (not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(target.shape)):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"checkpoint entry {key} has shape {got}, the model's is {tuple(target.shape)}")


def load_state_dict(
    model: nn.Module, checkpoint: Mapping[str, Any], optimizer: torch.optim.Optimizer | None = None, *, restore_rng: bool = True
) -> dict[str, Any]:
    """Restores what :func:`state_dict` returned.

    Everything is checked first (format, model keys and shapes, embedding
    optimizer kinds, slots and shapes, presence of the dense optimizer state),
    then written.

    Args:
        model: the model to restore, built as the saved one was.
        checkpoint: the dict from :func:`state_dict` (or :func:`torch.load` of a saved file).
        optimizer: the dense optimizer to restore (required if one was saved).
        restore_rng: also restore the CPU and tpu RNG states.

    Returns:
        The checkpoint's ``extra`` dict.

    Raises:
        ValueError: the checkpoint does not fit ``model`` / ``optimizer``; nothing was changed.
    """
    if not isinstance(checkpoint, Mapping) or checkpoint.get("format") != FORMAT:
        found = checkpoint.get("format") if isinstance(checkpoint, Mapping) else type(checkpoint).__name__
        raise ValueError(f"not a {FORMAT} checkpoint (format: {found!r}); write one with tpurec.sparse.checkpoint.save")
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
            raise ValueError(f"embedding optimizer state of module '{name or '<model>'}': {e}") from e
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


def save(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, extra: Mapping[str, Any] | None = None) -> Path:
    """Writes :func:`state_dict` to ``path`` atomically.

    The file is written under a temporary name in the same folder, flushed to
    disk, then renamed over ``path``: a crash mid-write leaves the previous
    checkpoint intact, never a torn file.

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
    checkpoint = state_dict(model, optimizer, extra)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def load(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, restore_rng: bool = True) -> dict[str, Any]:
    """Restores a checkpoint written by :func:`save` (see :func:`load_state_dict`).

    Args:
        path: the checkpoint file.
        model: the model, built as the saved one was (on any device).
        optimizer: the dense optimizer (required if one was saved).
        restore_rng: also restore the RNG states.

    Returns:
        The ``extra`` dict given to :func:`save`.
    """
    checkpoint = torch.load(Path(path), map_location="cpu", weights_only=True)
    return load_state_dict(model, checkpoint, optimizer, restore_rng=restore_rng)
