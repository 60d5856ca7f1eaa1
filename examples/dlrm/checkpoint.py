"""Checkpoints of a DLRM run: one file, written atomically.

A checkpoint holds the model's ``state_dict`` (TorchRec's keys), each tpurec
``EmbeddingBagCollection``'s fused optimizer slots and step counts
(``optimizer_state_dict``), the dense optimizer's ``state_dict``, where the run
is (epoch, step), the loss/AUC history and numpy's global generator state
(TorchRec's Criteo readers shuffle with it). Everything is copied to the host
first; the file is written next to its final name and then renamed
(``os.replace``), so a crash mid-write leaves the previous checkpoint intact.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from torch import nn

import tpurec.sparse as sparse
from dlrm.flags import ConfigError

FILE_NAME = "checkpoint.pt"


def _to_host(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _to_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_host(v) for v in value)
    return value


def embedding_collections(model: nn.Module) -> dict[str, sparse.EmbeddingBagCollection]:
    """tpurec embedding collections of ``model`` by module path."""
    return {name: m for name, m in model.named_modules() if isinstance(m, sparse.EmbeddingBagCollection)}


def save(directory: str, model: nn.Module, dense_optimizer: torch.optim.Optimizer, progress: dict[str, Any],
         numpy_state: Any = None) -> str:
    """Writes the checkpoint of ``model`` and its optimizers to ``directory``.

    Args:
        directory: the checkpoint directory (created if missing).
        model: the model.
        dense_optimizer: the dense optimizer.
        progress: where the run is and its history (JSON-like).
        numpy_state: numpy's global generator state to resume with (default: the current one).

    Returns:
        The checkpoint's path.
    """
    os.makedirs(directory, exist_ok=True)
    payload = {
        "model": _to_host(model.state_dict()),
        "embedding_optimizers": {name: _to_host(m.optimizer_state_dict()) for name, m in embedding_collections(model).items()},
        "dense_optimizer": _to_host(dense_optimizer.state_dict()),
        "progress": progress,
        "numpy_random_state": np.random.get_state() if numpy_state is None else numpy_state,
    }
    path = os.path.join(directory, FILE_NAME)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load(directory: str, model: nn.Module, dense_optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Restores ``model`` and its optimizers from ``directory``'s checkpoint.

    Returns:
        ``{"progress": ..., "numpy_random_state": ...}`` as saved.

    Raises:
        ConfigError: no checkpoint there, or it does not fit the model.
    """
    path = os.path.join(directory, FILE_NAME)
    if not os.path.isfile(path):
        raise ConfigError(f"--resume: no checkpoint at {path}; run once with --checkpoint_dir {directory} first")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False)
        model.load_state_dict(payload["model"])
    except (RuntimeError, KeyError, EOFError, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"--resume: checkpoint {path} does not fit this model/flags ({first})") from None
    collections = embedding_collections(model)
    for name, state in payload["embedding_optimizers"].items():
        collections[name].load_optimizer_state_dict(state)
    dense_optimizer.load_state_dict(payload["dense_optimizer"])
    return {"progress": payload["progress"], "numpy_random_state": payload["numpy_random_state"]}
