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
:func:`accumulator_dtype` and :mod:`tpurec.sparse.update_rules`).

The gradient ops ``sparse_dense_matmul_grad_with_<name>`` exist for every update rule
(:mod:`tpurec.sparse.update_rules`): the rows a batch touched get the rule's row math.

Example::

    out = sparse_dense_matmul(rp, ids, samples, gains, table, batch_size=32)
"""

from __future__ import annotations

import collections
from typing import Callable

import jax
import jax.numpy as jnp

from tpurec.sparse.types import PAD_ID
from tpurec.sparse.update_rules import RULES, UpdateRule, rule_of

__all__ = [
    "TRACE_COUNTS",
    "sparse_dense_matmul",
    "touched_rows_update",
    "accumulator_dtype",
    "make_grad_op",
    "grad_ops",
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


def _touched_rows(op_name, row_pointers, embedding_ids, sample_ids, gains, grad_output, table, slots, hyperparameters):
    ids, g = _row_gradients(row_pointers, embedding_ids, sample_ids, gains, grad_output, table)
    acc = g.dtype
    w = _gather(table, ids).astype(acc)
    # Optimizer state is kept (and read) in its own dtype: float32, as FBGEMM keeps momenta.
    gathered = [_gather(x, ids).astype(jnp.promote_types(x.dtype, acc)) for x in slots]
    new_w, *new_slots = rule_of(op_name).rows(g, w, *gathered, dtype=table.dtype, **hyperparameters)
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


def make_grad_op(rule: UpdateRule, body: Callable, module: str) -> Callable:
    """The entry point of ``rule``'s gradient op for a kernel module: the op's arguments
    (CSR, ``grad_output``, ``table``, the slots, the hyperparameters by keyword) passed to
    ``body(op_name, csr, grad_output, table, slots, hyperparameters)``."""
    hyper_names = frozenset(rule.hyperparameters)

    def grad_op(row_pointers, embedding_ids, sample_ids, gains, grad_output, table, *slots, **hyperparameters):
        if len(slots) != len(rule.slots) or set(hyperparameters) != hyper_names:
            raise TypeError(
                f"{rule.op_name} takes the slots {[s.argument for s in rule.slots]} and the hyperparameters "
                f"{list(rule.hyperparameters)}; got {len(slots)} slots and {sorted(hyperparameters)}"
            )
        csr = (row_pointers, embedding_ids, sample_ids, gains)
        return body(rule.op_name, csr, grad_output, table, slots, hyperparameters)

    grad_op.__name__ = grad_op.__qualname__ = rule.op_name
    grad_op.__module__ = module
    returns = f"``(table, {', '.join(s.argument for s in rule.slots)})``" if rule.slots else "the table"
    grad_op.__doc__ = f"{rule.summary}.\n\nReturns:\n    {returns} updated."
    return grad_op


def grad_ops(body: Callable, module: str) -> Callable[[str], Callable]:
    """A kernel module's ``__getattr__`` for its gradient ops: one entry point per registered
    rule (:mod:`tpurec.sparse.update_rules`), made on first use and kept."""
    made: dict[str, Callable] = {}

    def entry(name: str) -> Callable:
        fn = made.get(name)
        if fn is None:
            if name not in RULES:
                raise AttributeError(f"module {module!r} has no attribute {name!r}")
            fn = made[name] = make_grad_op(RULES[name], body, module)
        return fn

    return entry


__getattr__ = grad_ops(_grad_op, __name__)
