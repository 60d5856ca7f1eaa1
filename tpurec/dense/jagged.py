"""FBGEMM's jagged-tensor operators, the ones TorchRec's ``JaggedTensor`` calls, on the tpu device.

``JaggedTensor.offsets()`` runs ``fbgemm::asynchronous_complete_cumsum`` on the lengths;
``JaggedTensor.to_padded_dense`` runs ``fbgemm::jagged_to_padded_dense``, a composite
whose autograd kernel (FBGEMM's, registered for every backend) calls
``jagged_to_padded_dense_forward`` and, in backward, ``jagged_to_padded_dense_backward``;
``fbgemm::dense_to_jagged`` is the same pair the other way round. Only the forward and
backward kernels need lowerings: autograd stays FBGEMM's own.

Shapes are static (the padded sizes are arguments, the jagged total is ``values``'
length), so a batch with other lengths reuses the compiled program. Each dense position
finds its row of ``values`` by walking the offsets one jagged level at a time (a gather
per level); positions past a sequence's length, and rows past the end of ``values``,
hold the padding value (FBGEMM's CPU kernel reads out of bounds for offsets that exceed
``values``; here they read as padding). The backward scatters the gradient of each
valid position into its row; rows no position reaches (truncated by ``max_lengths``)
get zero, as in FBGEMM.

The FBGEMM library defines these ops, so this family loads on the first ``fbgemm`` op
(``tpurec.dense.registry``), not with the other families.
"""

from __future__ import annotations

from typing import Sequence

import fbgemm_gpu  # noqa: F401  (defines torch.ops.fbgemm)
import jax
import jax.numpy as jnp
import torch

from tpurec.dense.registry import Kind, lower, mark

fbgemm = torch.ops.fbgemm

__all__ = ["complete_cumsum", "jagged_to_padded_dense", "padded_dense_to_jagged"]

# The dtypes FBGEMM's CPU kernels take (others raise there too).
_CUMSUM_DTYPES = (jnp.int32, jnp.int64, jnp.float32, jnp.float16)
_OFFSET_DTYPES = (jnp.int32, jnp.int64)


@lower(fbgemm.asynchronous_complete_cumsum.default)
def complete_cumsum(t: jax.Array) -> jax.Array:
    """Lengths -> offsets: a leading 0, then the running sum (per row of a 2-D input).

    Args:
        t: 1-D ``[n]`` or 2-D ``[rows, n]`` int32/int64/float32/float16 tensor.

    Returns:
        ``[n + 1]`` (or ``[rows, n + 1]``) of ``t``'s dtype, summed in that dtype as FBGEMM does.

    Raises:
        ValueError: ``t`` is not 1-D or 2-D.
        TypeError: ``t``'s dtype has no FBGEMM kernel.
    """
    if t.ndim not in (1, 2):
        raise ValueError(f"asynchronous_complete_cumsum takes a 1-D or 2-D tensor, got shape {tuple(t.shape)}")
    if t.dtype not in _CUMSUM_DTYPES:
        raise TypeError(
            f"asynchronous_complete_cumsum takes int32, int64, float32 or float16 (as FBGEMM's kernel), got {t.dtype}"
        )
    summed = jnp.cumsum(t, axis=-1, dtype=t.dtype)
    zero = jnp.zeros(t.shape[:-1] + (1,), t.dtype)
    return jnp.concatenate([zero, summed], axis=-1)


