"""Custom ops written in JAX or Pallas, callable on ``tpu`` tensors.

``jax_op("mylib::name")`` turns a function over ``jax.Array``s into a PyTorch
custom op (``torch.ops.mylib.name``) that

* runs on ``tpu`` tensors through the lowering table, like every ATen op: one
  cached program per shape in eager mode, a node of the window in fused mode,
  a node of the one XLA program of a ``torch.compile(backend="tpu")`` graph
  (the op is traceable, so it never breaks the graph);
* has a fake kernel derived from ``jax.eval_shape`` (for Dynamo / FakeTensor);
* is differentiable: through ``jax.vjp`` of the function, or through a
  ``backward=`` function the user gives (needed for Pallas kernels, which JAX
  cannot differentiate); the backward is itself a custom op, so it is part of
  the backward program too;
* also runs on CPU tensors (the same function under ``jax.jit`` on XLA:CPU),
  which makes it easy to check against a PyTorch reference.

Argument types come from the function's annotations (``jax.Array`` ->
``Tensor``, ``int``/``float``/``bool``/``str`` as is) or from an explicit
``schema=``. As everywhere in tpurec (tpurec/dense/registry.py), ``float``
arguments are traced runtime values (a new value never recompiles; the function
must not branch on them) while ``int``/``bool``/``str`` are static.

Example::

    import jax, jax.numpy as jnp
    import tpurec.library

    @tpurec.library.jax_op("mylib::scaled_tanh")
    def scaled_tanh(x: jax.Array, *, scale: float = 1.0) -> jax.Array:
        return jnp.tanh(x) * scale

    y = scaled_tanh(torch.randn(8, 4, device="tpu", requires_grad=True), scale=2.0)
    y.sum().backward()
"""

from __future__ import annotations

import inspect
import re
import typing
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch

from tpurec.dense.registry import lower, to_jax_dtype, to_torch_dtype

__all__ = ["jax_op", "JaxOp"]

_NAME = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)::([A-Za-z_][A-Za-z0-9_]*)$")
_SCALAR_TYPES = {int: "int", float: "float", bool: "bool", str: "str"}
# One Library per namespace: torch refuses a second FRAGMENT that defines the same name anyway.
_libraries: dict[str, torch.library.Library] = {}


def _library(namespace: str) -> torch.library.Library:
    lib = _libraries.get(namespace)
    if lib is None:
        lib = _libraries[namespace] = torch.library.Library(namespace, "FRAGMENT")
    return lib


# --- schema from annotations --------------------------------------------------------


def _is_array_type(annotation: Any) -> bool:
    return annotation in (jax.Array, jnp.ndarray, torch.Tensor, np.ndarray)


def _type_name(annotation: Any, where: str) -> str:
    if _is_array_type(annotation):
        return "Tensor"
    if annotation in _SCALAR_TYPES:
        return _SCALAR_TYPES[annotation]
    raise TypeError(
        f"{where}: annotation {annotation!r} is not supported; use jax.Array for tensors and int, float, bool "
        "or str for other arguments, or pass schema='(Tensor x, ...) -> Tensor' to jax_op"
    )


def _default_text(value: Any) -> str:
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, bool):
        return "True" if value else "False"
    return repr(value)


