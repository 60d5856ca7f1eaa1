"""Arguments that PyTorch requires to share one dtype, for ops whose lowering would promote.

JAX promotes mixed operands where PyTorch's CPU (and CUDA) kernels refuse them, and for several
of these ops PyTorch's meta kernel does not check either (``addmm``, ``index_add``,
``index_put``...), so the meta shapes the dispatcher computes cannot catch them. The dispatcher
runs :func:`check` when it builds a program; the program cache is keyed by dtypes, so a cached
op pays nothing.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten

# overload -> (names of the tensor arguments that must share a dtype, what the op is called in
# the error). Optional arguments that are None take no part.
SAME_DTYPE: dict = {
    aten.mm.default: (("self", "mat2"), "mm"),
    aten.bmm.default: (("self", "mat2"), "bmm"),
    aten.mv.default: (("self", "vec"), "mv"),
    aten.dot.default: (("self", "tensor"), "dot"),
    aten.addmm.default: (("self", "mat1", "mat2"), "addmm"),
    aten.addbmm.default: (("self", "batch1", "batch2"), "addbmm"),
    aten.baddbmm.default: (("self", "batch1", "batch2"), "baddbmm"),
    aten.addmv.default: (("self", "mat", "vec"), "addmv"),
    aten.scatter.src: (("self", "src"), "scatter()"),
    aten.scatter.reduce: (("self", "src"), "scatter()"),
    aten.scatter_add.default: (("self", "src"), "scatter_add()"),
    aten.scatter_reduce.two: (("self", "src"), "scatter_reduce()"),
    aten.index_add.default: (("self", "source"), "index_add_()"),
    aten.index_copy.default: (("self", "source"), "index_copy_()"),
    aten.index_put.default: (("self", "values"), "index_put_()"),
    aten.put.default: (("self", "source"), "put_()"),
    aten.masked_scatter.default: (("self", "source"), "masked_scatter()"),
    # CPU and CUDA refuse a weight of another dtype than the input (the bias may differ).
    aten.convolution.default: (("input", "weight"), "convolution"),
    aten.lerp.Tensor: (("self", "end", "weight"), "lerp()"),
    aten.lerp.Scalar: (("self", "end"), "lerp()"),
}

_POSITIONS: dict = {}


def check(func, args: tuple, kwargs: dict) -> None:
    """Raises PyTorch's kind of error (RuntimeError) where ``func`` would get mixed dtypes."""
    rule = SAME_DTYPE.get(func)
    if rule is None:
        return
    names, op = rule
    positions = _POSITIONS.get(func)
    if positions is None:
        schema = [a.name for a in func._schema.arguments]
        positions = _POSITIONS[func] = [schema.index(n) for n in names]
    found = []
    for name, i in zip(names, positions):
        value = args[i] if i < len(args) else kwargs.get(name)
        if isinstance(value, torch.Tensor):
            found.append((name, value.dtype))
    if len({d for _, d in found}) > 1:
        got = ", ".join(f"{n} {str(d).removeprefix('torch.')}" for n, d in found)
        raise RuntimeError(f"{op}: expected {', '.join(n for n, _ in found)} to have the same dtype, but got {got}")
