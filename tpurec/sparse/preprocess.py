"""KeyedJaggedTensor -> SparseCore CSR input, on the host.

The numpy code here is the reference. :func:`preprocess_kjt` runs the native
C++ version (:mod:`tpurec.sparse.kernels.native.preprocess`, identical output)
when it can; ``TPUREC_PREPROCESS=numpy`` forces the reference,
``TPUREC_PREPROCESS=native`` requires the native build (default ``auto``: native
if it builds, else numpy with a warning).

Example::

    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
    from tpurec.sparse import Capacity, preprocess_kjt

    tables = [EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=100,
                                 feature_names=["f0", "f1"])]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1"], values=torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([2, 0, 1, 1]))
    batch = preprocess_kjt(kjt, tables, num_partitions=4, capacities=Capacity(16))
    batch.stacks["t0"].embedding_ids
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import OrderedDict
from typing import Iterable, Literal, Mapping, Sequence

import numpy as np
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tpurec import config

# Rule 3 (batch sizes) sits below the native kernels, which apply it too.
from tpurec.sparse.batching import Batching, _is_integer, read_batching
from tpurec.sparse.types import (
    PAD_ID,
    Capacity,
    CapacityError,
    FeatureSlot,
    SparseCoreInput,
    StackedCsr,
    StackedTable,
    TableInStack,
)

__all__ = [
    "stack_tables",
    "preprocess_kjt",
    "suggest_capacities",
    "FeatureBatch",
    "Batching",
    "read_kjt",
    "read_batching",
    "shared_features",
]

Overflow = Literal["error", "drop"]

_FLOAT32_MAX = float(np.finfo(np.float32).max)


def stack_tables(tables: Sequence[EmbeddingBagConfig], stack: bool = True) -> list[StackedTable]:
    """Groups tables into stacked tables (one per embedding dim and data_type).

    Tables of one embedding dim and data_type share a stack (their optimizer is the module's,
    so it always agrees); each keeps a row offset. Stacks appear in the order of
    their first table; inside a stack, features take output slots in table
    order, then in each table's ``feature_names`` order. A feature listed by
    several tables (as TorchRec allows) takes one slot per table.

    Args:
        tables: torchrec table configs.
        stack: ``False`` gives each table its own stack.

    Returns:
        The stacked tables.

    Example::

        stacks = stack_tables([EmbeddingBagConfig(name="a", embedding_dim=8, num_embeddings=10,
                                                  feature_names=["f"])])
    """
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ValueError(f"table names must be unique, got {names}")
    # A feature may look up several tables (TorchRec names those outputs "<feature>@<table>"),
    # but one table only once: TorchRec would give both lookups the same output name.
    for t in tables:
        twice = sorted({f for f in t.feature_names if list(t.feature_names).count(f) > 1})
        if twice:
            raise ValueError(
                f"table {t.name!r} lists feature {twice[0]!r} twice in feature_names {list(t.feature_names)}; "
                "list each feature once per table"
            )
    groups: "OrderedDict[object, list[EmbeddingBagConfig]]" = OrderedDict()
    for t in tables:
        # One stack is one stored tensor: its tables share a dim and a data_type.
        groups.setdefault((t.embedding_dim, t.data_type) if stack else t.name, []).append(t)
    stacks = []
    for group in groups.values():
        offset, members, slots = 0, [], []
        for t in group:
            members.append(TableInStack(t.name, offset, t.num_embeddings))
            for f in t.feature_names:
                slots.append(FeatureSlot(f, t.name, len(slots), offset, t.num_embeddings, t.pooling))
            offset += t.num_embeddings
        if offset >= PAD_ID:
            raise ValueError(
                f"stack of tables {[t.name for t in group]} has {offset} rows; ids must stay below {PAD_ID}"
            )
        name = "__".join(t.name for t in group)
        stacks.append(StackedTable(name, group[0].embedding_dim, tuple(members), tuple(slots)))
    return stacks


def shared_features(tables: Sequence[EmbeddingBagConfig]) -> dict[str, list[str]]:
    """Features looked up in more than one table -> those tables' names, in table order.

    Args:
        tables: torchrec table configs.

    Returns:
        ``{feature: [table, ...]}`` for every feature listed by two tables or more.
    """
    tables_of: dict[str, list[str]] = {}
    for t in tables:
        for f in dict.fromkeys(t.feature_names):
            tables_of.setdefault(f, []).append(t.name)
    return {f: names for f, names in tables_of.items() if len(names) > 1}


@dataclasses.dataclass
class FeatureBatch:
    """One feature of a validated KJT, as numpy arrays.

    Args:
        ids: int64 ids.
        lengths: int64 bag lengths, ``[batch_size]``.
        weights: float32 per-id weights, or None.
    """

    ids: np.ndarray
    lengths: np.ndarray
    weights: np.ndarray | None


def _tables_of(tables: Sequence[EmbeddingBagConfig] | Sequence[StackedTable]) -> list[StackedTable]:
    if tables and isinstance(tables[0], StackedTable):
        return list(tables)  # type: ignore[arg-type]
    return stack_tables(tables)  # type: ignore[arg-type]


_FLOAT_WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def read_kjt(
    kjt: KeyedJaggedTensor,
    stacks: Sequence[StackedTable],
    is_weighted: bool | None = None,
    *,
    variable_batch: bool | Literal["unpooled"] = False,
) -> tuple[int, dict[str, FeatureBatch]]:
    """Validates ``kjt`` against the tables and splits it per feature.

    This is the one place where a batch is validated: every rule below runs
    before anything is returned, so a rejected batch changes no state anywhere.
    Each failure is a ``ValueError`` (never a crash, never a silent fix) naming
    the offending feature and value. The rules, in the order they are checked
    (a native reimplementation must check the same rules in the same order so
    that it reports the same feature):

    1. Keys are unique (a duplicate key is named; torchrec would silently
       drop one of the blocks).
    2. Every key is a feature of some table; every table feature is a key.
    3. Batch sizes (:func:`read_batching`). Without ``variable_batch`` every
       feature has the KJT's stride (a VBE batch raises ``NotImplementedError``).
       With it, feature ``f`` has ``stride_per_key()[f]`` bags (summed over
       ranks); non-empty ``inverse_indices`` are a 2-D integer tensor with a
       row for every feature, each entry a bag of that feature, and their
       width is the output batch; without them every feature has the same
       number of bags.
    4. ``values`` is a 1-D integer tensor (floating, complex and bool ids are
       rejected, naming the first feature); ``lengths`` is a 1-D integer tensor
       with one entry per bag. If the KJT was built from offsets,
       they start at 0 (a batch of size 0 has no offsets to check).
    5. No bag length is negative (the first feature, in key order, with a
       negative length is named).
    6. No bag length exceeds ``len(values)``: checked *before* anything is
       summed, so that the per-feature sums below cannot overflow int64 and
       wrap around (such a batch used to pass the total check and crash).
    7. The lengths add up to ``len(values)``; if not, the first feature whose
       running end passes ``len(values)`` is named (or the last feature, if
       the lengths fall short).
    8. If a ``weights`` tensor is present (weighted tables or not, as torchrec
       splits it per feature either way) it is 1-D, of a floating dtype
       torchrec accepts (float16, bfloat16, float32, float64), and has one
       entry per id; otherwise the first feature without a matching weight is
       named. Weighted tables (``is_weighted=True``) require weights.
       Weights are converted to float32.
    9. Every id of a feature is in ``[0, num_embeddings)`` of every table it
       looks up (the first bad id is named with its feature and table).

    An empty batch (stride 0, every key present, no bags) is valid.

    Args:
        kjt: the batch (CPU tensors).
        stacks: the stacked tables it will be looked up in.
        is_weighted: require (True) or ignore (False) weights; None uses them
            when present.
        variable_batch: accept a variable batch size per feature and
            ``inverse_indices`` (rule 3); ``"unpooled"``: per-feature batch
            sizes for outputs per bag (:func:`read_batching`).

    Returns:
        ``(rows, {feature: FeatureBatch})``: ``rows`` is the batch size (with
        ``variable_batch``, the CSR rows per feature slot, see :class:`Batching`);
        each feature's ``lengths`` has one entry per bag of that feature.

    Raises:
        ValueError: the batch breaks one of the rules above.
        NotImplementedError: a VBE batch without ``variable_batch``.
    """
    batching, out = _read_kjt(kjt, stacks, is_weighted, variable_batch)
    return batching.rows, out


def _read_kjt(
    kjt: KeyedJaggedTensor,
    stacks: Sequence[StackedTable],
    is_weighted: bool | None,
    variable_batch: bool | Literal["unpooled"],
) -> tuple[Batching, dict[str, FeatureBatch]]:
    """:func:`read_kjt`, returning the whole :class:`Batching`."""
    slots: dict[str, list] = {}
    for st in stacks:
        for s in st.features:
            slots.setdefault(s.feature, []).append(s)
    keys = list(kjt.keys())
    # Rule 1: unique keys.
    seen: set[str] = set()
    duplicates = [k for k in keys if k in seen or seen.add(k)]
    if duplicates:
        raise ValueError(
            f"feature '{duplicates[0]}' appears more than once in the KeyedJaggedTensor keys {keys}; "
            "each feature must appear once"
        )
    # Rule 2: the keys are exactly the tables' features.
    unknown = [k for k in keys if k not in slots]
    if unknown:
        raise ValueError(
            f"features {unknown} of the KeyedJaggedTensor are not in any table (known features: {sorted(slots)})"
        )
    missing = [f for f in slots if f not in keys]
    if missing:
        raise ValueError(f"features {missing} used by the tables are missing from the KeyedJaggedTensor (keys: {keys})")
    # Rule 3: batch sizes.
    batching = read_batching(kjt, variable_batch)
    # Rule 4: dtypes, ranks, sizes.
    values_t, lengths_t = kjt.values(), kjt.lengths()
    if values_t.dim() != 1:
        raise ValueError(f"values of features {keys} must be a 1-D tensor of ids, got shape {tuple(values_t.shape)}")
    if not _is_integer(values_t):
        first = values_t[0].item() if values_t.numel() else None
        raise ValueError(
            f"ids of features {keys} must be integers, got dtype {values_t.dtype} (first value of feature "
            f"'{keys[0]}': {first})"
        )
    if lengths_t.dim() != 1 or not _is_integer(lengths_t):
        raise ValueError(
            f"lengths of features {keys} must be a 1-D integer tensor, got dtype {lengths_t.dtype} and shape "
            f"{tuple(lengths_t.shape)}"
        )
    offsets_t = kjt.offsets_or_none()
    if offsets_t is not None and offsets_t.numel() and int(offsets_t[0]) != 0:
        raise ValueError(f"offsets of features {keys} must start at 0, got {int(offsets_t[0])} (feature '{keys[0]}')")
    values = values_t.detach().cpu().numpy().astype(np.int64, copy=False)
    lengths = lengths_t.detach().cpu().numpy().astype(np.int64, copy=False)
    n_keys = len(keys)
    bags = np.array(batching.bags_per_key, np.int64)
    if lengths.shape[0] != int(bags.sum()):
        if kjt.variable_stride_per_key():
            raise ValueError(
                f"lengths has {lengths.shape[0]} entries but stride_per_key_per_rank gives {int(bags.sum())} bags "
                f"({dict(zip(keys, batching.bags_per_key))} per feature); give one length per bag"
            )
        raise ValueError(
            f"lengths has {lengths.shape[0]} entries, expected {n_keys} features x batch {batching.rows} "
            f"(features {keys})"
        )
    bounds = np.concatenate([[0], np.cumsum(bags)])
    key_of = np.repeat(np.arange(n_keys), bags)  # the key of each bag

    def bags_of(k: int) -> np.ndarray:
        return lengths[bounds[k] : bounds[k + 1]]

    # Rule 5: no negative lengths.
    negative = np.nonzero(lengths < 0)[0]
    if negative.size:
        k = int(key_of[negative[0]])
        raise ValueError(f"feature '{keys[k]}' has a negative bag length {bags_of(k).min()}")
    # Rule 6: no length above len(values), before summing (sums then stay far below 2**63).
    too_long = np.nonzero(lengths > values.shape[0])[0]
    if too_long.size:
        k = int(key_of[too_long[0]])
        raise ValueError(
            f"feature '{keys[k]}' has a bag length {int(bags_of(k).max())} but values has only "
            f"{values.shape[0]} ids in all"
        )
    # Rule 7: lengths add up to len(values).
    running = np.concatenate([[0], np.cumsum(lengths)])
    per_key = running[bounds[1:]] - running[bounds[:-1]]
    ends = np.cumsum(per_key)
    total = int(ends[-1]) if n_keys else 0
    if total != values.shape[0]:
        over = np.nonzero(ends > values.shape[0])[0]
        k = over[0] if over.size else n_keys - 1
        raise ValueError(
            f"lengths sum to {total} but values has {values.shape[0]} ids "
            f"(feature '{keys[k]}' lengths sum to {int(per_key[k])}, ending at {int(ends[k])})"
        )
    # Rule 8: weights.
    weights_t = kjt.weights_or_none()
    use_weights = weights_t is not None if is_weighted is None else is_weighted
    if use_weights and weights_t is None:
        raise ValueError(f"the tables are weighted but the KeyedJaggedTensor of features {keys} has no weights")
    weights = None
    if weights_t is not None:
        if weights_t.dtype not in _FLOAT_WEIGHT_DTYPES:
            raise ValueError(
                f"weights of features {keys} must be float16, bfloat16, float32 or float64, got {weights_t.dtype}"
            )
        if weights_t.dim() != 1 or weights_t.shape[0] != values.shape[0]:
            n_weights = weights_t.shape[0] if weights_t.dim() == 1 else weights_t.numel()
            k = int(np.searchsorted(ends, min(n_weights, values.shape[0]), side="right"))
            k = min(k, n_keys - 1)
            entries = f"{n_weights} entries" if weights_t.dim() == 1 else f"shape {tuple(weights_t.shape)}"
            raise ValueError(
                f"weights has {entries} but values has {values.shape[0]} ids (first feature without matching "
                f"weights: '{keys[k]}'); give one weight per id"
            )
        if use_weights:
            # numpy has no bfloat16: widen in torch first (exact for every float dtype accepted).
            weights = weights_t.detach().cpu().to(torch.float32).numpy()
    starts = ends - per_key
    out: dict[str, FeatureBatch] = {}
    # Rule 9: ids in range (of every table the feature looks up).
    for k, key in enumerate(keys):
        ids = values[starts[k] : ends[k]]
        for slot in slots[key]:
            bad = (ids < 0) | (ids >= slot.num_embeddings)
            if bad.any():
                value = int(ids[np.argmax(bad)])
                raise ValueError(
                    f"feature '{key}' has id {value} outside [0, {slot.num_embeddings}) of table '{slot.table}'"
                )
        w = None if weights is None else weights[starts[k] : ends[k]]
        out[key] = FeatureBatch(ids, bags_of(k), w)
    return batching, out


def _sort_order(part, ids, samples, num_partitions: int, num_rows: int, num_samples: int) -> np.ndarray:
    """Order by (partition, id, sample).

    One int64 key and a plain argsort are several times faster than ``lexsort``
    over three keys; entries with equal keys are duplicates that get merged.
    """
    if num_partitions * num_rows * num_samples < 2**62:
        # Stable: duplicates of one bag keep KJT order, so their (weighted) gains
        # are summed in a defined order (the native preprocessing sums the same way).
        return np.argsort((part * num_rows + ids) * num_samples + samples, kind="stable")
    return np.lexsort((samples, ids, part))


def _stack_csr(
    stack: StackedTable,
    features: Mapping[str, FeatureBatch],
    batch_size: int,
    num_partitions: int,
    capacity: Capacity | None,
    overflow: Overflow,
) -> StackedCsr:
    """CSR arrays of one stack, ``batch_size`` rows per slot; ``capacity=None`` sizes the buffers to fit."""
    ids_l, samples_l, gains_l, slots_l = [], [], [], []
    for k, slot in enumerate(stack.features):
        fb = features[slot.feature]
        ids_l.append(fb.ids + slot.row_offset)
        slots_l.append(np.full(fb.ids.shape[0], k, np.int32))  # which feature: counts drops per feature
        # A feature's bags fill the first rows of its slot (fewer than batch_size with VBE).
        bags = np.arange(fb.lengths.shape[0], dtype=np.int64)
        samples_l.append(np.repeat(bags + slot.slot * batch_size, fb.lengths))
        g = np.ones(fb.ids.shape[0], np.float64) if fb.weights is None else fb.weights.astype(np.float64)
        if slot.pooling == PoolingType.MEAN:
            # MEAN divides by the bag length (FBGEMM/torchrec), also for weighted bags.
            g = g / np.repeat(fb.lengths, fb.lengths)
        gains_l.append(g)
    ids = np.concatenate(ids_l) if ids_l else np.zeros(0, np.int64)
    samples = np.concatenate(samples_l) if samples_l else np.zeros(0, np.int64)
    gains = np.concatenate(gains_l) if gains_l else np.zeros(0, np.float64)
    slot_of = np.concatenate(slots_l) if slots_l else np.zeros(0, np.int32)
    P = num_partitions
    part = ids % P
    order = _sort_order(part, ids, samples, P, stack.num_rows, max(stack.num_slots * batch_size, 1))
    ids, samples, gains, part, slot_of = ids[order], samples[order], gains[order], part[order], slot_of[order]
    n = ids.shape[0]

    # Merge duplicate (sample, id) pairs: one entry, gains summed.
    if n:
        new_pair = np.empty(n, bool)
        new_pair[0] = True
        new_pair[1:] = (ids[1:] != ids[:-1]) | (samples[1:] != samples[:-1])
        starts = np.nonzero(new_pair)[0]
        merged = np.add.reduceat(gains, starts)
        # A sum of finite float32 gains may pass float32's range (float64 holds it):
        # such a pair keeps its entries unmerged, so the kernel adds gain * row
        # products, which stay finite as in torchrec, instead of using an inf gain.
        unrepresentable = np.isfinite(merged) & (np.abs(merged) > _FLOAT32_MAX)
        if unrepresentable.any():
            split = unrepresentable[np.cumsum(new_pair) - 1]
            keep = new_pair | split
            gains = np.where(split, gains, merged[np.cumsum(new_pair) - 1])[keep]
            ids, samples, part, slot_of = ids[keep], samples[keep], part[keep], slot_of[keep]
        else:
            gains = merged
            # A merged pair is one sample of one slot: one feature.
            ids, samples, part, slot_of = ids[starts], samples[starts], part[starts], slot_of[starts]
    n = ids.shape[0]
    new_id = np.empty(n, bool)
    if n:
        new_id[0] = True
        new_id[1:] = ids[1:] != ids[:-1]
    counts = np.bincount(part, minlength=P)
    unique_counts = np.bincount(part[new_id], minlength=P)

    if capacity is None:
        capacity = Capacity(max(int(counts.max()), 1), max(int(unique_counts.max()), 1))
    dropped = 0
    dropped_by_feature: dict[str, int] = {}
    max_unique = capacity.max_unique_ids_per_partition
    assert max_unique is not None  # (Capacity.__post_init__ sets it)
    too_many = counts > capacity.max_ids_per_partition
    too_many_unique = unique_counts > max_unique
    if too_many.any() or too_many_unique.any():
        if overflow != "drop":
            p = int(np.argmax(too_many | too_many_unique))
            raise CapacityError(
                f"stacked table '{stack.name}', partition {p} of {P}: the batch needs {int(counts[p])} ids "
                f"({int(unique_counts[p])} unique) but the capacity is max_ids_per_partition="
                f"{capacity.max_ids_per_partition}, max_unique_ids_per_partition="
                f"{capacity.max_unique_ids_per_partition}; raise it (see suggest_capacities) or pass overflow='drop'"
            )
        # Keep, per partition, the first max_unique ids and then the first max_ids entries.
        uniq_start = np.cumsum(unique_counts) - unique_counts
        unique_rank = np.cumsum(new_id) - 1 - uniq_start[part]
        keep = unique_rank < max_unique
        kept_counts = np.bincount(part[keep], minlength=P)
        rank = np.cumsum(keep) - 1 - (np.cumsum(kept_counts) - kept_counts)[part]
        keep &= rank < capacity.max_ids_per_partition
        dropped = int(n - keep.sum())
        for k, count in enumerate(np.bincount(slot_of[~keep], minlength=len(stack.features)).tolist()):
            if count:
                feature = stack.features[k].feature
                dropped_by_feature[feature] = dropped_by_feature.get(feature, 0) + count
        ids, samples, gains, part = ids[keep], samples[keep], gains[keep], part[keep]
    kept = np.bincount(part, minlength=P)
    rank = np.arange(ids.shape[0]) - (np.cumsum(kept) - kept)[part]
    size = capacity.partition_size
    pos = part * size + rank
    out_ids = np.full(P * size, PAD_ID, np.int32)
    out_samples = np.full(P * size, PAD_ID, np.int32)
    out_gains = np.zeros(P * size, np.float32)
    out_ids[pos] = ids
    out_samples[pos] = samples
    out_gains[pos] = gains
    row_pointers = (np.arange(P) * size + kept).astype(np.int32)
    return StackedCsr(
        row_pointers,
        out_ids,
        out_samples,
        out_gains,
        counts.astype(np.int32),
        unique_counts.astype(np.int32),
        dropped,
        dropped_by_feature,
    )


def _capacity_for(capacities: Capacity | Mapping[str, Capacity] | None, stack: StackedTable) -> Capacity | None:
    if capacities is None or isinstance(capacities, Capacity):
        return capacities
    if stack.name in capacities:
        return capacities[stack.name]
    for t in stack.tables:  # a single-table stack may be named by its table
        if t.name in capacities and len(stack.tables) == 1:
            return capacities[t.name]
    raise ValueError(f"no capacity for stacked table '{stack.name}' (given: {sorted(capacities)})")


_NATIVE_FAILED = False


def _native_enabled() -> bool:
    choice = config.get("TPUREC_PREPROCESS")
    return choice == "native" or (choice == "auto" and not _NATIVE_FAILED)


def _preprocess_native(
    kjt: KeyedJaggedTensor,
    stacks: Sequence[StackedTable],
    num_partitions: int,
    capacities: Capacity | Mapping[str, Capacity] | None,
    is_weighted: bool | None,
    overflow: Overflow,
) -> SparseCoreInput | None:
    """The native path, or None when the numpy reference must run (see its module)."""
    global _NATIVE_FAILED
    from tpurec.sparse.kernels.native import NativeBuildError
    from tpurec.sparse.kernels.native.preprocess import preprocess_native

    try:
        per_stack = {st.name: _capacity_for(capacities, st) for st in stacks}
    except ValueError:
        return None  # the reference raises it, after validating the batch
    if any(c is None for c in per_stack.values()):
        return None  # sizing buffers to the batch: reference path
    try:
        return preprocess_native(kjt, stacks, num_partitions, per_stack, is_weighted, overflow)  # type: ignore[arg-type]
    except NativeBuildError as e:
        if config.get("TPUREC_PREPROCESS") == "native":
            raise
        _NATIVE_FAILED = True
        warnings.warn(f"native preprocessing unavailable, using numpy: {e}", RuntimeWarning, stacklevel=3)
        return None


def preprocess_kjt(
    kjt: KeyedJaggedTensor,
    tables: Sequence[EmbeddingBagConfig] | Sequence[StackedTable],
    num_partitions: int = 1,
    capacities: Capacity | Mapping[str, Capacity] | None = None,
    *,
    is_weighted: bool | None = None,
    overflow: Overflow = "error",
) -> SparseCoreInput:
    """Turns a KeyedJaggedTensor into SparseCore CSR input, per stacked table.

    A batch with a variable batch size per feature (VBE, ``stride_per_key_per_rank``)
    and ``inverse_indices`` is accepted as TorchRec's ``EmbeddingBagCollection``
    accepts it: each feature's bags fill the first rows of its slot, padded to
    the output batch (``inverse_indices``' width), so the CSR shapes depend on
    that batch only; ``SparseCoreInput.inverse_indices`` say which bag each
    output sample repeats.

    Args:
        kjt: the batch (CPU).
        tables: torchrec table configs (stacked with :func:`stack_tables`) or
            already stacked tables.
        num_partitions: MOD partitions (SparseCores holding the table).
        capacities: one :class:`Capacity` for every stack, one per stack name,
            or None to size the buffers to this batch (shapes then change from
            batch to batch: every new shape compiles again).
        is_weighted: see :func:`read_kjt`.
        overflow: ``"error"`` raises :class:`CapacityError` with the observed and
            allowed numbers; ``"drop"`` drops what does not fit and counts it in
            ``StackedCsr.dropped``.

    Returns:
        The :class:`SparseCoreInput`.

    Example::

        batch = preprocess_kjt(kjt, tables, num_partitions=2, capacities=Capacity(64))
        rp, ids, samples, gains = batch.stacks["t0"].arrays()
    """
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    if overflow not in ("error", "drop"):
        raise ValueError(f"overflow must be 'error' or 'drop', got {overflow!r}")
    stacks = _tables_of(tables)
    if _native_enabled():
        batch = _preprocess_native(kjt, stacks, num_partitions, capacities, is_weighted, overflow)
        # The native code merges duplicate (sample, id) gains without the float32-range
        # rule of _stack_csr (sums past float32 stay unmerged): a non-finite gain sends
        # the batch to the reference, which applies it (or agrees, for inf weights).
        # A batch that dropped entries also runs the reference, which says which features they
        # were of (the native code counts a total per stack): the same arrays, dropped per feature.
        if batch is not None and all(np.isfinite(csr.gains).all() and not csr.dropped for csr in batch.stacks.values()):
            return batch
    batching, features = _read_kjt(kjt, stacks, is_weighted, variable_batch=True)
    rows = batching.rows
    csrs = {
        st.name: _stack_csr(st, features, rows, num_partitions, _capacity_for(capacities, st), overflow)
        for st in stacks
    }
    return SparseCoreInput(rows, num_partitions, csrs, batching.inverse_indices)


def suggest_capacities(
    batches: Iterable[KeyedJaggedTensor],
    tables: Sequence[EmbeddingBagConfig] | Sequence[StackedTable],
    num_partitions: int = 1,
    *,
    is_weighted: bool | None = None,
    headroom: float = 1.0,
) -> dict[str, Capacity]:
    """Measures the capacities a data set needs.

    Args:
        batches: sample batches.
        tables: as in :func:`preprocess_kjt`.
        num_partitions: MOD partitions.
        is_weighted: see :func:`read_kjt`.
        headroom: factor applied to the observed maxima (e.g. 1.2).

    Returns:
        Stack name -> :class:`Capacity` fitting every batch.

    Example::

        caps = suggest_capacities(loader_sample, tables, num_partitions=4, headroom=1.25)
        batch = preprocess_kjt(kjt, tables, 4, caps)
    """
    stacks = _tables_of(tables)
    ids = {st.name: 1 for st in stacks}
    uniq = {st.name: 1 for st in stacks}
    for kjt in batches:
        batch = preprocess_kjt(kjt, stacks, num_partitions, None, is_weighted=is_weighted)
        for name, csr in batch.stacks.items():
            ids[name] = max(ids[name], int(csr.max_ids.max()))
            uniq[name] = max(uniq[name], int(csr.max_unique_ids.max()))
    out = {}
    for name in ids:
        m = int(np.ceil(ids[name] * headroom))
        out[name] = Capacity(m, min(m, int(np.ceil(uniq[name] * headroom))))
    return out
