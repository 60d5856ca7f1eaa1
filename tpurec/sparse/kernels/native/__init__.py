"""Native XLA:CPU kernels of the sparse op set, registered with XLA's FFI.

Same signatures and semantics as :mod:`tpurec.sparse.kernels.reference`
(float32 tables only); threads own partitions ``id % P`` (docs/design.md, contract 4).
The kernels are ``tpurec/native/sparse_cpu.cc``, part of tpurec's one native
library (:mod:`tpurec.native`: built with g++ on first use and cached); KJT ->
CSR preprocessing in the same library is :mod:`tpurec.sparse.kernels.native.preprocess`.

SGD, Adagrad, row-wise Adagrad and Adam have their row math in C++; the gradient op of any
other update rule (:mod:`tpurec.sparse.update_rules`) is the reference's XLA kernel.

The gradient ops alias their table/slot outputs to the inputs
(``input_output_aliases``): only touched rows are written, and with the inputs
donated by the caller the update is in place (no table copy).

Environment: see :mod:`tpurec.native` (threads, compiler, ``-march=native``).

Example::

    from tpurec.sparse.kernels import native
    out = jax.jit(native.sparse_dense_matmul, static_argnames="batch_size")(rp, ids, samples, gains, table, batch_size=32)
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp

from tpurec.native import FFI_TARGETS, NativeBuildError, ensure_registered, library_path, load_library
from tpurec.sparse.kernels import reference
from tpurec.sparse.update_rules import RULES, bias_correction

__all__ = [
    "NativeBuildError",
    "TRACE_COUNTS",
    "library_path",
    "load_library",
    "sparse_dense_matmul",
    "sparse_dense_matmul_grad_with_sgd",
    "sparse_dense_matmul_grad_with_adagrad",
    "sparse_dense_matmul_grad_with_rowwise_adagrad",
    "sparse_dense_matmul_grad_with_adam",
]

_TARGETS = {
    symbol: FFI_TARGETS[symbol]
    for symbol in (
        "TpurecSparseDenseMatmul",
        "TpurecGradSgd",
        "TpurecGradAdagrad",
        "TpurecGradRowwiseAdagrad",
        "TpurecGradAdam",
    )
}

TRACE_COUNTS: collections.Counter = collections.Counter()
"""Kernel name -> times JAX traced it (a trace is a compilation)."""


def _csr(row_pointers, embedding_ids, sample_ids, gains):
    """The CSR operands, refusing (not casting) other dtypes: an int64 id of
    ``2**32 + 1`` cast to int32 would silently read row 1."""
    arrays = {"row_pointers": row_pointers, "embedding_ids": embedding_ids, "sample_ids": sample_ids, "gains": gains}
    out = []
    for (name, a), want in zip(arrays.items(), (jnp.int32, jnp.int32, jnp.int32, jnp.float32)):
        a = jnp.asarray(a)
        if a.dtype != want:
            raise TypeError(
                f"native kernels take {jnp.dtype(want)} {name}, got {a.dtype}; convert it after checking the values fit"
            )
        if a.ndim != 1:
            raise ValueError(f"native kernels take a 1-D {name}, got shape {a.shape}")
        out.append(a)
    return tuple(out)


def _check_f32(**arrays) -> None:
    for name, a in arrays.items():
        if jnp.result_type(a) != jnp.float32:
            raise TypeError(f"native kernels take float32 {name}, got {jnp.result_type(a)} (use the reference kernel)")


def sparse_dense_matmul(row_pointers, embedding_ids, sample_ids, gains, table, *, batch_size: int):
    """Pooled lookup ``out[s] = sum_i gains[i] * table[ids[i]]``; see the reference kernel.

    Returns:
        ``[batch_size, dim]`` float32.
    """
    TRACE_COUNTS["sparse_dense_matmul"] += 1
    ensure_registered()
    _check_f32(table=table)
    call = jax.ffi.ffi_call(
        _TARGETS["TpurecSparseDenseMatmul"], jax.ShapeDtypeStruct((batch_size, table.shape[1]), jnp.float32)
    )
    return call(*_csr(row_pointers, embedding_ids, sample_ids, gains), table)


def _grad(symbol, op_name, csr, grad_output, hyper, table, slots):
    TRACE_COUNTS[op_name] += 1
    ensure_registered()
    _check_f32(grad_output=grad_output, table=table, **{f"slot{i}": s for i, s in enumerate(slots)})
    # Scalars go in as one f32 operand, not as attributes: a new learning rate
    # (or Adam step) must not recompile. Each is rounded to f32 from the same
    # expression the reference uses, so both kernels see the same value.
    hyper = jnp.stack([jnp.asarray(h).astype(jnp.float32) for h in hyper])
    state = (table, *slots)
    first = 6  # operands: 4 CSR arrays, grad_output, hyper, then the state
    call = jax.ffi.ffi_call(
        _TARGETS[symbol],
        [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in state],
        input_output_aliases={first + i: i for i in range(len(state))},
    )
    out = call(*_csr(*csr), grad_output, hyper, *state)
    return tuple(out) if len(state) > 1 else out[0]


def sparse_dense_matmul_grad_with_sgd(
    row_pointers, embedding_ids, sample_ids, gains, grad_output, table, *, learning_rate
):
    """SGD on the touched rows: ``w -= lr * g``. Returns the updated table."""
    return _grad(
        "TpurecGradSgd",
        "sparse_dense_matmul_grad_with_sgd",
        (row_pointers, embedding_ids, sample_ids, gains),
        grad_output,
        [learning_rate],
        table,
        (),
    )


def sparse_dense_matmul_grad_with_adagrad(
    row_pointers, embedding_ids, sample_ids, gains, grad_output, table, accumulator, *, learning_rate, eps
):
    """Adagrad: ``m += g**2; w -= lr * g / (sqrt(m) + eps)``. Returns ``(table, accumulator)``."""
    return _grad(
        "TpurecGradAdagrad",
        "sparse_dense_matmul_grad_with_adagrad",
        (row_pointers, embedding_ids, sample_ids, gains),
        grad_output,
        [learning_rate, eps],
        table,
        (accumulator,),
    )


def sparse_dense_matmul_grad_with_rowwise_adagrad(
    row_pointers, embedding_ids, sample_ids, gains, grad_output, table, accumulator, *, learning_rate, eps, weight_decay
):
    """Row-wise Adagrad with L2 weight decay. Returns ``(table, accumulator)``, ``accumulator`` is ``[rows]``."""
    return _grad(
        "TpurecGradRowwiseAdagrad",
        "sparse_dense_matmul_grad_with_rowwise_adagrad",
        (row_pointers, embedding_ids, sample_ids, gains),
        grad_output,
        [learning_rate, eps, weight_decay],
        table,
        (accumulator,),
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
    """Lazy Adam on the touched rows (``step`` counts from 1). Returns ``(table, momentum1, momentum2)``."""
    hyper = [
        learning_rate,
        beta1,
        1.0 - beta1,
        beta2,
        1.0 - beta2,
        eps,
        weight_decay,
        bias_correction(beta1, step),
        bias_correction(beta2, step),  # as the reference computes them
    ]
    return _grad(
        "TpurecGradAdam",
        "sparse_dense_matmul_grad_with_adam",
        (row_pointers, embedding_ids, sample_ids, gains),
        grad_output,
        hyper,
        table,
        (momentum1, momentum2),
    )


def __getattr__(name: str):
    # Update rules without C++ row math: the reference's XLA kernel (same semantics).
    if name in RULES:
        return getattr(reference, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
