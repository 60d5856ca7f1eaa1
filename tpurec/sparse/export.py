"""Exporting converted TorchRec models for serving: ``torch.export`` and ``torchrec.fx``.

An :class:`~tpurec.sparse.EmbeddingBagCollection` preprocesses each batch on the host
(numpy or native C++ over the KeyedJaggedTensor) before its SparseCore lookup, and a
graph tracer cannot follow that code. Under ``torch.export.export`` and
``torch.fx`` / ``torchrec.fx.symbolic_trace`` the collection's forward therefore
records its whole lookup as one custom op::

    torch.ops.tpurec.embedding_bag_collection(stacked_weights, values, weights, lengths, offsets,
                                              keys, layout) -> Tensor   # [batch, sum of dims]

``layout`` is a JSON string with everything the lookup needs besides the tables
(table configs, stacking, partitions, capacities, overflow policy), so an exported
program runs without the module that made it. The op's kernel runs the path of the
eager module: the same preprocessing (and validation: a bad batch raises the same
``ValueError``) and ``torch.ops.tpurec.sparse_dense_matmul`` on the tables' device,
so the exported program's results equal the eager model's exactly. Its fake kernel
gives ``[lengths.numel() // len(keys), sum of dims]``, so the batch size (and the
number of ids) may be dynamic: see :func:`kjt_dynamic_shapes`.

Only the inference forward is exported: a collection in training mode raises
``NotImplementedError`` (its backward applies the fused optimizer, which a graph of
the forward does not contain).

Example::

    model = tpurec.sparse.from_torchrec(dlrm).eval().to("tpu")
    batch = torch.export.Dim("batch")
    ep = torch.export.export(
        model, (dense, kjt),
        dynamic_shapes=({0: batch}, tpurec.sparse.export.kjt_dynamic_shapes(kjt, batch)))
    logits = ep.module()(dense2, kjt2)  # any batch size
"""

from __future__ import annotations

import functools
import json
from typing import Any, Mapping, Optional, Protocol

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from tpurec.sparse.lookup import output_runs, preprocess_growing
from tpurec.sparse.preprocess import stack_tables
from tpurec.sparse.types import Capacity, SparseCoreInput, StackedTable


class ExportedLookup(Protocol):
    """What export reads of an :class:`~tpurec.sparse.EmbeddingBagCollection` (a protocol:
    this module sits below the modules, which call it)."""

    training: bool
    num_partitions: int
    overflow: str
    output_dtype: torch.dtype
    _fixed_capacities: Capacity | Mapping[str, Capacity] | None
    _auto_capacities: dict[str, Capacity]
    _embedding_names: list[str]
    _length_per_key: list[int]

    @property
    def stacks(self) -> list[StackedTable]: ...

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]: ...

    def is_weighted(self) -> bool: ...

    def stacked_weight(self, index: int) -> torch.Tensor: ...


__all__ = ["is_tracing", "traced_forward", "kjt_dynamic_shapes", "layout_of", "LookupPlan", "SCRIPT_UNSUPPORTED"]

_LAYOUT_VERSION = 1


def is_tracing(features: Any) -> bool:
    """Whether a forward runs under ``torch.export`` or ``torch.fx`` symbolic tracing.

    Args:
        features: the forward's KJT argument (an ``fx.Proxy`` under fx tracing).
    """
    return torch.compiler.is_exporting() or isinstance(features, torch.fx.Proxy)


# --- the layout: what the lookup needs besides the tables -----------------------------


