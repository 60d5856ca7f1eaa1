"""TorchRec's ``UNFUSED_TPU`` compute kernel: its tables registered with the sharded module.

TorchRec's sharded collections (``ShardedEmbeddingBagCollection``,
``ShardedEmbeddingCollection``) make every table a parameter of their own
(``embedding_bags.<table>.weight``) from what their compute kernels yield in
``named_parameters_by_table()``; that parameter is what ``model.parameters()`` hands an
optimizer and what ``load_state_dict`` copies a checkpoint's local shards into. TorchRec
1.9.2's TPU kernels (``BatchedTPUEmbeddingBag`` / ``BatchedTPUEmbedding`` in
``torchrec.distributed.batched_embedding_kernel``) keep one parameter per table shard in
their own modules and yield nothing there, so the sharded module puts an empty CPU
placeholder in each table's place: an optimizer over ``model.parameters()`` trains no table,
and ``load_state_dict`` fails with a size mismatch against ``[0]``.

:func:`install` (a patch of ``tpurec/_patches.py``, applied when that TorchRec module is
imported) gives both kernels a ``named_parameters_by_table`` that yields, for each table of
the kernel's group, the kernel's own parameter of its shard, the tensor the lookups read and
the state_dict's local shard holds, so training and loading reach the tables. A kernel that
holds several column shards of one table (the sharded module then expects one parameter of
them stacked, which separate parameters cannot be) raises instead; so does the batched Pallas
lookup (``PooledLookupKernel.BATCHED_OFFSET``), which tpurec does not run.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any, cast

from torch import nn

__all__ = ["install", "named_parameters_by_table"]

_MODULE = "torchrec.distributed.batched_embedding_kernel"
_CLASSES = ("BatchedTPUEmbeddingBag", "BatchedTPUEmbedding")


def named_parameters_by_table(kernel: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``(table name, parameter)`` for each table of a TorchRec TPU kernel's group.

    Args:
        kernel: a ``BatchedTPUEmbeddingBag`` or ``BatchedTPUEmbedding``.

    Yields:
        The table's name and the kernel's parameter of its local shard (the same tensor
        object the lookups read and ``state_dict`` returns as the local shard).

    Raises:
        NotImplementedError: the kernel uses the batched Pallas lookup, or holds more than
            one shard of a table (column-wise shards of one table placed on one rank).
    """
    if getattr(kernel, "_use_batched_lookup", False):
        raise NotImplementedError(
            f"{type(kernel).__name__}: the batched Pallas lookup (PooledLookupKernel.BATCHED_OFFSET) is not run by "
            "tpurec; use the default pooled lookup kernel (PooledLookupKernel.OFFSET)"
        )
    tables: list[Any] = list(getattr(kernel, "_config").embedding_tables)  # noqa: B009 (TorchRec's private field)
    modules: list[nn.Module] = list(cast(nn.ModuleList, getattr(kernel, "_emb_modules")))  # noqa: B009
    names = [table.name for table in tables]
    for name, module in zip(names, modules, strict=True):
        if names.count(name) > 1:
            raise NotImplementedError(
                f"TorchRec's UNFUSED_TPU kernel holds {names.count(name)} column shards of table {name!r} on this "
                "rank, and the sharded module needs one parameter of them stacked, which the kernel's separate "
                "per-shard parameters cannot be: plan at most one column shard of a table per rank (a larger "
                "min_partition in its ParameterConstraints, or more ranks)"
            )
        weight = module.weight
        if not isinstance(weight, nn.Parameter):
            raise TypeError(f"table {name!r}: the kernel's weight is a {type(weight).__name__}, not a Parameter")
        yield name, weight


def install() -> None:
    """Gives TorchRec's TPU kernels :func:`named_parameters_by_table` (idempotent)."""
    module = importlib.import_module(_MODULE)
    for class_name in _CLASSES:
        cls = getattr(module, class_name)
        if getattr(cls.named_parameters_by_table, "_tpurec", False):
            continue

        def method(self: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
            return named_parameters_by_table(self)

        method.__name__ = "named_parameters_by_table"
        method.__doc__ = (
            "Each table's parameter (the kernel's own parameter of its shard), registered by the sharded module "
            "as <table>.weight (tpurec.distributed.torchrec_tables)."
        )
        method._tpurec = True  # pyright: ignore[reportFunctionMemberAccess]
        cls.named_parameters_by_table = method
