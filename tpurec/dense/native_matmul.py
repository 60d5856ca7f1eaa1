"""Batched products of small matrices on XLA:CPU through tpurec's native kernel.

XLA:CPU computes a batch of many small products (DLRM's pairwise interaction,
``bmm(x, x.transpose(1, 2))`` with ``x`` of ``[4096, 27, 64]``) one small GEMM
at a time: 41 ms for that forward product on 2 cores, 29 ms for one of its
backward products, where PyTorch's CPU kernel takes 7 to 10 ms.
``tpurec/native/matmul_cpu.cc`` computes the whole batch in one call (about
8 ms each), with either operand transposed.

The kernel is the CPU branch of ``lax.platform_dependent``, so a program
exported for another platform keeps XLA's dot. It serves float32 batches of
small matrices on one device; everything else (other dtypes, large matrices,
programs XLA partitions over a mesh) keeps XLA's dot. A transposed operand that
came from reading a transposed view is passed untransposed, with the kernel's
transpose flag, instead of being copied first; and the transpose of a product
(autograd's gradient for a transposed operand) is computed as the product of
the swapped operands, not copied. ``TPUREC_NATIVE_MATMUL=0`` turns
the kernel off (programs traced afterwards use XLA's dot).

Example::

    from tpurec.dense import native_matmul
    y = jax.jit(lambda x: native_matmul.bmm(x, jnp.swapaxes(x, 1, 2), jnp.matmul))(x)  # x: float32 [4096, 27, 64]
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from tpurec import config, native
from tpurec.dense.trace_context import remember_transposer, tracing_spmd, transposed_from

__all__ = ["applies", "batched_matmul", "bmm"]

# Products up to this size per batch element: above it XLA's blocked GEMM wins
# (the kernel keeps one K x N panel per element and does not block over K).
_MAX_PANEL = 64 * 1024  # floats of op(b), K * N
_MAX_ROWS = 1024  # rows of op(a), M


def applies(a, b) -> bool:
    """True when ``bmm(a, b)`` should use the native kernel in the program being traced."""
    if a.ndim != 3 or b.ndim != 3 or a.dtype != jnp.float32 or b.dtype != jnp.float32:
        return False
    batch, m, k = a.shape
    if b.shape[0] != batch or b.shape[1] != k:
        return False
    if k * b.shape[2] > _MAX_PANEL or m > _MAX_ROWS:
        return False
    if not config.get("TPUREC_NATIVE_MATMUL"):
        return False
    return jax.default_backend() == "cpu" and not tracing_spmd()


def _untransposed(x) -> tuple[jax.Array, bool]:
    """``(source, True)`` when ``x`` is ``source`` with its two minor dims swapped, else ``(x, False)``."""
    found = transposed_from(x)
    if found is not None and found[1] == (0, 2, 1):
        return found[0], True
    return x, False


def bmm(a, b, xla_matmul: Callable):
    """``a @ b`` for ``[B, M, K] @ [B, K, N]`` float32 (see :func:`applies`).

    Args:
        a, b: the operands.
        xla_matmul: the lowering's own product (XLA's dot), for the other platforms.
    """
    a, trans_a = _untransposed(a)
    b, trans_b = _untransposed(b)
    return _product(a, b, trans_a, trans_b, xla_matmul)


def _product(a, b, trans_a: bool, trans_b: bool, xla_matmul: Callable):
    def native(a, b):
        return batched_matmul(a, b, trans_a, trans_b)

    def xla(a, b):
        return xla_matmul(jnp.swapaxes(a, 1, 2) if trans_a else a, jnp.swapaxes(b, 1, 2) if trans_b else b)

    out = lax.platform_dependent(a, b, cpu=native, default=xla)
    # (op(a) op(b))^T = op(b)^T op(a)^T: one more product instead of a strided copy.
    remember_transposer(
        out, lambda perm: _product(b, a, not trans_b, not trans_a, xla_matmul) if perm == (0, 2, 1) else None
    )
    return out


def _call(a, b, trans_a: bool, trans_b: bool):
    native.ensure_registered()
    m = a.shape[2] if trans_a else a.shape[1]
    n = b.shape[1] if trans_b else b.shape[2]
    out = jax.ShapeDtypeStruct((a.shape[0], m, n), jnp.float32)
    return jax.ffi.ffi_call(native.FFI_TARGETS["TpurecBatchedMatmul"], out)(a, b, trans_a=trans_a, trans_b=trans_b)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def batched_matmul(a, b, trans_a: bool = False, trans_b: bool = False):
    """``op(a) @ op(b)`` per batch element, ``op(x)`` being ``x`` or its transpose (minor two dims).

    Args:
        a: float32 ``[B, M, K]`` (``[B, K, M]`` with ``trans_a``).
        b: float32 ``[B, K, N]`` (``[B, N, K]`` with ``trans_b``).
        trans_a: read ``a`` transposed.
        trans_b: read ``b`` transposed.

    Returns:
        float32 ``[B, M, N]``, computed by the native XLA:CPU kernel.
    """
    return _call(a, b, trans_a, trans_b)


def _forward(a, b, trans_a, trans_b):
    return _call(a, b, trans_a, trans_b), (a, b)


def _backward(trans_a, trans_b, saved, grad):
    a, b = saved
    # c = op(a) @ op(b): d op(a) = grad @ op(b)^T, d op(b) = op(a)^T @ grad, each
    # written as one kernel call with the transposes as flags.
    grad_a = _call(b, grad, trans_b, True) if trans_a else _call(grad, b, False, not trans_b)
    grad_b = _call(grad, a, True, trans_a) if trans_b else _call(a, grad, not trans_a, False)
    return grad_a, grad_b


batched_matmul.defvjp(_forward, _backward)