def layout_of(module: ExportedLookup) -> str:
    """The JSON layout string of ``module``'s lookup (the op's ``layout`` argument).

    Auto-grown capacities are recorded as they are now; the exported program keeps
    growing them (by powers of two, as the module does) when a batch needs more.
    """
    configs = module.embedding_bag_configs()
    fixed = module._fixed_capacities
    if fixed is None or isinstance(fixed, Capacity):
        capacities: Any = None if fixed is None else _capacity_json(fixed)
    else:
        capacities = {name: _capacity_json(c) for name, c in fixed.items()}
    layout = {
        "version": _LAYOUT_VERSION,
        "tables": [
            {
                "name": t.name,
                "embedding_dim": t.embedding_dim,
                "num_embeddings": t.num_embeddings,
                "feature_names": list(t.feature_names),
                "pooling": t.pooling.name,
            }
            for t in configs
        ],
        # The tables of each stack, in row order: rebuilding the stacks from these groups
        # gives the module's own stacks (checked below), whatever ``stack=`` it was built with.
        "stacks": [[t.name for t in st.tables] for st in module.stacks],
        "is_weighted": module.is_weighted(),
        "num_partitions": module.num_partitions,
        "capacities": capacities,
        "grown_capacities": {name: _capacity_json(c) for name, c in module._auto_capacities.items()},
        "overflow": module.overflow,
    }
    text = json.dumps(layout, sort_keys=True)
    if LookupPlan.of(text).stacks != module.stacks:
        raise RuntimeError(
            "tpurec internal error: the exported layout does not rebuild the collection's stacked tables; "
            "please report it"
        )
    return text


def _capacity_json(c: Capacity) -> list[int | None]:
    return [c.max_ids_per_partition, c.max_unique_ids_per_partition]


def _capacity(value: list[int | None]) -> Capacity:
    return Capacity(value[0], value[1])


class LookupPlan:
    """The lookup of one collection, rebuilt from its layout string (no tables).

    One plan per layout string per process (:meth:`of`): the capacities it grows
    persist across calls, as the module's do, so batches within them reuse the
    compiled lookup program.
    """

    def __init__(self, layout: str) -> None:
        spec = json.loads(layout)
        if spec.get("version") != _LAYOUT_VERSION:
            raise ValueError(
                f"tpurec.embedding_bag_collection layout version {spec.get('version')!r} is not {_LAYOUT_VERSION}: "
                "the program was exported by another tpurec version; export it again with this one"
            )
        configs = {
            t["name"]: EmbeddingBagConfig(
                name=t["name"],
                embedding_dim=t["embedding_dim"],
                num_embeddings=t["num_embeddings"],
                feature_names=list(t["feature_names"]),
                pooling=PoolingType[t["pooling"]],
            )
            for t in spec["tables"]
        }
        self.configs: list[EmbeddingBagConfig] = [configs[t["name"]] for t in spec["tables"]]
        self.stacks: list[StackedTable] = [
            stack_tables([configs[name] for name in group], stack=True)[0] for group in spec["stacks"]
        ]
        self.is_weighted: bool = spec["is_weighted"]
        self.num_partitions: int = spec["num_partitions"]
        self.overflow: str = spec["overflow"]
        caps = spec["capacities"]  # None (grown on demand), one for every stack, or one per stack name
        self.fixed_capacities: Capacity | dict[str, Capacity] | None = (
            None
            if caps is None
            else _capacity(caps)
            if isinstance(caps, list)
            else {name: _capacity(c) for name, c in caps.items()}
        )
        self.grown_capacities: dict[str, Capacity] = {k: _capacity(v) for k, v in spec["grown_capacities"].items()}
        self.dims: list[int] = [t.embedding_dim for t in self.configs for _ in t.feature_names]
        # (stack, first slot, end slot): runs of consecutive output slots in TorchRec's
        # output order (tables, then their features), as the module assembles them.
        self.output_runs: list[tuple[int, int, int]] = output_runs(self.stacks, self.configs)

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def of(layout: str) -> "LookupPlan":
        """The process's plan for ``layout``."""
        return LookupPlan(layout)

    def preprocess(self, features: KeyedJaggedTensor) -> SparseCoreInput:
        """The CSR input of ``features``, with the module's capacity rules.

        Fixed capacities are used as given (``overflow`` decides what a batch beyond
        them does); otherwise capacities grow to the next power of two a batch needs,
        as :meth:`EmbeddingBagCollection.preprocess` grows them.
        """
        return preprocess_growing(
            features,
            self.stacks,
            self.num_partitions,
            self.fixed_capacities,
            self.grown_capacities,
            self.is_weighted,
            self.overflow,  # type: ignore[arg-type]
        )


# --- the op ---------------------------------------------------------------------------


