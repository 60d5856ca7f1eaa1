"""Swap torchrec embedding modules for tpurec's, keeping weights and optimizer.

Example::

    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    apply_optimizer_in_backward(torch.optim.Adagrad, model.sparse_arch.parameters(), {"lr": 0.1})
    model = from_torchrec(model, device="tpu")
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence, TypeGuard, cast

import torch
from torch import nn
from torchrec.modules.embedding_configs import DataType
from torchrec.modules.embedding_modules import EmbeddingBagCollection as TorchrecEBC
from torchrec.modules.embedding_modules import EmbeddingCollection as TorchrecEC
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

from tpurec.sparse.managed import check_convertible as check_managed
from tpurec.sparse.managed import convert_managed
from tpurec.sparse.modules import EmbeddingBagCollection
from tpurec.sparse.sequence import EmbeddingCollection
from tpurec.sparse.optimizers import EmbeddingOptimizer, optimizer_from_torch
from tpurec.sparse.types import Capacity

if TYPE_CHECKING:
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as TorchrecQuantEBC

__all__ = ["from_torchrec"]

_TorchrecModule = TorchrecEBC | FusedEmbeddingBagCollection | TorchrecEC


def _weight(tables: nn.ModuleDict, name: str) -> torch.Tensor:
    """The weight of table ``name`` of a TorchRec module's ``embedding_bags`` / ``embeddings``."""
    weight = tables[name].weight
    assert isinstance(weight, torch.Tensor)
    return weight


def _optimizer_of(module: nn.Module, default: EmbeddingOptimizer | None) -> tuple[EmbeddingOptimizer | None, bool]:
    """The module's embedding optimizer (else ``default``; None: inference), and whether it
    came from ``apply_optimizer_in_backward`` (torch's semantics) rather than a fused module."""
    if isinstance(module, FusedEmbeddingBagCollection):
        return optimizer_from_torch(module.optimizer_type(), module.optimizer_kwargs()), False
    found = set()
    for p in module.parameters():
        classes = getattr(p, "_optimizer_classes", None)
        if classes:
            kwargs = getattr(p, "_optimizer_kwargs")[0]
            found.add((classes[0], tuple(sorted(kwargs.items()))))
    if len(found) > 1:
        raise ValueError(f"the tables of one EmbeddingBagCollection use different in-backward optimizers: {found}")
    if found:
        cls, kwargs = found.pop()
        return optimizer_from_torch(cls, dict(kwargs), semantics="torch"), True
    return default, False


def _refuse_unsupported(model: nn.Module) -> None:
    """Raises for a TorchRec embedding module that from_torchrec would leave as it is.

    Such a module (fused sequence embeddings, quantized tables) would stay a
    CPU TorchRec module inside a tpu model and fail later with a device mismatch, or, worse,
    run but train differently; naming it here is the one clear place.
    """
    from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface, EmbeddingCollectionInterface
    from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection
    from torchrec.modules.mc_modules import ManagedCollisionCollection

    # Managed collisions: tpurec.sparse.managed refuses those it cannot convert.
    check_managed(model)
    managed = (BaseManagedCollisionEmbeddingCollection, ManagedCollisionCollection)
    unsupported = (EmbeddingCollectionInterface,)
    for name, module in model.named_modules():
        if type(module).__module__.startswith("tpurec.") or isinstance(
            module, (TorchrecEBC, FusedEmbeddingBagCollection, TorchrecEC, *managed)
        ):
            continue
        if _is_torchrec_quant_ebc(module):
            _refuse_unsupported_quant(name, module)
            continue
        if isinstance(module, unsupported) or isinstance(module, EmbeddingBagCollectionInterface):
            where = f"model.{name}" if name else "the model"
            raise NotImplementedError(
                f"from_torchrec cannot convert {where} ({type(module).__module__}.{type(module).__qualname__}): "
                "tpurec converts torchrec's EmbeddingBagCollection, FusedEmbeddingBagCollection and "
                "EmbeddingCollection (float32 tables) only, and leaving this module on the host would fail or "
                "differ from TorchRec. Keep the model on CPU, or replace the module by an EmbeddingBagCollection "
                "before converting."
            )


