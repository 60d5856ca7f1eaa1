"""One op call as one cached program: the arguments split by the calling convention.

:func:`execute` runs a ``JAX`` lowering of the table on tpu tensors; the
arguments travel as :mod:`tpurec.dense.calling` says (tensors and runtime
scalars are program inputs, the rest is part of the key). :func:`_fallback`
runs an op without a lowering through its composite or decomposition.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import torch
from torch.utils._pytree import tree_map

from tpurec.dense.composites import COMPOSITES
from tpurec.core import accounting, fused, modes, rng, runtime
from tpurec.core.errors import ArgumentError, lowering_failed, unsupported_op
from tpurec.core.fused import Pending
from tpurec.core.programs import _placed, run_program, store_array, fresh, fresh_with_key
from tpurec.core.tensor import TpuTensor, host_array, is_plain
from tpurec.core.views import read_view, reinterpretation, write_view
from tpurec.dense import calling, dtype_rules
from tpurec.dense.calling import argument_kinds
from tpurec.dense.registry import Lowering, to_jax_dtype

__all__ = ["execute"]


# --- building a call ---------------------------------------------------------


class _Call:
    """One op call split into runtime inputs (``inputs``) and the device they live on."""

    __slots__ = ("inputs", "index")

    def __init__(self) -> None:
        self.inputs: list = []
        self.index: int | None = None

    def tensor(self, t) -> tuple:
        """Records tensor ``t``; returns how the program rebuilds it."""
        if isinstance(t, TpuTensor):
            if self.index is None:
                self.index = t._storage.index
            elif t._storage.index != self.index:
                raise RuntimeError(
                    "Expected all tensors to be on the same device, but found at least two devices, "
                    f"tpu:{self.index} and tpu:{t._storage.index}!"
                )
            self.inputs.append(t._storage.array)
            return ("t",) + t._key
        if isinstance(t, torch.Tensor):
            if t.dim() == 0 and t.device.type == "cpu":
                # A CPU 0-dim tensor is a scalar operand, as on CUDA; as a numpy value
                # JAX moves it to wherever the program runs.
                self.inputs.append(host_array(t))
                return ("s", t.dtype)
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found a {t.device} tensor "
                f"of shape {tuple(t.shape)} mixed with tpu tensors; move it with .to('tpu')"
            )
        raise TypeError(f"expected a tensor, got {type(t).__name__}")


def _rebuild_tensor(spec: tuple, it):
    """A tensor argument inside the program: its view of a storage, or a CPU scalar operand."""
    if spec[0] == "t":
        _, shape, dtype, size, stride, offset, storage_dtype = spec
        return read_view(next(it), size, stride, offset, reinterpretation(storage_dtype, dtype))
    return next(it).astype(to_jax_dtype(spec[1]))  # "s": a CPU 0-dim tensor


def _flatten_out(out) -> list:
    """An op's outputs as one list: a tuple of tensors and lists of tensors (``_fused_adam``'s
    new parameters, gradients and state) in order, a list's tensors in its place."""
    if not isinstance(out, (tuple, list)):
        return [out]
    flat = []
    for o in out:
        if isinstance(o, (tuple, list)):
            flat.extend(o)
        else:
            flat.append(o)
    return flat


def _meta_outputs(func, args, kwargs) -> list | None:
    """(shape, dtype) of each output as PyTorch's meta kernels predict them, or None without one."""

    def to_meta(x):
        if isinstance(x, TpuTensor):
            return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device="meta")
        if isinstance(x, torch.device):
            return torch.device("meta")
        return x

    meta_kwargs = {k: to_meta(v) for k, v in kwargs.items()}
    if "device" in meta_kwargs:
        meta_kwargs["device"] = torch.device("meta")
    try:
        out = func(*tree_map(to_meta, args), **meta_kwargs)
    except Exception:
        return None
    return [(tuple(o.shape), o.dtype) if isinstance(o, torch.Tensor) else None for o in _flatten_out(out)]


def _debug_check(func, outs, metas) -> None:
    """Debug mode: each result against the meta shape/dtype, and optionally NaN/Inf."""
    for i, o in enumerate(outs):
        if o is None:
            continue
        if metas is not None and metas[i] is not None:
            shape, dtype = metas[i]
            if tuple(o.shape) != shape or o.dtype != to_jax_dtype(dtype):
                raise RuntimeError(
                    f"tpurec debug: {func} output {i} is {tuple(o.shape)} {o.dtype}, but PyTorch's meta kernel "
                    f"says {shape} {dtype}; this is a lowering bug, please report it"
                )
        if modes.check_nan() and jnp.issubdtype(o.dtype, jnp.inexact) and not bool(jnp.isfinite(o).all()):
            raise FloatingPointError(f"tpurec debug: {func} produced NaN or Inf in output {i} (TPUREC_CHECK_NAN=1)")


