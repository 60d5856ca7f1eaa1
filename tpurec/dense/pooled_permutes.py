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

This family loads with FBGEMM's other ops (``tpurec.dense.jagged``), on the first ``fbgemm`` op.
"""

from __future__ import annotations

import fbgemm_gpu  # noqa: F401  (defines torch.ops.fbgemm)
import jax
import jax.numpy as jnp
import torch

from tpurec.dense.registry import lower

__all__ = ["permute_pooled_embs", "permuted_columns"]

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