def infer_schema(fn: Callable, op_name: str) -> str:
    """The operator schema of ``fn`` from its annotations, e.g. ``(Tensor x, *, float scale=1.0) -> Tensor``.

    Raises:
        TypeError: an argument or the return value lacks a supported annotation.
    """
    hints = typing.get_type_hints(fn)
    signature = inspect.signature(fn)
    parts: list[str] = []
    keyword_only_started = False
    for parameter in signature.parameters.values():
        if parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            raise TypeError(f"{op_name}: *args/**kwargs cannot become an operator schema; name every argument")
        if parameter.name not in hints:
            raise TypeError(
                f"{op_name}: argument {parameter.name!r} has no annotation; annotate it (jax.Array, int, float, "
                "bool, str) or pass schema= to jax_op"
            )
        if parameter.kind == inspect.Parameter.KEYWORD_ONLY and not keyword_only_started:
            parts.append("*")
            keyword_only_started = True
        text = f"{_type_name(hints[parameter.name], f'{op_name} argument {parameter.name!r}')} {parameter.name}"
        if parameter.default is not inspect.Parameter.empty:
            if _is_array_type(hints[parameter.name]):
                raise TypeError(f"{op_name}: tensor argument {parameter.name!r} cannot have a default")
            text += "=" + _default_text(parameter.default)
        parts.append(text)
    if "return" not in hints:
        raise TypeError(f"{op_name}: annotate the return value (jax.Array or tuple[jax.Array, ...]) or pass schema=")
    returned = hints["return"]
    if _is_array_type(returned):
        returns = "Tensor"
    elif typing.get_origin(returned) is tuple and all(_is_array_type(a) for a in typing.get_args(returned)):
        returns = "(" + ", ".join("Tensor" for _ in typing.get_args(returned)) + ")"
    else:
        raise TypeError(f"{op_name}: return annotation {returned!r} must be jax.Array or tuple[jax.Array, ...]")
    return "(" + ", ".join(parts) + ") -> " + returns


# --- calling the JAX function with torch-shaped arguments ---------------------------