def _check_offsets(offsets: Sequence[jax.Array], max_lengths: Sequence[int], op: str) -> None:
    """Static checks FBGEMM makes (or would need): one offsets tensor per padded length, 1-D, int."""
    if not offsets:
        raise ValueError(f"{op}: needs at least one offsets tensor (one per jagged dimension)")
    if len(max_lengths) != len(offsets):
        raise ValueError(
            f"{op}: got {len(offsets)} offsets tensors but {len(max_lengths)} max_lengths; give one padded "
            "length per jagged dimension"
        )
    for level, off in enumerate(offsets):
        if off.ndim != 1 or off.shape[0] < 1:
            raise ValueError(
                f"{op}: offsets[{level}] must be 1-D with at least one entry, got shape {tuple(off.shape)}"
            )
        if off.dtype not in _OFFSET_DTYPES:
            raise TypeError(f"{op}: offsets[{level}] must be int32 or int64 (as FBGEMM's kernel), got {off.dtype}")
    if len({off.dtype for off in offsets}) > 1:
        # FBGEMM's kernel refuses the mix too ("expected scalar type Long but found Int").
        raise TypeError(f"{op}: all offsets tensors must have one dtype, got {[str(off.dtype) for off in offsets]}")
    for level, length in enumerate(max_lengths):
        if length < 0:
            raise ValueError(f"{op}: max_lengths[{level}] must be >= 0, got {length}")


def _rows(offsets: Sequence[jax.Array], max_lengths: Sequence[int], total: int) -> tuple[jax.Array, jax.Array]:
    """For each dense position ``[B, L_1, ..., L_N]``: the row of ``values`` it holds, and whether it holds one.

    Level ``k`` maps a row of level ``k - 1`` (a batch entry for ``k = 0``) to the span
    ``offsets[k][row] : offsets[k][row + 1]`` of the next level; the position's index
    ``j`` along ``L_k`` is valid while it lies inside that span.
    """
    batch = offsets[0].shape[0] - 1
    row = jnp.arange(batch, dtype=jnp.int64)
    valid = jnp.ones((batch,), dtype=bool)
    for off, length in zip(offsets, max_lengths):
        off = off.astype(jnp.int64)
        spans = off.shape[0] - 1
        valid = valid & (row < spans)  # an outer level pointing past this level's rows
        safe = jnp.clip(row, 0, max(spans - 1, 0))
        start = off[safe]
        end = off[jnp.minimum(safe + 1, spans)]
        j = jnp.arange(length, dtype=jnp.int64)
        valid = valid[..., None] & (j < (end - start)[..., None])
        row = start[..., None] + j
    valid = valid & (row >= 0) & (row < total)
    return row, valid


def _trailing(mask: jax.Array, inner: int) -> jax.Array:
    """``mask`` with ``inner`` trailing unit axes, to broadcast over the values' inner dims."""
    return mask.reshape(mask.shape + (1,) * inner)


@lower(fbgemm.jagged_to_padded_dense_forward.default)
def jagged_to_padded_dense(
    values: jax.Array, offsets: list[jax.Array], max_lengths: list[int], padding_value: jax.Array | float = 0.0
) -> jax.Array:
    """Jagged rows -> a dense ``[B, max_lengths..., D]`` tensor, empty places holding ``padding_value``.

    Args:
        values: ``[total]`` or ``[total, D]``.
        offsets: one int32/int64 offsets tensor per jagged dimension (``offsets[0]``: ``B + 1`` entries).
        max_lengths: the padded length of each jagged dimension; longer sequences are truncated.
        padding_value: the value of positions no row fills (a traced scalar: a new value never recompiles).

    Returns:
        ``[B, *max_lengths]`` (1-D values) or ``[B, *max_lengths, D]``, of ``values``' dtype.
    """
    op = "jagged_to_padded_dense"
    _check_offsets(offsets, max_lengths, op)
    if values.ndim not in (1, 2):
        raise ValueError(
            f"{op}: values must be 1-D or 2-D [total, D] (as FBGEMM's kernel), got shape {tuple(values.shape)}"
        )
    total = values.shape[0]
    batch = offsets[0].shape[0] - 1
    shape = (batch, *max_lengths, *values.shape[1:])
    padding = jnp.asarray(padding_value).astype(values.dtype)
    if total == 0:
        return jnp.full(shape, padding, values.dtype)
    row, valid = _rows(offsets, max_lengths, total)
    gathered = values[jnp.where(valid, row, 0)]
    return jnp.where(_trailing(valid, values.ndim - 1), gathered, padding)


