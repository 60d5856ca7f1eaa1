"""The lowering table: how the tpu device runs each supported ATen overload.

Eager, fused and compiled execution all read this one table (docs/design.md,
contract 1). Each entry says its :class:`Kind`: most are ``JAX`` lowerings
(below); the others are the device kernels eager runs itself (``tpurec.core``),
the functional forms of views, allocations and size queries that compiled
graphs use (``tpurec.compile``), composites written in torch ops
(``tpurec.dense.composites``), and marks for data-dependent ops and factories. All
register through :func:`lower` (``kind=``); the families of JAX lowerings are
the modules listed in :data:`FAMILIES`, imported with ``tpurec.dense``.

A JAX lowering receives the ATen op's arguments exactly as the
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
import enum
from typing import Callable, Iterable, TypeVar

import jax.numpy as jnp
import torch

from tpurec.dense import calling

# The calling convention's names, also importable from here.
from tpurec.dense.calling import (  # noqa: F401
    DYNAMIC,
    DYNAMIC_LIST,
    STATIC,
    TENSOR,
    TENSOR_LIST,
    argument_kinds,
)

__all__ = [
    "FAMILIES",
    "LOWERINGS",
    "MARKS",
    "TABLE",
    "Kind",
    "Lowering",
    "defer",
    "entry",
    "get_lowering",
    "load_families",
    "lower",
    "mark",
    "to_jax_dtype",
    "to_torch_dtype",
]


class Kind(enum.Enum):
    """What an entry of the table is, and so who runs it and how."""

    JAX = "jax"
    """A JAX function: the op's lowering, run by eager, fused and compiled execution."""
    KERNEL = "kernel"
    """A device kernel on tpu tensors (copies, allocations, metadata): eager and fused only."""
    VIEW = "view"
    """The functional JAX form of a view op, for compiled graphs (eager views share storage)."""
    GRAPH = "graph"
    """A JAX function for an op eager runs as a kernel (allocations, copy), for compiled graphs."""
    SIZE_QUERY = "size_query"
    """A symbolic size query of a compiled graph, answered from the shapes seen while tracing."""
    COMPOSITE = "composite"
    """torch ops composing an op that has no lowering: eager runs it, compile decomposes with it."""
    DATA_DEPENDENT = "data_dependent"
    """An op whose output shape depends on input values: eager runs it on the host (no ``fn``)."""
    FACTORY = "factory"
    """A factory (no tensor inputs) that gets a PrivateUse1 kernel (no ``fn``)."""


@dataclasses.dataclass(frozen=True)
class Lowering:
    """One entry of the lowering table.

    Args:
        op: the ATen overload, e.g. ``torch.ops.aten.add.Tensor``.
        fn: the function (see :class:`Kind` for what it receives); for the kinds
            that only mark an op (``DATA_DEPENDENT``, ``FACTORY``), one that refuses to run.
        random: the op consumes randomness; ``fn`` gets ``key=`` (``JAX`` entries).
        static_scalars: treat ``Scalar``/``float`` arguments as static values
            (for ops whose output shape depends on them, like ``arange``).
        kind: what the entry is.
        special_scalars: Python numbers that a ``Scalar``/``float`` argument passes as a static
            value instead of a runtime one (``pow``'s exponents 2, 0.5, ...: the lowering gives each
            its own small program; other values share one program computing the general case).
    """

    op: torch._ops.OpOverload
    fn: Callable
    random: bool = False
    static_scalars: bool = False
    kind: Kind = Kind.JAX
    special_scalars: frozenset = frozenset()

    def __call__(self, *args, **kwargs):
        """Calls ``fn`` (so a kind's part of the table reads as a mapping of op -> function)."""
        return self.fn(*args, **kwargs)


# The one table: per kind, op -> entry. One op may have entries of several kinds (a
# kernel for eager and a JAX lowering for compiled graphs, e.g. ``_to_copy``), at most
# one of each.
TABLE: dict[Kind, dict[torch._ops.OpOverload, Lowering]] = {kind: {} for kind in Kind}
LOWERINGS: dict[torch._ops.OpOverload, Lowering] = TABLE[Kind.JAX]

MARKS = (Kind.DATA_DEPENDENT, Kind.FACTORY)
_F = TypeVar("_F", bound=Callable)


def _overloads(op) -> Iterable[torch._ops.OpOverload]:
    if isinstance(op, torch._ops.OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]
    return [op]


def _add(
    ops: tuple, fn: Callable, kind: Kind, random: bool, static_scalars: bool, special_scalars: frozenset = frozenset()
) -> None:
    entries = TABLE[kind]
    overloads = [overload for op in ops for overload in _overloads(op)]
    for overload in overloads:
        if overload in entries:
            raise ValueError(f"{overload} has two {kind.value} entries")
    for overload in overloads:
        entries[overload] = Lowering(overload, fn, random, static_scalars, kind, special_scalars)


def lower(
    *ops,
    kind: Kind = Kind.JAX,
    random: bool = False,
    static_scalars: bool = False,
    special_scalars: Iterable[float] = (),
) -> Callable[[_F], _F]:
    """Registers the decorated function as the ``kind`` entry of ``ops``.

    Args:
        *ops: ATen overloads (or packets, meaning all their overloads).
        kind: what the function is (:class:`Kind`); a JAX lowering by default.
        random: see :class:`Lowering`.
        static_scalars: see :class:`Lowering`.
        special_scalars: see :class:`Lowering`.

    Raises:
        ValueError: an op already has an entry of this kind (then none is added), or
            ``kind`` is one that holds no function (use :func:`mark`).
    """
    if kind in MARKS:
        raise ValueError(f"a {kind.value} entry holds no function: use mark(*ops, kind=...)")

    def register(fn: _F) -> _F:
        _add(ops, fn, kind, random, static_scalars, frozenset(special_scalars))
        return fn

    return register


