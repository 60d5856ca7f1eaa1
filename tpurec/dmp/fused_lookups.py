"""The patch ``torchrec_tpu_fused``: TorchRec's grouped lookups build tpurec's kernels on tpu.

TorchRec's ``GroupedPooledEmbeddingsLookup`` and ``GroupedEmbeddingsLookup``
(``torchrec.distributed.embedding_lookup``) build one compute kernel per table group in
``_create_embedding_kernel``. :func:`install` wraps both: for a tpu device the group goes to
:func:`tpurec.dmp.fused_kernel.create_kernel` (a ``FUSED`` group of an
EmbeddingBagCollection becomes tpurec's fused kernel; what tpurec cannot run as TorchRec would
raises), any other group or device to TorchRec's own method. ``tpurec.sparse`` is imported on
the first tpu group only: this patch is applied while TorchRec's distributed modules are still
being imported, and importing ``tpurec.sparse`` then would import them again, half initialized.

Tables planned with TorchRec's ``FUSED_UVM`` or ``FUSED_UVM_CACHING`` kernel (a table in host
memory, or in host memory behind a device cache, on CUDA) are grouped by TorchRec with the
``FUSED`` tables, so they run on tpurec's fused kernel with the table and its optimizer state in
device memory: the same values, without the host placement. TorchRec on CPU does the same (its
FBGEMM kernel holds every table in host memory there). tpurec says so with one ``UserWarning``
per process, naming the tables of the first such group.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

import torch

from tpurec.dmp import fused_kernel

__all__ = ["install"]

_MODULE = "torchrec.distributed.embedding_lookup"
# The host-memory kernels TorchRec groups with FUSED; on tpu their tables live in device memory.
_HOST_MEMORY_KERNELS = ("fused_uvm", "fused_uvm_caching")
_warned_host_memory = False


def _warn_host_memory(config: Any) -> None:
    """Warns once per process that ``FUSED_UVM``/``FUSED_UVM_CACHING`` tables run in device memory on tpu."""
    global _warned_host_memory
    tables = {t.name: t.compute_kernel.value for t in config.embedding_tables}
    host = {name: kernel for name, kernel in tables.items() if kernel in _HOST_MEMORY_KERNELS}
    if not host or _warned_host_memory:
        return
    _warned_host_memory = True
    listed = ", ".join(f"{name!r} ({kernel})" for name, kernel in host.items())
    warnings.warn(
        f"tables {listed}: TorchRec's fused_uvm and fused_uvm_caching compute kernels keep a table in host "
        "memory (behind a device cache for fused_uvm_caching) on CUDA; on tpu tpurec runs them as the 'fused' "
        "kernel, with the table and its optimizer state in device memory (the same values, more device memory). "
        "Plan them with the 'fused' compute kernel to run the same without this warning, which is given once "
        "per process and covers every such table.",
        UserWarning,
        stacklevel=2,
    )


def _create(pooled: bool, config: Any, pg: Any, device: Any, sharding_type: Any = None) -> Any:
    if device is None or torch.device(device).type != "tpu":
        return None
    kernel = fused_kernel.create_kernel(pooled, config, pg, torch.device(device), sharding_type)
    if kernel is not None:
        _warn_host_memory(config)
    return kernel


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