@torch.library.custom_op("tpurec::embedding_bag_collection", mutates_args=())
def embedding_bag_collection(
    stacked_weights: list[torch.Tensor],
    values: torch.Tensor,
    weights: Optional[torch.Tensor],
    lengths: Optional[torch.Tensor],
    offsets: Optional[torch.Tensor],
    keys: str,
    layout: str,
) -> torch.Tensor:
    """Pooled lookup of a KJT in a collection's stacked tables (TorchRec's ``KeyedTensor.values()``).

    Device independent: on ``tpu`` tables it runs the host preprocessing and
    ``torch.ops.tpurec.sparse_dense_matmul`` on the device, exactly as the eager
    module does; on CPU tables the same ops on CPU. ``keys`` is the KJT's key list
    as JSON (an op schema has no ``str[]``).
    """
    plan = LookupPlan.of(layout)
    _check_weights(plan, stacked_weights)
    features = KeyedJaggedTensor(
        keys=json.loads(keys), values=values, weights=weights, lengths=lengths, offsets=offsets
    )
    batch = plan.preprocess(features)
    b = batch.batch_size
    device = stacked_weights[0].device
    per_stack = []
    for i, st in enumerate(plan.stacks):
        arrays = [torch.from_numpy(a).to(device) for a in batch.stacks[st.name].arrays()]
        out = torch.ops.tpurec.sparse_dense_matmul(*arrays, stacked_weights[i], batch_size=st.num_slots * b)
        per_stack.append(out.view(st.num_slots, b, st.embedding_dim))
    blocks = [
        per_stack[i][first:last].transpose(0, 1).reshape(b, (last - first) * plan.stacks[i].embedding_dim)
        for i, first, last in plan.output_runs
    ]
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)


