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
the state_dict's local shard holds, so training and loading reach the tables.

Several column shards of one table on one rank (column-wise or grid plans): the sharded
module expects one parameter of them, the shards' rows stacked (``[shards * rows, cols]``,
shard ``k`` at rows ``k * rows``, the layout TorchRec's dense kernel and its
``load_state_dict`` hook use). The patched ``__init__`` makes that stacked parameter and
turns each shard module's table into a view of its rows, taken again before each lookup so
autograd reaches the stacked parameter through a fresh view; the state_dict's local shards
are views of the same storage, so loading and training write the tables the lookups read.
The batched Pallas lookup (``PooledLookupKernel.BATCHED_OFFSET``), which tpurec does not
run, raises.

The pooled kernel's ``forward`` passes only ids and offsets to its lookups: the per-sample
weights of a weighted ``EmbeddingBagCollection`` would be dropped without a word, so the
patched ``forward`` refuses a KeyedJaggedTensor that carries weights.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch import nn

__all__ = ["install", "named_parameters_by_table", "stack_column_shards"]

_MODULE = "torchrec.distributed.batched_embedding_kernel"
_CLASSES = ("BatchedTPUEmbeddingBag", "BatchedTPUEmbedding")
# The kernel attribute holding each stacked table's parameter (table name -> parameter).
_STACKED = "_tpurec_stacked_tables"


def _tables_and_modules(kernel: nn.Module) -> tuple[list[str], list[nn.Module]]:
    tables: list[Any] = list(getattr(kernel, "_config").embedding_tables)  # noqa: B009 (TorchRec's private field)
    modules: list[nn.Module] = list(cast(nn.ModuleList, getattr(kernel, "_emb_modules")))  # noqa: B009
    return [table.name for table in tables], modules


def _view_rows(stacked: nn.Parameter, start: int, rows: int) -> Callable[[nn.Module, Any], None]:
    """A forward pre-hook that points a shard module's table at its rows of ``stacked``."""

    def hook(module: nn.Module, _args: Any) -> None:
        module._weight = stacked[start : start + rows]  # pyright: ignore[reportAttributeAccessIssue]

    return hook


def stack_column_shards(kernel: nn.Module) -> None:
    """Makes one parameter of each table the kernel holds several (column) shards of.

    Args:
        kernel: a ``BatchedTPUEmbeddingBag`` or ``BatchedTPUEmbedding`` after its own ``__init__``.

    Raises:
        NotImplementedError: the shards of one table differ in shape (TorchRec's stacked layout,
            ``[shards * rows, cols]``, has one width; its planner makes equal column shards).
    """
    if getattr(kernel, "_use_batched_lookup", False):
        return  # one batched table: named_parameters_by_table refuses it
    names, modules = _tables_and_modules(kernel)
    stacked_tables: dict[str, nn.Parameter] = {}
    for name in dict.fromkeys(names):
        members = [module for n, module in zip(names, modules, strict=True) if n == name]
        if len(members) == 1:
            continue
        weights = [cast(torch.Tensor, getattr(module, "_weight")) for module in members]  # noqa: B009
        shapes = {tuple(weight.shape) for weight in weights}
        if len(shapes) != 1:
            raise NotImplementedError(
                f"TorchRec's UNFUSED_TPU kernel holds {len(members)} shards of table {name!r} on this rank with "
                f"different shapes {sorted(shapes)}; the sharded module stacks a table's shards on one rank as "
                "[shards * rows, cols], which needs equal shards: plan equal column shards (TorchRec's planner does)"
            )
        rows = weights[0].shape[0]
        with torch.no_grad():
            values = torch.cat([weight.detach() for weight in weights])
        stacked = nn.Parameter(values, requires_grad=weights[0].requires_grad)
        for k, module in enumerate(members):
            # The shard's own parameter leaves the module: its table is now rows of the stacked one.
            del module._parameters["_weight"]
            hook = _view_rows(stacked, k * rows, rows)
            hook(module, ())
            module.register_forward_pre_hook(hook)
        stacked_tables[name] = stacked
    setattr(kernel, _STACKED, stacked_tables)


def named_parameters_by_table(kernel: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``(table name, parameter)`` for each table of a TorchRec TPU kernel's group.

    Args:
        kernel: a ``BatchedTPUEmbeddingBag`` or ``BatchedTPUEmbedding``.

    Yields:
        The table's name and the kernel's parameter of its local shard (the same tensor
        object the lookups read and ``state_dict`` returns as the local shard), or, for a
        table with several shards here, the parameter of them stacked (see
        :func:`stack_column_shards`).

    Raises:
        NotImplementedError: the kernel uses the batched Pallas lookup.
    """
    if getattr(kernel, "_use_batched_lookup", False):
        raise NotImplementedError(
            f"{type(kernel).__name__}: the batched Pallas lookup (PooledLookupKernel.BATCHED_OFFSET) is not run by "
            "tpurec; use the default pooled lookup kernel (PooledLookupKernel.OFFSET)"
        )
    stacked_tables: dict[str, nn.Parameter] = getattr(kernel, _STACKED, {})
    names, modules = _tables_and_modules(kernel)
    for name, module in zip(names, modules, strict=True):
        if name in stacked_tables:
            continue
        weight = getattr(module, "_weight")  # noqa: B009 (TorchRec's private field)
        if not isinstance(weight, nn.Parameter):
            raise TypeError(f"table {name!r}: the kernel's weight is a {type(weight).__name__}, not a Parameter")
        yield name, weight
    yield from stacked_tables.items()


def install() -> None:
    """Gives TorchRec's TPU kernels :func:`named_parameters_by_table` and stacked column shards (idempotent)."""
    module = importlib.import_module(_MODULE)
    for class_name in _CLASSES:
        cls = getattr(module, class_name)
        if getattr(cls.named_parameters_by_table, "_tpurec", False):
            continue

        def method(self: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
            return named_parameters_by_table(self)

        method.__name__ = "named_parameters_by_table"
        method.__doc__ = (
            "Each table's parameter (the kernel's own parameter of its shard, or its shards stacked), registered "
            "by the sharded module as <table>.weight (tpurec.dmp.unfused_tables)."
        )
        method._tpurec = True  # pyright: ignore[reportFunctionMemberAccess]
        cls.named_parameters_by_table = method

        cls.__init__ = _stacking_init(cls.__init__)
        if class_name == "BatchedTPUEmbeddingBag":
            cls.forward = _refusing_weights(cls.forward)


def _stacking_init(original: Callable[..., None]) -> Callable[..., None]:
    """The kernel's ``__init__``, then :func:`stack_column_shards`."""

    @functools.wraps(original)
    def init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        stack_column_shards(self)

    return init


def _refusing_weights(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The pooled kernel's ``forward``, refusing per-sample weights (which it would drop)."""

    @functools.wraps(original)
    def forward(self: nn.Module, features: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if features.weights_or_none() is not None:
            raise NotImplementedError(
                "TorchRec's UNFUSED_TPU kernel (BatchedTPUEmbeddingBag) looks up ids and offsets only and would "
                "drop the per-sample weights of this weighted EmbeddingBagCollection's features "
                f"{list(features.keys())}; tpurec refuses rather than train without them. Shard weighted tables "
                "with tpurec.shard (which takes per-sample weights), or use unweighted features"
            )
        return original(self, features, *args, **kwargs)

    return forward