def mark(*ops, kind: Kind) -> None:
    """Registers ``ops`` as entries of a kind that holds no function (``DATA_DEPENDENT``, ``FACTORY``).

    Raises:
        ValueError: ``kind`` is not such a kind, or an op already has an entry of it.
    """
    if kind not in MARKS:
        raise ValueError(f"a {kind.value} entry needs a function: use @lower(*ops, kind=...)")

    def refuse(*args, **kwargs):
        raise TypeError(f"a {kind.value} entry marks its op and holds no function to run")

    _add(ops, refuse, kind, False, False)


def entry(op: torch._ops.OpOverload, kind: Kind) -> Lowering | None:
    """The ``kind`` entry of ``op``, or None."""
    if kind is Kind.JAX:
        return get_lowering(op)
    return TABLE[kind].get(op)


def get_lowering(op: torch._ops.OpOverload) -> Lowering | None:
    """The JAX lowering of ``op``, loading a deferred family on the first op of its namespace."""
    lowering = LOWERINGS.get(op)
    if lowering is None:
        module = _deferred_module(getattr(op, "namespace", None))
        if module is not None:
            import importlib

            importlib.import_module(module)
            lowering = LOWERINGS.get(op)
    return lowering


def _deferred_module(namespace: str | None) -> str | None:
    """The dotted module of the family deferred to ``namespace``'s first op (None: not deferred)."""
    if namespace in DEFERRED:
        return f"tpurec.dense.{DEFERRED[namespace]}"
    return DEFERRED_ABOVE.get(namespace) if namespace is not None else None


def defer(namespace: str, module: str) -> None:
    """Loads ``module`` (a dotted path) on the first op of ``namespace`` that has no entry yet.

    For a family of another library's ops that lives above the lowering table (one whose
    lowerings use the sparse op set, say): the layer that owns it registers the deferral, so
    the table never imports upwards.

    Raises:
        ValueError: ``namespace`` is already deferred to another module.
    """
    known = _deferred_module(namespace)
    if known is not None and known != module:
        raise ValueError(f"the {namespace!r} namespace is already deferred to {known}, not {module}")
    DEFERRED_ABOVE[namespace] = module


# The op families, each a module of tpurec.dense that registers its entries when
# imported; tpurec/dense/__init__.py imports them all (load_families).
FAMILIES = (
    "composites",  # fused PyTorch kernels (the Transformer fast path) written as ordinary ops
    "conv",
    "creation",
    "ctc",
    "elementwise",
    "fft",
    "foreach",
    "fractional_pooling",
    "grid_sample",
    "grouped_mm",
    "histogram",
    "linalg",
    "margin_losses",
    "nn",
    "optimizers",
    "pooling",
    "random",
    "reductions",
    "rnn",
    "selection",
    "shape",
    "special",
    "upsample",
    "weight_norm",
)
# Families of another library's ops (namespace -> module), loaded on the first op of that
# namespace: the ops exist only once their library is imported, and importing it for
# every program (FBGEMM: half a second) would tax models that never use it.
DEFERRED = {"fbgemm": "jagged"}
# Namespace -> dotted module of a deferred family above the table (registered with defer()).
DEFERRED_ABOVE: dict[str, str] = {}


def load_families() -> None:
    """Imports every family of :data:`FAMILIES` (each once); the deferred ones stay deferred.
    (The device kernels register with ``tpurec.core``, the compiled graphs' entries with
    ``tpurec.compile``: the layers that run them.)"""
    import importlib

    for name in FAMILIES:
        importlib.import_module(f"tpurec.dense.{name}")


_load_families = load_families


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


def call_lowering(op: torch._ops.OpOverload, args: tuple, kwargs: dict | None = None, key=None):
    """Runs ``op``'s lowering once under ``jax.jit`` on CPU torch inputs.

    The reference calling convention, for tests and debugging: the arguments
    travel as eager execution passes them (:mod:`tpurec.dense.calling`): tensors
    become jax arrays, ``Scalar``/``float`` arguments traced values, everything
    else is static. Returns jax arrays (not cast to torch's dtype).

    Example::

        out = call_lowering(torch.ops.aten.add.Tensor, (x, y), {"alpha": 2})
    """
    import jax

    lowering = get_lowering(op)
    if lowering is None:
        raise NotImplementedError(f"no lowering for {op}")
    kinds = argument_kinds(op, lowering.static_scalars)
    inputs: list = []

    def record(x: torch.Tensor) -> tuple:
        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:
            inputs.append(jnp.asarray(x.view(torch.int16).numpy()).view(jnp.bfloat16))
        else:
            inputs.append(jnp.asarray(x.resolve_conj().resolve_neg().numpy()))
        return ("t",)

    special = lowering.special_scalars
    arg_specs = [calling.split(calling.kind_of(kinds, i), a, inputs, record, special) for i, a in enumerate(args)]
    kw_specs = [
        (k, calling.split(calling.kind_of(kinds, k), v, inputs, record, special)) for k, v in (kwargs or {}).items()
    ]

    def program(dyn, rng):
        it = iter(dyn)
        a = [calling.rebuild(s, it, _next_input) for s in arg_specs]
        kw = {k: calling.rebuild(s, it, _next_input) for k, s in kw_specs}
        if lowering.random:
            kw["key"] = rng
        return lowering.fn(*a, **kw)

    if lowering.random and key is None:
        key = jax.random.key(0)
    return jax.jit(program)(inputs, key)


def _next_input(spec: tuple, it):
    return next(it)
