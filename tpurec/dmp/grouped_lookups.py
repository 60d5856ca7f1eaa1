"""The patch ``torchrec_tpu_kernels``: TorchRec's grouped lookups build tpurec's kernels on tpu.

TorchRec's ``GroupedPooledEmbeddingsLookup`` and ``GroupedEmbeddingsLookup``
(``torchrec.distributed.embedding_lookup``) build one compute kernel per table group in
``_create_embedding_kernel``. :func:`install` wraps both. For a group on a tpu device it first
checks the placements of the group's shards (:func:`tpurec.dmp.placements.check_placements`: a
plan that places a rank's shards on another tpu device than the process's gets tpurec's error,
on every rank), then builds

* a ``DENSE`` group with :mod:`tpurec.dmp.dense_kernel`'s kernels (TorchRec's tpu kernels,
  any table width, in place of FBGEMM's dense kernel, which cannot hold tpu tables);
* a ``FUSED`` group of an EmbeddingBagCollection with :mod:`tpurec.dmp.fused_kernel`'s kernel
  (the lookup and its in-backward optimizer as tpurec's sparse ops), of an EmbeddingCollection with
  :mod:`tpurec.dmp.fused_sequence_kernel`'s; what tpurec cannot run as TorchRec would raises;
* any other group with TorchRec's own method, as it does for every other device.

``tpurec.sparse`` is imported by the first tpu group's kernel only: this patch is applied while
TorchRec's distributed modules are still being imported, and importing ``tpurec.sparse`` then
would import them again, half initialized.

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

from tpurec.dmp import dense_kernel, fused_kernel, fused_sequence_kernel
from tpurec.dmp.placements import check_placements

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


def _tpu_kernel(pooled: bool, config: Any, pg: Any, device: Any, sharding_type: Any = None) -> Any:
    """tpurec's kernel for a group on a tpu device, or None (another device, or TorchRec's own kernel)."""
    if device is None or torch.device(device).type != "tpu":
        return None
    device = torch.device(device)
    check_placements(config, device)
    if dense_kernel.is_dense(config):
        pooled_class, sequence_class = dense_kernel.kernel_classes()
        if pooled:
            return pooled_class(config=config, pg=pg, device=device, sharding_type=sharding_type)
        return sequence_class(config=config, pg=pg, device=device)
    kernel = (
        fused_kernel.create_kernel(pooled, config, pg, device, sharding_type)
        if pooled or not fused_kernel.is_fused(config)
        else fused_sequence_kernel.create_kernel(config, pg, device)
    )
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
            kernel = _tpu_kernel(True, config, pg, device, sharding_type)
            return kernel if kernel is not None else original_pooled(self, config, device, pg, sharding_type, env)

        create_pooled._tpurec = True  # pyright: ignore[reportFunctionMemberAccess]
        pooled._create_embedding_kernel = create_pooled

    sequence = lookup.GroupedEmbeddingsLookup
    if not getattr(sequence._create_embedding_kernel, "_tpurec", False):
        original_sequence = sequence._create_embedding_kernel

        def create_sequence(self: Any, config: Any, pg: Any, device: Any, env: Any = None) -> Any:
            kernel = _tpu_kernel(False, config, pg, device)
            return kernel if kernel is not None else original_sequence(self, config, pg, device, env)

        create_sequence._tpurec = True  # pyright: ignore[reportFunctionMemberAccess]
        sequence._create_embedding_kernel = create_sequence
