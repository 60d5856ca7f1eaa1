"""An ATen FX graph as one JAX function, built from the lowering table.

``GraphProgram(gm)`` walks the graph once to plan it (which op runs how, which
scalars travel as runtime inputs, how many random keys it needs); ``trace``
then interprets it node by node over jax arrays, inside ``jax.jit``. Every
ATen op is called exactly as eager execution calls it (tpurec/core/dispatch.py):

* tensors become jax arrays; ``Scalar``/``float`` arguments become traced
  weakly typed scalars (runtime inputs of the program), everything else is a
  static Python value;
* each result is cast to the dtype PyTorch's meta kernel predicted
  (``node.meta['val']``);
* random lowerings get ``key=`` from a (seed, counter) triple passed in at run
  time, one per random node, drawn from ``tpurec.rng`` like eager ops;
* view ops, which eager handles with strides, are functional here
  (tpurec/compile/views.py);
* symbolic sizes are concrete while tracing: the program is specialised to the
  input shapes it is called with (see backend.py).
"""

from __future__ import annotations

import dataclasses
import math
import operator
import os
from typing import Any, Callable

import jax.numpy as jnp
import torch
import torch.fx
from torch._dynamo.exc import ShortenTraceback

from tpurec.compile import views as _views  # noqa: F401 (registers the VIEW entries)
from tpurec.dense import calling
from tpurec.dense.calling import argument_kinds
from tpurec.dense.registry import Kind, entry, get_lowering, lower, to_jax_dtype
from tpurec.core import host_device, host_to_jax, rng_key_from

aten = torch.ops.aten

__all__ = ["GraphProgram", "CompileError", "describe_node", "handled_without_lowering"]


class CompileError(ShortenTraceback):
    """A graph op could not be lowered; the message names the ATen op and the user's line.

    A RuntimeError. Dynamo re-raises ``ShortenTraceback`` errors from a backend as
    they are, so users see this message itself instead of a ``BackendCompilerFailed``
    wrapper, as in eager mode.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message, first_useful_frame=None)


def describe_node(node: torch.fx.Node) -> str:
    """The op of ``node`` and, when known, the user source line that produced it."""
    target = node.target
    name = target.name() if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target))
    text = f"ATen op '{name}' (graph node '{node.name}')"
    trace = node.meta.get("stack_trace")
    if trace:
        lines = [line for line in trace.strip().splitlines() if line.strip()]
        # The last "File ..., line ..." frame and its code line are the user's; frames inside
        # torch itself (F.grouped_mm calling torch._grouped_mm) are not, unless there is no other.
        frames = [i for i, line in enumerate(lines) if line.lstrip().startswith("File ")]
        outside = [i for i in frames if not _in_torch(lines[i])]
        if frames:
            last = (outside or frames)[-1]
            text += "\n  from user code:\n    " + "\n    ".join(l.strip() for l in lines[last : last + 2])
    return text


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _in_torch(frame_line: str) -> bool:
    """A stack-trace line ``File "...", line N, in f`` of a file in torch's own package."""
    start = frame_line.find('"')
    return start >= 0 and frame_line[start + 1 :].startswith(_TORCH_DIR)


# --- small ops that need no lowering -----------------------------------------


# Allocations have no meaningful values; zeros keeps programs deterministic.
@lower(aten.empty.memory_format, kind=Kind.GRAPH)
def _zeros(size, *args, dtype=None, **kwargs):
    return jnp.zeros(tuple(size), to_jax_dtype(dtype or torch.get_default_dtype()))


@lower(aten.empty_strided.default, kind=Kind.GRAPH)
def _empty_strided(size, stride, **kwargs):
    return _zeros(size, **kwargs)


@lower(aten.empty_like.default, kind=Kind.GRAPH)
def _empty_like(x, *args, dtype=None, **kwargs):
    return jnp.zeros(x.shape, to_jax_dtype(dtype) if dtype is not None else x.dtype)


@lower(aten.new_empty.default, kind=Kind.GRAPH)
def _new_empty(x, size, *args, dtype=None, **kwargs):
    return jnp.zeros(tuple(size), to_jax_dtype(dtype) if dtype is not None else x.dtype)


@lower(aten.new_empty_strided.default, kind=Kind.GRAPH)
def _new_empty_strided(x, size, stride, **kwargs):
    return _new_empty(x, size, **kwargs)


@lower(aten.copy.default, kind=Kind.GRAPH)
def _copy(x, src, non_blocking: bool = False):
    # The functional copy_: src's values, broadcast to x's shape, in x's dtype.
    return jnp.broadcast_to(src, x.shape).astype(x.dtype)


