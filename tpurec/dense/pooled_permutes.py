"""FBGEMM's permutations of pooled embeddings, the ones ``KeyedTensor.regroup`` runs, on the tpu device.

``KeyedTensor.regroup`` (and ``regroup_as_dict``), when each key is used once, concatenates the
pooled embeddings of its keyed tensors and reorders their column blocks (one per key) with
``fbgemm::permute_pooled_embs_auto_grad``. That op's autograd kernel is FBGEMM's, registered for
every backend: its forward calls ``fbgemm::permute_pooled_embs`` and its backward the same op
with the inverse lists, so the lowering of the plain op serves both directions. The autograd op
itself (reached where autograd is off: ``torch.no_grad``'s inference mode, compiled graphs) and
the ``_split`` variant lower to the same permutation.

The lists are device tensors: ``offset_dim_list`` the ``n + 1`` column offsets of the input's
blocks, ``permute_list`` which input block each output block is. Each output column finds its
block by a search over the output's block offsets, so the permutation runs on values the
program receives (a regroup with the same shapes reuses the compiled program).

``KeyedTensor.regroup`` with a key in several groups, and TorchRec's ``KTRegroupAsDict`` module,
run ``fbgemm::permute_multi_embedding`` instead: a list of pooled embeddings in, a list out, moved
by the rows of ``permutes`` (``kt_regroup_arguments``'s: input tensor, output tensor, input start,
output start, width, and a link FBGEMM's kernels follow to sum a key's gradients). Its autograd
kernel is FBGEMM's too: it calls ``fbgemm::permute_multi_embedding_function`` forward and, with
``reverse=True``, backward, where each output block's gradient is added into its input block (a key
in two groups gets the sum). Both ops and both directions lower here to one gather (or scatter-add)
of the concatenated columns, its index computed on the device from ``permutes``.
``fbgemm::kt_regroup_arguments``, which computes ``permutes`` from the keys, runs FBGEMM's CPU
kernel on the host and moves its tensors to the embeddings' device (as FBGEMM's CUDA kernel puts
them on the GPU); ``fbgemm::regroup_keyed_tensor`` (TorchRec's ``regroup_kts``) is the two in a row.

This family loads with FBGEMM's other ops (``tpurec.dense.jagged``), on the first ``fbgemm`` op.
"""

from __future__ import annotations

import fbgemm_gpu  # noqa: F401  (defines torch.ops.fbgemm)
import jax
import jax.numpy as jnp
import numpy as np
import torch

from tpurec.dense.registry import Kind, lower

__all__ = [
    "kt_regroup_arguments",
    "permute_multi_embedding",
    "permute_pooled_embs",
    "permuted_columns",
    "regroup_keyed_tensor",
]

fbgemm = torch.ops.fbgemm


def permuted_columns(offset_dim_list: jax.Array, permute_list: jax.Array, columns: int) -> jax.Array:
    """For each of ``columns`` output columns, the input column it reads.

    Args:
        offset_dim_list: ``[n + 1]`` integer column offsets of the input's blocks.
        permute_list: ``[n]``: output block ``i`` is input block ``permute_list[i]``.
        columns: the output's column count (the input's).

    Returns:
        ``[columns]`` input column indices, of ``offset_dim_list``'s dtype.
    """
    dims = offset_dim_list[1:] - offset_dim_list[:-1]
    out_offsets = jnp.concatenate([jnp.zeros((1,), dims.dtype), jnp.cumsum(dims[permute_list])])
    positions = jnp.arange(columns, dtype=offset_dim_list.dtype)
    blocks = jnp.searchsorted(out_offsets[1:], positions, side="right")
    blocks = jnp.minimum(blocks, permute_list.shape[0] - 1)
    return offset_dim_list[permute_list[blocks]] + positions - out_offsets[blocks]


@lower(
    fbgemm.permute_pooled_embs.default,
    fbgemm.permute_pooled_embs_auto_grad.default,
    fbgemm.permute_pooled_embs_split.default,
)
def permute_pooled_embs(
    pooled_embs: jax.Array,
    offset_dim_list: jax.Array,
    permute_list: jax.Array,
    inv_offset_dim_list: jax.Array,
    inv_permute_list: jax.Array,
) -> jax.Array:
    """Pooled embeddings ``[batch, columns]`` with their column blocks reordered by ``permute_list``.

    The inverse lists serve FBGEMM's backward, which calls this op with the lists swapped.

    Raises:
        ValueError: ``pooled_embs`` is not 2-D, or the lists do not fit together.
    """
    del inv_offset_dim_list, inv_permute_list
    if pooled_embs.ndim != 2:
        raise ValueError(f"permute_pooled_embs takes a 2-D [batch, columns] tensor, got shape {pooled_embs.shape}")
    if offset_dim_list.ndim != 1 or permute_list.ndim != 1 or offset_dim_list.shape[0] != permute_list.shape[0] + 1:
        raise ValueError(
            "permute_pooled_embs: offset_dim_list must hold one more offset than permute_list has blocks, got "
            f"shapes {offset_dim_list.shape} and {permute_list.shape}"
        )
    if permute_list.shape[0] == 0:
        return pooled_embs
    return jnp.take(pooled_embs, permuted_columns(offset_dim_list, permute_list, pooled_embs.shape[1]), axis=1)


