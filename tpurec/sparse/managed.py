"""Managed collisions: TorchRec's MCH remapping on the host in front of tpurec's lookups.

TorchRec's ``ManagedCollisionCollection`` maps raw ids (anywhere in ``[0, input_hash_size)``)
to table rows in ``[0, zch_size)`` with data-dependent host code (``searchsorted``,
``unique``, ``argsort``, masked writes); in training it also records the ids it saw and,
every ``eviction_interval`` forwards, lets the eviction policy (LFU, LRU, DistanceLFU)
replace rarely used ids by new ones. Its state is partly int64 buffers (in the state dict)
and partly plain attributes (the history accumulator, the iteration counters, the
``_mch_metadata`` dict that refers to the buffers by object).

tpurec keeps that module as TorchRec wrote it and runs it on the host, on the CPU
``KeyedJaggedTensor`` that tpurec's collections preprocess there anyway; only the embedding
collection behind it becomes tpurec's. The remapped ids are therefore TorchRec's, bit for
bit, and the state dict keeps TorchRec's keys. Moving the model (``.to("tpu")``) leaves the
remapping state on the host: TorchRec's own ``.to()`` would swap the buffers for new tensors
while ``_mch_metadata`` and the history buffers stay behind on the old device.

Example::

    model = tpurec.sparse.from_torchrec(model_with_mc_ebc, device="tpu")
    pooled, remapped = model.sparse_arch(kjt)   # kjt on CPU, raw ids
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, cast

import torch
from torch import nn
from torchrec.modules.embedding_modules import EmbeddingBagCollection as TorchrecEBC
from torchrec.modules.embedding_modules import EmbeddingCollection as TorchrecEC
from torchrec.modules.mc_embedding_modules import (
    BaseManagedCollisionEmbeddingCollection,
)
from torchrec.modules.mc_embedding_modules import (
    ManagedCollisionEmbeddingBagCollection as TorchrecMCEBC,
)
from torchrec.modules.mc_embedding_modules import (
    ManagedCollisionEmbeddingCollection as TorchrecMCEC,
)
from torchrec.modules.mc_modules import ManagedCollisionCollection as TorchrecMCC
from torchrec.modules.mc_modules import ManagedCollisionModule, MCHManagedCollisionModule
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

if TYPE_CHECKING:
    from tpurec.sparse.modules import EmbeddingBagCollection
    from tpurec.sparse.sequence import EmbeddingCollection

__all__ = [
    "HostManagedCollisionCollection",
    "ManagedCollisionEmbeddingBagCollection",
    "ManagedCollisionEmbeddingCollection",
    "REMAP_TYPES",
    "check_convertible",
    "check_host_features",
    "convert_managed",
    "remapped_features",
]


def _where(name: str) -> str:
    return f"model.{name}" if name else "the model"


def _check_collection(mcc: nn.Module, where: str) -> None:
    """Raises unless ``mcc`` is a TorchRec collection whose remap tpurec runs unchanged."""
    if type(mcc) is not TorchrecMCC and not isinstance(mcc, HostManagedCollisionCollection):
        raise NotImplementedError(
            f"from_torchrec cannot convert the managed-collision collection of {where} "
            f"({type(mcc).__module__}.{type(mcc).__qualname__}): tpurec runs torchrec's own "
            "ManagedCollisionCollection, not subclasses of it (their overrides are untested here)."
        )
    for table, module in mcc._managed_collision_modules.items():
        if type(module) is not MCHManagedCollisionModule:
            raise NotImplementedError(
                f"from_torchrec cannot convert the managed-collision module of table {table!r} in {where} "
                f"({type(module).__module__}.{type(module).__qualname__}): tpurec runs torchrec's "
                "MCHManagedCollisionModule only. Keep the model on CPU, or use MCHManagedCollisionModule."
            )
        devices = {t.device.type for t in module.buffers()}
        if devices != {"cpu"}:
            raise ValueError(
                f"the managed-collision module of table {table!r} in {where} has its buffers on "
                f"{sorted(devices)}: tpurec remaps ids on the host, so build it with device=torch.device('cpu') "
                "(its state is small: zch_size int64 values per buffer)."
            )


def check_convertible(model: nn.Module) -> None:
    """Raises for a managed-collision module of ``model`` that :func:`convert_managed` cannot convert.

    Called by ``from_torchrec`` before it changes anything, so a refused model is left as it was.

    Args:
        model: any module.

    Raises:
        NotImplementedError: a subclass of TorchRec's managed-collision modules, a managed-collision
            module other than ``MCHManagedCollisionModule``, or an embedding module inside that is not
            a plain TorchRec ``EmbeddingBagCollection`` / ``EmbeddingCollection``.
        ValueError: managed-collision buffers that are not on the CPU.
    """
    for name, module in _targets(model):
        where = _where(name)
        if isinstance(module, BaseManagedCollisionEmbeddingCollection):
            if type(module) not in (TorchrecMCEBC, TorchrecMCEC):
                raise NotImplementedError(
                    f"from_torchrec cannot convert {where} ({type(module).__module__}.{type(module).__qualname__}): "
                    "tpurec converts torchrec's ManagedCollisionEmbeddingBagCollection and "
                    "ManagedCollisionEmbeddingCollection themselves, not subclasses of them."
                )
            inner = module._embedding_module
            if type(inner) not in (TorchrecEBC, TorchrecEC):
                raise NotImplementedError(
                    f"from_torchrec cannot convert the embedding module of {where} "
                    f"({type(inner).__module__}.{type(inner).__qualname__}): inside a managed-collision "
                    "collection tpurec converts a torchrec EmbeddingBagCollection or EmbeddingCollection."
                )
            _check_collection(module._managed_collision_collection, where)
        else:
            _check_collection(module, where)


def _targets(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """TorchRec managed-collision modules of ``model``, outermost only (a collection inside an
    MC-EBC is converted with it), tpurec's own skipped."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if type(module).__module__.startswith("tpurec."):
            continue
        if any(name == f or name.startswith(f + ".") or not f for f, _ in found):
            continue
        if isinstance(module, (BaseManagedCollisionEmbeddingCollection, TorchrecMCC)):
            found.append((name, module))
    return found


