"""Native (C++) KeyedJaggedTensor -> SparseCore CSR preprocessing.

The fast path behind :func:`tpurec.sparse.preprocess_kjt`; the numpy code in
:mod:`tpurec.sparse.preprocess` stays the reference and both give identical
arrays. ``preprocess_cpu.cc`` is built into the native kernels' library (same
on-first-use build, see :mod:`tpurec.sparse.kernels.native`).

Only inputs of the common shape take this path: every table feature a key of
the KJT once (a feature of two tables feeds two slots), int32/int64 ids and
lengths, float weights when the tables use them, and explicit capacities. A
variable batch size per feature (VBE) is padded here to one stride with empty
bags; its batch sizes and ``inverse_indices`` are validated by the reference's
own rule (:func:`tpurec.sparse.batching.read_batching`), which raises here.
:func:`preprocess_native` returns ``None`` for anything else and for any batch
the C++ checks reject (a bad bag length, an id outside its table, a capacity
overflow with ``overflow="error"``); the caller then runs the numpy reference,
which either handles the case or raises its documented ``ValueError`` /
``CapacityError``. So both paths accept the same batches and fail with the
same messages, and the C++ code never has to format one.

Example::

    from tpurec.sparse.kernels.native.preprocess import preprocess_native
    batch = preprocess_native(kjt, stacks, num_partitions=4, capacities={s.name: Capacity(512) for s in stacks},
                              is_weighted=None, overflow="error")
"""

from __future__ import annotations

import ctypes
import functools
from typing import Mapping, Sequence

import numpy as np
import torch
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tpurec.sparse.batching import read_batching
from tpurec.sparse.types import PAD_ID, Capacity, SparseCoreInput, StackedCsr, StackedTable

__all__ = ["preprocess_native"]

_OK, _INVALID, _OVERFLOW = 0, 1, 2
_ID_DTYPES = (torch.int64, torch.int32)
_WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


@functools.lru_cache(maxsize=1)
def _functions() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr]:  # type: ignore[name-defined]
    from tpurec.sparse.kernels import native

    lib = native.load_library()
    key_starts = lib.TpurecKjtKeyStarts
    key_starts.argtypes = [_ptr, _i64, _i64, _i64, _ptr]
    key_starts.restype = ctypes.c_int
    stack = lib.TpurecPreprocessStack
    stack.argtypes = [
        _ptr,
        _ptr,
        _ptr,
        _ptr,
        _i64,
        _i64,
        _ptr,
        _ptr,
        _ptr,
        _ptr,
        _i64,
        _i64,
        _i64,
        _i64,
        ctypes.c_int32,
        _ptr,
        _ptr,
        _ptr,
        _ptr,
        _ptr,
        _ptr,
        _ptr,
    ]
    stack.restype = ctypes.c_int
    return key_starts, stack


@functools.lru_cache(maxsize=64)
def _slot_layout(stack: StackedTable, keys: tuple[str, ...]) -> tuple[np.ndarray, ...]:
    """Per slot of ``stack``: KJT key index, row offset, rows, MEAN flag (C arrays)."""
    index = {k: i for i, k in enumerate(keys)}
    slots = stack.features
    return (
        np.array([index[s.feature] for s in slots], np.int64),
        np.array([s.row_offset for s in slots], np.int64),
        np.array([s.num_embeddings for s in slots], np.int64),
        np.array([s.pooling == PoolingType.MEAN for s in slots], np.int32),
    )


def _as_int64(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.detach().cpu().to(torch.int64).numpy())


