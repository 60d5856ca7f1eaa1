"""Grouped matrix products: ``aten::_grouped_mm`` (Mixture-of-Experts layers).

A 2D operand is cut into groups along one dimension by ``offs`` (int32 group
ends); ``offs`` is data, so every layout is one ragged dot of static shape
(``lax.ragged_dot_general``: XLA's ragged-dot instruction on TPU and GPU, a
masked dense product on CPU) and new routings never recompile.

=========================  ==========  =========================================
mat_a x mat_b              offs cuts   out
=========================  ==========  =========================================
[M, K] x [G, K, N]         M (rows)    [M, N]; rows past offs[-1] are zero
[G, M, K] x [K, N]         N (cols)    [M, N]; columns past offs[-1] are zero
[M, K] x [K, N]            K           [G, M, N]; group g sums k in its range
[G, M, K] x [G, K, N]      (none)      [G, M, N] (a batched product)
=========================  ==========  =========================================

PyTorch's kernels leave the rows past ``offs[-1]`` uninitialised; zeros are
one valid value for them, and the one ragged dot gives. The backward is
PyTorch's own formula (more ``_grouped_mm`` calls on transposed operands),
which lands on the layouts above.

Dtypes are those of PyTorch's CPU kernel (float32, bfloat16, float16, both
operands alike); low precision accumulates in float32 and rounds once.
``out_dtype`` may be the input dtype or, for bfloat16/float16 inputs, float32
(``torch.nn.functional.grouped_mm`` documents it as keeping the float32
accumulation). Precision follows ``torch.get_float32_matmul_precision()``.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch
from jax import lax

from tpurec.dense._util import acc_dtype
from tpurec.dense.registry import lower, to_jax_dtype, to_torch_dtype

aten = torch.ops.aten

__all__ = ["grouped_mm", "grouped_mm_output", "register_fake_rule"]

_PRECISION = {"highest": lax.Precision.HIGHEST, "high": lax.Precision.HIGH, "medium": lax.Precision.DEFAULT}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"_grouped_mm: {message}")


def grouped_mm_output(
    a_shape,
    b_shape,
    a_dtype: torch.dtype,
    b_dtype: torch.dtype,
    has_offs: bool,
    offs_shape,
    offs_dtype,
    has_bias: bool,
    out_dtype: torch.dtype | None,
) -> tuple[tuple[int, ...], torch.dtype]:
    """(shape, dtype) of ``_grouped_mm``'s result on the tpu device, or a ``ValueError``/``NotImplementedError``.

    One rule set for the lowering and the fake-tensor rule (torch.compile), so
    both accept exactly the same calls. Strides do not matter here: the
    16-byte alignment CUDA's kernel needs has no counterpart in XLA.
    """
    if a_dtype not in _DTYPES or b_dtype != a_dtype:
        raise NotImplementedError(
            f"_grouped_mm on the tpu device takes two float32, bfloat16 or float16 operands of one dtype, "
            f"got {a_dtype} and {b_dtype}"
        )
    if has_bias:
        raise NotImplementedError(
            "_grouped_mm with bias is not supported (nor by PyTorch's kernels); add it to the result"
        )
    if out_dtype is not None and out_dtype != a_dtype and not (out_dtype == torch.float32 and a_dtype != torch.float32):
        raise NotImplementedError(
            f"_grouped_mm on the tpu device: out_dtype {out_dtype} with {a_dtype} operands is not supported "
            f"(out_dtype may be {a_dtype}" + (" or torch.float32)" if a_dtype != torch.float32 else ")")
        )
    a2, b2 = len(a_shape) == 2, len(b_shape) == 2
    _check(
        len(a_shape) in (2, 3) and len(b_shape) in (2, 3),
        f"multiplicands must be 2D or 3D, got {len(a_shape)}D and {len(b_shape)}D",
    )
    if not (a2 and b2):
        _check(
            a_shape[-1] == b_shape[-2],
            f"contraction dimension of mat_a and mat_b must match, got {tuple(a_shape)} and {tuple(b_shape)}",
        )
    if a2 or b2:
        _check(has_offs, f"offs is needed for {len(a_shape)}D/{len(b_shape)}D multiplicands")
        _check(
            len(offs_shape) == 1 and offs_dtype == torch.int32,
            f"offs must be a 1D int32 tensor, got {len(offs_shape)}D {offs_dtype}",
        )
    else:
        _check(not has_offs, "offs is not needed for 3D/3D multiplicands")
    groups = offs_shape[0] if has_offs else None
    if a2 and b2:
        _check(
            a_shape[1] == b_shape[0],
            f"contraction dimension of mat_a and mat_b must match, got {tuple(a_shape)} and {tuple(b_shape)}",
        )
        shape = (groups, a_shape[0], b_shape[1])
    elif a2:
        _check(groups == b_shape[0], f"offs has {groups} groups but mat_b has {b_shape[0]} matrices")
        shape = (a_shape[0], b_shape[2])
    elif b2:
        _check(groups == a_shape[0], f"offs has {groups} groups but mat_a has {a_shape[0]} matrices")
        shape = (a_shape[1], b_shape[1])
    else:
        _check(a_shape[0] == b_shape[0], f"batched dimension has to match, got {a_shape[0]} and {b_shape[0]}")
        shape = (a_shape[0], a_shape[1], b_shape[2])
    return tuple(int(n) for n in shape), (out_dtype or a_dtype)


@lower(aten._grouped_mm.default)
def grouped_mm(a, b, offs=None, bias=None, out_dtype=None):
    _, dtype = grouped_mm_output(
        a.shape,
        b.shape,
        to_torch_dtype(a.dtype),
        to_torch_dtype(b.dtype),
        offs is not None,
        () if offs is None else offs.shape,
        None if offs is None else to_torch_dtype(offs.dtype),
        bias is not None,
        out_dtype,
    )
    acc = acc_dtype(a.dtype)
    precision = _PRECISION.get(torch.get_float32_matmul_precision(), lax.Precision.HIGHEST)
    if offs is None:
        out = lax.dot_general(a, b, (((2,), (1,)), ((0,), (0,))), precision=precision, preferred_element_type=acc)
        return out.astype(to_jax_dtype(dtype))
    # offs holds group ends; the ragged dot wants sizes. The first group starts at 0.
    sizes = jnp.diff(offs, prepend=jnp.zeros((1,), offs.dtype))

    def ragged(lhs, rhs, contract, lhs_ragged, rhs_group):
        numbers = lax.RaggedDotDimensionNumbers((contract, ((), ())), lhs_ragged, rhs_group)

        def dot(x, y):
            return lax.ragged_dot_general(x, y, sizes, numbers, precision=precision, preferred_element_type=acc)

        if jnp.dtype(lhs.dtype) == acc:
            return dot(lhs, rhs)
        # XLA:CPU's dot thunk has no bf16 x bf16 -> f32 kernel for some of these dimension
        # numbers; widening first is exact (bf16 products fit in f32) and leaves TPU/GPU on bf16.
        return lax.platform_dependent(lhs, rhs, cpu=lambda x, y: dot(x.astype(acc), y.astype(acc)), default=dot)

    if a.ndim == 2 and b.ndim == 3:
        # [M, K] rows in groups, each times its [K, N].
        out = ragged(a, b, ((1,), (1,)), (0,), (0,))
    elif a.ndim == 3 and b.ndim == 2:
        # The columns of [K, N] are grouped: as the ragged operand, mat_b gives [N, M], transposed back.
        out = ragged(b, a, ((0,), (2,)), (1,), (0,)).T
    else:
        # The contraction is grouped: one [M, N] partial product per group (a weight gradient).
        out = ragged(a, b, ((1,), (0,)), (1,), ())
    return out.astype(to_jax_dtype(dtype))


_fake_rule_registered = False


def register_fake_rule() -> None:
    """Lets torch.compile trace ``_grouped_mm`` on tpu tensors by the rules above.

    PyTorch's meta kernel states CUDA's limits (bfloat16 only, 16-byte aligned
    strides), so fake-tensor tracing refused float32 MoE layers that run eagerly.
    The rule answers only for tpu tensors; every other device keeps the meta kernel.
    """
    global _fake_rule_registered
    if _fake_rule_registered:
        return
    _fake_rule_registered = True
    from torch._subclasses import fake_impls

    op = aten._grouped_mm.default

    @fake_impls.register_op_impl(lambda func: func is op)
    def _grouped_mm_fake(fake_mode, func, *args, **kwargs):
        bound = dict(zip((a.name for a in func._schema.arguments), args))
        bound.update(kwargs)
        a, b, offs = bound["self"], bound["mat2"], bound.get("offs")
        if a.device.type != "tpu":
            return NotImplemented
        try:
            shape, dtype = grouped_mm_output(
                a.shape,
                b.shape,
                a.dtype,
                b.dtype,
                offs is not None,
                () if offs is None else offs.shape,
                None if offs is None else offs.dtype,
                bound.get("bias") is not None,
                bound.get("out_dtype"),
            )
        except ValueError as error:
            raise RuntimeError(str(error)) from None
        with fake_mode:
            return torch.empty(shape, dtype=dtype, device=a.device)
