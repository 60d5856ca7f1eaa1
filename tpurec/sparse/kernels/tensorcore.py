"""TensorCore kernels of the sparse op set: embeddings on TPUs without usable SparseCores.

Same signatures and semantics as :mod:`tpurec.sparse.kernels.reference` (the optimizer
row math is the update rules' of :mod:`tpurec.sparse.update_rules`, declared once), built for what is slow on a TensorCore: XLA's row gather from a
``[rows, 64]`` float32 table moves 11 GB/s on a TPU v5e and its row scatter 2.6-4.9 GB/s,
while reading a whole table streams at about 700 GB/s (measured on the chip,
docs/throughput.md). So where a batch touches enough of a table the kernels *stream*:

* **Schedule.** The CSR contract sorts a partition's entries by (id, sample); with one
  partition the entries are in id order already, with several they are sorted once per
  call (``lax.sort``). Walking the sorted ids and the table's blocks of
  :data:`BLOCK_ROWS` rows together gives a list of steps (an id chunk, a table block,
  the entries of that chunk in that block), computed on the device from the ids.
* **Forward** (:func:`stream_pool`): a Pallas kernel whose grid runs over the steps;
  each step's table block is DMA'd into VMEM by the pipeline (a block no id touches is
  never read, and consecutive steps of one block read it once) and each entry's row is
  added, times its gain, straight into the ``[batch, dim]`` output kept in VMEM, in entry
  order (the order the reference's segment sum adds them).
* **Backward** (:func:`stream_update`): the same walk; each entry's gradient (the output
  gradient kept in VMEM, or gathered per entry by XLA when it does not fit) is added into
  a block-sized VMEM buffer, and at the block's last step the update rule's row math runs
  on the whole block and only the touched rows take the result. The table and slots are
  aliased to the outputs (donated by the modules: updated in place, no table-sized
  temporary, untouched blocks neither read nor written); one-dimensional slots (row-wise
  Adagrad's accumulator) are viewed lane-dense.

``TPUREC_TENSORCORE_ONE_PASS=0`` selects the two-pass kernels instead (slower on a TPU
v5e: docs/throughput.md): rows gathered by :func:`stream_gather` then pooled by a second
kernel; per-entry gradients summed per unique id, the touched rows gathered, updated by
XLA and written back by :func:`stream_scatter`.

Elsewhere (a batch that touches few rows of a large table, float16/bfloat16 tables,
whose rows Mosaic cannot address one by one, an output that does not fit VMEM) the
same steps run as XLA gathers and scatters with sorted, unique indices. Off a TPU the
Pallas kernels run in interpret mode (tests on XLA:CPU check their logic).

Example::

    out = sparse_dense_matmul(rp, ids, samples, gains, table, batch_size=64)
"""

from __future__ import annotations

import collections
import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpurec.sparse.kernels import reference
from tpurec.sparse.types import PAD_ID
from tpurec.sparse.update_rules import rule_of

__all__ = [
    "BLOCK_ROWS",
    "CHUNK",
    "LANES",
    "TRACE_COUNTS",
    "stream_gather",
    "stream_pool",
    "stream_scatter",
    "rows_per_line",
    "stream_update",
    "stored_shape",
    "streams",
    "sparse_dense_matmul",
]

TRACE_COUNTS: collections.Counter = collections.Counter()
"""Kernel name -> times JAX traced it (a trace is a compilation)."""

BLOCK_ROWS = 2048
"""Table rows per streamed block (1 MiB of VMEM at dim 64: lanes pad to 128)."""

CHUNK = 512
"""Ids per chunk of the schedule (held in SMEM while their steps run)."""

MXU_CHUNK = 128
"""Ids per chunk when the optimizer step sums gradients on the MXU: each step multiplies a
``[BLOCK_ROWS, MXU_CHUNK]`` one-hot matrix."""

_STREAM_DENSITY = 64
"""Stream when a call has at least one id per this many table rows: a block of
:data:`BLOCK_ROWS` rows then serves about 32 ids, which XLA's per-row gather
(~23 ns a row on a v5e) would take longer to fetch than the block's DMA."""

_VMEM_LIMIT = 100 * 2**20
_POOL_VMEM = 48 * 2**20
"""Largest pooled output (lanes padded to 128) kept in VMEM by the pooling kernel."""


_ZERO = np.int32(0)
"""Block index 0 for index maps: an int32 (a Python 0 traces as int64 under tpurec's x64,
which Mosaic refuses)."""


def _interpret() -> bool:
    # Mosaic compiles for TPUs only; elsewhere the kernels run in Pallas' interpreter.
    return jax.default_backend() != "tpu"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def streams(num_ids: int, table: jax.Array | np.ndarray) -> bool:
    """Whether a call with ``num_ids`` id slots on ``table`` uses the streaming kernels."""
    rows, dim = table.shape
    return (
        jnp.dtype(table.dtype) == jnp.float32
        and rows > 0
        and dim > 0
        and num_ids > 0
        and num_ids * _STREAM_DENSITY >= rows
    )


LANES = 128
"""Lanes of a TPU vector register, and of a line of the lane-dense layout."""


def rows_per_line(rows: int, dim: int, dtype=jnp.float32) -> int:
    """Table rows kept in each 128-lane line of the lane-dense layout (1: rows as they are).

    A TPU's vector memory is 128 lanes wide, so a ``[rows, 64]`` float32 table stored as it is
    pads every row to 128 lanes: half of each block the kernels stream is padding, and its DMAs
    moved a fifth of the bytes a second of a ``[rows / 2, 128]`` view (measured on a TPU v5e,
    docs/throughput.md). A float32 table whose dim is below 128 and divides it, with a row count
    that is a multiple of ``128 // dim``, is therefore kept as ``[rows * dim / 128, 128]``: row
    ``r`` in lanes ``(r % k) * dim ...`` of line ``r // k`` (``k = 128 // dim``), the row-major
    table's own bytes. The collections store such tables in that shape on the tpu device
    (:func:`tpurec.core.tensor.with_storage_shape`) and the kernels stream its lines, so
    neither side moves data to change layouts. ``TPUREC_TENSORCORE_LANE_DENSE=0`` keeps rows as
    they are.

    Args:
        rows: the table's rows.
        dim: its embedding dim.
        dtype: its dtype (only float32 tables are packed).

    Returns:
        ``k``, the rows in a line; 1 when the table is not packed.

    Example::

        rows_per_line(100_000, 64)   # 2: stored as [50_000, 128]
    """
    from tpurec import config

    if not config.get("TPUREC_TENSORCORE_LANE_DENSE") or jnp.dtype(dtype) != jnp.float32:
        return 1
    if dim <= 0 or dim >= LANES or LANES % dim or rows <= 0:
        return 1
    k = LANES // dim
    return k if rows % k == 0 else 1


