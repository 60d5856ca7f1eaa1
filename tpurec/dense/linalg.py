"""Matrix products: mm, addmm, bmm, baddbmm, dot, mv, addmv, addr, _addmm_activation.

Precision follows ``torch.get_float32_matmul_precision()`` (default "highest",
i.e. true float32), so a TPU does not silently drop to one bf16 pass. Low
precision inputs accumulate in float32 and round once, as torch does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from jax import lax

from tpurec.dense._util import cast, is_float
from tpurec.dense.registry import lower

aten = torch.ops.aten

_PRECISION = {"highest": lax.Precision.HIGHEST, "high": lax.Precision.HIGH, "medium": lax.Precision.DEFAULT}


def _acc(dtype) -> jnp.dtype:
    dt = jnp.dtype(dtype)
    if dt in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return jnp.dtype(jnp.float32)
    return dt


def matmul(a, b, rounded: bool = True):
    """``a @ b`` with torch's accumulation dtype and precision.

    ``rounded=False`` keeps the accumulation dtype (float32 for bf16/f16 inputs),
    for ops that add to the product before rounding once, as ATen's addmm does.
    """
    if a.dtype != b.dtype:
        raise TypeError(f"expected both operands to have the same dtype, got {a.dtype} and {b.dtype}")
    precision = _PRECISION.get(torch.get_float32_matmul_precision(), lax.Precision.HIGHEST)
    out = jnp.matmul(a, b, precision=precision, preferred_element_type=_acc(a.dtype))
    return out.astype(a.dtype) if rounded else out


def _scaled_add(x, prod, beta, alpha, dt=None):
    """beta * x + alpha * prod in dtype ``dt`` (default: prod's); beta == 0 ignores x entirely (NaNs included)."""
    dt = prod.dtype if dt is None else dt
    acc = _acc(dt)
    p = prod.astype(acc) * cast(alpha, acc)
    if not is_float(dt):
        return (cast(beta, acc) * x.astype(acc) + p).astype(dt)
    b = cast(beta, acc)
    scaled = jnp.where(b == 0, jnp.zeros((), acc), b * x.astype(acc))
    return (scaled + p).astype(dt)


@lower(aten.mm.default)
def mm(a, b):
    return matmul(a, b)


@lower(aten.bmm.default)
def bmm(a, b):
    return matmul(a, b)


@lower(aten.dot.default, aten.vdot.default)
def dot(a, b):
    return matmul(a, b)


@lower(aten.mv.default)
def mv(a, v):
    return matmul(a, v)


@lower(aten.addmm.default)
def addmm(x, a, b, *, beta=1, alpha=1):
    # One rounding of the bf16/f16 result, after the bias is added (as ATen/oneDNN).
    return _scaled_add(x, matmul(a, b, rounded=False), beta, alpha, a.dtype)


@lower(aten._addmm_activation.default)
def addmm_activation(x, a, b, *, beta=1, alpha=1, use_gelu: bool = False):
    y = addmm(x, a, b, beta=beta, alpha=alpha)
    if use_gelu:
        # torch's CPU kernel applies exact (erf) gelu; CUDA's cuBLASLt epilogue
        # uses tanh. We follow CPU, the reference these lowerings are tested on.
        return jax.nn.gelu(y.astype(_acc(y.dtype)), approximate=False).astype(y.dtype)
    return jnp.maximum(y, jnp.zeros((), y.dtype))


@lower(aten.baddbmm.default)
def baddbmm(x, a, b, *, beta=1, alpha=1):
    return _scaled_add(x, matmul(a, b), beta, alpha)


@lower(aten.addbmm.default)
def addbmm(x, a, b, *, beta=1, alpha=1):
    # One contraction over (batch, k), as torch does, not a sum of per-batch products.
    precision = _PRECISION.get(torch.get_float32_matmul_precision(), lax.Precision.HIGHEST)
    prod = jnp.einsum("bik,bkj->ij", a, b, precision=precision, preferred_element_type=_acc(a.dtype)).astype(a.dtype)
    return _scaled_add(x, prod, beta, alpha)


@lower(aten.addmv.default)
def addmv(x, a, v, *, beta=1, alpha=1):
    return _scaled_add(x, matmul(a, v), beta, alpha)


@lower(aten.addr.default)
def addr(x, v1, v2, *, beta=1, alpha=1):
    prod = v1[:, None] * v2[None, :]
    if prod.dtype == jnp.bool_:
        # torch: bool addr is (beta and x) or (alpha and outer)
        return jnp.logical_or(jnp.logical_and(cast(beta, bool), x), jnp.logical_and(cast(alpha, bool), prod))
    return _scaled_add(x, prod, beta, alpha)