def _refuse_low_precision(modules: Sequence[tuple[str, _TorchrecModule]]) -> None:
    """Raises for a TorchRec module with a non-FP32 table, before anything is converted.

    TorchRec's unsharded modules do not train such tables as FBGEMM does: the plain
    EmbeddingBagCollection / EmbeddingCollection store FP16 *and* BF16 tables as float16
    ``nn.EmbeddingBag`` / ``nn.Embedding`` (pooled output rounded to float16, float16 dense
    gradients; in-backward Adagrad turns untouched rows into NaN, its eps underflowing),
    and FusedEmbeddingBagCollection ignores ``data_type`` (float32 tables). tpurec's
    FP16/BF16 tables follow FBGEMM (TorchRec's sharded modules), so a conversion would
    change the source's numbers.
    """
    for name, module in modules:
        configs = module.embedding_configs() if isinstance(module, TorchrecEC) else module.embedding_bag_configs()
        for cfg in configs:
            if cfg.data_type == DataType.FP32:
                continue
            where = f"model.{name}" if name else "the model"
            if isinstance(module, FusedEmbeddingBagCollection):
                what = "TorchRec's FusedEmbeddingBagCollection ignores data_type and trains it as float32"
                fix = "set data_type=DataType.FP32 (what it trains)"
            else:
                what = (
                    f"TorchRec's {type(module).__name__} keeps it as a float16 nn.Module (also for BF16), rounds "
                    "each lookup to float16 and trains it with float16 dense gradients"
                )
                fix = "use DataType.FP32"
            raise ValueError(
                f"table {cfg.name!r} has data_type={cfg.data_type.name} in {where}: {what}, which tpurec's "
                "FP16/BF16 tables (FBGEMM's arithmetic, as TorchRec's sharded modules train them) do not "
                f"reproduce. To convert, {fix}; to train FP16/BF16 tables as FBGEMM does, build "
                "sp.EmbeddingBagCollection(tables, optimizer=...) from the configs (tpurec.sparse as sp)."
            )


# --- quantized collections (tpurec.sparse.quant) -----------------------------------------


def _is_torchrec_quant_ebc(module: nn.Module) -> TypeGuard[TorchrecQuantEBC]:
    """TorchRec's quantized EmbeddingBagCollection itself; its subclasses (feature-processed,
    managed-collision) add behaviour tpurec does not reproduce and stay refused."""
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as TorchrecQuantEBC

    return type(module) is TorchrecQuantEBC


def _refuse_unsupported_quant(name: str, module: TorchrecQuantEBC) -> None:
    from tpurec.sparse.quant import unsupported_quant_reason

    reason = unsupported_quant_reason(module)
    if reason is not None:
        where = f"model.{name}" if name else "the model"
        raise NotImplementedError(
            f"from_torchrec cannot convert {where} ({type(module).__module__}.{type(module).__qualname__}): {reason}. tpurec "
            "converts row-wise INT8/INT4/INT2 tables without pruning, with float32/float16/bfloat16 output; keep "
            "this module on CPU or quantize it without the setting named."
        )


def _refuse_optimizer_for_quant(model: nn.Module, optimizer: EmbeddingOptimizer | None) -> None:
    quantized = [
        f"model.{name}" if name else "the model" for name, m in model.named_modules() if _is_torchrec_quant_ebc(m)
    ]
    if quantized and optimizer is not None:
        raise ValueError(
            f"from_torchrec got optimizer={type(optimizer).__name__}, but {quantized} hold quantized tables, which "
            "are for inference and cannot train. Convert without optimizer= (or train the float model and quantize "
            "it afterwards)."
        )


def _convert_sequence(
    module: TorchrecEC,
    optimizer: EmbeddingOptimizer | None,
    max_seq_len: int | Mapping[str, int] | None,
    kwargs: Mapping[str, Any],
) -> EmbeddingCollection:
    chosen, in_backward = _optimizer_of(module, optimizer)
    new = EmbeddingCollection(
        tables=module.embedding_configs(),
        need_indices=module.need_indices(),
        optimizer=chosen,
        max_seq_len=max_seq_len,
        **kwargs,
    )
    if in_backward:
        new.bags.optimizer_semantics = "torch"
    with torch.no_grad():
        for cfg in module.embedding_configs():
            source = _weight(module.embeddings, cfg.name)
            if source.device.type != "meta":
                new.table_weight(cfg.name).copy_(source.detach())
    return new


def _fused_slots(module: FusedEmbeddingBagCollection) -> dict[str, list[torch.Tensor]]:
    """FBGEMM optimizer states per table name: [momentum1, momentum2, ...]."""
    out: dict[str, list[torch.Tensor]] = {}
    for emb, (_key, tables) in zip(module._emb_modules, module._key_to_tables.items()):
        fbgemm = cast(Any, emb)._emb_module  # FBGEMM's SplitTableBatchedEmbeddingBagsCodegen
        for table, states in zip(tables, fbgemm.split_optimizer_states()):
            out[table.name] = list(states)
    return out