class HostManagedCollisionCollection(TorchrecMCC):
    """TorchRec's ``ManagedCollisionCollection`` whose remapping state stays on the host.

    The forward, the eviction and the state dict are TorchRec's (inherited unchanged). Only
    device moves differ: ``.to("tpu")``, ``.cuda()``, ``to_empty(device=...)`` of an enclosing
    model leave its buffers on the CPU, where the remap runs on the host KJT. Conversions that
    keep tensors on the CPU (``.cpu()``, ``share_memory()``) apply as usual; float dtype
    conversions never touch its int64 buffers.

    Args: as ``torchrec.modules.mc_modules.ManagedCollisionCollection``.
    """

    @classmethod
    def from_torchrec(cls, mcc: TorchrecMCC) -> "HostManagedCollisionCollection":
        """The same collection (the same managed-collision module objects and their state).

        Args:
            mcc: a torchrec ``ManagedCollisionCollection`` with ``MCHManagedCollisionModule``\\ s on CPU.

        Returns:
            A host-pinned collection sharing ``mcc``'s modules.
        """
        if isinstance(mcc, cls):
            return mcc
        _check_collection(mcc, "the collection")
        modules = cast(dict[str, ManagedCollisionModule], dict(mcc._managed_collision_modules.items()))
        new = cls(modules, mcc.embedding_configs(), mcc.need_preprocess)
        # The feature order is learnt from the first KJT (torchrec's lazy init): keep what was learnt.
        new._features_order = list(mcc._features_order)
        new._created_feature_order = list(mcc._created_feature_order)
        new.train(mcc.training)
        return new

    def _apply(
        self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
    ) -> "HostManagedCollisionCollection":
        def on_host(t: torch.Tensor) -> torch.Tensor:
            # A move off the host would replace the buffers while _mch_metadata and the history
            # buffers (plain attributes) keep the old tensors: keep them all where the remap runs.
            out = fn(t)
            return out if out.device.type == "cpu" else t

        return super()._apply(on_host, recurse)

    def forward(self, features: KeyedJaggedTensor, mutate_miss_lengths: bool = True) -> KeyedJaggedTensor:
        """TorchRec's remap (and, in training, profiling and eviction) of a CPU KJT.

        Args:
            features: KJT of raw ids on the CPU.
            mutate_miss_lengths: passed to the managed-collision modules (TorchRec's meaning).

        Returns:
            The KJT of remapped ids, on the CPU.

        Raises:
            ValueError: ``features`` is not on the CPU.
        """
        check_host_features(features)
        return super().forward(features, mutate_miss_lengths=mutate_miss_lengths)


