"""TorchRec's TPU lookup operators (``torch.ops.torchrec.*``) on the tpu device.

TorchRec's ``UNFUSED_TPU`` compute kernel (``BatchedTPUEmbedding`` /
``BatchedTPUEmbeddingBag`` in ``torchrec.distributed.batched_embedding_kernel``) looks
up its tables through ops that ``torchrec.experimental.torch_tpu.pallas.ops`` defines
with CPU kernels and autograd formulas (the backward is another op of the set). TorchRec
ships their TPU kernels as Pallas programs for the private TorchTPU runtime; here the
lookups lower to tpurec's sparse op set instead: every lookup is a
``sparse_dense_matmul`` over a one-partition CSR input (entry ``i`` of bag ``s`` with gain
1), so a forward runs the same kernel as tpurec's own embedding collections (the
SparseCore primitives on TPU, the native kernel on XLA:CPU). The backward of an unfused
lookup is the dense table gradient (a scatter-add of the output gradient's rows), which
autograd hands to the user's optimizer.

Shapes are static: the bag count comes from the offsets' length, entries past the last
offset are padding (the CSR row pointer is the last offset; TorchRec's CPU kernel of
``embedding_pooled_lookup_offset`` takes no padding, its batched variant and the Pallas kernels
do), so a batch with other lengths and the same number of ids reuses the compiled program.

TorchRec defines these ops when its TPU kernel module is imported, so this family loads on
the first ``torchrec`` op (``tpurec`` defers the namespace to it, ``tpurec.dense.registry.defer``).

TorchRec's grid sharding reorders its pooled output with FBGEMM's
``fbgemm::permute_pooled_embs_auto_grad_split`` (its column-wise sharding uses
``torchrec::permute_pooled_embs`` on tpu), an op FBGEMM registers for CPU and AutogradCPU
only. Its lowering is the same column permutation, and its autograd for tpu (registered
here, with the lowering, so both exist from the first lookup, which precedes every output
permutation of a sharded forward) is FBGEMM's: the backward permutes the gradient back with
the inverse lists.
"""

from __future__ import annotations

from typing import Any, cast

import fbgemm_gpu  # noqa: F401  (defines torch.ops.fbgemm)
import jax
import jax.numpy as jnp
import torch
import torchrec.experimental.torch_tpu.pallas.ops  # noqa: F401  (defines torch.ops.torchrec)

from tpurec.dense.pooled_permutes import permuted_columns
from tpurec.dense.registry import lower
from tpurec.sparse.ops import kernel_for

__all__ = [
    "embedding_lookup",
    "fbgemm_permute_pooled_embs_split",
    "embedding_lookup_backward",
    "permute_pooled_embs",
    "permute_pooled_embs_backward",
    "pooled_lookup_offset",
    "pooled_lookup_offset_backward",
]

torchrec_ops = torch.ops.torchrec


def _matmul(table: jax.Array, ids: jax.Array, samples: jax.Array, valid_entries: jax.Array, bags: int) -> jax.Array:
    """``out[s] = sum of table[ids[i]]`` over the valid entries ``i`` of bag ``s``: tpurec's sparse_dense_matmul."""
    row_pointers = jnp.reshape(valid_entries, (1,)).astype(jnp.int32)
    gains = jnp.ones(ids.shape, jnp.float32)
    kernel = kernel_for("sparse_dense_matmul", table_dtype=table.dtype)
    out = kernel(row_pointers, ids.astype(jnp.int32), samples.astype(jnp.int32), gains, table, batch_size=bags)
    return out.astype(table.dtype)


def _check_ids(name: str, ids: jax.Array) -> None:
    if not jnp.issubdtype(ids.dtype, jnp.integer) or ids.ndim != 1:
        raise TypeError(f"torchrec::{name}: the indices must be a 1-d integer tensor, got {ids.ndim}-d {ids.dtype}")


def _bag_of_entries(offsets: jax.Array, entries: int) -> jax.Array:
    """The bag of each entry ``i`` (the ``s`` with ``offsets[s] <= i < offsets[s + 1]``)."""
    positions = jnp.arange(entries, dtype=offsets.dtype)
    return jnp.searchsorted(offsets[1:], positions, side="right").astype(jnp.int32)


@lower(torchrec_ops.embedding_lookup.default)
def embedding_lookup(indices: jax.Array, weights: jax.Array, emb_dim: int) -> jax.Array:
    """Rows ``weights[indices]``: a lookup with one entry per bag."""
    _check_ids("embedding_lookup", indices)
    n = indices.shape[0]
    return _matmul(weights, indices, jnp.arange(n, dtype=jnp.int32), jnp.asarray(n), n)


@lower(torchrec_ops.embedding_lookup_backward.default)
def embedding_lookup_backward(grad_out: jax.Array, indices: jax.Array, num_rows: int, emb_dim: int) -> jax.Array:
    """The table gradient of :func:`embedding_lookup`: each output row's gradient added to its table row."""
    _check_ids("embedding_lookup_backward", indices)
    zeros = jnp.zeros((num_rows, emb_dim), grad_out.dtype)
    return zeros.at[indices].add(grad_out, mode="drop")


