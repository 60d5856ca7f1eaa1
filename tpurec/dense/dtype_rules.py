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
    # CPU refuses per-sample weights of another dtype than the table (checked before the mode).
    aten._embedding_bag.default: (("weight", "per_sample_weights"), "embedding_bag"),
    aten._embedding_bag_forward_only.default: (("weight", "per_sample_weights"), "embedding_bag"),
}

_POSITIONS: dict = {}

# Normalisations whose parameters share one dtype: the input's, or float32 for a bfloat16 or
# float16 input (the mixed-precision kernels of CPU and CUDA).
_PARAMETERS: dict = {aten.native_layer_norm.default: ("input", ("weight", "bias"), "native_layer_norm")}

# Bitwise ops PyTorch implements for integers (and the logical ones for bool) only; XLA's would
# fail with a TypeError inside the lowering. The value is CPU's kernel name for the error.
_INTEGER_ONLY: dict = {}
for _name, _kernel, _bool in [
    ("bitwise_left_shift", "lshift_cpu", False),
    ("bitwise_right_shift", "rshift_cpu", False),
    ("__lshift__", "lshift_cpu", False),
    ("__rshift__", "rshift_cpu", False),
    ("bitwise_and", "bitwise_and_cpu", True),
    ("bitwise_or", "bitwise_or_cpu", True),
    ("bitwise_xor", "bitwise_xor_cpu", True),
]:
    _packet = getattr(aten, _name)
    for _ov in ("Tensor", "Scalar", "Tensor_Scalar", "Scalar_Tensor"):
        if _ov in _packet.overloads():
            _INTEGER_ONLY[getattr(_packet, _ov)] = (_kernel, _bool)


def _tensor_dtypes(func, args: tuple, kwargs: dict, names: tuple) -> list:
    """(name, dtype) of each of the named arguments that is a tensor (None is left out)."""
    positions = _POSITIONS.get((func, names))
    if positions is None:
        schema = [a.name for a in func._schema.arguments]
        positions = _POSITIONS[(func, names)] = [schema.index(n) for n in names]
    found = []
    for name, i in zip(names, positions):
        value = args[i] if i < len(args) else kwargs.get(name)
        if isinstance(value, torch.Tensor):
            found.append((name, value.dtype))
    return found


def check(func, args: tuple, kwargs: dict, targets: list | None = None) -> None:
    """Raises PyTorch's kind of error where ``func`` would get mixed dtypes (RuntimeError) or a
    dtype its kernels lack (NotImplementedError). ``targets``: the tensors an in-place call writes."""
    integer_only = _INTEGER_ONLY.get(func)
    if integer_only is not None:
        kernel, bool_ok = integer_only
        dtype = torch.result_type(args[0], args[1])
        if dtype.is_floating_point or dtype.is_complex or (dtype == torch.bool and not bool_ok):
            name = _SCALAR_TYPE.get(dtype, dtype)
            raise NotImplementedError(f"\"{kernel}\" not implemented for '{name}'")
        if targets is not None:
            # The meta kernels of the shift dunders refuse a bool tensor that CPU shifts as int64,
            # so the dispatcher's check of in-place results cannot see ``bool_t >>= 2``.
            check_writable([dtype], [t.dtype for t in targets])
        return
    parameters = _PARAMETERS.get(func)
    if parameters is not None:
        input_name, names, op = parameters
        (_, dtype), *found = _tensor_dtypes(func, args, kwargs, (input_name, *names))
        allowed = {dtype, torch.float32} if dtype in (torch.bfloat16, torch.float16) else {dtype}
        if len({d for _, d in found}) > 1 or any(d not in allowed for _, d in found):
            got = ", ".join(f"{n} {str(d).removeprefix('torch.')}" for n, d in found)
            raise RuntimeError(
                f"{op}: expected {', '.join(n for n, _ in found)} to have one dtype, the input's ({dtype}) or "
                f"float32 for a bfloat16/float16 input, but got {got}"
            )
        return
    rule = SAME_DTYPE.get(func)
    if rule is None:
        return
    names, op = rule
    found = _tensor_dtypes(func, args, kwargs, names)
    if len({d for _, d in found}) > 1:
        got = ", ".join(f"{n} {str(d).removeprefix('torch.')}" for n, d in found)
        raise RuntimeError(f"{op}: expected {', '.join(n for n, _ in found)} to have the same dtype, but got {got}")


_SCALAR_TYPE = {
    torch.float32: "Float",
    torch.float64: "Double",
    torch.float16: "Half",
    torch.bfloat16: "BFloat16",
    torch.int64: "Long",
    torch.int32: "Int",
    torch.int16: "Short",
    torch.int8: "Char",
    torch.uint8: "Byte",
    torch.bool: "Bool",
    torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble",
}


def check_writable(results: list, targets: list) -> None:
    """In-place and ``out=``: PyTorch refuses to write a result into a tensor of a dtype it cannot
    be cast to without losing its kind (float into int, int into bool, complex into float), where
    XLA would cast silently."""
    for result, target in zip(results, targets):
        if result is not None and target is not None and not torch.can_cast(result, target):
            raise RuntimeError(
                f"result type {_SCALAR_TYPE.get(result, result)} can't be cast to the desired output type "
                f"{_SCALAR_TYPE.get(target, target)}"
            )