# --- the fast path: a call repeated with the same argument metadata ------------------------
#
# The calling convention's split (one spec tuple per argument, the program key, the program
# cache under the current settings) is the same for every call of an op with the same
# argument metadata. A repeated call gathers its runtime inputs and a flat signature in one
# loop, finds everything else in ``runtime.programs.fast_table()`` and wraps the outputs with
# their metadata known. The first call of each signature takes the full path and checks that
# both gather the same inputs before the signature is kept.

# Static (baked-in) argument types a signature holds by value; with their type, so that
# ``True`` and ``1`` are different signatures.
_STATIC_ATOMS = frozenset({bool, str, torch.dtype, torch.memory_format, torch.layout, torch.device})
_TENSOR, _DYNAMIC, _STATIC = calling.TENSOR, calling.DYNAMIC, calling.STATIC
_TENSOR_LIST, _DYNAMIC_LIST = calling.TENSOR_LIST, calling.DYNAMIC_LIST


class _Fast:
    """What a repeated call needs: the program and its outputs' metadata (``TpuTensor._key``)."""

    __slots__ = ("program", "outputs", "plain", "random")

    def __init__(self, program: runtime.Program, outputs: tuple, random: bool) -> None:
        self.program = program
        self.outputs = outputs  # per output: its tensor key, or None (no tensor)
        self.plain = tuple(key is not None and is_plain(key) for key in outputs)  # see tensor.with_key
        self.random = random


def _gather(func, kinds: tuple, args: tuple, kwargs: dict, targets: list | None, special: frozenset):
    """The signature, runtime inputs, device and pending flag of a call, or None when it needs the full path.

    The inputs are gathered in :func:`tpurec.dense.calling.split`'s order (arguments, keyword
    arguments, targets); only calls whose arguments are tpu tensors, Python numbers, ``None``
    (also in lists) and simple static values take this path (CPU scalar tensors take the
    full one). ``special``: the lowering's ``special_scalars``, numbers that are static values.
    """
    positional, by_name = kinds
    if len(args) > len(positional):
        return None
    signature: list[Any]
    if kwargs:
        values = (*args, *kwargs.values())
        order = (*positional[: len(args)], *(by_name.get(k, _STATIC) for k in kwargs))
        signature = [id(func), tuple(kwargs)]  # id: an OpOverload's own hash is Python code
    else:
        values, order = args, positional
        signature = [id(func)]
    add = signature.append
    inputs: list = []
    put = inputs.append
    index = None
    pending = False
    for kind, value in zip(order, values):
        if isinstance(value, TpuTensor):
            if kind != _TENSOR:
                return None
            storage = value._storage
            if index is None:
                index = storage.index
            elif storage.index != index:
                return None  # the full path raises the device error
            add(value._key)
            array = storage.array
            if type(array) is Pending:
                pending = True
            put(array)
        elif value is None:
            add(None)
        else:
            kind_of_value = type(value)
            if kind_of_value is int or kind_of_value is float:
                if kind == _DYNAMIC and special and value in special:
                    add((kind_of_value, value))  # a special value: static, as calling.split makes it
                elif kind == _TENSOR or kind == _DYNAMIC:
                    add(kind_of_value)  # a runtime scalar: its value is an input, not part of the key
                    put(value)
                elif kind == _STATIC:
                    add((kind_of_value, value))
                else:
                    return None
            elif kind_of_value in _STATIC_ATOMS and kind != _TENSOR_LIST and kind != _DYNAMIC_LIST:
                add((kind_of_value, value))
            elif kind == _STATIC and (kind_of_value is list or kind_of_value is tuple):
                for item in value:
                    if type(item) is not int:
                        return None
                add((kind_of_value, tuple(value)))
            elif kind == _TENSOR_LIST and (kind_of_value is list or kind_of_value is tuple):
                add(len(value))  # cat's inputs, a foreach op's tensors
                for item in value:
                    if isinstance(item, TpuTensor):
                        storage = item._storage
                        if index is None:
                            index = storage.index
                        elif storage.index != index:
                            return None
                        add(item._key)
                        array = storage.array
                        if type(array) is Pending:
                            pending = True
                        put(array)
                    elif item is None:
                        add(None)
                    else:
                        return None
            elif kind == _DYNAMIC_LIST and (kind_of_value is list or kind_of_value is tuple):
                types = tuple(type(item) for item in value)  # a foreach op's scalars: runtime inputs
                for item_type in types:
                    if item_type is not int and item_type is not float:
                        return None
                add(types)
                inputs.extend(value)
            else:
                return None
    if targets is not None:
        add("targets")
        if len(targets) > 1:
            # Which targets share a storage: their writes go one after another into one value
            # (see _execute), so the program differs with it.
            firsts: dict[int, int] = {}
            add(tuple(firsts.setdefault(id(t._storage), i) for i, t in enumerate(targets)))
        for t in targets:
            storage = t._storage
            if storage.index != index:
                return None
            add(t._key)
            array = storage.array
            if type(array) is Pending:
                pending = True
            put(array)
    if index is None:
        return None  # no tensor input: placed by the device argument (the full path)
    return tuple(signature), inputs, index, pending