@lower(torchrec_ops.embedding_pooled_lookup_offset.default)
def pooled_lookup_offset(indices: jax.Array, offsets: jax.Array, weights: jax.Array, emb_dim: int) -> jax.Array:
    """Sum pooling of bag ``s``'s rows, bag ``s`` holding entries ``offsets[s]`` to ``offsets[s + 1]``."""
    _check_ids("embedding_pooled_lookup_offset", indices)
    bags = offsets.shape[0] - 1
    samples = _bag_of_entries(offsets, indices.shape[0])
    return _matmul(weights, indices, samples, offsets[-1], bags)


@lower(torchrec_ops.embedding_pooled_lookup_offset_backward.default)
def pooled_lookup_offset_backward(
    grad_out: jax.Array, indices: jax.Array, offsets: jax.Array, num_rows: int, emb_dim: int
) -> jax.Array:
    """The table gradient of :func:`pooled_lookup_offset`: each bag's gradient added to its entries' rows."""
    _check_ids("embedding_pooled_lookup_offset_backward", indices)
    n = indices.shape[0]
    samples = _bag_of_entries(offsets, n)
    valid = jnp.arange(n) < offsets[-1]
    rows = jnp.where(valid[:, None], grad_out[jnp.minimum(samples, grad_out.shape[0] - 1)], 0)
    zeros = jnp.zeros((num_rows, emb_dim), grad_out.dtype)
    return zeros.at[jnp.where(valid, indices, num_rows)].add(rows, mode="drop")


@lower(torchrec_ops.permute_pooled_embs.default)
def permute_pooled_embs(pooled_embs: jax.Array, offset_dim_list: jax.Array, permute_list: jax.Array) -> jax.Array:
    """Pooled embeddings ``[batch, columns]`` with their column blocks (one per feature shard) reordered."""
    return jnp.take(pooled_embs, permuted_columns(offset_dim_list, permute_list, pooled_embs.shape[1]), axis=1)


@lower(torchrec_ops.permute_pooled_embs_backward.default)
def permute_pooled_embs_backward(grad_out: jax.Array, offset_dim_list: jax.Array, permute_list: jax.Array) -> jax.Array:
    """The gradient of :func:`permute_pooled_embs`: each output column's gradient back to its input column."""
    columns = permuted_columns(offset_dim_list, permute_list, grad_out.shape[1])
    return jnp.zeros_like(grad_out).at[:, columns].add(grad_out)


@lower(torch.ops.fbgemm.permute_pooled_embs_auto_grad_split.default)
def fbgemm_permute_pooled_embs_split(
    pooled_embs: jax.Array,
    offset_dim_list: jax.Array,
    permute_list: jax.Array,
    inv_offset_dim_list: jax.Array,
    inv_permute_list: jax.Array,
) -> jax.Array:
    """FBGEMM's :func:`permute_pooled_embs` (the inverse lists serve its backward)."""
    del inv_offset_dim_list, inv_permute_list
    return permute_pooled_embs(pooled_embs, offset_dim_list, permute_list)


class _PermuteSplit(torch.autograd.Function):
    """FBGEMM's autograd of ``permute_pooled_embs_auto_grad_split``: the backward is the same op
    with the forward's and the inverse lists swapped."""

    @staticmethod
    def forward(
        ctx: Any,
        pooled_embs: torch.Tensor,
        offset_dim_list: torch.Tensor,
        permute_list: torch.Tensor,
        inv_offset_dim_list: torch.Tensor,
        inv_permute_list: torch.Tensor,
    ) -> torch.Tensor:
        ctx.save_for_backward(offset_dim_list, permute_list, inv_offset_dim_list, inv_permute_list)
        with torch._C._AutoDispatchBelowAutograd():
            return _PERMUTE_SPLIT(pooled_embs, offset_dim_list, permute_list, inv_offset_dim_list, inv_permute_list)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        offset_dim_list, permute_list, inv_offset_dim_list, inv_permute_list = ctx.saved_tensors
        grad_in = _PERMUTE_SPLIT(grad, inv_offset_dim_list, inv_permute_list, offset_dim_list, permute_list)
        return grad_in, None, None, None, None


def _permute_split_autograd(
    pooled_embs: torch.Tensor,
    offset_dim_list: torch.Tensor,
    permute_list: torch.Tensor,
    inv_offset_dim_list: torch.Tensor,
    inv_permute_list: torch.Tensor,
) -> torch.Tensor:
    return cast(
        torch.Tensor,
        _PermuteSplit.apply(pooled_embs, offset_dim_list, permute_list, inv_offset_dim_list, inv_permute_list),
    )


_PERMUTE_SPLIT = torch.ops.fbgemm.permute_pooled_embs_auto_grad_split.default
_fbgemm_tpu = torch.library.Library("fbgemm", "IMPL")
_fbgemm_tpu.impl("permute_pooled_embs_auto_grad_split", _permute_split_autograd, "AutogradPrivateUse1")