@lower(torch.ops.prims.convert_element_type.default, kind=Kind.GRAPH)
def _convert_element_type(x, dtype):
    return x.astype(to_jax_dtype(dtype))


# Symbolic-size queries: answered from the concrete shapes seen while tracing.
@lower(aten.sym_size.int, kind=Kind.SIZE_QUERY)
def _sym_size(x, dim):
    return x.shape[dim]


@lower(aten.sym_numel.default, kind=Kind.SIZE_QUERY)
def _sym_numel(x):
    return math.prod(x.shape)


@lower(aten.sym_stride.int, kind=Kind.SIZE_QUERY)
def _sym_stride(x, dim):
    return _contiguous_stride(x.shape, dim)


@lower(aten.sym_storage_offset.default, kind=Kind.SIZE_QUERY)
def _sym_storage_offset(x):
    return 0


def _contiguous_stride(shape, dim: int) -> int:
    return math.prod(max(n, 1) for n in shape[dim + 1 :]) if dim >= 0 else _contiguous_stride(shape, dim + len(shape))


# The kinds of entry the interpreter runs itself (never decomposed), in the order it looks.
_OWN_KINDS = (Kind.VIEW, Kind.GRAPH, Kind.SIZE_QUERY)


def handled_without_lowering(op) -> bool:
    """Ops the interpreter runs itself (views, allocations, size queries): never decomposed."""
    return any(entry(op, kind) is not None for kind in _OWN_KINDS)


# --- planning ----------------------------------------------------------------


@dataclasses.dataclass
class _Step:
    """How one call_function node runs."""

    node: torch.fx.Node
    fn: Callable
    kind: str  # "lowering", "view", "special", "size", "python", "getitem"
    kinds: tuple = ((), {})  # the travel kinds of the arguments (lowerings only), see tpurec.dense.calling
    random: bool = False
    dtypes: Any = None  # the meta dtypes to cast outputs to
    special: frozenset = frozenset()  # the lowering's special_scalars (static numbers)


def _meta_dtypes(node: torch.fx.Node):
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.dtype
    if isinstance(val, (list, tuple)):
        return [v.dtype if isinstance(v, torch.Tensor) else None for v in val]
    return None


def _is_input_mutation(node: torch.fx.Node) -> bool:
    """``copy_(input, new)``: how AOTAutograd keeps a graph input's mutation in the graph."""
    return (
        node.op == "call_function"
        and node.target is aten.copy_.default
        and isinstance(node.args[0], torch.fx.Node)
        and node.args[0].op == "placeholder"
    )


def _plan_node(node: torch.fx.Node) -> _Step:
    target = node.target
    if _is_input_mutation(node):
        # Its value is the input's new value (an extra output of the program, see
        # GraphProgram.mutations); the caller writes it into the input tensor.
        return _Step(node, _copy, "special", dtypes=_meta_dtypes(node))
    if target is operator.getitem:
        return _Step(node, operator.getitem, "getitem")
    if not isinstance(target, torch._ops.OpOverload):
        # operator.mul on SymInts, math.ceil, torch.sym_float, ...: plain Python at trace time.
        return _Step(node, target, "python")
    size_query = entry(target, Kind.SIZE_QUERY)
    if size_query is not None:
        return _Step(node, size_query.fn, "size")
    lowering = get_lowering(target)
    if lowering is not None:
        kinds = argument_kinds(target, lowering.static_scalars)
        return _Step(
            node, lowering.fn, "lowering", kinds, lowering.random, _meta_dtypes(node), lowering.special_scalars
        )
    view = entry(target, Kind.VIEW)
    if view is not None:
        return _Step(node, view.fn, "view")
    special = entry(target, Kind.GRAPH)
    if special is not None:
        return _Step(node, special.fn, "special", dtypes=_meta_dtypes(node))
    from tpurec.core import unsupported_op

    raise CompileError(f"{unsupported_op(target)}\n  in {describe_node(node)}")