def stored_shape(rows: int, dim: int, dtype=jnp.float32) -> tuple[int, int]:
    """The shape a ``[rows, dim]`` table is stored in on a TPU: ``[rows / k, 128]`` lines when
    :func:`rows_per_line` packs ``k > 1`` rows a line, else ``[rows, dim]``."""
    k = rows_per_line(rows, dim, dtype)
    return (rows // k, LANES) if k > 1 else (rows, dim)


def _lane_group(dim: int):
    """``[1, 128]`` int32: which row of a line each lane belongs to."""
    return jax.lax.broadcasted_iota(jnp.int32, (1, LANES), 1) // dim


def _segmented_row_mean(dim: int):
    """The update rules' ``row_mean`` on ``[lines, 128]``: each row's mean over its lanes, on its lanes."""

    def row_mean(x):
        group = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1) // dim
        out = jnp.zeros_like(x)
        for g in range(LANES // dim):
            mean = jnp.sum(jnp.where(group == g, x, 0.0), axis=1, keepdims=True) / dim
            out = jnp.where(group == g, mean, out)
        return out

    return row_mean


def _xla_take_rows(table, keys):
    """``table[keys]`` (keys clamped to the table) by XLA, reading lines when the table is lane-dense."""
    rows, dim = table.shape
    keys = jnp.minimum(keys, rows - 1)
    k = rows_per_line(rows, dim, table.dtype)
    if k == 1:
        return jnp.take(table, keys, axis=0, indices_are_sorted=True, unique_indices=False)
    lines = jnp.take(table.reshape(rows // k, LANES), keys // k, axis=0, indices_are_sorted=True)
    return jnp.take_along_axis(lines.reshape(-1, k, dim), (keys % k)[:, None, None], axis=1)[:, 0]


def _xla_put_rows(table, keys, new_rows):
    """``table.at[keys].set(new_rows)`` for ascending unique ``keys`` (``>= rows`` skipped) by XLA,
    writing whole lines when the table is lane-dense."""
    rows, dim = table.shape
    new_rows = new_rows.astype(table.dtype)
    k = rows_per_line(rows, dim, table.dtype)
    if k == 1:
        return table.at[keys].set(new_rows, mode="drop", indices_are_sorted=True, unique_indices=True)
    n, num_lines = keys.shape[0], rows // k
    valid = keys < rows
    line = jnp.where(valid, keys // k, num_lines)
    # The keys of one line are neighbours (ascending keys): each run of a line writes it once.
    first = valid & jnp.concatenate([jnp.ones((1,), bool), line[1:] != line[:-1]])
    run = jnp.where(valid, jnp.cumsum(first.astype(jnp.int32)) - 1, n)
    mine = _lane_group(dim) == (keys % k)[:, None]  # [n, 128]: the lanes of each key's row
    placed = jnp.where(mine, jnp.tile(new_rows, (1, k)), 0).astype(table.dtype)
    written = jax.ops.segment_max(mine.astype(jnp.int32), run, num_segments=n + 1)[:n] > 0
    values = jax.ops.segment_sum(placed, run, num_segments=n + 1)[:n]  # one key per lane: exact
    run_line = jax.ops.segment_max(jnp.where(valid, line, -1), run, num_segments=n + 1)[:n]
    run_line = jnp.where(run_line >= 0, run_line, num_lines)
    lines = table.reshape(num_lines, LANES)
    old = jnp.take(lines, jnp.minimum(run_line, num_lines - 1), axis=0, indices_are_sorted=True)
    lines = lines.at[run_line].set(
        jnp.where(written, values, old), mode="drop", indices_are_sorted=True, unique_indices=True
    )
    return lines.reshape(rows, dim)


# --- sorted entries ----------------------------------------------------------------------


def _sorted_entries(row_pointers, embedding_ids, sample_ids, gains):
    """``(keys, samples, gains, valid)`` with keys ascending; invalid entries keyed ``PAD_ID`` at the end.

    The CSR contract sorts a partition's entries by (id, sample), so one partition from
    ``preprocess_kjt`` is in order already; entries that are not (several partitions, or the
    entries a sharded program received from several devices) are sorted once, stably (equal
    ids keep their order). Which case holds is checked on the device: the sort runs only when
    needed.
    """
    valid = reference._valid(row_pointers, embedding_ids)
    keys = jnp.where(valid, embedding_ids, PAD_ID)
    samples = jnp.where(valid, sample_ids, 0)
    gains = jnp.where(valid, gains, 0.0)
    if keys.shape[0] > 1:
        in_order = jnp.all(keys[1:] >= keys[:-1])
        keys, samples, gains = jax.lax.cond(
            in_order,
            lambda k, s, g: (k, s, g),
            lambda k, s, g: tuple(jax.lax.sort((k, s, g), num_keys=1, is_stable=True)),
            keys,
            samples,
            gains,
        )
        valid = keys != PAD_ID
    return keys, samples, gains, valid


def _unique(keys, valid):
    """``(unique_keys, segment)``: sorted unique keys (``PAD_ID``-padded) and each entry's index among them."""
    first = valid & jnp.concatenate([jnp.ones((1,), bool), keys[1:] != keys[:-1]])
    segment = jnp.cumsum(first.astype(jnp.int32)) - 1
    # Compaction by sort: the first entry of each id keeps its key, the rest sort to the end.
    unique_keys = jax.lax.sort(jnp.where(first, keys, PAD_ID))
    return unique_keys, segment


# --- the streaming schedule --------------------------------------------------------------


_UNROLL = 8


def _unrolled(lo, hi, body) -> None:
    """``body(i)`` for ``i`` in ``[lo, hi)``, :data:`_UNROLL` calls per loop iteration.

    The loop's bounds are data (scalars in SMEM), so the iterations past ``hi`` in the last
    group repeat ``body(hi - 1)``: ``body`` must be idempotent (a copy of one row is). A
    loop of single rows with data-dependent bounds ran about 4x slower on a TPU v5e.
    """

    def group(k, carry):
        for u in range(_UNROLL):
            body(jnp.minimum(lo + k * _UNROLL + u, hi - 1))
        return carry

    jax.lax.fori_loop(0, (hi - lo + _UNROLL - 1) // _UNROLL, group, 0)


def _masked_groups(lo, hi, body) -> None:
    """``body(i, ok)`` for ``i`` in ``[lo, hi)`` in groups of :data:`_UNROLL` calls.

    For bodies that accumulate (not idempotent): the calls past ``hi`` in the last group
    get ``i = hi - 1`` and ``ok = False``, and send their result to a sink row.
    """

    def group(k, carry):
        for u in range(_UNROLL):
            i = lo + k * _UNROLL + u
            body(jnp.minimum(i, hi - 1), i < hi)
        return carry

    jax.lax.fori_loop(0, (hi - lo + _UNROLL - 1) // _UNROLL, group, 0)


def _schedule(keys, num_rows: int, chunk: int, block_rows: int):
    """The steps of a walk over sorted ``keys`` and the table's row blocks.

    Returns ``(lo, hi, chunk_of, block_of)``, each ``[steps]`` int32: step ``s`` handles
    entries ``[lo[s], hi[s])`` (keys of chunk ``chunk_of[s]`` inside block ``block_of[s]``).
    Empty steps repeat their neighbour's chunk and block, so the pipeline fetches nothing
    for them.
    """
    n = keys.shape[0]
    num_chunks, num_blocks = n // chunk, _cdiv(num_rows, block_rows)
    # Unrolled: the default's while loop of 18 steps took 0.3 ms of a DLRM step on a v5e beside its gathers.
    block_starts = jnp.searchsorted(
        keys, jnp.arange(num_blocks + 1, dtype=jnp.int32) * block_rows, side="left", method="scan_unrolled"
    ).astype(jnp.int32)
    num_valid = block_starts[-1]
    cuts = jnp.sort(jnp.concatenate([jnp.arange(num_chunks + 1, dtype=jnp.int32) * chunk, block_starts]))
    lo = jnp.minimum(cuts[:-1], num_valid)
    hi = jnp.minimum(cuts[1:], num_valid)
    nonempty = hi > lo
    chunk_of = jnp.minimum(lo // chunk, num_chunks - 1)
    block_of = jnp.where(nonempty, keys[jnp.minimum(lo, n - 1)] // block_rows, 0)
    block_of = jax.lax.cummax(jnp.minimum(block_of, num_blocks - 1))
    chunk_of = jax.lax.cummax(jnp.where(nonempty, chunk_of, 0))
    return lo, hi, chunk_of, block_of


def _pad_keys(keys, chunk: int):
    n = keys.shape[0]
    padded = _cdiv(n, chunk) * chunk
    return jnp.pad(keys, (0, padded - n), constant_values=PAD_ID) if padded != n else keys


def _chunk_for(n: int) -> int:
    return CHUNK if n >= CHUNK else max(8, _cdiv(n, 8) * 8)


def _walk(keys, num_rows: int, block_rows: int, chunk: int | None = None, rows_in_line: int = 1):
    """``(padded keys, chunk, block rows, schedule)`` of a walk over sorted ``keys`` and a table.

    A lane-dense table (``rows_in_line > 1``) smaller than a block is one block of all its lines.
    """
    chunk = chunk or _chunk_for(keys.shape[0])
    keys = _pad_keys(keys, chunk)
    if rows_in_line > 1:
        block_rows = min(block_rows, num_rows)
    else:
        block_rows = min(block_rows, _cdiv(num_rows, 8) * 8)
    return keys, chunk, block_rows, _schedule(keys, num_rows, chunk, block_rows)


def _line_of(r, k: int):
    """``(line, place)`` of block row ``r`` (int32 scalar) in a layout of ``k`` rows a line: its line
    and which of the line's rows it is (its lanes start at ``place * dim``)."""
    bits = k.bit_length() - 1  # k is a power of two (it divides 128)
    return jax.lax.shift_right_logical(r, np.int32(bits)), jnp.bitwise_and(r, np.int32(k - 1))


# Block specs of a walk's grid: index maps get the step and the 4 scheduled scalar arrays.
def _keys_spec(chunk: int):
    return pl.BlockSpec((chunk,), lambda s, lo, hi, c, b: (c[s],), memory_space=pltpu.SMEM)


def _rows_spec(chunk: int, dim: int):
    return pl.BlockSpec((chunk, dim), lambda s, lo, hi, c, b, *_: (c[s], _ZERO))


def _block_spec(block_rows: int, dim: int):
    return pl.BlockSpec((block_rows, dim), lambda s, lo, hi, c, b, *_: (b[s], _ZERO))


def _walk_call(kernel, schedule, *, in_specs, out_spec, out_shape, aliases=None):
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(schedule),
            grid=(schedule[0].shape[0],),
            in_specs=in_specs,
            out_specs=out_spec,
        ),
        out_shape=out_shape,
        input_output_aliases=aliases or {},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",), vmem_limit_bytes=_VMEM_LIMIT),
        interpret=_interpret(),
    )


def stream_gather(table: jax.Array, keys: jax.Array, *, block_rows: int = BLOCK_ROWS) -> jax.Array:
    """``table[keys]`` for ascending ``keys`` (``PAD_ID`` at the end), streaming the table's blocks.

    Args:
        table: ``[rows, dim]`` float32.
        keys: ``[n]`` int32, ascending; entries ``>= rows`` (``PAD_ID``) are padding.
        block_rows: rows per streamed block.

    Returns:
        ``[n, dim]``: the rows of the valid keys; rows of padding entries are undefined
        (mask them with ``jnp.where``, not a product).
    """
    n, dim = keys.shape[0], table.shape[1]
    keys, chunk, block_rows, schedule = _walk(keys, table.shape[0], block_rows)

    def kernel(lo_ref, hi_ref, c_ref, b_ref, keys_ref, block_ref, out_ref):
        s = pl.program_id(0)
        base, first_row = c_ref[s] * chunk, b_ref[s] * block_rows

        def copy(i):
            j = i - base
            out_ref[pl.ds(j, 1), :] = block_ref[pl.ds(keys_ref[j] - first_row, 1), :]

        _unrolled(lo_ref[s], hi_ref[s], copy)

    out = _walk_call(
        kernel,
        schedule,
        in_specs=[_keys_spec(chunk), _block_spec(block_rows, dim)],
        out_spec=_rows_spec(chunk, dim),
        out_shape=jax.ShapeDtypeStruct((keys.shape[0], dim), table.dtype),
    )(*schedule, keys, table)
    return out[:n]


def stream_scatter(table: jax.Array, keys: jax.Array, rows_in: jax.Array, *, block_rows: int = BLOCK_ROWS) -> jax.Array:
    """``table.at[keys].set(rows_in)`` for ascending unique ``keys``, written block by block in place.

    Args:
        table: ``[rows, dim]`` float32 (aliased to the result: donate it to update in place).
        keys: ``[n]`` int32, ascending and unique; entries ``>= rows`` are skipped.
        rows_in: ``[n, dim]`` the new rows.
        block_rows: rows per streamed block.

    Returns:
        The table with the rows written; blocks without a key are not touched.
    """
    n, dim = keys.shape[0], table.shape[1]
    keys, chunk, block_rows, schedule = _walk(keys, table.shape[0], block_rows)
    rows_in = jnp.pad(rows_in, ((0, keys.shape[0] - n), (0, 0))).astype(table.dtype)

    def kernel(lo_ref, hi_ref, c_ref, b_ref, keys_ref, rows_ref, block_ref, out_ref):
        s = pl.program_id(0)
        base, first_row = c_ref[s] * chunk, b_ref[s] * block_rows
        # The output block stays in VMEM over consecutive steps of one block: fill it from
        # the table at the block's first step only.
        first_step = jnp.logical_or(s == 0, b_ref[jnp.maximum(s - 1, 0)] != b_ref[s])

        @pl.when(first_step)
        def _():
            out_ref[...] = block_ref[...]

        def put(i):
            j = i - base
            out_ref[pl.ds(keys_ref[j] - first_row, 1), :] = rows_ref[pl.ds(j, 1), :]

        _unrolled(lo_ref[s], hi_ref[s], put)

    return _walk_call(
        kernel,
        schedule,
        in_specs=[_keys_spec(chunk), _rows_spec(chunk, dim), _block_spec(block_rows, dim)],
        out_spec=_block_spec(block_rows, dim),
        out_shape=jax.ShapeDtypeStruct(table.shape, table.dtype),
        # Operand 6 (after the 4 scheduled scalars, the keys and the rows) is the table.
        aliases={6: 0},
    )(*schedule, keys, rows_in, table)


def _pad_to_rows(x, n: int):
    return jnp.pad(x, ((0, n - x.shape[0]), (0, 0))) if x.shape[0] != n else x


def _pad_to(x, n: int, value=0):
    return jnp.pad(x, (0, n - x.shape[0]), constant_values=value) if x.shape[0] != n else x


def _pool_window(batch_size: int, width: int) -> int:
    """Output rows :func:`stream_pool` keeps in VMEM at once: all of them when they fit :data:`_POOL_VMEM`."""
    fits = _POOL_VMEM // (max(_cdiv(width, 128) * 128, 128) * 4) - 8
    return batch_size if batch_size <= fits else max(8, fits // 8 * 8)


def stream_pool(
    table: jax.Array,
    keys: jax.Array,
    samples: jax.Array,
    gains: jax.Array,
    batch_size: int,
    *,
    block_rows: int = BLOCK_ROWS,
    window_rows: int | None = None,
) -> jax.Array:
    """The pooled lookup in one pass: ``out[samples[i]] += gains[i] * table[keys[i]]`` in entry order.

    The table's blocks stream through VMEM as in :func:`stream_gather`, and each entry's row
    is added straight into the ``[batch_size, dim]`` output, which stays in VMEM: the looked-up
    rows never go back to HBM. An output larger than :data:`_POOL_VMEM` is made in windows of
    output rows: the entries are ordered by (window, id) once, the walk goes over the table's
    blocks once per window that has entries (tables stacked in feature order touch one window or
    two each), and each window's rows stay in VMEM while its entries are added.

    Args:
        table: ``[rows, dim]`` float32.
        keys: ``[n]`` int32, ascending; entries ``>= rows`` (``PAD_ID``) are padding and skipped.
        samples: ``[n]`` int32, each entry's output row (``< batch_size``).
        gains: ``[n]`` float32, each entry's weight.
        batch_size: output rows.
        block_rows: rows per streamed block.
        window_rows: output rows kept in VMEM at once (None: as many as fit).

    A lane-dense table's row is added in its own lanes of the output row (the line's other lanes
    masked), and the output's lane groups are summed at the end: a rotation to lane 0 in the loop
    cost 18 ns an entry on a v5e, the mask 8.

    Returns:
        ``[batch_size, dim]`` float32.
    """
    TRACE_COUNTS["stream_pool"] += 1
    rows, dim = table.shape
    k = rows_per_line(rows, dim, table.dtype)
    width = LANES if k > 1 else dim  # a lane-dense table's rows are added in their own lanes
    window = min(window_rows or _pool_window(batch_size, width), batch_size)
    windows = _cdiv(batch_size, window)
    block_rows = min(block_rows, rows) if k > 1 else min(block_rows, _cdiv(rows, 8) * 8)  # as _walk takes it
    blocks = _cdiv(rows, block_rows)  # a window's blocks: its entries' keys are window * span + key
    span = blocks * block_rows
    if windows > 1:
        assert windows * span < PAD_ID, "stream_pool: too many output windows for int32 keys"
        valid = keys < rows
        window_of = jnp.where(valid, samples // window, windows)
        keys = jnp.where(valid, window_of * span + keys, PAD_ID)
        samples = jnp.where(valid, samples - window_of * window, 0)
        # The keys ascend within each window: a stable sort by key orders the entries by (window, id).
        keys, samples, gains = jax.lax.sort((keys, samples, gains), num_keys=1, is_stable=True)
    keys, chunk, block_rows, schedule = _walk(keys, windows * span, block_rows, rows_in_line=k)
    n = keys.shape[0]
    samples, gains = _pad_to(samples, n), _pad_to(gains.astype(table.dtype), n)
    sink = window  # the rows of the last group's repeated calls land here
    out_rows = _cdiv(window + 1, 8) * 8
    nb = np.int32(blocks)

    def kernel(lo_ref, hi_ref, c_ref, b_ref, keys_ref, samples_ref, gains_ref, block_ref, *refs):
        out_ref = refs[-1]
        s = pl.program_id(0)
        base, first_row = c_ref[s] * chunk, b_ref[s] * block_rows
        window_of_step = jax.lax.div(b_ref[s], nb)
        first_of_window = jnp.logical_or(s == 0, jax.lax.div(b_ref[jnp.maximum(s - 1, 0)], nb) != window_of_step)

        @pl.when(first_of_window)
        def _():
            out_ref[...] = jnp.zeros_like(out_ref)

        def add(i, ok):
            j = i - base
            dst = jnp.where(ok, samples_ref[j], sink)
            if k == 1:
                row = block_ref[pl.ds(keys_ref[j] - first_row, 1), :]
            else:
                line, place = _line_of(keys_ref[j] - first_row, k)
                row = jnp.where(_lane_group(dim) == place, block_ref[pl.ds(line, 1), :], np.float32(0))
            out_ref[pl.ds(dst, 1), :] += row * gains_ref[j]

        _masked_groups(lo_ref[s], hi_ref[s], add)

    smem = lambda: pl.BlockSpec((chunk,), lambda s, lo, hi, c, b: (c[s],), memory_space=pltpu.SMEM)  # noqa: E731
    table_spec = pl.BlockSpec((block_rows // k, width), lambda s, lo, hi, c, b: (jax.lax.rem(b[s], nb), _ZERO))
    out_spec = pl.BlockSpec((out_rows, width), lambda s, lo, hi, c, b: (jax.lax.div(b[s], nb), _ZERO))
    out_shape = jax.ShapeDtypeStruct((windows * out_rows, width), table.dtype)
    operands = [*schedule, keys, samples, gains, table.reshape(rows // k, width)]
    in_specs = [smem(), smem(), smem(), table_spec]
    aliases = None
    if windows > 1:
        # A window without entries is never visited: its rows keep the zeros of this buffer.
        operands.append(jnp.zeros(out_shape.shape, out_shape.dtype))
        in_specs.append(pl.BlockSpec(index_map=lambda s, lo, hi, c, b: (_ZERO, _ZERO), memory_space=pl.ANY))
        aliases = {len(operands) - 1: 0}
    out = _walk_call(kernel, schedule, in_specs=in_specs, out_spec=out_spec, out_shape=out_shape, aliases=aliases)(
        *operands
    )
    out = out.reshape(windows, out_rows, width)[:, :window].reshape(windows * window, width)[:batch_size]
    if k > 1:  # row r's sums are in lane group r % k: add the groups
        return out.reshape(batch_size, k, dim).sum(axis=1)
    return out


def _bfloat16_parts(x):
    """``x`` (float32) as three bfloat16 parts ``hi + mid + lo`` that hold its 24 significand bits
    (exact for normal floats): a product of each part with a 0/1 or power-of-two matrix is exact."""
    hi = x.astype(jnp.bfloat16)
    rest = x - hi.astype(jnp.float32)
    mid = rest.astype(jnp.bfloat16)
    lo = (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)
    return hi, mid, lo


def _one_hot_dot(onehot, x):
    """``onehot @ x`` in float32 with every product exact, in three one-pass bfloat16 products.

    A 0/1 matrix is exact in bfloat16, so each product of it with a part of ``x``
    (:func:`_bfloat16_parts`) is an exact copy of that part; the float32 accumulation sums in the
    MXU's order, not entry order.
    """
    ones = onehot.astype(jnp.bfloat16)
    return sum(jnp.dot(ones, part, preferred_element_type=jnp.float32) for part in _bfloat16_parts(x))


def _lanes_to_column(x, lanes_iota):
    """``[k, 128]`` (row ``r`` of a block at ``x[r // 128, r % 128]``) -> ``[128 k, 1]``.

    Built from a square transpose, selects and lane sums, which Mosaic lowers for float32."""
    k = x.shape[0]
    square = jnp.concatenate([x, jnp.zeros((128 - k, 128), x.dtype)], axis=0).T  # column c = x[c]
    return jnp.concatenate(
        [jnp.sum(jnp.where(lanes_iota == c, square, 0.0), axis=1, keepdims=True) for c in range(k)], axis=0
    )


def _column_to_lanes(col, k: int, lanes_iota):
    """The inverse of :func:`_lanes_to_column`: ``[128 k, 1]`` -> ``[k, 128]``."""
    square = jnp.zeros((128, 128), col.dtype)
    for c in range(k):
        square = jnp.where(lanes_iota == c, col[c * 128 : (c + 1) * 128], square)
    return square.T[:k]


def _gradient_windows(valid, samples, chunk: int, window: int):
    """``(window_of, served)`` of :func:`stream_update`'s moving gradient window: for each chunk of
    entries the window multiple below its smallest valid sample (int32), and whether each chunk's
    samples all lie in the ``2 * window`` rows from there."""
    valid, samples = valid.reshape(-1, chunk), samples.reshape(-1, chunk)
    low = jnp.min(jnp.where(valid, samples, jnp.iinfo(jnp.int32).max), axis=1)
    high = jnp.max(jnp.where(valid, samples, -1), axis=1)
    window_of = jnp.where(high >= 0, low // window, 0).astype(jnp.int32)
    return window_of, jnp.all(high < (window_of + 2) * window)


def _update_vmem(batch_size: int, dim: int, slots, block_rows: int = BLOCK_ROWS) -> tuple[int, int]:
    """VMEM bytes of :func:`stream_update`: ``(blocks, resident output gradient)``.

    Blocks: each 2-D array's block in and out (two buffers each), the gradient and
    touched-row scratch, and room for the 1-D slots' blocks. The output gradient kept in
    VMEM takes two buffers too.
    """
    lanes = max(_cdiv(dim, 128) * 128, 128)
    block = block_rows * lanes * 4
    return 4 * block * (1 + sum(x.ndim == 2 for x in slots)) + 2 * block, 2 * batch_size * lanes * 4


def _update_fits(table: jax.Array, slots) -> bool:
    rows, dim = table.shape
    blocks, _ = _update_vmem(0, dim, slots)
    return (
        blocks <= _VMEM_LIMIT - 8 * 2**20
        and rows >= BLOCK_ROWS
        and all(jnp.dtype(x.dtype) == jnp.float32 and (x.shape == table.shape or x.shape == (rows,)) for x in slots)
    )


def stream_update(
    op_name: str,
    table,
    slots,
    keys,
    samples,
    gains,
    grad_output,
    hyperparameters,
    *,
    block_rows: int = BLOCK_ROWS,
    resident: bool | None = None,
    row_sum: str = "loop",
    gradient_window: int | None = None,
    block_marks: bool = False,
):
    """A fused optimizer step in one pass over the touched blocks of a table and its slots.

    For each streamed block: the entries' gradients (``grad_output[sample] * gain``: the
    output gradient kept in VMEM when it fits, else gathered per entry by XLA first and
    streamed in chunks) are summed per row into a block-sized VMEM buffer in entry order, then the update rule's row math (:mod:`tpurec.sparse.update_rules`) runs on the whole
    block and only the touched rows take the result. The table and slots are aliased to the
    outputs (donate them to update in place); blocks without an entry are neither read nor
    written. One-dimensional slots (row-wise Adagrad's accumulator) are viewed lane-dense
    as ``[rows / 128, 128]``.

    Args:
        op_name: a gradient op of :data:`tpurec.sparse.update_rules.RULES`.
        table: ``[rows, dim]`` float32, ``rows >= BLOCK_ROWS``.
        slots: the optimizer's float32 state, each ``[rows, dim]`` or ``[rows]``.
        keys: ``[n]`` int32, ascending; entries ``>= rows`` (``PAD_ID``) are padding.
        samples: ``[n]`` int32, each entry's row of ``grad_output``.
        gains: ``[n]`` float32.
        grad_output: ``[batch_size, dim]`` float32.
        hyperparameters: the optimizer's scalars (float or 0-d arrays).
        block_rows: rows per streamed block, a multiple of 1024 up to 16384 (larger blocks than
            :data:`BLOCK_ROWS` make fewer blocks, each with its fixed work, and take more VMEM).
        resident: keep ``grad_output`` in VMEM (None: when it fits).
        row_sum: how a step's entries are summed into the block's gradient: ``"loop"``, one
            entry at a time; ``"mxu"``, one matrix product per step of :data:`MXU_CHUNK`
            entries, ``onehot(ids)^T @ gradients`` (the gradients gathered per entry first, so
            ``resident`` does not apply), each product exact (:func:`_one_hot_dot`).
        gradient_window: when the output gradient does not fit VMEM (and the loop sum runs), it is
            read through a window of ``2 * gradient_window`` rows that moves with the walk (each
            chunk of entries sets it at the window-row multiple below its smallest sample); where
            some chunk's samples span more than the window holds (a table looked up by samples far
            apart, e.g. many features on one table), every entry's gradient row is gathered by XLA
            first instead (at batch 16384 of DLRM on a v5e: 45 ms for the step, 63 ms gathered).
            None: as many rows as fit; 0: always gather.
        block_marks: (experimental, the loop sum) mark a block's touched rows with the block's number
            + 1 in a buffer cleared once, instead of ones in a buffer cleared at every block (which
            stores a vector register per 8 rows of the block).

    A lane-dense table (:func:`rows_per_line`; its element slots alike) streams as lines: the
    output gradient is laid out once in each of a line's row lanes beforehand, an entry adds its
    row's lanes of it (the others masked) into the block's gradient lines and marks its row in a
    buffer of rows (one store, no read), the marks become the lines' lanes when the block is done
    (strided loads), the row math runs on whole lines (a row slot spread over its row's lanes,
    row reductions per row: the rules' ``row_mean``), and the lanes of touched rows take the
    result. The loop sum only. (On a v5e, rotating each entry's gradient into its lanes instead
    made a DLRM-sized step 2 ms slower, and reading and writing a line's marks 0.4 ms.)

    Returns:
        ``(table, *slots)`` updated.
    """
    TRACE_COUNTS["stream_update"] += 1
    rows, dim = table.shape
    assert block_rows % 1024 == 0 and block_rows <= 16384, "stream_update streams whole 1024-row blocks"
    assert rows >= block_rows, "stream_update streams whole blocks: the table has fewer rows than one"
    assert row_sum in ("loop", "mxu"), row_sum
    mxu = row_sum == "mxu"
    block_marks = block_marks and not mxu  # the MXU sum counts a row's entries into its marks
    rule = rule_of(op_name)
    flat = [x.ndim == 1 for x in slots]
    k = 1 if mxu else rows_per_line(rows, dim, table.dtype)
    reduces = "row_mean" in inspect.signature(rule.rows).parameters
    if k > 1 and any(flat) and not reduces:
        k = 1  # a rule with row slots that cannot reduce per row inside a line: rows as they are
    keys, chunk, block_rows, schedule = _walk(keys, rows, block_rows, MXU_CHUNK if mxu else None)
    n = keys.shape[0]
    samples, gains = _pad_to(samples, n), _pad_to(gains.astype(table.dtype), n)
    num_steps = schedule[0].shape[0]
    batch_size = grad_output.shape[0]
    # Python numbers stay constants of the row math (as in the reference); traced ones (the op
    # set passes hyperparameters traced, so a new learning rate does not recompile) go in SMEM.
    constants: dict[str, object] = {name: v for name, v in hyperparameters.items() if isinstance(v, (int, float))}
    names = sorted(set(hyperparameters) - set(constants))
    hp = (
        jnp.stack([jnp.asarray(hyperparameters[name], jnp.float32) for name in names])
        if names
        else jnp.zeros((1,), jnp.float32)
    )
    # How a lane-dense block's row slots and row means move between lanes and rows: XLU lane
    # reductions and strided copies, products on the MXU, or the row math once a row with per-row
    # values moved by square transposes (TPUREC_TENSORCORE_ROW_SLOTS; the last for 2 rows a line and
    # rules that take ``spread``, else products).
    row_slots = _row_slots() if k > 1 else "xlu"
    if row_slots == "transpose" and not (k == 2 and reduces and "spread" in inspect.signature(rule.rows).parameters):
        row_slots = "mxu"
    by_rows = row_slots == "transpose" and any(flat)
    slots_on_mxu = row_slots == "mxu"
    if k > 1 and reduces and not by_rows:
        constants["row_mean"] = _mxu_row_mean(dim) if slots_on_mxu else _segmented_row_mean(dim)
    lane_rows = block_rows // 128
    block_lines, width = block_rows // k, (LANES if k > 1 else dim)
    padded_rows = _cdiv(rows, 128) * 128
    slot_views = [
        _pad_to(x, padded_rows).reshape(padded_rows // 128, 128) if f else x.reshape(rows // k, width)
        for x, f in zip(slots, flat)
    ]
    row_fn = rule.rows
    sink = block_lines
    blocks_vmem, gradient_vmem = _update_vmem(batch_size, dim, slots, block_rows)
    if resident is None:
        resident = blocks_vmem + gradient_vmem <= _VMEM_LIMIT - 8 * 2**20
    resident = resident and not mxu
    grad_output = grad_output.astype(jnp.float32)
    # Gradient rows once in each row's lanes of a line (a lane-dense table), or padded to the width.
    widen = (lambda x: jnp.tile(x, (1, k))) if k > 1 else (lambda x: jnp.pad(x, ((0, 0), (0, width - dim))))  # noqa: E731
    window = 0
    if not resident and not mxu:
        lanes = max(_cdiv(width, 128) * 128, 128)
        fits = (_VMEM_LIMIT - 8 * 2**20 - blocks_vmem) // (4 * lanes * 4) // 8 * 8  # 2 buffers of 2 windows
        window = fits if gradient_window is None else gradient_window
        window = window // 8 * 8 if window >= 8 else 0
    # The MXU sum reads the chunk's ids as a lane vector too (the loop reads them from SMEM only).
    # ([chunks, 1, chunk]: Mosaic takes a block of one row only as the whole of its last two dims)
    lane_keys = [keys.reshape(n // chunk, 1, chunk)] if mxu else []
    lane_keys_specs = [pl.BlockSpec((None, 1, chunk), lambda s, lo, hi, c, b, *_: (c[s], _ZERO, _ZERO))] if mxu else []
    mode = "resident" if resident else "window" if window else "streamed"

    def run(mode: str):
        windowed = mode == "window"
        if mode == "resident":
            gradient = widen(grad_output)
            gradient_spec = pl.BlockSpec((batch_size, width), lambda s, lo, hi, c, b, *_: (_ZERO, _ZERO))
            scheduled = schedule
        elif windowed:  # rows [h * window, (h + 2) * window) of the output gradient, h per chunk
            gradient = widen(_pad_to_rows(grad_output, (_cdiv(batch_size, window) + 1) * window))
            span = np.int32(window)
            gradient_spec = pl.BlockSpec(
                (pl.Element(2 * window), pl.Element(width)), lambda s, lo, hi, c, b, h: (h[s] * span, _ZERO)
            )
            scheduled = (*schedule, window_of[schedule[2]])
        else:  # each entry's gradient row, read chunk by chunk with its ids
            rows_of = jnp.take(grad_output, jnp.clip(samples, 0, max(batch_size - 1, 0)), axis=0)
            gradient = widen(rows_of * gains[:, None])
            gradient_spec = _rows_spec(chunk, width)
            scheduled = schedule
        return update_call(mode, scheduled, gradient, gradient_spec)

    def kernel(mode, lo_ref, hi_ref, c_ref, b_ref, *refs):
        h_ref, refs = (refs[0], refs[1:]) if mode == "window" else (None, refs)
        hp_ref, keys_ref, samples_ref, gains_ref, gout_ref, *refs = refs
        keys_row_ref, refs = (refs[0], refs[1:]) if mxu else (None, refs)
        m = 1 + len(slots)
        ins, outs, (grad_ref, touched_ref, *spread_ref) = refs[:m], refs[m : 2 * m], refs[2 * m :]
        s = pl.program_id(0)
        base, first_row = c_ref[s] * chunk, b_ref[s] * block_rows
        first_step = jnp.logical_or(s == 0, b_ref[jnp.maximum(s - 1, 0)] != b_ref[s])
        last_step = jnp.logical_or(s == num_steps - 1, b_ref[jnp.minimum(s + 1, num_steps - 1)] != b_ref[s])

        if block_marks:  # a row is marked with its block's number + 1: no block clears the buffer
            generation = jnp.full((1, 128), b_ref[s] + np.int32(1), jnp.int32).astype(jnp.float32)

            @pl.when(s == 0)
            def _():
                touched_ref[...] = jnp.zeros_like(touched_ref)

            def is_marked(x):
                return x == generation[:, :1]

        else:
            generation = jnp.ones((1, 128), jnp.float32)

            def is_marked(x):
                return x > 0.0

        @pl.when(first_step)
        def _():
            grad_ref[...] = jnp.zeros_like(grad_ref)
            if not block_marks:
                touched_ref[...] = jnp.zeros_like(touched_ref)

        marked = generation

        def add(i, ok):
            j = i - base
            r = keys_ref[j] - first_row
            if mode == "resident":
                g = gout_ref[pl.ds(samples_ref[j], 1), :] * gains_ref[j]
            elif h_ref is not None:  # the moving window
                g = gout_ref[pl.ds(samples_ref[j] - h_ref[s] * np.int32(window), 1), :] * gains_ref[j]
            else:
                g = gout_ref[pl.ds(j, 1), :]
            if k == 1:
                dst = jnp.where(ok, r, sink)
                touched_ref[pl.ds(dst, 1), :] = marked
            else:  # the row's lanes of its line (the gradient is in every row's lanes)
                line, place = _line_of(r, k)
                g = jnp.where(_lane_group(dim) == place, g, np.float32(0))
                dst = jnp.where(ok, line, sink)
                touched_ref[pl.ds(jnp.where(ok, r, block_rows), 1), :] = marked
            grad_ref[pl.ds(dst, 1), :] += g

        if keys_row_ref is not None:  # the MXU row sum
            entry = jax.lax.broadcasted_iota(jnp.int32, (1, chunk), 1) + base
            in_step = jnp.logical_and(entry >= lo_ref[s], entry < hi_ref[s])
            local = jnp.where(in_step, keys_row_ref[...] - first_row, -1)
            onehot_t = jax.lax.broadcasted_iota(jnp.int32, (block_rows, chunk), 0) == local  # [block, chunk]
            grad_ref[:block_rows, :] += _one_hot_dot(onehot_t, gout_ref[...])
            touched_ref[:block_rows, 0:1] += jnp.sum(onehot_t.astype(jnp.float32), axis=1, keepdims=True)
        else:
            _masked_groups(lo_ref[s], hi_ref[s], add)

        @pl.when(last_step)
        def _():
            lanes_iota = jax.lax.broadcasted_iota(jnp.int32, (128, 128), 1)
            marks = None
            if k == 1:
                touched = is_marked(touched_ref[:block_rows, 0:1])
            else:  # line l's lanes of place p take row l * k + p's mark
                group = _lane_group(dim)
                marks = touched_ref[pl.ds(0, block_lines, stride=k), :]
                for place in range(1, k):
                    marks = jnp.where(group == place, touched_ref[pl.ds(place, block_lines, stride=k), :], marks)
                touched = is_marked(marks)
            gradient = grad_ref[:block_lines, :]
            w = ins[0][...]
            if by_rows:
                args = (ins, outs, flat, gradient, w, touched, marks, is_marked, dim, hp_ref, names, constants)
                args = (*args, table.dtype, spread_ref)
                _rows_step(row_fn, *args)
                return
            olds = [
                (
                    _row_slot_in_mxu(r[...], k, dim)
                    if slots_on_mxu
                    else _row_slot_in(r[...], k, dim, lanes_iota, spread_ref)
                )
                if f
                else r[...]
                for r, f in zip(ins[1:], flat)
            ]
            hps = {name: jnp.full((1, 1), hp_ref[i], jnp.float32) for i, name in enumerate(names)} | constants
            new = row_fn(gradient, w, *olds, dtype=table.dtype, **hps)
            outs[0][...] = jnp.where(touched, new[0], w)
            for r, f, old, value in zip(outs[1:], flat, olds, new[1:]):
                kept = jnp.where(touched, value.reshape(old.shape), old)
                if not f:
                    r[...] = kept
                elif slots_on_mxu:
                    r[...] = _row_slot_out_mxu(kept, k, dim, lane_rows)
                else:
                    r[...] = _row_slot_out(kept, k, dim, lane_rows, lanes_iota, spread_ref)

    def block(f):
        if f:
            return pl.BlockSpec((lane_rows, 128), lambda s, lo, hi, c, b, *_: (b[s], _ZERO))
        return _block_spec(block_lines, width)

    smem = lambda: pl.BlockSpec((chunk,), lambda s, lo, hi, c, b, *_: (c[s],), memory_space=pltpu.SMEM)  # noqa: E731
    specs = [block(False)] + [block(f) for f in flat]
    arrays = [table.reshape(rows // k, width), *slot_views]
    # The row slots of a lane-dense table pass through a block of rows spread over all lanes.
    spread = [pltpu.VMEM((block_rows, LANES), jnp.float32)] if k > 1 and any(flat) and row_slots == "xlu" else []
    if by_rows:  # a square for transposes and a block of row values in the kernel's pair order
        spread = [pltpu.VMEM((LANES, LANES), jnp.float32), pltpu.VMEM((lane_rows, LANES), jnp.float32)]

    def update_call(mode, scheduled, gradient, gradient_spec):
        # After the scheduled scalars, hp, keys, samples, gains, the gradient and (MXU) the ids as lanes.
        first_aliased = len(scheduled) + 5 + len(lane_keys)
        return pl.pallas_call(
            functools.partial(kernel, mode),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=len(scheduled),
                grid=(num_steps,),
                in_specs=[
                    pl.BlockSpec(hp.shape, lambda s, lo, hi, c, b, *_: (_ZERO,), memory_space=pltpu.SMEM),
                    smem(),
                    smem(),
                    smem(),
                    gradient_spec,
                    *lane_keys_specs,
                    *specs,
                ],
                out_specs=specs,
                scratch_shapes=[
                    pltpu.VMEM((block_lines + 8, width), jnp.float32),
                    pltpu.VMEM((block_rows + 8, 128), jnp.float32),  # marks: a row's (lane-dense) or a line's
                    *spread,
                ],
            ),
            out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in arrays],
            input_output_aliases={first_aliased + i: i for i in range(len(arrays))},
            compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",), vmem_limit_bytes=_VMEM_LIMIT),
            interpret=_interpret(),
        )(*scheduled, hp, keys, samples, gains, gradient, *lane_keys, *arrays)

    if mode == "window":
        window_of, served = _gradient_windows(keys < rows, samples, chunk, window)
        outs = jax.lax.cond(served, lambda: run("window"), lambda: run("streamed"))
    else:
        outs = run(mode)
    new_slots = [o.reshape(-1)[:rows] if f else o.reshape(rows, dim) for o, f in zip(outs[1:], flat)]
    return (outs[0].reshape(rows, dim), *new_slots)


# --- the row math once a row (TPUREC_TENSORCORE_ROW_SLOTS=transpose, 2 rows a line) -------------
#
# A block's row slot is stored in row order, ``[lane_rows, 128]`` (row ``r`` at ``[r // 128, r % 128]``),
# and its rows' lanes are the block's lines (row ``r`` on lanes ``(r % 2) * 64 ...`` of line ``r // 2``).
# Between the two the kernel keeps per-row values in *pair order*: rows ``256 a + 2 b + p`` at
# ``[2 a + p, b]``. Pair order is what a square transpose of 128 lines gives: the transposed lines'
# sublanes ``64 p ... 64 p + 63`` are place ``p``'s lanes, so a row's sum is a sum over sublanes and
# 128 lines give pair rows ``2 a`` and ``2 a + 1``; the way back is a transpose of those two rows, each
# broadcast over 64 sublanes. Row order and pair order differ by a transpose, strided copies and a swap
# of half rows, on the ``lane_rows`` rows only. Transposes run on the XLU; no product, no split into
# bfloat16 parts, and the rule's per-row math (the accumulator's square root and quotient) runs on
# ``lane_rows`` rows instead of the block's lines.


def _swap_halves(x, pm_ref):
    """Pair rows ``2 a``, ``2 a + 1`` exchange halves: ``[x0, x1], [y0, y1] -> [x0, y0], [x1, y1]``
    (its own inverse: row order's transposed copy <-> pair order)."""
    pm_ref[...] = x
    h = x.shape[0] // 2
    even, odd = pm_ref[pl.ds(0, h, stride=2), :], pm_ref[pl.ds(1, h, stride=2), :]
    low = jax.lax.broadcasted_iota(jnp.int32, (h, LANES), 1) < LANES // 2
    # an int32 shift (a Python int traces as int64 under x64, which Mosaic refuses)
    half: Any = np.int32(LANES // 2)
    pm_ref[pl.ds(0, h, stride=2), :] = jnp.where(low, even, pltpu.roll(odd, half, 1))
    pm_ref[pl.ds(1, h, stride=2), :] = jnp.where(low, pltpu.roll(even, half, 1), odd)
    return pm_ref[...]


def _square(x):
    """``x`` (``[n <= 128, 128]``) padded with zero rows to ``[128, 128]``."""
    n = x.shape[0]
    return x if n == LANES else jnp.concatenate([x, jnp.zeros((LANES - n, LANES), x.dtype)], axis=0)


def _rows_to_pairs(x, sq_ref, pm_ref):
    """A row slot's block ``[lane_rows, 128]`` in row order -> pair order."""
    sq_ref[...] = _square(x).T  # [j, i]: row 128 i + j
    half = LANES // 2
    split = jnp.concatenate([sq_ref[pl.ds(0, half, stride=2), :], sq_ref[pl.ds(1, half, stride=2), :]], axis=0)
    return _swap_halves(split.T[: x.shape[0]], pm_ref)  # [i, 64 p + b]: row 128 i + 2 b + p, then pairs


def _pairs_to_rows(x, sq_ref, pm_ref):
    """The inverse of :func:`_rows_to_pairs`."""
    split = _square(_swap_halves(x, pm_ref)).T  # [64 p + b, i]: row 128 i + 2 b + p
    half = LANES // 2
    sq_ref[pl.ds(0, half, stride=2), :] = split[:half]
    sq_ref[pl.ds(1, half, stride=2), :] = split[half:]
    return sq_ref[...].T[: x.shape[0]]


def _lines_to_pairs(x, pick):
    """``[lines, 128]`` -> ``[lines / 64, 128]`` in pair order, each row's value from its 64 lanes:
    ``pick(t)`` reduces a transposed place's ``[64, 128]`` sublanes to ``[1, 128]``."""
    lane_rows = x.shape[0] // 64
    pair_row = jax.lax.broadcasted_iota(jnp.int32, (lane_rows, LANES), 0)
    out = jnp.zeros((lane_rows, LANES), x.dtype)
    half = LANES // 2
    for a in range(x.shape[0] // LANES):
        t = x[a * LANES : (a + 1) * LANES].T  # [lane, b]: line 128 a + b
        for p in range(2):
            out = jnp.where(pair_row == 2 * a + p, pick(t[p * half : (p + 1) * half]), out)
    return out


def _pairs_to_lines(x, pm_ref):
    """Per-row values in pair order ``[lane_rows, 128]`` -> ``[lane_rows * 64, 128]``, each row's value
    on its lanes of its line."""
    pm_ref[...] = x
    half = (LANES // 2, LANES)
    tiles = []
    for a in range(x.shape[0] // 2):
        # pair row 2 a on sublanes 0-63, 2 a + 1 on 64-127: broadcasts (one vector register each)
        rows = [jnp.broadcast_to(pm_ref[2 * a + p : 2 * a + p + 1, :], half) for p in range(2)]
        tiles.append(jnp.concatenate(rows, axis=0).T)  # [b, s]: row 256 a + 2 b + s // 64
    return jnp.concatenate(tiles, axis=0)


def _rows_step(
    row_fn, ins, outs, flat, gradient, w, touched, marks, is_marked, dim: int, hp_ref, names, constants, dtype, scratch
):
    """A lane-dense block's update (2 rows a line) with the rule's per-row math once a row: row
    slots in pair order, ``row_mean`` a transpose and sublane sums, ``spread`` a transpose back."""
    sq_ref, pm_ref = scratch
    # every lane of a row holds its mark: the first sublane of each transposed place
    touched_rows = is_marked(_lines_to_pairs(marks, lambda t: t[0:1]))
    olds = [_rows_to_pairs(r[...], sq_ref, pm_ref) if f else r[...] for r, f in zip(ins[1:], flat)]
    scale = np.float32(1.0 / dim)  # a power of two: the mean is the sum's exact multiple

    def row_mean(x):
        return _lines_to_pairs(x, lambda t: jnp.sum(t, axis=0, keepdims=True)) * scale

    hps = {name: jnp.full((1, 1), hp_ref[i], jnp.float32) for i, name in enumerate(names)} | constants
    new = row_fn(gradient, w, *olds, dtype=dtype, row_mean=row_mean, spread=lambda v: _pairs_to_lines(v, pm_ref), **hps)
    outs[0][...] = jnp.where(touched, new[0], w)
    for r, f, old, value in zip(outs[1:], flat, olds, new[1:]):
        if f:
            r[...] = _pairs_to_rows(jnp.where(touched_rows, value, old), sq_ref, pm_ref)
        else:
            r[...] = jnp.where(touched, value.reshape(old.shape), old)


def _row_slot_in(x, k: int, dim: int, lanes_iota, spread_ref):
    """A row slot's block as the row math takes it: ``[lane_rows, 128]`` (row ``r`` at
    ``x[r // 128, r % 128]``) -> a column ``[block_rows, 1]``, or for a lane-dense table
    ``[block_rows / k, 128]``, each row's value on its lanes of its line."""
    column = _lanes_to_column(x, lanes_iota)
    if k == 1:
        return column
    (spread,) = spread_ref
    block_rows = column.shape[0]
    spread[...] = jnp.broadcast_to(column, (block_rows, LANES))
    group = jax.lax.broadcasted_iota(jnp.int32, (block_rows // k, LANES), 1) // dim
    out = jnp.zeros((block_rows // k, LANES), jnp.float32)
    for g in range(k):  # rows g, g + k, ... are the g-th rows of consecutive lines
        out = jnp.where(group == g, spread[pl.ds(g, block_rows // k, stride=k), :], out)
    return out


def _row_slot_out(value, k: int, dim: int, lane_rows: int, lanes_iota, spread_ref):
    """The inverse of :func:`_row_slot_in`."""
    if k == 1:
        return _column_to_lanes(value, lane_rows, lanes_iota)
    (spread,) = spread_ref
    block_lines = value.shape[0]
    for g in range(k):
        spread[pl.ds(g, block_lines, stride=k), :] = value
    block_rows = block_lines * k
    row = jax.lax.broadcasted_iota(jnp.int32, (block_rows, LANES), 0)
    lane = jax.lax.broadcasted_iota(jnp.int32, (block_rows, LANES), 1)
    own = lane == jnp.bitwise_and(row, np.int32(k - 1)) * dim  # the first lane of the row's own lanes
    column = jnp.sum(jnp.where(own, spread[...], 0.0), axis=1, keepdims=True)
    return _column_to_lanes(column, lane_rows, lanes_iota)


def _exact_dot(x, selector):
    """``x @ selector`` in float32, ``selector`` holding only 0, 1 or powers of two: each product
    with a part of ``x`` (:func:`_bfloat16_parts`) is exact and only the MXU's float32
    accumulation rounds."""
    hi, mid, lo = _bfloat16_parts(x)
    b = selector.astype(jnp.bfloat16)
    out = jnp.dot(hi, b, preferred_element_type=jnp.float32)
    out = out + jnp.dot(mid, b, preferred_element_type=jnp.float32)
    return out + jnp.dot(lo, b, preferred_element_type=jnp.float32)


def _square_iotas():
    return (
        jax.lax.broadcasted_iota(jnp.int32, (LANES, LANES), 0),
        jax.lax.broadcasted_iota(jnp.int32, (LANES, LANES), 1),
    )


def _mxu_row_mean(dim: int):
    """:func:`_segmented_row_mean` as one product: each lane takes the mean of its row's lanes."""

    def row_mean(x):
        a, b = _square_iotas()
        # 1/dim is a power of two; float32 constants (Python floats would trace as float64 under x64)
        return _exact_dot(x, jnp.where(a // dim == b // dim, np.float32(1.0 / dim), np.float32(0.0)))

    return row_mean


def _row_slot_in_mxu(x, k: int, dim: int):
    """:func:`_row_slot_in` for a lane-dense table (``k > 1``) as one product: ``[lane_rows, 128]`` ->
    ``[lane_rows * 128 / k, 128]``, each row's value on its lanes of its line.

    Slot row ``i`` holds the rows of lines ``i * 128 / k ...``; each line takes its slot row with
    every lane but its own rows' masked, and the product moves lane ``j`` (row ``j % k`` of the line)
    onto that row's lanes.
    """
    lane_rows, per = x.shape[0], LANES // k
    lines = lane_rows * per
    spread = jnp.broadcast_to(x[:, None, :], (lane_rows, per, LANES)).reshape(lines, LANES)
    line = jax.lax.broadcasted_iota(jnp.int32, (lines, LANES), 0)
    lane = jax.lax.broadcasted_iota(jnp.int32, (lines, LANES), 1)
    own = jnp.where(lane // k == line % per, spread, 0.0)
    j, out_lane = _square_iotas()
    return _exact_dot(own, (j % k == out_lane // dim).astype(jnp.float32))


def _row_slot_out_mxu(value, k: int, dim: int, lane_rows: int):
    """The inverse of :func:`_row_slot_in_mxu`: each row's value read from its first lane."""
    lines, per = value.shape[0], LANES // k
    lane, j = _square_iotas()
    picked = _exact_dot(value, (lane == (j % k) * dim).astype(jnp.float32))  # [line, j]: row j % k's value
    line = jax.lax.broadcasted_iota(jnp.int32, (lines, LANES), 0)
    out_lane = jax.lax.broadcasted_iota(jnp.int32, (lines, LANES), 1)
    mine = jnp.where(line % per == out_lane // k, picked, 0.0)
    return jnp.sum(mine.reshape(lane_rows, per, LANES), axis=1)


def _pool(rows, samples, gains, num_valid, batch_size: int):
    """``out[samples[i]] += gains[i] * rows[i]`` for the first ``num_valid`` entries, in entry order."""
    n, dim = rows.shape
    chunk = _chunk_for(n)
    padded = _cdiv(n, chunk) * chunk
    if padded != n:
        rows = jnp.pad(rows, ((0, padded - n), (0, 0)))
        samples = jnp.pad(samples, (0, padded - n))
        gains = jnp.pad(gains, (0, padded - n))

    def kernel(count_ref, samples_ref, gains_ref, rows_ref, out_ref):
        c = pl.program_id(0)

        @pl.when(c == 0)
        def _():
            out_ref[...] = jnp.zeros_like(out_ref)

        def add(j, carry):
            s = samples_ref[j]
            out_ref[pl.ds(s, 1), :] += rows_ref[pl.ds(j, 1), :] * gains_ref[j]
            return carry

        count = jnp.clip(count_ref[0] - c * chunk, 0, chunk)

        @pl.when(count == chunk)
        def _():  # a full chunk: a loop of static length, which unrolls
            jax.lax.fori_loop(0, chunk, add, 0, unroll=_UNROLL)

        @pl.when(count < chunk)
        def _():
            jax.lax.fori_loop(0, count, add, 0)

    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(padded // chunk,),
            in_specs=[
                pl.BlockSpec((chunk,), lambda c, n: (c,), memory_space=pltpu.SMEM),
                pl.BlockSpec((chunk,), lambda c, n: (c,), memory_space=pltpu.SMEM),
                pl.BlockSpec((chunk, dim), lambda c, n: (c, _ZERO)),
            ],
            out_specs=pl.BlockSpec((batch_size, dim), lambda c, n: (_ZERO, _ZERO)),
        ),
        out_shape=jax.ShapeDtypeStruct((batch_size, dim), rows.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",), vmem_limit_bytes=_VMEM_LIMIT),
        interpret=_interpret(),
    )(jnp.reshape(num_valid, (1,)).astype(jnp.int32), samples, gains, rows)


def _pool_fits(batch_size: int, dim: int) -> bool:
    return 0 < batch_size and batch_size * max(_cdiv(dim, 128) * 128, 128) * 4 <= _POOL_VMEM


# --- the ops -----------------------------------------------------------------------------


def _gather_rows(x, keys, stream: bool):
    if stream and x.ndim == 2:
        return stream_gather(x, keys)
    if x.ndim == 2:
        return _xla_take_rows(x, keys)
    return jnp.take(x, jnp.minimum(keys, x.shape[0] - 1), axis=0, indices_are_sorted=True, unique_indices=False)


def _scatter_rows(x, keys, new_rows, stream: bool):
    if stream and x.ndim == 2:
        return stream_scatter(x, keys, new_rows)
    if x.ndim == 2:
        return _xla_put_rows(x, keys, new_rows)
    return x.at[keys].set(new_rows.astype(x.dtype), mode="drop", indices_are_sorted=True, unique_indices=True)


def _one_pass() -> bool:
    from tpurec import config

    return bool(config.get("TPUREC_TENSORCORE_ONE_PASS"))


def _row_slots() -> str:
    from tpurec import config

    return str(config.get("TPUREC_TENSORCORE_ROW_SLOTS"))


def _row_sum() -> str:
    from tpurec import config

    return str(config.get("TPUREC_TENSORCORE_ROW_SUM"))


def sparse_dense_matmul(row_pointers, embedding_ids, sample_ids, gains, table, *, batch_size: int):
    """Pooled lookup (see :func:`tpurec.sparse.kernels.reference.sparse_dense_matmul`)."""
    TRACE_COUNTS["sparse_dense_matmul"] += 1
    acc = reference.accumulator_dtype(table.dtype)
    keys, samples, g, valid = _sorted_entries(row_pointers, embedding_ids, sample_ids, gains)
    stream = streams(keys.shape[0], table)
    if stream and batch_size > 0 and _one_pass():
        return stream_pool(table, keys, samples, g.astype(acc), batch_size)
    rows = jnp.where(valid[:, None], _gather_rows(table, keys, stream).astype(acc), 0)
    if stream and _pool_fits(batch_size, table.shape[1]):
        return _pool(rows, samples, g.astype(acc), jnp.sum(valid.astype(jnp.int32)), batch_size)
    weighted = rows * g.astype(acc)[:, None]
    return jax.ops.segment_sum(weighted, jnp.where(valid, samples, batch_size), num_segments=batch_size + 1)[
        :batch_size
    ]


def _grad_op(op_name, csr, grad_output, table, slots, hyperparameters):
    TRACE_COUNTS[op_name] += 1
    acc = reference.accumulator_dtype(table.dtype)
    keys, samples, g, valid = _sorted_entries(*csr)
    n = keys.shape[0]
    grad_output = grad_output.astype(jnp.promote_types(grad_output.dtype, acc))
    if grad_output.shape[0] == 0:
        # An empty batch has no output rows, so no entry can carry a gradient.
        valid = jnp.zeros_like(valid)
        keys = jnp.full_like(keys, PAD_ID)
        grads = jnp.zeros((n, grad_output.shape[1]), grad_output.dtype)
    else:
        if streams(n, table) and _update_fits(table, slots) and _one_pass():
            updated = stream_update(
                op_name, table, slots, keys, samples, g, grad_output, hyperparameters, row_sum=_row_sum()
            )
            return updated if len(updated) > 1 else updated[0]
        grads = jnp.take(grad_output, samples, axis=0) * jnp.where(valid, g, 0).astype(grad_output.dtype)[:, None]
    unique_keys, segment = _unique(keys, valid)
    row_grads = jax.ops.segment_sum(
        jnp.where(valid[:, None], grads, 0), jnp.where(valid, segment, n), num_segments=n + 1, indices_are_sorted=True
    )[:n].astype(acc)
    stream = streams(n, table)
    w = _gather_rows(table, unique_keys, stream).astype(acc)
    gathered = [_gather_rows(x, unique_keys, stream).astype(jnp.promote_types(x.dtype, acc)) for x in slots]
    new_w, *new_slots = rule_of(op_name).rows(row_grads, w, *gathered, dtype=table.dtype, **hyperparameters)
    out: list[jax.Array] = [
        _scatter_rows(x, unique_keys, r.astype(x.dtype), stream) for x, r in zip((table, *slots), (new_w, *new_slots))
    ]
    return tuple(out) if len(out) > 1 else out[0]


# One entry point per update rule (sparse_dense_matmul_grad_with_<name>), made on first use.
__getattr__ = reference.grad_ops(_grad_op, __name__)
