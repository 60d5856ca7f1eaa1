"""Helpers shared by the lowering families: torch type promotion, dims, casts.

Type promotion is delegated to ``torch._prims_common.elementwise_dtypes`` so
that the lowerings follow PyTorch's rules exactly (0-dim tensors and Python
scalars rank below dimensioned tensors, int/int division gives float, bf16
computes in float32). The JAX operands are described to torch as tiny meta
tensors; a *weakly typed* 0-dim JAX value is how a ``Scalar`` schema argument
arrives (registry.py), so it is described as a Python number.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND as Kind
from torch._prims_common import elementwise_dtypes

from tpurec.dense.registry import to_jax_dtype, to_torch_dtype

__all__ = [
    "Kind",
    "is_weak_scalar",
    "promote",
    "cast",
    "dims",
    "norm_dim",
    "jdtype",
    "is_float",
    "default_float",
    "float_for",
]

DEFAULT = Kind.DEFAULT
INT_TO_FLOAT = Kind.INT_TO_FLOAT
ALWAYS_BOOL = Kind.ALWAYS_BOOL


def is_weak_scalar(x: Any) -> bool:
    """True for a traced/weak 0-dim JAX value: a ``Scalar`` schema argument."""
    if isinstance(x, (bool, int, float, complex)):
        return True
    aval = getattr(x, "aval", None)
    weak = aval.weak_type if aval is not None else getattr(x, "weak_type", False)
    return bool(weak) and jnp.ndim(x) == 0


def _describe(x: Any):
    """``x`` as torch's promotion logic sees it: a Python number or a meta tensor."""
    if isinstance(x, (bool, int, float, complex)):
        return x
    dt = jnp.dtype(x.dtype)
    if is_weak_scalar(x):
        return {"b": False, "i": 0, "u": 0, "f": 0.0, "c": 0j}[dt.kind]
    shape = () if jnp.ndim(x) == 0 else (1,)
    return torch.empty(shape, dtype=to_torch_dtype(dt), device="meta")


def promote(*operands: Any, kind: Kind = DEFAULT) -> tuple[jnp.dtype, jnp.dtype]:
    """(computation dtype, result dtype) of an elementwise op, as torch decides."""
    described = [_describe(x) for x in operands if x is not None]
    comp, res = elementwise_dtypes(*described, type_promotion_kind=kind)
    return to_jax_dtype(comp), to_jax_dtype(res)


def cast(x: Any, dtype) -> jax.Array:
    """``x`` (array or scalar) as a ``dtype`` array."""
    return jnp.asarray(x, dtype=dtype)


def jdtype(dtype: torch.dtype | None, fallback=None):
    """The JAX dtype for an optional torch dtype argument."""
    if dtype is None:
        return fallback
    return to_jax_dtype(dtype)


def acc_dtype(dtype) -> jnp.dtype:
    """The dtype torch accumulates ``dtype`` in: float32 for bfloat16/float16, else itself."""
    dt = jnp.dtype(dtype)
    if dt in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return jnp.dtype(jnp.float32)
    return dt


def is_float(dtype) -> bool:
    return jnp.issubdtype(jnp.dtype(dtype), jnp.inexact)


def is_int_or_bool(dtype) -> bool:
    return not is_float(dtype)


def default_float() -> jnp.dtype:
    return to_jax_dtype(torch.get_default_dtype())


def float_for(dtype) -> jnp.dtype:
    """The floating dtype torch uses for ``dtype`` in int->float promotion."""
    return jnp.dtype(dtype) if is_float(dtype) else default_float()


def norm_dim(d: int, ndim: int) -> int:
    """A possibly-negative dim as a non-negative one (0-dim tensors accept -1/0)."""
    n = max(ndim, 1)
    if not -n <= d < n:
        raise IndexError(f"dim {d} out of range for a {ndim}-d tensor")
    return d % n if ndim else 0


def dims(dim: int | Sequence[int] | None, ndim: int) -> tuple[int, ...]:
    """Reduction dims: None or [] means all of them (torch's convention)."""
    if dim is None:
        return tuple(range(ndim))
    if isinstance(dim, int):
        dim = [dim]
    if len(dim) == 0:
        return tuple(range(ndim))
    if ndim == 0:
        for d in dim:
            norm_dim(d, 0)
        return ()
    return tuple(sorted({norm_dim(d, ndim) for d in dim}))


def np_dtype(x) -> np.dtype:
    return np.dtype(jnp.dtype(x.dtype))