class GraphProgram:
    """A planned FX graph: ``trace(inputs, scalars, seeds)`` returns the graph's outputs.

    Args:
        gm: an ATen-level, functional GraphModule (what AOTAutograd produces).
    """

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.gm = gm
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.steps: dict[torch.fx.Node, _Step] = {}
        for node in gm.graph.nodes:
            if node.op == "call_function":
                self.steps[node] = _plan_node(node)
        self.random_nodes = [n for n, s in self.steps.items() if s.random]
        (self.output_node,) = [n for n in gm.graph.nodes if n.op == "output"]
        # Input mutations kept in the graph (``keep_inference_input_mutations``): per mutated
        # input, its placeholder's position and the node computing its new value, last write
        # first found last (a later copy_ into the same input wins).
        written = {n.args[0]: n for n in gm.graph.nodes if _is_input_mutation(n)}
        self.mutations: list[tuple[int, torch.fx.Node]] = [
            (self.placeholders.index(p), n)
            for p, n in written.items()  # pyright: ignore[reportArgumentType]
        ]
        self.constants = self._collect_constants()

    # Scalars that eager passes as runtime inputs are runtime inputs here too, so each
    # lowering sees exactly what it sees eagerly (a weakly typed traced scalar).
    def _collect_constants(self) -> list:
        constants: list = []
        for step in self.steps.values():
            if step.kind != "lowering":
                continue
            node = step.node
            for i, a in enumerate(node.args):
                constants.extend(_dynamic_values(calling.kind_of(step.kinds, i), a, step.special))
            for k, a in node.kwargs.items():
                constants.extend(_dynamic_values(calling.kind_of(step.kinds, k), a, step.special))
        return constants

    def ops(self) -> list[str]:
        return sorted({str(s.node.target) for s in self.steps.values() if s.kind in ("lowering", "view", "special")})

    def trace(self, inputs: list, scalars: list, seeds: list) -> list:
        """Interprets the graph over ``inputs`` (jax arrays / Python numbers).

        ``scalars`` are the traced values of ``self.constants`` and ``seeds`` one
        (seed_hi, seed_lo, counter) triple per random node, in graph order.
        """
        env: dict[torch.fx.Node, Any] = dict(zip(self.placeholders, inputs))
        scalar_it = iter(scalars)
        seed_it = iter(seeds)
        for node in self.gm.graph.nodes:
            if node.op == "get_attr":
                env[node] = _constant(getattr(self.gm, node.target))
            elif node.op == "call_function":
                env[node] = self._run(self.steps[node], env, scalar_it, seed_it)
        outs = self.output_node.args[0]
        # The graph's outputs, then the new value of each mutated input (self.mutations).
        return [None if o is None else env[o] if isinstance(o, torch.fx.Node) else o for o in outs] + [
            env[n] for _, n in self.mutations
        ]

    def _run(self, step: _Step, env: dict, scalar_it, seed_it):
        node = step.node

        def load(a):
            return torch.fx.node.map_arg(a, lambda n: env[n])

        try:
            if step.kind != "lowering":
                args, kwargs = load(node.args), load(node.kwargs)
                out = step.fn(*args, **kwargs)
                if step.kind == "special":
                    out = _cast(out, step.dtypes)
                return out
            kinds = step.kinds
            special = step.special
            args = [_bind(calling.kind_of(kinds, i), a, scalar_it, load, special) for i, a in enumerate(node.args)]
            kwargs = {k: _bind(calling.kind_of(kinds, k), a, scalar_it, load, special) for k, a in node.kwargs.items()}
            if step.random:
                kwargs["key"] = rng_key_from(*next(seed_it))
            return _cast(step.fn(*args, **kwargs), step.dtypes)
        except CompileError:
            raise
        except Exception as e:
            raise CompileError(f"tpurec: lowering failed: {type(e).__name__}: {e}\n  in {describe_node(node)}") from e


def _dynamic_values(kind: str, value, special: frozenset = frozenset()) -> list:
    """The graph constants of one argument that travel as runtime scalars, as in eager
    execution (:func:`tpurec.dense.calling.runtime_scalars`); a node's value is never one."""
    if isinstance(value, torch.fx.Node) or value is None:
        return []
    return calling.runtime_scalars(kind, value, special) or []


def _bind(kind: str, value, scalar_it, load: Callable, special: frozenset = frozenset()):
    """One argument's value: graph constants that travel as runtime scalars are
    replaced by their traced values (in planning order); the rest is loaded.

    Decided on the graph's own argument, before loading, exactly as in
    ``_dynamic_values``: a size computed by another node is static, not a constant.
    """
    n = len(_dynamic_values(kind, value, special))
    if n == 0:
        return load(value)
    if isinstance(value, (list, tuple)):
        return [next(scalar_it) for _ in range(n)]
    return next(scalar_it)


def _cast(out, dtypes):
    if dtypes is None:
        return out
    if isinstance(dtypes, torch.dtype):
        return out.astype(to_jax_dtype(dtypes)) if hasattr(out, "astype") else out
    return (
        type(out)(o if d is None or o is None else o.astype(to_jax_dtype(d)) for o, d in zip(out, dtypes))
        if isinstance(out, (list, tuple))
        else out
    )


def _constant(value):
    """A tensor attribute of the graph (a lifted constant) as a jax array."""
    if isinstance(value, torch.Tensor):
        from tpurec.core import TpuTensor, value_of

        if isinstance(value, TpuTensor):
            return value_of(value)
        return jnp.asarray(host_to_jax(value, host_device()))
    return value
