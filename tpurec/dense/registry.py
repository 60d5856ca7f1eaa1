"""The lowering table: one JAX function per supported ATen overload.

Eager, fused and compiled execution all read this one table (docs/design.md,
contract 1). A lowering receives the ATen op's arguments exactly as the
dispatcher passed them, with every ``Tensor`` replaced by a ``jax.Array`` (and
``Tensor[]`` by a list of them). Arguments whose schema type is ``Scalar`` or
``float`` arrive as *traced* JAX scalars (weakly typed), so a learning rate that
changes every step never triggers a recompilation: a lowering must not branch on
their values. Every other argument (ints, int lists, bools, dtypes, strings)
arrives as a plain Python value and may shape the computation.

A lowering returns what the ATen op returns: one ``jax.Array``, or a tuple /
list of them. The runtime casts each result to the dtype PyTorch's meta kernel
predicts, so a lowering may return a wider dtype, never a different shape.

Random ops are declared with ``random=True`` and receive a fresh
``jax.random`` key as the keyword argument ``key``.

Example::

    from torch._ops import ops
    from tpurec.dense.registry import lower

    aten = ops.aten

    @lower(aten.relu.default)
    def relu(x):
        return jnp.maximum(x, 0)
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

import jax.numpy as jnp
import torch

__all__ = ["Lowering", "LOWERINGS", "lower", "get_lowering", "to_jax_dtype", "to_torch_dtype"]


@dataclasses.dataclass(frozen=True)
class Lowering:
    """One entry of the lowering table.

    Args:
        op: the ATen overload, e.g. ``torch.ops.aten.add.Tensor``.
        fn: the JAX function.
        random: the op consumes randomness; ``fn`` gets ``key=``.
        static_scalars: treat ``Scalar``/``float`` arguments as static values
            (for ops whose output shape depends on them, like ``arange``).
    """

    op: torch._ops.OpOverload
    fn: Callable
    random: bool = False
    static_scalars: bool = False


LOWERINGS: dict[torch._ops.OpOverload, Lowering] = {}


def _overloads(op) -> Iterable[torch._ops.OpOverload]:
    if isinstance(op, torch._ops.OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]
    return [op]


def lower(*ops, random: bool = False, static_scalars: bool = False):
    """Registers the decorated JAX function as the lowering of ``ops``.

    Args:
        *ops: ATen overloads (or packets, meaning all their overloads).
        random: see :class:`Lowering`.
        static_scalars: see :class:`Lowering`.
    """

    def register(fn: Callable) -> Callable:
        for op in ops:
            for overload in _overloads(op):
                if overload in LOWERINGS:
                    raise ValueError(f"{overload} has two lowerings")
                LOWERINGS[overload] = Lowering(overload, fn, random, static_scalars)
        return fn

    return register


def get_lowering(op: torch._ops.OpOverload) -> Lowering | None:
    """The lowering for ``op``, loading the op families on first use."""
    _load_families()
    lowering = LOWERINGS.get(op)
    if lowering is None and getattr(op, "namespace", None) in _DEFERRED:
        import importlib

        importlib.import_module(f"tpurec.dense.{_DEFERRED[op.namespace]}")
        lowering = LOWERINGS.get(op)
    return lowering


_loaded = False
# Families of another library's ops (namespace -> module), loaded on the first op of that
# namespace: the ops exist only once their library is imported, and importing it for
# every program (FBGEMM: half a second) would tax models that never use it.
_DEFERRED = {"fbgemm": "jagged"}


def _load_families() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    import importlib
    import pkgutil

    import tpurec.dense as dense

    for info in pkgutil.iter_modules(dense.__path__):
        if info.name.startswith("_") or info.name == "registry" or info.name in _DEFERRED.values():
            continue
        importlib.import_module(f"tpurec.dense.{info.name}")


_TORCH_TO_JAX = {
    torch.float32: jnp.float32,
    torch.float64: jnp.float64,
    torch.float16: jnp.float16,
    torch.bfloat16: jnp.bfloat16,
    torch.int8: jnp.int8,
    torch.int16: jnp.int16,
    torch.int32: jnp.int32,
    torch.int64: jnp.int64,
    torch.uint8: jnp.uint8,
    # PyTorch's "limited" unsigned types (few ops; hash_tensor returns uint64).
    torch.uint16: jnp.uint16,
    torch.uint32: jnp.uint32,
    torch.uint64: jnp.uint64,
    torch.bool: jnp.bool_,
    torch.complex64: jnp.complex64,
    torch.complex128: jnp.complex128,
}
_JAX_TO_TORCH = {jnp.dtype(v): k for k, v in _TORCH_TO_JAX.items()}


def to_jax_dtype(dtype: torch.dtype) -> jnp.dtype:
    """The JAX dtype holding values of torch ``dtype``."""
    try:
        return jnp.dtype(_TORCH_TO_JAX[dtype])
    except KeyError:
        raise TypeError(f"dtype {dtype} is not supported on the tpu device") from None


def to_torch_dtype(dtype) -> torch.dtype:
    """The torch dtype for a JAX/numpy ``dtype``."""
    return _JAX_TO_TORCH[jnp.dtype(dtype)]


# --- the calling convention -------------------------------------------------
#
# How each schema argument travels into a jitted lowering. "dynamic" arguments
# are runtime values of the compiled program; "static" ones are part of the
# cache key and baked into the program.

TENSOR, TENSOR_LIST, DYNAMIC, DYNAMIC_LIST, STATIC = "tensor", "tensor_list", "dynamic", "dynamic_list", "static"


def _arg_kind(arg: torch._C.Argument, static_scalars: bool) -> str:
    t = arg.type
    if isinstance(t, torch._C.OptionalType):
        t = t.getElementType()
    if isinstance(t, torch._C.TensorType):
        return TENSOR
    if isinstance(t, torch._C.ListType):
        elem = t.getElementType()
        if isinstance(elem, torch._C.OptionalType):
            elem = elem.getElementType()
        if isinstance(elem, torch._C.TensorType):
            return TENSOR_LIST
        if not static_scalars and isinstance(elem, (torch._C.NumberType, torch._C.FloatType)):
            return DYNAMIC_LIST
        return STATIC
    if not static_scalars and isinstance(t, (torch._C.NumberType, torch._C.FloatType)):
        return DYNAMIC
    return STATIC


_KINDS_CACHE: dict = {}


def argument_kinds(op: torch._ops.OpOverload, static_scalars: bool = False) -> tuple[tuple[str, ...], dict[str, str]]:
    """Per-argument travel kinds of ``op``: (positional kinds, kwarg kinds)."""
    key = (op, static_scalars)
    kinds = _KINDS_CACHE.get(key)
    if kinds is None:
        positional = tuple(_arg_kind(a, static_scalars) for a in op._schema.arguments)
        by_name = {a.name: _arg_kind(a, static_scalars) for a in op._schema.arguments}
        kinds = _KINDS_CACHE[key] = (positional, by_name)
    return kinds


def call_lowering(op: torch._ops.OpOverload, args: tuple, kwargs: dict | None = None, key=None):
    """Runs ``op``'s lowering once under ``jax.jit`` on CPU torch inputs.

    The reference calling convention, for tests and debugging: tensors become
    jax arrays, ``Scalar``/``float`` arguments become traced values, everything
    else is static. Returns jax arrays (not cast to torch's dtype).

    Example::

        out = call_lowering(torch.ops.aten.add.Tensor, (x, y), {"alpha": 2})
    """
    import jax
    import numpy as np

    lowering = get_lowering(op)
    if lowering is None:
        raise NotImplementedError(f"no lowering for {op}")
    kwargs = dict(kwargs or {})
    positional, by_name = argument_kinds(op, lowering.static_scalars)

    def to_jax(x):
        if isinstance(x, torch.Tensor):
            x = x.detach().cpu()
            if x.dtype == torch.bfloat16:
                return jnp.asarray(x.view(torch.int16).numpy()).view(jnp.bfloat16)
            return jnp.asarray(x.resolve_conj().resolve_neg().numpy())
        return x

    dyn_values: list = []
    slots: list = []  # (where, name_or_index, kind, static value)

    def split(where, ident, kind, value):
        if kind == TENSOR and value is not None:
            dyn_values.append(to_jax(value))
            slots.append((where, ident, "dyn", None))
        elif kind == TENSOR_LIST:
            dyn_values.append([None if v is None else to_jax(v) for v in value])
            slots.append((where, ident, "dyn", None))
        elif kind == DYNAMIC and isinstance(value, (int, float, bool)) and not isinstance(value, bool):
            dyn_values.append(value)
            slots.append((where, ident, "dyn", None))
        elif kind == DYNAMIC_LIST and value is not None:
            dyn_values.append(list(value))
            slots.append((where, ident, "dyn", None))
        else:
            slots.append((where, ident, "static", value))

    for i, value in enumerate(args):
        split("arg", i, positional[i], value)
    for name, value in kwargs.items():
        split("kw", name, by_name[name], value)

    def program(dyn, rng):
        it = iter(dyn)
        a, kw = [], {}
        for where, ident, how, static in slots:
            v = next(it) if how == "dyn" else static
            (a.append(v) if where == "arg" else kw.__setitem__(ident, v))
        if lowering.random:
            kw["key"] = rng
        return lowering.fn(*a, **kw)

    if lowering.random and key is None:
        key = jax.random.key(0)
    return jax.jit(program)(dyn_values, key)