def execute(func, lowering: Lowering, args: tuple, kwargs: dict, targets: list | None = None, device=None, kinds=None):
    """Runs ``lowering`` for ``func``: the fast path for a repeated call, else :func:`_execute`.

    Args, returns: as :func:`_execute`; ``kinds``: ``argument_kinds(func, lowering.static_scalars)``
    if the caller has them.
    """
    mode = modes.get_mode()
    if mode == "debug" or device is not None:
        return _execute(func, lowering, args, kwargs, targets, device)
    if kinds is None:
        kinds = argument_kinds(func, lowering.static_scalars)
    gathered = _gather(func, kinds, args, kwargs, targets, lowering.special_scalars)
    if gathered is None:
        return _execute(func, lowering, args, kwargs, targets, device)
    signature, inputs, index, pending = gathered
    table = runtime.programs.fast_table()
    fast = table.get(signature)
    if fast is None:
        return _execute_and_remember(func, lowering, args, kwargs, targets, signature, inputs, table)
    accounting.counters().cache_hits += 1
    program = fast.program
    if fast.random:
        inputs.extend(rng.next_seed_and_counter())
    if mode == "fused":
        outs = fused.record(program, tuple(inputs), index)
    else:
        if pending:
            inputs = [fused.resolve(x) for x in inputs]
        outs = program(*inputs)
    if targets is not None:
        for t, new in zip(targets, outs):
            store_array(t._storage, new)
        return targets
    return [
        None if key is None else fresh_with_key(o, index, key, plain)
        for o, key, plain in zip(outs, fast.outputs, fast.plain)
    ]


def _execute_and_remember(func, lowering: Lowering, args, kwargs, targets, signature: tuple, inputs: list, table: dict):
    """The first call of ``signature``: the full path, then what a repeat needs is kept."""
    seen_inputs: list = []
    outs = _execute(func, lowering, args, kwargs, targets, None, seen=seen_inputs)
    program = seen_inputs.pop()
    if lowering.random:
        del seen_inputs[-3:]
    same = len(seen_inputs) == len(inputs) and all(
        a is b or (type(a) is type(b) and not isinstance(a, (jax.Array, Pending)) and a == b)
        for a, b in zip(seen_inputs, inputs)
    )
    # A signature equal to itself (a NaN static argument is not) whose inputs the full path
    # gathered the same way: a repeat may take the fast path.
    if same and signature == signature:
        outputs = tuple(None if o is None else o._key for o in outs) if targets is None else ()
        table[signature] = _Fast(program, outputs, lowering.random)
    return outs