def preprocess_native(
    kjt: KeyedJaggedTensor,
    stacks: Sequence[StackedTable],
    num_partitions: int,
    capacities: Mapping[str, Capacity],
    is_weighted: bool | None,
    overflow: str,
) -> SparseCoreInput | None:
    """Preprocesses ``kjt`` in C++, or returns ``None`` when the reference must decide.

    Args:
        kjt: the batch (CPU).
        stacks: the stacked tables.
        num_partitions: MOD partitions (>= 1).
        capacities: stack name -> capacity (every stack).
        is_weighted: as for :func:`tpurec.sparse.preprocess_kjt`.
        overflow: ``"error"`` or ``"drop"``.

    Returns:
        The same :class:`SparseCoreInput` as the numpy reference, or ``None``
        when the batch is unusual or invalid (the reference then raises or
        handles it).

    Raises:
        tpurec.sparse.kernels.native.NativeBuildError: the library cannot be built.
        ValueError: bad batch sizes or ``inverse_indices`` (rule 3 of
            :func:`tpurec.sparse.read_kjt`, the reference's message).
    """
    keys = tuple(kjt.keys())
    features = {s.feature for st in stacks for s in st.features}  # a feature of two tables: two slots, one key
    if len(keys) != len(set(keys)) or set(keys) != features:
        return None  # unknown, missing or duplicate keys: the reference names them
    # Rules 1 and 2 hold, so rule 3 (batch sizes, inverse_indices) raises here exactly
    # what the reference would raise.
    batching = read_batching(kjt, variable_batch=True)
    values_t, lengths_t, weights_t = kjt.values(), kjt.lengths(), kjt.weights_or_none()
    if (
        values_t.dtype not in _ID_DTYPES
        or lengths_t.dtype not in _ID_DTYPES
        or values_t.dim() != 1
        or lengths_t.dim() != 1
    ):
        return None
    offsets_t = kjt.offsets_or_none()
    if offsets_t is not None and offsets_t.numel() and int(offsets_t[0]) != 0:
        return None  # offsets must start at 0: the reference says so
    batch_size = batching.rows
    num_keys = len(keys)
    if batch_size <= 0 or lengths_t.numel() != sum(batching.bags_per_key):
        return None
    if any(st.num_slots * batch_size >= PAD_ID for st in stacks):
        return None
    if weights_t is not None and (
        weights_t.dtype not in _WEIGHT_DTYPES or weights_t.dim() != 1 or weights_t.shape[0] != values_t.shape[0]
    ):
        return None  # weights are checked even when the tables ignore them (the reference names the error)
    use_weights = weights_t is not None if is_weighted is None else is_weighted
    weights = None
    if use_weights:
        if weights_t is None:
            return None
        weights = np.ascontiguousarray(weights_t.detach().cpu().to(torch.float32).numpy())

    key_starts_fn, stack_fn = _functions()
    values, lengths = _as_int64(values_t), _as_int64(lengths_t)
    if any(n != batch_size for n in batching.bags_per_key):
        # Variable batch per feature: each key's bags first, then empty bags up to
        # batch_size rows, so the C++ code sees one stride (empty bags add nothing).
        padded = np.zeros((num_keys, batch_size), np.int64)
        starts = np.concatenate([[0], np.cumsum(batching.bags_per_key)])
        for k, n in enumerate(batching.bags_per_key):
            padded[k, :n] = lengths[starts[k] : starts[k + 1]]
        lengths = padded.reshape(-1)
    key_starts = np.empty(num_keys + 1, np.int64)
    if key_starts_fn(lengths.ctypes.data, num_keys, batch_size, values.shape[0], key_starts.ctypes.data) != _OK:
        return None

    P = num_partitions
    drop = overflow == "drop"
    out: dict[str, StackedCsr] = {}
    for st in stacks:
        capacity = capacities[st.name]
        size = capacity.partition_size
        slot_key, slot_offset, slot_rows, slot_mean = _slot_layout(st, keys)
        row_pointers = np.empty(P, np.int32)
        ids = np.empty(P * size, np.int32)
        samples = np.empty(P * size, np.int32)
        gains = np.empty(P * size, np.float32)
        counts = np.empty(P, np.int32)
        unique_counts = np.empty(P, np.int32)
        dropped = np.zeros(1, np.int64)
        status = stack_fn(
            values.ctypes.data,
            None if weights is None else weights.ctypes.data,
            lengths.ctypes.data,
            key_starts.ctypes.data,
            batch_size,
            st.num_slots,
            slot_key.ctypes.data,
            slot_offset.ctypes.data,
            slot_rows.ctypes.data,
            slot_mean.ctypes.data,
            P,
            capacity.max_ids_per_partition,
            capacity.max_unique_ids_per_partition,
            size,
            int(drop),
            row_pointers.ctypes.data,
            ids.ctypes.data,
            samples.ctypes.data,
            gains.ctypes.data,
            counts.ctypes.data,
            unique_counts.ctypes.data,
            dropped.ctypes.data,
        )
        if status != _OK:
            return None
        out[st.name] = StackedCsr(row_pointers, ids, samples, gains, counts, unique_counts, int(dropped[0]))
    return SparseCoreInput(batch_size, P, out, batching.inverse_indices)
