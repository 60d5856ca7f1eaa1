"""JAX reference kernels of the SparseCore op set.

Every function takes the SparseCore CSR arrays (see :mod:`tpurec.sparse.types`)
and follows the lowering-table convention of :mod:`tpurec.dense.registry`:
``float`` hyperparameters may arrive as traced scalars (so a new learning rate
never recompiles), ints (``batch_size``) are static.

Validity of an entry comes from the row pointers (entry ``i`` of partition
``p`` is valid when ``i < row_pointers[p]``) and from the id not being the pad
id, so buffers from jax-tpu-embedding (garbage past the row pointers) work too.

Tables may be float16 or bfloat16 (FBGEMM's ``weights_precision``): rows are
gathered in the table's dtype and everything else (pooling, gradients, optimizer
state and math) is float32, as in FBGEMM's CPU kernels; only the new weights are
rounded back (to nearest even), in the order FBGEMM's CPU kernels round them (see
:func:`accumulator_dtype` and the optimizer row functions).

Example::

    out = sparse_dense_matmul(rp, ids, samples, gains, table, batch_size=32)
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp

from tpurec.sparse.types import PAD_ID

__all__ = [
    "TRACE_COUNTS",
    "sparse_dense_matmul",
    "sparse_dense_matmul_grad_with_sgd",
    "sparse_dense_matmul_grad_with_adagrad",
    "sparse_dense_matmul_grad_with_rowwise_adagrad",
    "sparse_dense_matmul_grad_with_adam",
    "touched_rows_update",
    "OPTIMIZER_ROWS",
    "accumulator_dtype",
]

TRACE_COUNTS: collections.Counter = collections.Counter()
"""Kernel name -> times JAX traced it (a trace is a compilation)."""


def accumulator_dtype(table_dtype) -> jnp.dtype:
    """The dtype a table of ``table_dtype`` is pooled, differentiated and updated in.

    float32 for float16/bfloat16/float32 tables (FBGEMM's ``at::acc_type``), float64
    for float64 ones. It is also the dtype of the pooled output.
    """
    return jnp.promote_types(table_dtype, jnp.float32)


def _valid(row_pointers: jax.Array, embedding_ids: jax.Array) -> jax.Array:
    num_partitions = row_pointers.shape[0]
    size = embedding_ids.shape[0] // num_partitions
    # Partition p holds entries [p * size, row_pointers[p]).
    position = (
        jnp.arange(size, dtype=jnp.int32)[None, :] + (jnp.arange(num_partitions, dtype=jnp.int32) * size)[:, None]
    )
    valid = position < row_pointers[:, None]
    return valid.reshape(-1) & (embedding_ids != PAD_ID)


def sparse_dense_matmul(row_pointers, embedding_ids, sample_ids, gains, table, *, batch_size: int):
    """Pooled lookup: ``out[s] = sum_i gains[i] * table[ids[i]]`` over entries of sample ``s``.

    Args:
        row_pointers, embedding_ids, sample_ids, gains: the CSR input.
        table: ``[rows, dim]``.
        batch_size: output rows (all feature slots of the stack times the batch).

    Returns:
        ``[batch_size, dim]`` in :func:`accumulator_dtype` (float32 for float16 and
        bfloat16 tables: FBGEMM's default ``output_dtype``).
    """
    TRACE_COUNTS["sparse_dense_matmul"] += 1
    acc = accumulator_dtype(table.dtype)
    valid = _valid(row_pointers, embedding_ids)
    # Gather in the table's dtype (half the bytes), widen, then pool in float32.
    rows = jnp.take(table, jnp.where(valid, embedding_ids, 0), axis=0).astype(acc)
    weighted = rows * jnp.where(valid, gains, 0).astype(acc)[:, None]
    segments = jnp.where(valid, sample_ids, batch_size)
    return jax.ops.segment_sum(weighted, segments, num_segments=batch_size + 1)[:batch_size]


def _row_gradients(row_pointers, embedding_ids, sample_ids, gains, grad_output, table):
    """Per touched row: (row ids padded with PAD_ID, summed gradient rows in the
    table's accumulator dtype)."""
    acc = accumulator_dtype(table.dtype)
    grad_output = grad_output.astype(jnp.promote_types(grad_output.dtype, acc))
    n = embedding_ids.shape[0]
    valid = _valid(row_pointers, embedding_ids)
    if grad_output.shape[0] == 0:
        # An empty batch has no output rows, so no entry can carry a gradient.
        valid = jnp.zeros_like(valid)
        grads = jnp.zeros((n, grad_output.shape[1]), grad_output.dtype)
    else:
        grads = jnp.take(grad_output, jnp.where(valid, sample_ids, 0), axis=0)
        grads = grads * jnp.where(valid, gains, 0).astype(grad_output.dtype)[:, None]
    ids = jnp.where(valid, embedding_ids, PAD_ID)
    # Sort-based unique, so the kernel does not depend on the input order.
    unique_ids, inverse = jnp.unique(ids, size=n, fill_value=PAD_ID, return_inverse=True)
    row_grads = jax.ops.segment_sum(grads, inverse.reshape(-1), num_segments=n)
    return unique_ids, row_grads.astype(acc)


def _gather(x, unique_ids):
    # Pad ids are out of range: clip for the gather, the scatter drops them.
    return jnp.take(x, jnp.minimum(unique_ids, x.shape[0] - 1), axis=0)


def _scatter(x, unique_ids, rows):
    return x.at[unique_ids].set(rows.astype(x.dtype), mode="drop")


def _round_update(update, w, dtype):
    """``update`` as FBGEMM's CPU kernels apply it to a ``dtype`` weight with ``w -= update``.

    The right-hand side is converted to the weight's type before the subtraction
    (C++ ``at::Half -= float``), so a float16 weight sees the update rounded to float16
    first; for a float32 weight both casts are exact.
    """
    return w - update.astype(dtype).astype(w.dtype)


def _sgd_rows(g, w, *, learning_rate, dtype):
    return (_round_update(learning_rate * g, w, dtype).astype(dtype),)


def _adagrad_rows(g, w, m, *, learning_rate, eps, dtype):
    m = m + g * g
    return _round_update(learning_rate * g / (jnp.sqrt(m) + eps), w, dtype).astype(dtype), m


def _rowwise_adagrad_rows(g, w, m, *, learning_rate, eps, weight_decay, dtype):
    # FBGEMM's form (L2 weight decay): the decay enters the accumulator through the
    # gradient and the weight through a correction factor, and the new weight is one
    # float32 expression rounded once to the table's dtype.
    decayed = g + weight_decay * w
    # keepdims/reshape: ``m`` is ``[n]`` here and ``[n, 1]`` in the TensorCore kernel's blocks.
    m = m + jnp.mean(decayed * decayed, axis=1, keepdims=True).reshape(m.shape)
    multiplier = (learning_rate / (jnp.sqrt(m) + eps)).reshape(-1, 1)
    correction = 1.0 - multiplier * weight_decay
    return (correction * w - g * multiplier).astype(dtype), m


def _adam_rows(g, w, m1, m2, *, learning_rate, beta1, beta2, eps, weight_decay, step, dtype):
    m1 = beta1 * m1 + (1.0 - beta1) * g
    m2 = beta2 * m2 + (1.0 - beta2) * g * g
    m1_hat = m1 / (1.0 - beta1**step)
    m2_hat = m2 / (1.0 - beta2**step)
    return (w - learning_rate * (m1_hat / (jnp.sqrt(m2_hat) + eps) + weight_decay * w)).astype(dtype), m1, m2


OPTIMIZER_ROWS = {
    "sparse_dense_matmul_grad_with_sgd": _sgd_rows,
    "sparse_dense_matmul_grad_with_adagrad": _adagrad_rows,
    "sparse_dense_matmul_grad_with_rowwise_adagrad": _rowwise_adagrad_rows,
    "sparse_dense_matmul_grad_with_adam": _adam_rows,
}
"""Gradient op name -> the optimizer on gathered rows: ``(g, w, *slots, dtype=, **hp) -> (w, *slots)``.

``g``, ``w`` and the slots are in the accumulator dtype; the new ``w`` comes back in
``dtype`` (the table's), the slots in theirs.
"""


def _touched_rows(op_name, row_pointers, embedding_ids, sample_ids, gains, grad_output, table, slots, hyperparameters):
    ids, g = _row_gradients(row_pointers, embedding_ids, sample_ids, gains, grad_output, table)
    acc = g.dtype
    w = _gather(table, ids).astype(acc)
    # Optimizer state is kept (and read) in its own dtype: float32, as FBGEMM keeps momenta.
    gathered = [_gather(x, ids).astype(jnp.promote_types(x.dtype, acc)) for x in slots]
    new_w, *new_slots = OPTIMIZER_ROWS[op_name](g, w, *gathered, dtype=table.dtype, **hyperparameters)
    return ids, (new_w, *(r.astype(x.dtype) for r, x in zip(new_slots, slots)))


def touched_rows_update(
    row_pointers, embedding_ids, sample_ids, gains, grad_output, table, *slots, op_name: str, **hyperparameters
):
    """The optimizer step on the touched rows only, without the scatter.

    For callers that update the table in place (the CPU path of the modules):
    same math as gradient op ``op_name``.

    Returns:
        ``(row_ids, new_table_rows, *new_slot_rows)``; unused entries of
        ``row_ids`` are ``PAD_ID``.
    """
    TRACE_COUNTS[f"touched_rows_update/{op_name}"] += 1
    ids, rows = _touched_rows(
        op_name, row_pointers, embedding_ids, sample_ids, gains, grad_output, table, slots, hyperparameters
    )
    return (ids, *rows)


def _grad_op(op_name, csr, grad_output, table, slots, hyperparameters):
    TRACE_COUNTS[op_name] += 1
    ids, rows = _touched_rows(op_name, *csr, grad_output, table, slots, hyperparameters)
    out = tuple(_scatter(x, ids, r) for x, r in zip((table, *slots), rows))
    return out if len(out) > 1 else out[0]


def sparse_dense_matmul_grad_with_sgd(
    row_pointers, embedding_ids, sample_ids, gains, grad_output, table, *, learning_rate
):
    """SGD on the touched rows (FBGEMM EXACT_SGD): ``w -= lr * g``.

    Returns:
        The updated table.
    """
    return _grad_op(
        "sparse_dense_matmul_grad_with_sgd",
        (row_pointers, embedding_ids, sample_ids, gains),
        grad_output,
        table,
        (),
        {"learning_rate": learning_rate},
    )


def sparse_dense_matmul_grad_with_adagrad(
    row_pointers, embedding_ids, sample_ids, gains, grad_output, table, accumulator, *, learning_rate, eps
):
    """Adagrad (FBGEMM EXACT_ADAGRAD): ``m += g**2; w -= lr * g / (sqrt(m) + eps)``.

    Returns:
        ``(table, accumulator)`` updated.
    """
    return _grad_op(
        "sparse_dense_matmul_grad_with_adagrad",
        (row_pointers, embedding_ids, sample_ids, gains),
        grad_output,
        table,
        (accumulator,),
        {"learning_rate": learning_rate, "eps": eps},
    )


def sparse_dense_matmul_grad_with_rowwise_adagrad(
    row_pointers, embedding_ids, sample_ids, gains, grad_output, table, accumulator, *, learning_rate, eps, weight_decay
):
    """Row-wise Adagrad (FBGEMM EXACT_ROWWISE_ADAGRAD, L2 weight decay).

    ``g += wd * w; m += mean(g**2); w -= lr * g / (sqrt(m) + eps)`` with one
    accumulator value per row.

    Returns:
        ``(table, accumulator)`` updated; ``accumulator`` is ``[rows]``.
    """
    return _grad_op(
        "sparse_dense_matmul_grad_with_rowwise_adagrad",
        (row_pointers, embedding_ids, sample_ids, gains),
        grad_output,
        table,
        (accumulator,),
        {"learning_rate": learning_rate, "eps": eps, "weight_decay": weight_decay},
    )


def sparse_dense_matmul_grad_with_adam(
    row_pointers,
    embedding_ids,
    sample_ids,
    gains,
    grad_output,
    table,
    momentum1,
    momentum2,
    *,
    learning_rate,
    beta1,
    beta2,
    eps,
    weight_decay,
    step,
):
    """Lazy Adam on the touched rows (FBGEMM ADAM; ``step`` counts from 1).

    ``m1 = b1 m1 + (1-b1) g; m2 = b2 m2 + (1-b2) g**2;
    w -= lr * (m1/(1-b1**t) / (sqrt(m2/(1-b2**t)) + eps) + wd * w)``.

    Returns:
        ``(table, momentum1, momentum2)`` updated.
    """
    return _grad_op(
        "sparse_dense_matmul_grad_with_adam",
        (row_pointers, embedding_ids, sample_ids, gains),
        grad_output,
        table,
        (momentum1, momentum2),
        {
            "learning_rate": learning_rate,
            "beta1": beta1,
            "beta2": beta2,
            "eps": eps,
            "weight_decay": weight_decay,
            "step": step,
        },
    )