class _Signature:
    """Which arguments of an op are tensors, from its schema."""

    def __init__(self, schema: torch._C.FunctionSchema) -> None:
        self.names = [a.name for a in schema.arguments]
        self.tensor = [isinstance(a.type, torch._C.TensorType) for a in schema.arguments]
        self.tensor_list = [
            isinstance(a.type, torch._C.ListType) and isinstance(a.type.getElementType(), torch._C.TensorType)
            for a in schema.arguments
        ]
        self.kwarg_only = [a.kwarg_only for a in schema.arguments]
        self.defaults = [
            a.default_value if a.has_default_value() else inspect.Parameter.empty for a in schema.arguments
        ]
        self.num_outputs = len(schema.returns)
        self.returns_list = self.num_outputs == 1 and isinstance(schema.returns[0].type, torch._C.ListType)

    def bind(self, args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
        """Every argument in schema order (defaults filled in)."""
        values = list(args) + [inspect.Parameter.empty] * (len(self.names) - len(args))
        for i, name in enumerate(self.names):
            if name in kwargs:
                values[i] = kwargs[name]
            elif values[i] is inspect.Parameter.empty:
                values[i] = self.defaults[i]
        return values

    def map_tensors(self, values: Sequence[Any], convert: Callable[[Any], Any]) -> list[Any]:
        """``values`` with every tensor (also inside ``Tensor[]`` arguments) replaced by ``convert(tensor)``."""
        return [
            convert(v) if t else [convert(x) for x in v] if tl else v
            for v, t, tl in zip(values, self.tensor, self.tensor_list)
        ]

    def call(self, fn: Callable, values: Sequence[Any]) -> Any:
        """``fn`` called with ``values`` (schema order), keyword-only ones by name."""
        positional = [v for v, k in zip(values, self.kwarg_only) if not k]
        keywords = {n: v for n, v, k in zip(self.names, values, self.kwarg_only) if k}
        return fn(*positional, **keywords)


def _as_tuple(out: Any) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _fake_outputs(signature: _Signature, fn: Callable, values: list[Any], op_name: str):
    """Output tensors (on the inputs' device) shaped as ``jax.eval_shape`` of ``fn`` says."""
    tensors = [v for v, t in zip(values, signature.tensor) if t] + [
        x for v, tl in zip(values, signature.tensor_list) if tl for x in v
    ]
    if not tensors:
        raise ValueError(f"{op_name}: a jax_op needs at least one tensor argument (it decides the device)")

    specs = signature.map_tensors(values, _abstract)
    is_array = [t or tl for t, tl in zip(signature.tensor, signature.tensor_list)]

    def with_arrays(arrays):
        # Only tensors are abstract: ints, bools and strings stay Python values, as in the real program.
        it = iter(arrays)
        return signature.call(fn, [next(it) if a else v for v, a in zip(specs, is_array)])

    try:
        avals = jax.eval_shape(with_arrays, [v for v, a in zip(specs, is_array) if a])
    except Exception as error:
        raise ValueError(f"{op_name}: the JAX function failed on inputs {_describe(specs)}: {error}") from error
    outs = [tensors[0].new_empty(tuple(a.shape), dtype=to_torch_dtype(a.dtype)) for a in _as_tuple(avals)]
    if signature.returns_list:
        return outs
    return outs[0] if signature.num_outputs == 1 else tuple(outs)


def _abstract(t: torch.Tensor) -> jax.ShapeDtypeStruct:
    # Symbolic sizes (torch.compile's dynamic dims) are specialised: tpu programs are per shape anyway.
    return jax.ShapeDtypeStruct(tuple(int(s) for s in t.shape), to_jax_dtype(t.dtype))


def _describe(specs: Sequence[Any]) -> str:
    return ", ".join(
        f"{list(s.shape)} {jnp.dtype(s.dtype).name}"
        if isinstance(s, jax.ShapeDtypeStruct)
        else "[" + _describe(s) + "]"
        if isinstance(s, list)
        else repr(s)
        for s in specs
    )


def _host_kernel(signature: _Signature, fn: Callable) -> Callable:
    """The op on CPU tensors: ``fn`` under ``jax.jit`` on XLA:CPU, one program per static arguments."""
    from tpurec.core import host_array, host_device, jax_to_host

    cache: dict[tuple, Callable] = {}

    def kernel(*args, **kwargs):
        # Looked up at the first call, not when the op is registered: registering (importing
        # tpurec.sparse) must not start JAX's backends, which tpurec.distributed.initialize()
        # (init_process_group of a "tpu" group) needs to precede.
        cpu = host_device()
        values = signature.bind(args, kwargs)
        runtime_value = [
            t or tl or isinstance(v, float) for v, t, tl in zip(values, signature.tensor, signature.tensor_list)
        ]
        statics = tuple((i, v) for i, (v, r) in enumerate(zip(values, runtime_value)) if not r)
        program = cache.get(statics)
        if program is None:
            fixed = dict(statics)

            def run(dynamic):
                it = iter(dynamic)
                return signature.call(fn, [fixed[i] if i in fixed else next(it) for i in range(len(values))])

            program = cache[statics] = jax.jit(run)
        converted = signature.map_tensors(values, lambda t: jax.device_put(host_array(t), cpu))
        dynamic = [v for v, r in zip(converted, runtime_value) if r]
        outs = [jax_to_host(o) for o in _as_tuple(program(dynamic))]
        if signature.returns_list:
            return outs
        return outs[0] if signature.num_outputs == 1 else tuple(outs)

    return kernel


# --- the public decorator ------------------------------------------------------------


class JaxOp:
    """A JAX (or Pallas) function registered as a PyTorch custom op.

    Calling it calls ``torch.ops.<namespace>.<name>``. Attributes:

    Attributes:
        name: ``"namespace::name"``.
        fn: the JAX function.
        op: the ``torch._ops.OpOverload`` of the forward.
        backward_op: the OpOverload computing input gradients.
        schema: the forward schema.
    """

    def __init__(self, name: str, fn: Callable, schema: str, backward: Callable | None) -> None:
        self.name = name
        self.fn = fn
        self.schema = schema
        namespace, short = name.split("::")
        lib = _library(namespace)
        lib.define(short + schema)
        self.op = getattr(getattr(torch.ops, namespace), short).default
        self.signature = _Signature(self.op._schema)
        if self.signature.returns_list:
            raise ValueError(f"{name}: return a tuple of arrays (schema '-> (Tensor, Tensor)'), not a Tensor[]")
        self.user_backward = backward
        self._register(lib, short, self.op, self.signature, fn)
        self.backward_op = self._define_backward(lib, namespace, short)
        self._vjp_checked: set = set()
        torch.library.register_autograd(name, self._autograd_backward, setup_context=self._setup_context, lib=lib)
        self.__doc__ = fn.__doc__
        self.__name__ = getattr(fn, "__name__", short)

    @staticmethod
    def _register(lib: torch.library.Library, short: str, op, signature: _Signature, fn: Callable) -> None:
        full_name = op._schema.name

        def fake(*args, **kwargs):
            return _fake_outputs(signature, fn, signature.bind(args, kwargs), full_name)

        def lowering(*args, **kwargs):
            return signature.call(fn, signature.bind(args, kwargs))

        torch.library.register_fake(full_name, fake, lib=lib)
        lib.impl(short, _host_kernel(signature, fn), "CPU")
        lower(op)(lowering)

    # --- backward: a second custom op, so it is part of the backward program too ---------

    def _define_backward(self, lib: torch.library.Library, namespace: str, short: str):
        arguments = str(self.op._schema).split("(", 1)[1].rsplit(") ->", 1)[0]
        # The cotangents first: the forward may end with keyword-only arguments.
        backward_schema = "(Tensor[] grad_outputs" + (", " + arguments if arguments else "") + ") -> Tensor[]"
        backward_name = f"{short}_backward"
        lib.define(backward_name + backward_schema)
        op = getattr(getattr(torch.ops, namespace), backward_name).default
        signature = _Signature(op._schema)
        forward_signature = self.signature
        forward = self.fn
        user_backward = self.user_backward
        num_outputs = forward_signature.num_outputs

        def gradients(grad_outputs, *args, **kwargs):
            values = forward_signature.bind(args, kwargs)
            positions = [i for i, t in enumerate(forward_signature.tensor) if t]
            cotangents = tuple(grad_outputs)
            if user_backward is not None:
                out = forward_signature.call(
                    lambda *a, **k: user_backward(cotangents[0] if num_outputs == 1 else cotangents, *a, **k), values
                )
                grads = list(_as_tuple(out))
                if len(grads) != len(positions):
                    raise ValueError(
                        f"{self.name}: backward returned {len(grads)} gradient(s); it must return one per tensor "
                        f"argument ({len(positions)}), None where there is none"
                    )
            else:

                def of_tensors(*arrays):
                    full = list(values)
                    for i, a in zip(positions, arrays):
                        full[i] = a
                    return forward_signature.call(forward, full)

                primals = [values[i] for i in positions]
                out, pullback = jax.vjp(of_tensors, *primals)
                grads = list(pullback(cotangents[0] if num_outputs == 1 else tuple(cotangents)))
            result = []
            for g, i in zip(grads, positions):
                primal = values[i]
                if g is None or g.dtype == jax.dtypes.float0:
                    g = jnp.zeros(primal.shape, primal.dtype)
                result.append(jnp.asarray(g).astype(primal.dtype).reshape(primal.shape))
            return result

        def bound(*args, **kwargs):
            values = signature.bind(args, kwargs)
            return signature.call(gradients, values)

        self._register(lib, backward_name, op, signature, bound)
        return op

    def _check_differentiable(self, values: list[Any]) -> None:
        """Fails in the forward (where an exception reaches the user) if jax.vjp cannot differentiate ``fn``."""
        if self.user_backward is not None:
            return
        key = tuple(
            (tuple(v.shape), v.dtype) if t else (v if not isinstance(v, float) else float)
            for v, t in zip(values, self.signature.tensor)
        )
        if key in self._vjp_checked:
            return
        positions = [i for i, t in enumerate(self.signature.tensor) if t]
        specs = [
            jax.ShapeDtypeStruct(tuple(int(s) for s in v.shape), to_jax_dtype(v.dtype)) if t else v
            for v, t in zip(values, self.signature.tensor)
        ]

        def pullback_shapes(*arrays):
            def of_tensors(*inner):
                full = list(specs)
                for i, a in zip(positions, inner):
                    full[i] = a
                return self.signature.call(self.fn, full)

            out, pullback = jax.vjp(of_tensors, *arrays)
            return pullback(out)

        try:
            jax.eval_shape(pullback_shapes, *[specs[i] for i in positions])
        except Exception as error:
            raise ValueError(
                f"{self.name}: jax.vjp cannot differentiate this function ({type(error).__name__}: {error}). "
                "Pallas kernels and other non-differentiable code need a backward: "
                f"jax_op({self.name!r}, backward=fn) with fn(grad_output, *args, **kwargs) returning one gradient "
                "per tensor argument"
            ) from error
        self._vjp_checked.add(key)

    def _setup_context(self, ctx, inputs, output, keyword_only_inputs: dict | None = None) -> None:
        # torch passes keyword_only_inputs only to ops that have keyword-only arguments.
        values = self.signature.bind(inputs, keyword_only_inputs or {})
        self._check_differentiable(values)
        ctx.tensor_positions = [i for i, t in enumerate(self.signature.tensor) if t]
        ctx.statics = {i: v for i, (v, t) in enumerate(zip(values, self.signature.tensor)) if not t}
        outputs = _as_tuple(output)
        ctx.output_meta = [(o.shape, o.dtype, o.device) for o in outputs]
        ctx.save_for_backward(*[values[i] for i in ctx.tensor_positions])

    def _autograd_backward(self, ctx, *grads):
        saved = iter(ctx.saved_tensors)
        values = [ctx.statics[i] if i in ctx.statics else next(saved) for i in range(len(self.signature.names))]
        grads = [
            torch.zeros(shape, dtype=dtype, device=device) if g is None else g
            for g, (shape, dtype, device) in zip(grads, ctx.output_meta)
        ]
        positional = [v for v, k in zip(values, self.signature.kwarg_only) if not k]
        keywords = {n: v for n, v, k in zip(self.signature.names, values, self.signature.kwarg_only) if k}
        input_grads = self.backward_op(list(grads), *positional, **keywords)
        result: list[Any] = [None] * len(values)
        for i, g in zip(ctx.tensor_positions, input_grads):
            result[i] = g if values[i].dtype.is_floating_point or values[i].dtype.is_complex else None
        return tuple(result)

    def __call__(self, *args, **kwargs):
        return self.op(*args, **kwargs)

    def __repr__(self) -> str:
        return f"JaxOp({self.name}{self.schema})"


def jax_op(name: str, *, schema: str | None = None, backward: Callable | None = None) -> Callable[[Callable], JaxOp]:
    """Registers a JAX function as the custom op ``name`` (``"namespace::op_name"``).

    Args:
        name: the op's qualified name; it becomes ``torch.ops.namespace.op_name``.
        schema: the operator schema without the name, e.g.
            ``"(Tensor x, Tensor y, *, float scale) -> Tensor"``; by default it is
            inferred from the function's annotations. Argument names must match the
            function's parameter names.
        backward: a JAX function ``backward(grad_output, *args, **kwargs)`` returning
            one gradient per tensor argument (None for none); ``grad_output`` is a
            tuple for ops with several outputs. Default: ``jax.vjp`` of the function.

    Returns:
        A decorator turning the function into a :class:`JaxOp`.

    Raises:
        ValueError: ``name`` is not ``namespace::op_name`` or is already defined.
        TypeError: the schema cannot be inferred from the annotations.

    Example::

        @jax_op("mylib::mul_add")
        def mul_add(x: jax.Array, y: jax.Array, *, alpha: float = 1.0) -> jax.Array:
            return x * y + alpha
    """
    match = _NAME.match(name) if isinstance(name, str) else None
    if match is None:
        raise ValueError(f"jax_op name {name!r} must look like 'namespace::op_name' (letters, digits, underscores)")
    if backward is not None and not callable(backward):
        raise TypeError(f"{name}: backward must be a function, got {type(backward).__name__}")
    namespace, short = match.groups()

    def decorate(fn: Callable) -> JaxOp:
        if not callable(fn):
            raise TypeError(f"{name}: jax_op decorates a function, got {type(fn).__name__}")
        if _has_schema(namespace, short):
            raise ValueError(f"{name} is already defined; pick another name (ops cannot be redefined in a process)")
        op_schema = schema if schema is not None else infer_schema(fn, name)
        return JaxOp(name, fn, op_schema, backward)

    return decorate


def _has_schema(namespace: str, short: str) -> bool:
    try:
        torch._C._get_schema(f"{namespace}::{short}", "")
        return True
    except RuntimeError:
        return False