def _execute(
    func,
    lowering: Lowering,
    args: tuple,
    kwargs: dict,
    targets: list | None = None,
    device=None,
    seen: list | None = None,
):
    """Runs ``lowering`` for ``func`` as one cached program.

    Args:
        func: the functional ATen overload being run.
        lowering: its table entry.
        args, kwargs: the call, with tpu tensors.
        targets: tpu tensors to overwrite with the outputs (in-place / out=
            variants), one per output; ``None`` returns fresh tensors.
        device: device index for ops without tensor inputs.
        seen: if given, receives the runtime inputs and then the program (for the fast path).
    """
    kinds = argument_kinds(func, lowering.static_scalars)
    call = _Call()
    inputs, record = call.inputs, call.tensor
    special = lowering.special_scalars
    arg_specs = tuple(calling.split(calling.kind_of(kinds, i), a, inputs, record, special) for i, a in enumerate(args))
    kw_specs = tuple(
        (k, calling.split(calling.kind_of(kinds, k), v, inputs, record, special)) for k, v in kwargs.items()
    )
    target_specs = ()
    # For each target, the first target over the same storage: views of one storage (the
    # destinations of _foreach_copy_ into split views of one buffer, as FSDP2's copy-in) are
    # written one after another into one value, so no write is lost.
    shared: tuple[int, ...] = ()
    if targets is not None:
        target_specs = tuple(call.tensor(t) for t in targets)
        firsts: dict[int, int] = {}
        shared = tuple(firsts.setdefault(id(t._storage), i) for i, t in enumerate(targets))
    if lowering.random:
        call.inputs.extend(rng.next_seed_and_counter())
    index = call.index if call.index is not None else (device if device is not None else torch.tpu.current_device())
    placed_on = index if call.index is None else None
    key = (func, arg_specs, kw_specs, target_specs, shared, placed_on)

    def build():
        # Mixed dtypes PyTorch refuses (JAX would promote them); once per program, not per call.
        dtype_rules.check(func, args, kwargs, targets)
        metas = _meta_outputs(func, args, kwargs)
        dtypes = None if metas is None else [None if m is None else m[1] for m in metas]
        if targets is not None and dtypes is not None:
            dtype_rules.check_writable(dtypes, [t.dtype for t in targets])
        random = lowering.random

        def program(*inputs):
            it = iter(inputs)
            a = [calling.rebuild(s, it, _rebuild_tensor) for s in arg_specs]
            kw = {k: calling.rebuild(s, it, _rebuild_tensor) for k, s in kw_specs}
            storages = [next(it) for _ in target_specs]
            if random:
                kw["key"] = rng.key_from(next(it), next(it), next(it))
            outs = _flatten_out(lowering.fn(*a, **kw))
            if dtypes is not None:
                outs = [o if d is None or o is None else o.astype(to_jax_dtype(d)) for o, d in zip(outs, dtypes)]
            if not target_specs:
                return outs
            written: dict[int, Any] = {}
            for storage, out, spec, first in zip(storages, outs, target_specs, shared):
                base = written.get(first, storage)
                value: Any = out  # an output of the lowering (None only for outputs that are not written)
                written[first] = write_view(base, value, spec[3], spec[4], spec[5], reinterpretation(spec[6], spec[2]))
            return [written[first] for first in shared]

        entry = runtime.Program(program, **_placed(placed_on))
        entry.metas = metas
        return entry

    program = runtime.programs.get(key, build)
    if seen is not None:
        seen.extend(call.inputs)
        seen.append(program)
    try:
        outs = run_program(program, *call.inputs, device=index)
    except Exception as error:
        if program.ran or program.out_avals is not None or isinstance(error, ArgumentError):
            raise
        raise lowering_failed(func, error) from error
    if targets is not None:
        for t, new in zip(targets, outs):
            store_array(t._storage, new)
        return targets
    if modes.get_mode() == "debug":
        _debug_check(func, outs, program.metas)
    return [None if o is None else fresh(o, index) for o in outs]


# --- ops without a lowering ---------------------------------------------------


# Non-ATen op -> whether its library registered a PrivateUse1 (= tpu) kernel (cached: asked per call).
_LIBRARY_DEVICE_KERNELS: dict = {}


def library_device_kernel(func) -> bool:
    """A library (not ATen) gave ``func`` a kernel for PrivateUse1 devices, written in torch ops.

    FSDP2's ``fsdp::all_gather_copy_in`` / ``split_with_sizes_copy`` / ``chunk_cat`` are such
    kernels (registered for CUDA, XPU, ..., PrivateUse1 alike). tpurec's tensors reach Python
    dispatch before any backend kernel runs, so without this they would have no kernel at all;
    running the library's kernel runs its torch ops on tpu, each through the lowering table.
    """
    found = _LIBRARY_DEVICE_KERNELS.get(func)
    if found is None:
        found = _LIBRARY_DEVICE_KERNELS[func] = func.namespace not in (
            "aten",
            "prims",
        ) and torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "PrivateUse1")
    return found


def _fallback(func, args, kwargs):
    """Ops without a lowering: a decomposition into ops that have one, or a clear error."""
    from torch._decomp import decomposition_table

    composite = COMPOSITES.get(func)
    decomposition = composite.fn if composite is not None else decomposition_table.get(func)
    if decomposition is not None:
        return decomposition(*args, **kwargs)
    if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
        out = func.decompose(*args, **kwargs)
        if out is not NotImplemented:
            return out
    if func.namespace not in ("aten", "prims") and torch._C._dispatch_has_kernel_for_dispatch_key(
        func.name(), "CompositeExplicitAutograd"
    ):
        # A library's device-independent implementation (torch.library.custom_op's default kernel,
        # e.g. torch.nn's chunked linear_cross_entropy), written in torch ops that run here one by one.
        return func._op_dk(torch._C.DispatchKey.CompositeExplicitAutograd, *args, **kwargs)
    raise unsupported_op(func)


# Ops whose output shape depends on input values: XLA needs static shapes, so
# they run on the host (a sync point in fused mode) and their result comes back.