def padded_dense_to_jagged(dense: jax.Array, offsets: list[jax.Array], total: int) -> jax.Array:
    """Dense positions -> their jagged rows (``[total, D]``); rows no position reaches are zero.

    The backward of :func:`jagged_to_padded_dense` (with the dense gradient) and
    FBGEMM's ``dense_to_jagged_forward`` are this one scatter.
    """
    max_lengths = list(dense.shape[1 : 1 + len(offsets)])
    inner = dense.shape[1 + len(offsets) :]
    out = jnp.zeros((total, *inner), dense.dtype)
    if total == 0 or dense.size == 0:
        return out
    row, valid = _rows(offsets, max_lengths, total)
    # Invalid positions aim past the end and are dropped; valid ones are distinct rows.
    return out.at[jnp.where(valid, row, total)].add(dense, mode="drop")


def _check_dense(dense: jax.Array, offsets: Sequence[jax.Array], op: str) -> None:
    levels = len(offsets)
    if dense.ndim not in (levels + 1, levels + 2):
        raise ValueError(
            f"{op}: a dense tensor for {levels} jagged dimension(s) is [B, {levels} padded lengths, (D)], "
            f"got shape {tuple(dense.shape)}"
        )
    _check_offsets(offsets, list(dense.shape[1 : 1 + levels]), op)
    if dense.shape[0] != offsets[0].shape[0] - 1:
        raise ValueError(
            f"{op}: the dense tensor has {dense.shape[0]} rows but offsets[0] describes {offsets[0].shape[0] - 1}"
        )


@lower(fbgemm.jagged_to_padded_dense_backward.default)
def jagged_to_padded_dense_backward(grad_output: jax.Array, offsets: list[jax.Array], total_L: int) -> jax.Array:
    """The gradient of ``values`` in :func:`jagged_to_padded_dense`: ``[total_L, D]``."""
    _check_dense(grad_output, offsets, "jagged_to_padded_dense_backward")
    return padded_dense_to_jagged(grad_output, offsets, total_L)


@lower(fbgemm.dense_to_jagged_forward.default)
def dense_to_jagged(dense: jax.Array, x_offsets: list[jax.Array], total_L: int | None = None) -> jax.Array:
    """FBGEMM's ``dense_to_jagged``: the jagged rows of a padded dense tensor, ``[total_L, D]``.

    Raises:
        ValueError: ``total_L`` is None; the output's length would depend on the
            offsets' values (pass ``total_L``, e.g. ``offsets[-1]`` read once on the host).
    """
    op = "dense_to_jagged_forward"
    if total_L is None:
        raise ValueError(
            f"{op} on the tpu device needs total_L (the output's length would depend on the offsets' values): "
            "pass total_L=int(offsets[-1])"
        )
    _check_dense(dense, x_offsets, op)
    return padded_dense_to_jagged(dense, x_offsets, total_L)


# FBGEMM's sparse-feature index ops that TorchRec's input distribution runs on a
# KeyedJaggedTensor's lengths and values (permuting features, bucketizing ids by the row
# shard that owns them, inverting permutations). The sizes of their outputs are sums of
# the lengths they read, so they run on the host like every data-dependent op (a sync
# point; the inputs are integer ids and lengths, as in tpurec's own input routing) with
# FBGEMM's own CPU kernels, and their results come back to the device.
mark(
    fbgemm.permute_2D_sparse_data,
    fbgemm.permute_1D_sparse_data,
    fbgemm.permute_2D_sparse_data_input1D,
    fbgemm.block_bucketize_sparse_features,
    fbgemm.invert_permute,
    fbgemm.expand_into_jagged_permute,
    fbgemm.keyed_jagged_index_select_dim1,
    kind=Kind.DATA_DEPENDENT,
)

# FBGEMM's pooled-embedding permutations (KeyedTensor.regroup) load with this family.
from tpurec.dense import pooled_permutes  # noqa: E402, F401
