"""Swap torchrec embedding modules for tpurec's, keeping weights and optimizer.

Example::

    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    apply_optimizer_in_backward(torch.optim.Adagrad, model.sparse_arch.parameters(), {"lr": 0.1})
    model = from_torchrec(model, device="tpu")
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence, TypeGuard, cast

import torch
from torch import nn
from torchrec.modules.embedding_configs import DataType
from torchrec.modules.embedding_modules import EmbeddingBagCollection as TorchrecEBC
from torchrec.modules.embedding_modules import EmbeddingCollection as TorchrecEC
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from tpurec.sparse.managed import check_convertible as check_managed
from tpurec.sparse.managed import convert_managed
from tpurec.sparse.modules import EmbeddingBagCollection
from tpurec.sparse.sequence import EmbeddingCollection
from tpurec.sparse.optimizers import EmbeddingOptimizer, optimizer_from_torch
from tpurec.sparse.types import Capacity

if TYPE_CHECKING:
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as TorchrecQuantEBC

__all__ = ["TorchrecEmbeddingBagCollectionOnDevice", "TorchrecEmbeddingCollectionOnDevice", "from_torchrec"]

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
                "EmbeddingCollection only, and leaving this module on the host would fail or "
                "differ from TorchRec. Keep the model on CPU, or replace the module by an EmbeddingBagCollection "
                "before converting."
            )


def _configs(module: _TorchrecModule) -> Sequence[Any]:
    """The table configs of a TorchRec float module."""
    return module.embedding_configs() if isinstance(module, TorchrecEC) else module.embedding_bag_configs()


def _has_low_precision(module: _TorchrecModule) -> bool:
    """Whether a TorchRec float module has a table whose ``data_type`` is not FP32."""
    return any(cfg.data_type != DataType.FP32 for cfg in _configs(module))


def _refuse_low_precision(
    model: nn.Module,
    modules: Sequence[tuple[str, _TorchrecModule]],
    optimizer: EmbeddingOptimizer | None,
    device: torch.device | str | None,
) -> None:
    """Raises, before anything is converted, where FP16/BF16 tables of a TorchRec float module
    cannot run as TorchRec runs them.

    TorchRec's plain EmbeddingBagCollection / EmbeddingCollection keep such tables as float16
    ``nn.EmbeddingBag`` / ``nn.Embedding`` trained by dense gradients (see
    :class:`TorchrecEmbeddingBagCollectionOnDevice`): there is no tpurec fused optimizer
    (``optimizer=``), no sharding (``device="meta"``) and no managed-collision remap in front
    of that computation.
    """
    from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection

    managed = {
        id(m._embedding_module): name
        for name, m in model.named_modules()
        if isinstance(m, BaseManagedCollisionEmbeddingCollection)
    }
    for name, module in modules:
        if isinstance(module, FusedEmbeddingBagCollection) or not _has_low_precision(module):
            continue  # (a fused collection's FP16/BF16 tables are float32: converted as such)
        where = f"model.{name}" if name else "the model"
        half = [c.name for c in _configs(module) if c.data_type != DataType.FP32]
        what = (
            f"{where} ({type(module).__name__}) has FP16/BF16 tables {half}, which TorchRec keeps as float16 "
            "nn.Module tables trained by dense float16 gradients; tpurec converts such a module by moving "
            "it to the device as it is,"
        )
        if id(module) in managed:
            raise NotImplementedError(
                f"{what} but not inside the managed-collision module model.{managed[id(module)]}. Use "
                "data_type=DataType.FP32 for its tables."
            )
        if device is not None and torch.device(device).type == "meta":
            raise ValueError(
                f"{what} so it cannot be converted to 'meta' for tpurec.shard. Convert it with device='tpu' "
                "(unsharded), or use data_type=DataType.FP32 to shard it."
            )
        weights = [p for p in module.parameters() if p.device.type == "meta"]
        if weights:
            raise ValueError(
                f"{what} but its tables are on 'meta' and have no values: build the TorchRec module on a "
                "device (or initialise its tables) before converting."
            )
        untrained = [n for n, p in module.named_parameters() if not getattr(p, "_optimizer_classes", None)]
        if optimizer is not None and untrained:
            raise ValueError(
                f"{what} where optimizer={type(optimizer).__name__} (tpurec's fused optimizer) does not apply, "
                f"and {untrained} have no in-backward optimizer. Train them as TorchRec does: "
                "apply_optimizer_in_backward on them before converting, or a dense torch optimizer over them "
                "after (they get a .grad); then convert without optimizer=."
            )


def _kjt_on(features: KeyedJaggedTensor, device: torch.device) -> KeyedJaggedTensor:
    """``features`` on ``device``, its per-feature split computed there.

    ``KeyedJaggedTensor.to`` carries over the source's cached ``to_dict()`` result, whose
    tensors stay where they were: the copy drops it, to split its own moved tensors.
    """
    moved = features.to(device)
    moved._jt_dict = None
    return moved


class TorchrecEmbeddingBagCollectionOnDevice(TorchrecEBC):
    """TorchRec's unsharded ``EmbeddingBagCollection`` with its tables on a device (e.g. ``tpu``).

    What ``from_torchrec`` makes of one with FP16/BF16 tables: the module itself (same tables,
    state dict and in-backward optimizers), its ``nn.EmbeddingBag`` tables moved to the
    device, so it computes what TorchRec computes there: float16 tables (for BF16 too),
    pooled and rounded to float16, a float32 output, float16 dense gradients, and the update
    of the optimizer the user gives them. Its forward takes the KJT on the host (as tpurec's
    collections do) or on the device.
    """

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        """TorchRec's forward on ``features`` moved to the tables' device.

        Args:
            features: KJT with the tables' features (host or device).

        Returns:
            TorchRec's ``KeyedTensor`` (float32 values, on the device).

        Raises:
            RuntimeError: per-id weights of another dtype than a table (float32 weights of a
                KJT with float16 tables), which PyTorch's ``nn.EmbeddingBag`` refuses on CPU.
        """
        weights = features.weights_or_none()
        if self._is_weighted and weights is not None:
            # The device's embedding_bag would widen them; TorchRec on CPU raises.
            mismatched = {
                n: bag.weight.dtype for n, bag in self.embedding_bags.items() if bag.weight.dtype != weights.dtype
            }
            if mismatched:
                raise RuntimeError(
                    f"the KJT's per-id weights are {weights.dtype} and tables {mismatched} are not: TorchRec's "
                    "EmbeddingBagCollection passes both to nn.EmbeddingBag, which refuses two dtypes (as it does "
                    "on CPU). Give the KJT weights of the tables' dtype (float16 for FP16/BF16 tables), or use "
                    "FP32 tables."
                )
        return super().forward(_kjt_on(features, self.device))


class TorchrecEmbeddingCollectionOnDevice(TorchrecEC):
    """TorchRec's unsharded ``EmbeddingCollection`` with its tables on a device (e.g. ``tpu``):
    as :class:`TorchrecEmbeddingBagCollectionOnDevice`, for ``nn.Embedding`` tables."""

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        """TorchRec's forward on ``features`` moved to the tables' device.

        Args:
            features: KJT with the tables' features (host or device).

        Returns:
            TorchRec's ``JaggedTensor`` per feature (float32 values, on the device).
        """
        return super().forward(_kjt_on(features, self.device))


def _moved_to_device(module: TorchrecEBC | TorchrecEC, device: torch.device | str | None) -> nn.Module:
    """``module`` (checked by :func:`_refuse_low_precision`) as TorchRec's own module on ``device``.

    The module keeps its parameter objects (``nn.Module.to`` moves their data in place), their
    in-backward optimizers follow them, and it takes the class that moves its input there too.
    """
    cast(Any, module).__class__ = (
        TorchrecEmbeddingCollectionOnDevice
        if isinstance(module, TorchrecEC)
        else TorchrecEmbeddingBagCollectionOnDevice
    )
    if device is not None:
        module.to(device)
        module._device = torch.device(device)
        _rehook_in_backward_optimizers(module)
    return module


def _rehook_in_backward_optimizers(module: nn.Module) -> None:
    """Moves the in-backward optimizers of ``module``'s parameters along with them.

    ``apply_optimizer_in_backward`` hooks a parameter's gradient accumulator, and a parameter
    moved to another device gets a new one: the hook goes to it (as torch's, an optimizer step
    then ``grad = None``), and the optimizers' state tensors (not the host step counts) to the
    parameter's device.
    """
    from torch.distributed.optim import apply_optimizer_in_backward as in_backward

    for param in module.parameters():
        optimizers = getattr(param, "_in_backward_optimizers", None)
        handles = in_backward.param_to_optim_hook_handle_map.pop(param, [])
        if not optimizers or not handles:
            continue
        for optimizer in optimizers:
            for state in optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        state[key] = value.to(param.device)
        for handle in handles:
            handle.remove()
        view = param.view_as(param).grad_fn  # (a parameter requiring grad: its view has one)
        assert view is not None
        accumulator = view.next_functions[0][0]
        assert accumulator is not None
        in_backward.param_to_acc_grad_map[param] = accumulator
        in_backward.param_to_optim_hook_handle_map[param] = [accumulator.register_hook(_optimizer_step_hook(param))]


def _optimizer_step_hook(param: nn.Parameter) -> Callable[..., None]:
    """The hook ``apply_optimizer_in_backward`` puts on ``param``'s gradient accumulator."""

    def step(*_unused: object) -> None:
        for optimizer in getattr(param, "_in_backward_optimizers"):
            optimizer.step()
        param.grad = None

    return step


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
    tables = module.embedding_bag_configs()
    if isinstance(module, FusedEmbeddingBagCollection):
        # TorchRec builds its FBGEMM module without weights_precision: whatever data_type says,
        # the tables are float32, and so are the converted ones.
        tables = [
            cfg if cfg.data_type == DataType.FP32 else dataclasses.replace(cfg, data_type=DataType.FP32)
            for cfg in tables
        ]
    new = EmbeddingBagCollection(tables=tables, is_weighted=module.is_weighted(), optimizer=chosen, **kwargs)
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
    (see :mod:`tpurec.sparse.managed`). A TorchRec ``EmbeddingBagCollection`` /
    ``EmbeddingCollection`` with FP16/BF16 tables stays TorchRec's module, moved to ``device``
    (:class:`TorchrecEmbeddingBagCollectionOnDevice`): it computes and trains as TorchRec's
    unsharded module does (float16 tables, dense gradients, the parameters' in-backward or
    dense torch optimizer); a ``FusedEmbeddingBagCollection``'s FP16/BF16 tables are the
    float32 tables TorchRec trains. The model is changed in place and returned
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

    Raises:
        ValueError: FP16/BF16 tables of a TorchRec float module with ``optimizer=`` and no
            in-backward optimizer, with ``device="meta"``, or on ``meta``.
        NotImplementedError: a module it cannot convert (named in the message).

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
        if isinstance(module, (TorchrecEBC, TorchrecEC)) and _has_low_precision(module):
            return _moved_to_device(module, device)
        if isinstance(module, TorchrecEC):
            return _convert_sequence(module, optimizer, max_seq_len, options(module))
        assert isinstance(module, (TorchrecEBC, FusedEmbeddingBagCollection))  # (convert is called on those)
        return _convert(module, optimizer, options(module))

    _refuse_unsupported(model)
    _refuse_optimizer_for_quant(model, optimizer)
    # FP16/BF16 tables of TorchRec's float modules: what cannot run as TorchRec runs them is
    # refused before anything changes.
    _refuse_low_precision(model, [(n, m) for n, m in model.named_modules() if isinstance(m, kinds)], optimizer, device)
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
