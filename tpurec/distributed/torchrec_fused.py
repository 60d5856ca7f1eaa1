"""The patch ``torchrec_tpu_fused``: TorchRec's grouped lookups build tpurec's kernels on tpu.

TorchRec's ``GroupedPooledEmbeddingsLookup`` and ``GroupedEmbeddingsLookup``
(``torchrec.distributed.embedding_lookup``) build one compute kernel per table group in
``_create_embedding_kernel``. :func:`install` wraps both: for a tpu device the group goes to
:func:`tpurec.sparse.torchrec_fused.create_kernel` (a ``FUSED`` group of an
EmbeddingBagCollection becomes tpurec's fused kernel; what tpurec cannot run as TorchRec would
raises), any other group or device to TorchRec's own method. ``tpurec.sparse`` is imported on
the first tpu group only: this patch is applied while TorchRec's distributed modules are still
being imported, and importing ``tpurec.sparse`` then would import them again, half initialized.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

__all__ = ["install"]

_MODULE = "torchrec.distributed.embedding_lookup"


def _create(pooled: bool, config: Any, pg: Any, device: Any, sharding_type: Any = None) -> Any:
    if device is None or torch.device(device).type != "tpu":
        return None
    fused = importlib.import_module("tpurec.sparse.torchrec_fused")
    return fused.create_kernel(pooled, config, pg, torch.device(device), sharding_type)


def install() -> None:
    """Wraps both grouped lookups' ``_create_embedding_kernel`` (idempotent)."""
    lookup = importlib.import_module(_MODULE)

    pooled = lookup.GroupedPooledEmbeddingsLookup
    if not getattr(pooled._create_embedding_kernel, "_tpurec", False):
        original_pooled = pooled._create_embedding_kernel

        def create_pooled(self: Any, config: Any, device: Any, pg: Any, sharding_type: Any, env: Any) -> Any:
            kernel = _create(True, config, pg, device, sharding_type)
            return kernel if kernel is not None else original_pooled(self, config, device, pg, sharding_type, env)

        create_pooled._tpurec = True  # pyright: ignore[reportFunctionMemberAccess]
        pooled._create_embedding_kernel = create_pooled

    sequence = lookup.GroupedEmbeddingsLookup
    if not getattr(sequence._create_embedding_kernel, "_tpurec", False):
        original_sequence = sequence._create_embedding_kernel

        def create_sequence(self: Any, config: Any, pg: Any, device: Any, env: Any = None) -> Any:
            kernel = _create(False, config, pg, device)
            return kernel if kernel is not None else original_sequence(self, config, pg, device, env)

        create_sequence._tpurec = True  # pyright: ignore[reportFunctionMemberAccess]
        sequence._create_embedding_kernel = create_sequence