@embedding_bag_collection.register_fake
def _embedding_bag_collection_fake(stacked_weights, values, weights, lengths, offsets, keys, layout):
    plan = LookupPlan.of(layout)
    _check_weights(plan, stacked_weights)
    if lengths is not None:
        rows = lengths.shape[0]
    elif offsets is not None:
        rows = offsets.shape[0] - 1
    else:
        raise ValueError("tpurec.embedding_bag_collection: the KJT has neither lengths nor offsets")
    num_keys = len(json.loads(keys))
    if num_keys == 0:
        features = [f for t in plan.configs for f in t.feature_names]
        raise ValueError(f"tpurec.embedding_bag_collection: the KJT has no keys; the tables need features {features}")
    torch._check(rows % num_keys == 0, lambda: f"the KJT's {rows} bags are not {num_keys} keys times a batch size")
    return stacked_weights[0].new_empty((rows // num_keys, sum(plan.dims)))


def _check_weights(plan: LookupPlan, stacked_weights: list[torch.Tensor]) -> None:
    shapes = [(st.num_rows, st.embedding_dim) for st in plan.stacks]
    got = [tuple(w.shape) for w in stacked_weights]
    if got != shapes:
        raise ValueError(f"tpurec.embedding_bag_collection: the layout's stacked tables are {shapes}, got tables {got}")


def _setup_context(ctx, inputs, output) -> None:
    pass


def _no_backward(ctx, grad):
    raise RuntimeError(
        "tpurec.embedding_bag_collection is the inference lookup of an exported or fx-traced EmbeddingBagCollection: "
        "it has no backward (the eager module's backward applies its fused optimizer). Train the eager model, or "
        "run the exported program under torch.no_grad()."
    )


embedding_bag_collection.register_autograd(_no_backward, setup_context=_setup_context)


SCRIPT_UNSUPPORTED = (
    "tpurec EmbeddingBagCollection cannot be TorchScripted: its lookup preprocesses each batch on the host in "
    "Python (numpy / native C++). For serving, export the model with torch.export.export(model.eval(), "
    "(dense, kjt)) (see tpurec.sparse.export), or trace it with torchrec.fx.symbolic_trace."
)


# --- the traced forward ------------------------------------------------------------------


@torch.fx.wrap
def _lookup(features: KeyedJaggedTensor, stacked_weights: list[torch.Tensor], layout: str) -> torch.Tensor:
    # One fx node (torch.fx.wrap): under fx tracing ``features`` is a Proxy whose keys
    # and fields are unknown until the traced module runs, which calls this with the real KJT.
    if features.variable_stride_per_key():
        raise NotImplementedError(
            "tpurec: exporting an EmbeddingBagCollection lookup of a variable-batch (VBE) KeyedJaggedTensor is not "
            "supported; export with a KJT of one batch size for every key"
        )
    if features.inverse_indices_or_none() is not None:
        # The op rebuilds the KJT from values/lengths/offsets: the expansion would be lost.
        raise NotImplementedError(
            "tpurec: exporting an EmbeddingBagCollection lookup of a KeyedJaggedTensor with inverse_indices is not "
            "supported (the exported lookup would not expand the pooled rows as TorchRec does); export with a KJT "
            "without inverse_indices"
        )
    return torch.ops.tpurec.embedding_bag_collection(
        stacked_weights,
        features.values(),
        features.weights_or_none(),
        features.lengths_or_none(),
        features.offsets_or_none(),
        json.dumps(list(features.keys())),
        layout,
    )


def traced_forward(module: ExportedLookup, features: KeyedJaggedTensor) -> KeyedTensor:
    """``module.forward`` as a graph: one ``tpurec::embedding_bag_collection`` node.

    Raises:
        NotImplementedError: the module is in training mode (its backward applies the
            fused optimizer, which an exported forward cannot contain), or the KJT's
            weights require grad.
    """
    if module.training:
        raise NotImplementedError(
            "tpurec EmbeddingBagCollection is in training mode: torch.export / torch.fx trace only its inference "
            "lookup (training applies the fused embedding optimizer in backward, which a traced forward cannot "
            "contain). Call model.eval() before exporting; to fx-trace a training model, keep the collection a leaf "
            "module (torchrec.fx.symbolic_trace(model, leaf_modules=['EmbeddingBagCollection']))."
        )
    low = [t.name for t in module.embedding_bag_configs() if t.data_type.name != "FP32"]
    if low or module.output_dtype != torch.float32:
        # The layout string carries no table or output dtype yet: refused rather than exported wrong.
        what = f"FP16/BF16 tables {low}" if low else f"output_dtype={module.output_dtype}"
        raise NotImplementedError(
            f"tpurec: exporting an EmbeddingBagCollection with {what} is not supported yet; export a collection of "
            "FP32 tables with float32 output, or run the eager module"
        )
    if not isinstance(features, torch.fx.Proxy):
        weights = features.weights_or_none()
        if torch.is_grad_enabled() and weights is not None and weights.requires_grad:
            raise NotImplementedError(
                "tpurec: the KJT's per-id weights require grad, but an exported lookup gives them no gradient. "
                "Detach the weights (or export under torch.no_grad())."
            )
    stacked = [module.stacked_weight(i) for i in range(len(module.stacks))]
    values = _lookup(features, stacked, layout_of(module))
    return KeyedTensor(keys=module._embedding_names, length_per_key=module._length_per_key, values=values)


def kjt_dynamic_shapes(features: KeyedJaggedTensor, batch: Any) -> list[Any]:
    """``torch.export`` dynamic shapes of a KJT argument: any batch size, any number of ids.

    Args:
        features: the example KJT (its keys are fixed in the exported program).
        batch: the ``torch.export.Dim`` of the batch size (shared with the dense input).

    Returns:
        The spec of the KJT's flattened fields (values, weights, lengths, offsets,
        stride_per_key_per_rank, inverse_indices), to pass in ``dynamic_shapes``.
    """
    if features.variable_stride_per_key():
        raise NotImplementedError("kjt_dynamic_shapes: a variable-batch (VBE) KJT cannot be exported")
    ids = torch.export.Dim.DYNAMIC
    num_keys = len(features.keys())
    return [
        {0: ids},
        None if features.weights_or_none() is None else {0: ids},
        None if features.lengths_or_none() is None else {0: num_keys * batch},
        None if features.offsets_or_none() is None else {0: num_keys * batch + 1},
        None,
        None,
    ]