def check_host_features(features: KeyedJaggedTensor) -> None:
    """Raises ``ValueError`` unless the KJT of raw ids is on the CPU, where the remap runs."""
    device = features.values().device
    if device.type != "cpu":
        raise ValueError(
            f"the KeyedJaggedTensor of raw ids is on {device}: managed-collision remapping runs on the host "
            "(TorchRec's code, on the CPU), before tpurec preprocesses the ids there. Pass the KJT on CPU."
        )


def _init_managed(
    self: BaseManagedCollisionEmbeddingCollection,
    embedding_module: EmbeddingBagCollection | EmbeddingCollection,
    configs: list[Any],
    managed_collision_collection: TorchrecMCC,
    return_remapped_features: bool,
    allow_in_place_embed_weight_update: bool,
) -> None:
    # TorchRec's __init__ accepts its own collections only (it tests the class to find the
    # configs); the attributes and their registration order (so the state dict's) are its.
    nn.Module.__init__(self)
    mcc = HostManagedCollisionCollection.from_torchrec(managed_collision_collection)
    if list(configs) != list(mcc.embedding_configs()):
        raise ValueError(
            "the embedding collection and the managed-collision collection must have the same table configs, got "
            f"{[c.name for c in configs]} and {[c.name for c in mcc.embedding_configs()]} (or different settings)"
        )
    self._managed_collision_collection = mcc
    self._return_remapped_features = return_remapped_features
    self._allow_in_place_embed_weight_update = allow_in_place_embed_weight_update
    # tpurec's collection stands where TorchRec's type hints name TorchRec's own.
    self._embedding_module = cast(Any, embedding_module)


class ManagedCollisionEmbeddingBagCollection(TorchrecMCEBC):
    """TorchRec's ``ManagedCollisionEmbeddingBagCollection`` over tpurec's ``EmbeddingBagCollection``.

    The raw ids are remapped on the host by TorchRec's own collection (kept on the CPU, see
    :class:`HostManagedCollisionCollection`), then looked up by the tpurec collection on its
    device. The output is TorchRec's: ``(KeyedTensor, None)``, or ``(KeyedTensor, remapped KJT)``
    with ``return_remapped_features``. Evicted slots keep their rows, as in TorchRec's unsharded
    module (its ``evict`` hook does nothing).

    Args:
        embedding_bag_collection: a :class:`tpurec.sparse.EmbeddingBagCollection`.
        managed_collision_collection: torchrec's ``ManagedCollisionCollection`` for the same tables.
        return_remapped_features: also return the remapped KJT.
        allow_in_place_embed_weight_update: kept for TorchRec (used by its sharded module only).
    """

    def __init__(
        self,
        embedding_bag_collection: EmbeddingBagCollection,
        managed_collision_collection: TorchrecMCC,
        return_remapped_features: bool = False,
        allow_in_place_embed_weight_update: bool = False,
    ) -> None:
        _init_managed(
            self,
            embedding_bag_collection,
            embedding_bag_collection.embedding_bag_configs(),
            managed_collision_collection,
            return_remapped_features,
            allow_in_place_embed_weight_update,
        )

    # The remap is data-dependent host code: under torch.compile it runs outside the graph.
    @torch.compiler.disable
    def forward(
        self, features: KeyedJaggedTensor, mutate_miss_lengths: bool = True
    ) -> tuple[KeyedTensor, KeyedJaggedTensor | None]:
        """TorchRec's forward: remap ``features`` (CPU, raw ids), then look them up.

        Raises:
            ValueError: ``features`` is not on the CPU.
        """
        check_host_features(features)
        pooled, remapped = super().forward(features, mutate_miss_lengths=mutate_miss_lengths)
        return cast(KeyedTensor, pooled), remapped