def _convert(
    module: TorchrecEBC | FusedEmbeddingBagCollection, optimizer: EmbeddingOptimizer | None, kwargs: Mapping[str, Any]
) -> EmbeddingBagCollection:
    chosen, in_backward = _optimizer_of(module, optimizer)
    new = EmbeddingBagCollection(
        tables=module.embedding_bag_configs(), is_weighted=module.is_weighted(), optimizer=chosen, **kwargs
    )
    if in_backward:
        new.optimizer_semantics = "torch"
    with torch.no_grad():
        for cfg in module.embedding_bag_configs():
            source = _weight(module.embedding_bags, cfg.name)
            # Tables built on "meta" have no values: the new module's own
            # initialisation (the config's init_fn, else torchrec's uniform
            # range) materialises them, so a large model is never held twice.
            if source.device.type != "meta":
                new.table_weight(cfg.name).copy_(source.detach())
        if isinstance(module, FusedEmbeddingBagCollection):
            slots = new.optimizer_state_dict()["state"]
            for name, states in _fused_slots(module).items():
                for target, state in zip(slots[f"embedding_bags.{name}.weight"].values(), states):
                    target.copy_(state.reshape(target.shape))
    return new


def from_torchrec(
    model: nn.Module,
    *,
    optimizer: EmbeddingOptimizer | None = None,
    device: torch.device | str | None = None,
    num_partitions: int = 1,
    capacities: Capacity | Mapping[str, Capacity] | None = None,
    max_seq_len: int | Mapping[str, int] | None = None,
) -> nn.Module:
    """Replaces every torchrec (Fused)EmbeddingBagCollection and EmbeddingCollection in ``model``.

    Weights are copied (tables on ``meta`` are initialised instead, from
    their configs, directly in the new module); the optimizer comes from ``apply_optimizer_in_backward``
    on the tables or from the fused module's settings (and its FBGEMM slots),
    else from ``optimizer``. With none of them the model is converted for
    inference: its tables never change, and a backward through the lookup
    raises (see :class:`EmbeddingBagCollection`). TorchRec's quantized
    ``torchrec.quant`` EmbeddingBagCollection (INT8/INT4/INT2 tables) becomes a
    :class:`tpurec.sparse.QuantEmbeddingBagCollection` holding the same bytes
    (inference only: ``optimizer`` must then be None). TorchRec's managed-collision
    modules keep their remapping, on the host, in front of the converted collection
    (see :mod:`tpurec.sparse.managed`). The model is changed in place and returned
    (a bare EBC is returned converted).

    Args:
        model: a module containing torchrec embedding bag collections.
        optimizer: fallback optimizer for tables without one (None: inference).
        device: device of the new tables (default: where the old ones were; tables
            on ``meta`` are then materialised on the host). ``"meta"`` keeps them
            without values, for :func:`tpurec.shard` to create each shard on its
            own device (tables born sharded, see docs/sharding.md).
        num_partitions: MOD partitions.
        capacities: static capacities (see ``suggest_capacities``).
        max_seq_len: positions per sequence of converted ``EmbeddingCollection`` modules
            (see :class:`tpurec.sparse.EmbeddingCollection`; None: grown by powers of two).

    Returns:
        The model with tpurec ``EmbeddingBagCollection`` / ``EmbeddingCollection`` modules.

    Example::

        model = from_torchrec(DLRM(embedding_bag_collection=ebc, ...))
    """
    kinds = (TorchrecEBC, FusedEmbeddingBagCollection, TorchrecEC)

    def options(module: _TorchrecModule) -> dict[str, Any]:
        dev = device
        if dev is None:
            tables = module.embeddings if isinstance(module, TorchrecEC) else module.embedding_bags
            weights = [_weight(tables, name) for name in tables]
            dev = weights[0].device if weights else None
            if dev is not None and dev.type == "meta":
                dev = None  # materialised on the host; pass device= to place them
        return {"device": dev, "num_partitions": num_partitions, "capacities": capacities}

    def convert(module: nn.Module) -> nn.Module:
        if _is_torchrec_quant_ebc(module):
            from tpurec.sparse.quant import from_torchrec_quant

            return from_torchrec_quant(module, device=device, num_partitions=num_partitions, capacities=capacities)
        if isinstance(module, TorchrecEC):
            return _convert_sequence(module, optimizer, max_seq_len, options(module))
        assert isinstance(module, (TorchrecEBC, FusedEmbeddingBagCollection))  # (convert is called on those)
        return _convert(module, optimizer, options(module))

    _refuse_unsupported(model)
    _refuse_optimizer_for_quant(model, optimizer)
    # FP16/BF16 tables of TorchRec's float modules: refused before anything changes.
    _refuse_low_precision([(n, m) for n, m in model.named_modules() if isinstance(m, kinds)])
    # Managed collisions: TorchRec's remap stays on the host, the collection behind it converts.
    model = convert_managed(model, convert)
    if isinstance(model, kinds) or _is_torchrec_quant_ebc(model):
        return convert(model)
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, kinds) or _is_torchrec_quant_ebc(m)]
    for name, module in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, convert(module))
    return model
