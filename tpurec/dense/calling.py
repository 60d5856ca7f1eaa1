"""The calling convention of a lowering: which arguments are traced, which are static.

Eager execution (``tpurec.core``), the fused window, compiled graphs
(``tpurec.compile``) and the reference harness (:func:`tpurec.dense.registry.call_lowering`)
all pass an ATen op's arguments to its lowering by these rules, so a lowering sees
the same values whichever path runs it:

* every schema argument has a travel kind (:func:`argument_kinds`): ``TENSOR``,
  ``TENSOR_LIST``, ``DYNAMIC`` (a ``Scalar``/``float``), ``DYNAMIC_LIST`` or ``STATIC``;
* tensors become runtime inputs of the program;
* Python numbers in ``Scalar``/``float`` positions, and in ``Tensor`` positions
  (PyTorch's "wrapped numbers"), become runtime scalars (:func:`runtime_scalars`),
  so a learning rate that changes every step reuses one compiled program;
* everything else is static: part of the program's cache key, baked into it.

:func:`split` turns one argument into a hashable *spec* (how the program rebuilds
it) plus the runtime inputs it contributes; :func:`rebuild` is its inverse inside
the traced program. Tensors are recorded and rebuilt by callbacks, because each
path holds them differently (a tpu storage and its view, a graph node, a CPU tensor).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = [
    "DYNAMIC",
    "DYNAMIC_LIST",
    "STATIC",
    "TENSOR",
    "TENSOR_LIST",
    "argument_kinds",
    "kind_of",
    "rebuild",
    "runtime_scalars",
    "split",
    "static_value",
]

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
    """Per-argument travel kinds of ``op``: (positional kinds, kwarg kinds).

    Args:
        op: the ATen overload.
        static_scalars: the lowering asked for ``Scalar``/``float`` arguments as static
            values (ops whose output shape depends on them, like ``arange``).
    """
    key = (op, static_scalars)
    kinds = _KINDS_CACHE.get(key)
    if kinds is None:
        positional = tuple(_arg_kind(a, static_scalars) for a in op._schema.arguments)
        by_name = {a.name: _arg_kind(a, static_scalars) for a in op._schema.arguments}
        kinds = _KINDS_CACHE[key] = (positional, by_name)
    return kinds


def kind_of(kinds: tuple[tuple[str, ...], dict[str, str]], where: int | str) -> str:
    """The travel kind of positional argument ``where`` (an int) or keyword ``where`` (a str).

    Arguments beyond the schema (which the dispatcher never passes, but a graph may) are static.
    """
    positional, by_name = kinds
    if isinstance(where, int):
        return positional[where] if where < len(positional) else STATIC
    return by_name.get(where, STATIC)


def runtime_scalars(kind: str, value: Any, special: frozenset = frozenset()) -> list | None:
    """The Python numbers of one argument that travel as runtime scalars, or None if none do.

    A single number (``[x]``) in a ``Scalar``/``float`` or ``Tensor`` position, or a
    list of numbers in a ``Scalar[]``/``float[]`` position. ``bool`` is a static value, and
    so is a number in a ``Scalar``/``float`` position that equals one of the lowering's
    ``special`` values (``Lowering.special_scalars``).
    """
    if kind in (DYNAMIC, TENSOR) and type(value) in (int, float):
        return None if kind == DYNAMIC and value in special else [value]
    if kind == DYNAMIC_LIST and isinstance(value, (list, tuple)) and all(type(v) in (int, float) for v in value):
        return list(value)
    return None


def static_value(value: Any) -> Any:
    """``value`` as a hashable static argument (lists become tuples, devices strings)."""
    if isinstance(value, list):
        return tuple(static_value(v) for v in value)
    if isinstance(value, torch.device):
        return str(value)
    if isinstance(value, (torch.SymInt, torch.SymFloat)):
        raise NotImplementedError("symbolic sizes are not supported by eager tpu execution")
    return value


def split(
    kind: str,
    value: Any,
    inputs: list,
    tensor: Callable[[torch.Tensor], tuple],
    special: frozenset = frozenset(),
) -> tuple:
    """Records one argument: appends its runtime values to ``inputs``, returns its spec.

    Args:
        kind: the argument's travel kind.
        value: the argument as the caller passed it.
        inputs: the program's runtime inputs so far (appended to).
        tensor: records a tensor (appending what it needs to ``inputs``) and returns
            its spec, a tuple whose first item is a tag other than the ones used here.
        special: the lowering's ``special_scalars`` (see :func:`runtime_scalars`).

    Returns:
        A hashable spec: ``("none",)``, a tensor's spec, ``("list", specs)``,
        ``("d", type)`` (a runtime scalar), ``("dl", types)`` or ``("c", static value, its types)``
        (the types too: ``arange(6)`` and ``arange(6.0)`` are equal keys otherwise, but not the
        same program).
    """
    if value is None:
        return ("none",)
    if kind == TENSOR and isinstance(value, torch.Tensor):
        return tensor(value)
    if kind == TENSOR_LIST:
        return ("list", tuple(("none",) if v is None else tensor(v) for v in value))
    scalars = runtime_scalars(kind, value, special)
    if scalars is not None:
        inputs.extend(scalars)
        return ("d", type(value)) if kind != DYNAMIC_LIST else ("dl", tuple(type(v) for v in value))
    if isinstance(value, torch.Tensor):
        return tensor(value)
    return ("c", static_value(value), _types_of(value))


def _types_of(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_types_of(v) for v in value)
    return type(value)


def rebuild(spec: tuple, it: Iterator, tensor: Callable[[tuple, Iterator], Any]) -> Any:
    """The argument ``spec`` describes, from the program's runtime inputs ``it`` (in :func:`split` order).

    Args:
        spec: what :func:`split` returned.
        it: the runtime inputs, consumed in order.
        tensor: rebuilds a tensor from its spec (the ``tensor`` callback's of :func:`split`).
    """
    tag = spec[0]
    if tag == "none":
        return None
    if tag == "list":
        return [rebuild(s, it, tensor) for s in spec[1]]
    if tag == "d":
        return next(it)
    if tag == "dl":
        return [next(it) for _ in spec[1]]
    if tag == "c":
        return spec[1] if not isinstance(spec[1], tuple) else list(spec[1])
    return tensor(spec, it)