def _multi_columns(permutes: jax.Array, in_widths: list[int], out_widths: list[int]) -> jax.Array:
    """For each column of the outputs laid side by side, the column of the inputs laid side by side it
    copies (``sum(in_widths)`` where no row of ``permutes`` covers it)."""
    rows = permutes.astype(jnp.int32)
    in_tensor, out_tensor, in_start, out_start, width = (rows[:, k] for k in range(5))
    in_base = jnp.asarray([0, *np.cumsum(in_widths)[:-1]] if in_widths else [0], jnp.int32)
    positions, tensors = [], []
    for k, w in enumerate(out_widths):
        positions.append(np.arange(w, dtype=np.int32))
        tensors.append(np.full(w, k, np.int32))
    column = jnp.asarray(np.concatenate(positions) if positions else np.zeros(0, np.int32))[None, :]
    tensor = jnp.asarray(np.concatenate(tensors) if tensors else np.zeros(0, np.int32))[None, :]
    covers = (out_tensor[:, None] == tensor) & (out_start[:, None] <= column) & (column < (out_start + width)[:, None])
    source = in_base[jnp.clip(in_tensor, 0, max(len(in_widths) - 1, 0))][:, None] + in_start[:, None] + column
    source = source - out_start[:, None]
    return jnp.where(covers.any(axis=0), jnp.sum(jnp.where(covers, source, 0), axis=0), sum(in_widths))


@lower(fbgemm.permute_multi_embedding.default, fbgemm.permute_multi_embedding_function.default)
def permute_multi_embedding(
    pooled_embs: list[jax.Array],
    permutes: jax.Array,
    in_shapes: jax.Array,
    out_shapes: jax.Array,
    out_lengths: list[int],
    reverse: bool = False,
) -> list[jax.Array]:
    """FBGEMM's ``permute_multi_embedding``: ``out_lengths``-wide ``[batch, width]`` tensors whose column
    blocks are the input blocks ``permutes`` names; with ``reverse`` (the backward) the inputs are the
    outputs' gradients and each output block's gradient is added into its input block.

    Raises:
        ValueError: ``permutes`` is not ``[rows, 6]``, or the tensors differ in batch size.
    """
    del in_shapes, out_shapes  # (the widths are the arrays' and out_lengths)
    if permutes.ndim != 2 or permutes.shape[1] != 6:
        raise ValueError(f"permute_multi_embedding: permutes must be [rows, 6], got shape {permutes.shape}")
    if not pooled_embs:
        return []
    batch = pooled_embs[0].shape[0]
    if any(x.ndim != 2 or x.shape[0] != batch for x in pooled_embs):
        raise ValueError(
            f"permute_multi_embedding takes 2-D tensors of one batch size, got shapes {[x.shape for x in pooled_embs]}"
        )
    dtype = pooled_embs[0].dtype
    given = jnp.concatenate([x.astype(dtype) for x in pooled_embs], axis=1)
    lengths = [int(n) for n in out_lengths]
    widths = [int(x.shape[1]) for x in pooled_embs]
    if reverse:  # the given tensors are the forward's outputs (their gradients), the results its inputs
        target = _multi_columns(permutes, lengths, widths)
        moved = jnp.zeros((batch, sum(lengths)), dtype).at[:, target].add(given, mode="drop")
    else:
        source = _multi_columns(permutes, widths, lengths)
        padded = jnp.concatenate([given, jnp.zeros((batch, 1), dtype)], axis=1)
        moved = jnp.take(padded, source, axis=1)
    return list(jnp.split(moved, np.cumsum(lengths)[:-1].tolist(), axis=1)) if lengths else []


def kt_regroup_arguments(
    embs: torch.Tensor, keys: list[list[str]], lengths: list[list[int]], groups: list[list[str]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """FBGEMM's ``kt_regroup_arguments``: its CPU kernel on the host, the tensors moved to ``embs``' device."""
    host = torch.empty(0, dtype=embs.dtype)
    permutes, in_shapes, out_shapes, out_lengths = fbgemm.kt_regroup_arguments(host, keys, lengths, groups)
    return permutes.to(embs.device), in_shapes.to(embs.device), out_shapes.to(embs.device), list(out_lengths)


def regroup_keyed_tensor(
    pooled_embs: list[torch.Tensor], keys: list[list[str]], lengths: list[list[int]], groups: list[list[str]]
) -> list[torch.Tensor]:
    """FBGEMM's ``regroup_keyed_tensor``: :func:`kt_regroup_arguments`, then ``permute_multi_embedding``."""
    permutes, in_shapes, out_shapes, out_lengths = kt_regroup_arguments(pooled_embs[0], keys, lengths, groups)
    return list(fbgemm.permute_multi_embedding(pooled_embs, permutes, in_shapes, out_shapes, out_lengths))


lower(fbgemm.kt_regroup_arguments.default, kind=Kind.COMPOSITE)(kt_regroup_arguments)
lower(fbgemm.regroup_keyed_tensor.default, kind=Kind.COMPOSITE)(regroup_keyed_tensor)