class ManagedCollisionEmbeddingCollection(TorchrecMCEC):
    """TorchRec's ``ManagedCollisionEmbeddingCollection`` over tpurec's ``EmbeddingCollection``.

    As :class:`ManagedCollisionEmbeddingBagCollection`, with ``Dict[str, JaggedTensor]`` out.

    Args:
        embedding_collection: a :class:`tpurec.sparse.EmbeddingCollection`.
        managed_collision_collection: torchrec's ``ManagedCollisionCollection`` for the same tables.
        return_remapped_features: also return the remapped KJT.
        allow_in_place_embed_weight_update: kept for TorchRec (used by its sharded module only).
    """

    def __init__(
        self,
        embedding_collection: EmbeddingCollection,
        managed_collision_collection: TorchrecMCC,
        return_remapped_features: bool = False,
        allow_in_place_embed_weight_update: bool = False,
    ) -> None:
        _init_managed(
            self,
            embedding_collection,
            embedding_collection.embedding_configs(),
            managed_collision_collection,
            return_remapped_features,
            allow_in_place_embed_weight_update,
        )

    @torch.compiler.disable
    def forward(
        self, features: KeyedJaggedTensor, mutate_miss_lengths: bool = True
    ) -> tuple[dict[str, JaggedTensor], KeyedJaggedTensor | None]:
        """TorchRec's forward: remap ``features`` (CPU, raw ids), then look them up.

        Raises:
            ValueError: ``features`` is not on the CPU.
        """
        check_host_features(features)
        looked_up, remapped = super().forward(features, mutate_miss_lengths=mutate_miss_lengths)
        return cast(dict[str, JaggedTensor], looked_up), remapped


# The module types that remap their features' ids in their forward, each with ``_feature_names``:
# TorchRec's managed-collision collection, and the sharded one (tpurec.sparse.sharding.managed adds it
# when imported: it sits above this module, which must not import it).
REMAP_TYPES: list[type[nn.Module]] = [TorchrecMCC]


def remapped_features(model: nn.Module) -> set[str]:
    """The features whose ids a managed-collision collection of ``model`` remaps in its forward.

    A collection looking these features up gets remapped ids made in the step itself (training
    updates the remap and may evict), so ``TrainPipeline`` prepares no batch of them ahead.

    Args:
        model: any module.

    Returns:
        Feature names (KJT keys).
    """
    remaps = tuple(REMAP_TYPES)
    names: list[list[str]] = [m._feature_names for m in model.modules() if isinstance(m, remaps)]  # type: ignore[misc]
    return {f for features in names for f in features}


def convert_managed(model: nn.Module, convert: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """Replaces TorchRec's managed-collision modules of ``model`` by tpurec's.

    An MC-EBC / MC-EC keeps its managed-collision collection (made host-pinned, same module
    objects and state) and gets ``convert(inner)`` as its embedding module; a bare
    ``ManagedCollisionCollection`` becomes a :class:`HostManagedCollisionCollection`.
    Run :func:`check_convertible` first.

    Args:
        model: the model (changed in place).
        convert: converts a TorchRec ``EmbeddingBagCollection`` / ``EmbeddingCollection``.

    Returns:
        ``model``, or its replacement when ``model`` itself is a managed-collision module.
    """

    def replacement(module: nn.Module) -> nn.Module:
        if isinstance(module, TorchrecMCC):
            return HostManagedCollisionCollection.from_torchrec(module)
        assert isinstance(module, (TorchrecMCEBC, TorchrecMCEC))  # (what _targets yields)
        cls = (
            ManagedCollisionEmbeddingBagCollection
            if isinstance(module, TorchrecMCEBC)
            else ManagedCollisionEmbeddingCollection
        )
        new = cls(
            cast(Any, convert(module._embedding_module)),  # tpurec's EmbeddingBagCollection / EmbeddingCollection
            module._managed_collision_collection,
            module._return_remapped_features,
            module._allow_in_place_embed_weight_update,
        )
        new.train(module.training)
        return new

    for name, module in _targets(model):
        if not name:
            return replacement(module)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, replacement(module))
    return model
