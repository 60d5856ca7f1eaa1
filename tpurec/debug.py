"""CPU shadow: every ATen op on tpu tensors run again by PyTorch on CPU, and compared.

``with tpurec.debug.shadow():`` (or ``TPUREC_MODE=debug TPUREC_SHADOW=cpu``) runs
each op as usual, then runs the same ATen overload on CPU copies of the values its
tpu inputs had, and raises :class:`ShadowMismatch` at the first op whose outputs, or
whose writes into its arguments, differ from PyTorch's. The error names the op, the
``nn.Module`` being run, the user's line and the difference.

Each op is judged on its own: its CPU inputs are copied from the tpu values just
before it runs, so a divergence never cascades into later ops, and random ops (whose
values cannot be compared) leave nothing behind that later ops would see differently.
A CPU copy is made per storage, with each tensor rebuilt as the same
(size, stride, offset) view of it, so views and in-place ops through views behave on
CPU as on tpu, and an in-place op is compared on the whole storage it wrote (the base
and every other view of it included).

Example::

    with tpurec.debug.shadow() as report:
        loss = model(x).sum()
        loss.backward()
        optimizer.step()
    print(report.checked, report.unchecked)
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import sys
import threading
import traceback
import weakref
from collections import Counter
from typing import Any, Iterator, cast

import torch
from torch.utils._pytree import tree_flatten, tree_map

from tpurec import config
from tpurec import core
from tpurec.core import LIBRARY_DIRS, TpuTensor, array_of, flush, get_mode, is_pending, jax_to_host, mode
from tpurec.dense.registry import get_lowering

__all__ = ["shadow", "ShadowMismatch", "ShadowReport", "DEFAULT_TOLERANCES", "FLOAT64_FACTOR"]

aten = torch.ops.aten

# (rtol, atol) per dtype, as the project's OpInfo check (float32: tests/dense/opinfo_device.py)
# and torch.testing (the others) use them: XLA's vectorised transcendental functions and
# reduction orders differ from ATen's by a few ulp, compounded over one op.
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-5),
    torch.complex64: (1e-4, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.complex128: (1e-7, 1e-7),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float16: (1e-3, 1e-5),
}
# A result that misses the tolerance is still right when it is as accurate as PyTorch's own:
# no farther from the op run in float64 than this many times CPU's error (the OpInfo rule).
FLOAT64_FACTOR = 2.0

# Their values are uninitialised memory on CPU: only shapes and dtypes can be compared.
_UNINITIALISED = {
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.empty_like.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten.empty_permuted.default,
    aten.resize_.default,
}
# Outputs that are a backend's workspace for its own backward op, not results: CTC's log_alpha
# is (N, T, 2 max(target_lengths) + 1) on CPU and CUDA, which read the lengths on the host (a
# sync); tpu bounds it by the targets' length instead, and CPU leaves the entries past each
# input's and target's length uninitialised. Only their dtype is compared; the loss and the
# gradient that the backward computes from them are compared in full.
_WORKSPACES = {aten._ctc_loss.default: (1,), aten._ctc_loss.Tensor: (1,)}
# Index outputs that may order ties either way (sort without stable=True, topk): any indices
# that pick CPU's values from the input are right.
_TIES = {aten.sort.default, aten.sort.stable, aten.topk.default}
# Host-side facts about a tpu tensor, not computations: CPU's answer is about a CPU tensor.
_NOT_COMPARED = {aten.is_pinned.default, aten._pin_memory.default}

_MODULE_KEY = "tpurec.debug.module"
_NO_SEQUENCE = 2**64 - 1  # AccumulateGrad's sequence number


class ShadowMismatch(RuntimeError):
    """An op whose tpu result differs from PyTorch CPU's on the same inputs.

    Attributes:
        op: the ATen overload, e.g. ``"aten.mul.Tensor"``.
        module: the ``nn.Module`` path being run (``None`` outside any module).
        where: the user's line, ``File "...", line N, in f: code``.
        details: the differences, one output or written argument per line.
    """

    def __init__(self, message: str, op: str, module: str | None, where: str | None, details: str) -> None:
        super().__init__(message)
        self.op, self.module, self.where, self.details = op, module, where, details


@dataclasses.dataclass
class ShadowReport:
    """What a shadow session compared.

    Attributes:
        checked: ops whose values were compared, by name.
        random: ops only shape- and dtype-checked because they draw random numbers.
        unchecked: ops PyTorch CPU could not run on these inputs -> its error.
        meta_conformant: outputs whose shape or dtype differs from CPU's as PyTorch's meta
            kernel says it should (CPU's own choice, e.g. bfloat16 layer norm statistics).
        undefined_casts: float -> integer casts with NaN, infinite or out-of-range elements,
            which are not compared (undefined in C++: x86 CPU gives INT_MIN, tpu and CUDA
            saturate, NaN -> 0).
        workspaces: outputs that only feed the op's own backward (CTC's ``log_alpha``), whose
            dtype alone is compared.
        ties: sort/topk index outputs that order equal values differently from CPU but pick
            the same values (PyTorch leaves that order unspecified unless ``stable=True``).
    """

    rtol: float | None = None
    atol: float | None = None
    checked: Counter = dataclasses.field(default_factory=Counter)
    random: Counter = dataclasses.field(default_factory=Counter)
    unchecked: dict = dataclasses.field(default_factory=dict)
    meta_conformant: Counter = dataclasses.field(default_factory=Counter)
    undefined_casts: Counter = dataclasses.field(default_factory=Counter)
    workspaces: Counter = dataclasses.field(default_factory=Counter)
    ties: Counter = dataclasses.field(default_factory=Counter)


# --- where an op runs: module path and user line ---------------------------------------


class _Frame:
    __slots__ = ("module", "path", "start")

    def __init__(self, module, path: str, start: int) -> None:
        self.module, self.path, self.start = module, path, start


_local = threading.local()
_names: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def _stack() -> list:
    stack = getattr(_local, "modules", None)
    if stack is None:
        stack = _local.modules = []
    return stack


def _label(module, path: str) -> str:
    return f"{path} ({type(module).__name__})" if path else f"the root module ({type(module).__name__})"


def _path_of(module, parent: _Frame | None) -> str:
    if parent is None:
        return ""
    known = _names.setdefault(module, {})
    if parent.path in known:
        return known[parent.path]
    name = next((n for n, m in parent.module._modules.items() if m is module), None)
    if name is None:  # called by an ancestor rather than its owner, or not registered at all
        name = next((n for n, m in parent.module.named_modules() if m is module), f"<{type(module).__name__}>")
    path = known[parent.path] = f"{parent.path}.{name}" if parent.path else name
    return path


def _forward_pre(module, args) -> None:
    if torch.compiler.is_compiling():  # Dynamo traces global hooks; compiled graphs are not shadowed
        return
    stack = _stack()
    path = _path_of(module, stack[-1] if stack else None)
    stack.append(_Frame(module, path, torch._C._autograd._get_sequence_nr()))  # pyright: ignore[reportAttributeAccessIssue] (no stub)


def _tensors(value) -> Iterator[torch.Tensor]:
    # Model outputs are often dict subclasses (transformers' ModelOutput) that pytree may not know.
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _forward_post(module, args, output) -> None:
    if torch.compiler.is_compiling():
        return
    stack = _stack()
    for i in range(len(stack) - 1, -1, -1):
        if stack[i].module is module:
            frame = stack[i]
            del stack[i:]
            break
    else:
        return
    if not torch.is_grad_enabled():
        return
    # The backward thread knows only the autograd node it runs: tag each node this forward
    # made (sequence numbers grow per thread, so they are the ones numbered since the
    # pre-hook) with the module. Submodules' hooks ran first, so the innermost module wins.
    label = _label(module, frame.path)
    todo = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
    seen = set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        number = node._sequence_nr()
        if number < frame.start:
            continue
        meta: dict[str, str] = node.metadata  # pyright: ignore[reportAssignmentType] (a dict at run time; the stub says a method)
        if _MODULE_KEY not in meta:
            meta[_MODULE_KEY] = label
        if number != _NO_SEQUENCE:
            todo.extend(n for n, _ in node.next_functions if n is not None)


def _current_module() -> str | None:
    node = torch._C._current_autograd_node()
    if node is not None:
        module = node.metadata.get(_MODULE_KEY)  # pyright: ignore[reportAttributeAccessIssue] (a dict at run time)
        name = type(node).__name__
        return f"backward of {module} (autograd node {name})" if module else f"backward (autograd node {name})"
    stack = _stack()
    return _label(stack[-1].module, stack[-1].path) if stack else None


def _describe(frame: traceback.FrameSummary) -> str:
    return f'File "{frame.filename}", line {frame.lineno}, in {frame.name}: {frame.line}'


def _user_lines(frames: list[traceback.FrameSummary], callers: int = 3) -> list[str]:
    """The innermost frame outside torch, jax and tpurec, then its callers outside installed packages.

    For a transformers model that is the line in the modeling code, then the user's own lines.
    """
    found = []
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if frame.filename.startswith("<frozen"):
            continue
        if path.startswith(LIBRARY_DIRS):
            continue
        if found and "-packages" + os.sep in path:
            continue
        found.append(_describe(frame))
        if len(found) > callers:
            break
    return found


# --- comparing values -----------------------------------------------------------------


def _tolerance(dtype: torch.dtype, report: ShadowReport) -> tuple[float, float]:
    rtol, atol = DEFAULT_TOLERANCES.get(dtype, (0.0, 0.0))
    return (rtol if report.rtol is None else report.rtol), (atol if report.atol is None else report.atol)


def _host(value) -> torch.Tensor:
    # A tpu value here is an op's input or output: the op runtime is loaded.
    value = core.value_of(value, "tpurec.debug.shadow") if isinstance(value, TpuTensor) else value
    value = jax_to_host(value) if not isinstance(value, torch.Tensor) else value
    return value.detach().resolve_conj().resolve_neg()


def _beyond(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> torch.Tensor:
    """Where ``actual`` misses ``expected`` (NaNs must sit in the same places, infinities be equal)."""
    a, e = actual.to(expected.dtype), expected
    close = (a - e).abs() <= atol + rtol * e.abs()
    close |= a == e
    close |= a.isnan() & e.isnan()
    return ~close


def _max_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    if not actual.numel():
        return 0.0
    error = (actual.to(reference.dtype) - reference).abs()
    error = torch.where(actual.isnan() & reference.isnan(), torch.zeros_like(error), error)
    return float(error.nan_to_num(nan=float("inf")).max())


def _index(flat: int, shape) -> list[int]:
    out = []
    for n in reversed(shape):
        out.append(flat % n)
        flat //= n
    return out[::-1]


def _difference(actual: torch.Tensor, expected: torch.Tensor, bad: torch.Tensor, rtol: float, atol: float) -> str:
    a, e = (
        actual.to(torch.complex128 if actual.is_complex() else torch.float64),
        expected.to(torch.complex128 if expected.is_complex() else torch.float64),
    )
    nan = a.isnan() != e.isnan()
    if bool(nan.any()):
        first = _index(int(nan.reshape(-1).nonzero()[0]), a.shape)
        side = "tpu" if bool(a.isnan()[tuple(first)]) else "CPU"
        return f"NaN in different places: {int(nan.sum())} elements, first at {first} (NaN on {side} only)"
    diff = (a - e).abs().nan_to_num(nan=0.0, posinf=float("inf"))
    flat = int(diff.reshape(-1).argmax())
    at = _index(flat, a.shape)
    rel = diff / e.abs()
    rel = torch.where(diff == 0, torch.zeros_like(rel), rel).nan_to_num(nan=0.0)
    rel_flat = int(rel.reshape(-1).argmax())
    return (
        f"max abs diff {float(diff.reshape(-1)[flat]):.3g} at {at} (tpu {a.reshape(-1)[flat].item():.6g}, "
        f"CPU {e.reshape(-1)[flat].item():.6g}); max rel diff {float(rel.reshape(-1)[rel_flat]):.3g} at "
        f"{_index(rel_flat, a.shape)}; {int(bad.sum())} of {bad.numel()} elements beyond rtol={rtol:g}, atol={atol:g}"
    )


def _meta(t: torch.Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}"


def _judge(actual: torch.Tensor, expected: torch.Tensor, reference, report: ShadowReport) -> str | None:
    """None when the tpu value ``actual`` matches CPU's ``expected``, else what differs.

    ``reference()`` gives CPU's result of the op in float64 (or raises), asked only on a miss.
    """
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        return f"tpu gives {_meta(actual)}, CPU {_meta(expected)}"
    if not (actual.is_floating_point() or actual.is_complex()):
        if torch.equal(actual, expected):
            return None
        bad = actual != expected
        flat = int(bad.reshape(-1).nonzero()[0])
        at = _index(flat, actual.shape)
        return (
            f"{int(bad.sum())} of {bad.numel()} elements differ (integers and bools must be equal), first at {at}: "
            f"tpu {actual.reshape(-1)[flat].item()}, CPU {expected.reshape(-1)[flat].item()}"
        )
    if torch.equal(actual, expected):  # most ops (views, copies, exact arithmetic): one pass
        return None
    rtol, atol = _tolerance(actual.dtype, report)
    bad = _beyond(actual, expected, rtol, atol)
    if not bool(bad.any()):
        return None
    text = _difference(actual, expected, bad, rtol, atol)
    if bool((actual.isnan() != expected.isnan()).any()):
        return text
    try:
        wide = reference()
    except Exception as error:  # noqa: BLE001 (an op may not run in float64: then the miss stands)
        return text + f"; (float64 run failed: {type(error).__name__})"
    if wide is None or wide.shape != actual.shape:
        return text
    if not bool(_beyond(actual, wide, rtol, atol).any()):
        return None
    tpu_error, cpu_error = _max_error(actual, wide), _max_error(expected, wide)
    if tpu_error <= FLOAT64_FACTOR * cpu_error:
        return None
    return text + f"; against float64 tpu errs by {tpu_error:.3g}, CPU {str(expected.dtype)[6:]} by {cpu_error:.3g}"


# --- one op on CPU ---------------------------------------------------------------------


_WIDE = {
    torch.float32: torch.float64,
    torch.bfloat16: torch.float64,
    torch.float16: torch.float64,
    torch.complex64: torch.complex128,
}


class _Inputs:
    """An op's tpu inputs as they were before it ran (jax arrays are immutable: references suffice)."""

    def __init__(self, args, kwargs) -> None:
        self.args, self.kwargs = args, kwargs
        self.before: dict[int, tuple] = {}
        # Each tensor's view as it was: in-place view ops (t_, squeeze_, as_strided_) change it.
        self.keys: dict[int, tuple] = {}
        for x in tree_flatten((args, kwargs))[0]:
            if isinstance(x, TpuTensor):
                self.keys.setdefault(id(x), x._key)
            if isinstance(x, TpuTensor) and id(x._storage) not in self.before:
                array = array_of(x)
                if is_pending(array):
                    flush("tpurec.debug.shadow")
                    array = array_of(x)
                self.before[id(x._storage)] = (x._storage, array)

    def on_cpu(self, widen: bool = False, unify: bool = False):
        """The call with each tpu tensor a view of a CPU copy of its storage; CPU tensors cloned.

        ``widen``: floats as float64 (complex64 as complex128). ``unify``: floats in the dtype
        of the first floating tensor.
        """
        storages: dict[int, torch.Tensor] = {}
        common: torch.dtype | None = None
        if unify:
            common = next(
                x.dtype
                for x in tree_flatten((self.args, self.kwargs))[0]
                if isinstance(x, torch.Tensor) and x.is_floating_point()
            )

        def convert(x):
            if isinstance(x, TpuTensor):
                flat = storages.get(id(x._storage))
                if flat is None:
                    flat = jax_to_host(self.before[id(x._storage)][1]).reshape(-1)
                    if widen and flat.dtype in _WIDE:
                        flat = flat.to(_WIDE[flat.dtype])
                    elif common is not None and flat.is_floating_point():
                        flat = flat.to(common)
                    storages[id(x._storage)] = flat
                _, dtype, size, stride, offset, storage_dtype = self.keys[id(x)]
                if widen:
                    dtype = _WIDE.get(dtype, dtype)
                elif common is not None and dtype.is_floating_point:
                    dtype = common
                base = flat if dtype == flat.dtype else flat.view(cast(torch.dtype, dtype))
                return base.as_strided(size, stride, offset)
            if isinstance(x, torch.Tensor):
                x = x.detach().clone()
                if common is not None and x.is_floating_point():
                    return x.to(common)
                return x.to(_WIDE[x.dtype]) if widen and x.dtype in _WIDE else x
            if isinstance(x, torch.device) and x.type == "tpu":
                return torch.device("cpu")
            return x

        args, kwargs = tree_map(convert, (self.args, self.kwargs))
        if isinstance(kwargs.get("device"), str) and kwargs["device"].startswith("tpu"):
            kwargs["device"] = "cpu"
        return args, kwargs, storages


def _written(func, args, kwargs) -> list[tuple[str, Any]]:
    """(argument name, value) of each argument the schema says the op writes."""
    found = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
            if value is not None:
                found.append((a.name, value))
    return found


_CASTS = {aten._to_copy.default, aten.copy.default, aten.copy_.default}


def _undefined_casts(func, cpu_args, result: torch.Tensor) -> torch.Tensor | None:
    """For a float -> integer cast, the elements of ``result`` whose source is NaN, infinite or
    outside the integer's range (C++ leaves their value undefined), as a bool mask; else None."""
    if func not in _CASTS or result.is_floating_point() or result.is_complex() or result.dtype == torch.bool:
        return None
    src = cpu_args[0] if func is aten._to_copy.default else cpu_args[1]
    if not isinstance(src, torch.Tensor) or not (src.is_floating_point() or src.is_complex()):
        return None
    info = torch.iinfo(result.dtype)
    value = (src.real if src.is_complex() else src).to(torch.float64).trunc()
    undefined = ~value.isfinite() | (value < info.min) | (value >= info.max + 1.0)
    return undefined.expand(result.shape) if bool(undefined.any()) else None


def _argument(func, args, kwargs, name: str, default):
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            value = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(name, default)
            return default if value is None else value
    return default


def _same_ties(func, cpu_args, cpu_kwargs, indices: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether ``indices`` (tpu's) pick CPU's ``values`` from the input, where ``func`` may order ties either way."""
    if func not in _TIES or (func is aten.sort.stable and _argument(func, cpu_args, cpu_kwargs, "stable", False)):
        return False
    source, dim = cpu_args[0], _argument(func, cpu_args, cpu_kwargs, "dim", -1)
    if source.dim() == 0 or indices.shape != values.shape or indices.dtype != torch.int64:
        return False
    if func is not aten.topk.default and not torch.equal(
        indices.sort(dim).values, torch.arange(source.shape[dim]).expand_as(indices.movedim(dim, -1)).movedim(-1, dim)
    ):
        return False  # a sort's indices are a permutation
    if bool(((indices < 0) | (indices >= source.shape[dim])).any()):
        return False
    picked = source.gather(dim, indices)
    return bool(
        (
            (picked == values) | (picked.isnan() & values.isnan()) if picked.is_floating_point() else picked == values
        ).all()
    )


def _meta_run(func, inputs: _Inputs):
    """The op's outputs by PyTorch's meta kernel (flattened), or the exception it raises."""

    def to_meta(x):
        if isinstance(x, TpuTensor):
            _, dtype, size, stride, _, _ = inputs.keys[id(x)]
            return torch.empty_strided(size, stride, dtype=dtype, device="meta")
        if isinstance(x, torch.Tensor):
            return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device="meta")
        if isinstance(x, torch.device) or (isinstance(x, str) and x.startswith("tpu")):
            return torch.device("meta")
        return x

    args, kwargs = tree_map(to_meta, (inputs.args, inputs.kwargs))
    try:
        return tree_flatten(func(*args, **kwargs))[0]
    except Exception as error:  # noqa: BLE001 (returned: the caller tells refusals from missing kernels)
        return error


def _meta_output(func, inputs: _Inputs, i: int) -> tuple | None:
    """(shape, dtype) of output ``i`` by PyTorch's meta kernel (None without one)."""
    outs = _meta_run(func, inputs)
    if isinstance(outs, Exception) or i >= len(outs) or not isinstance(outs[i], torch.Tensor):
        return None
    return outs[i].shape, outs[i].dtype


def _refused(error: Exception) -> bool:
    """``error`` says the inputs are invalid (not that a kernel is missing for this backend)."""
    return isinstance(error, (RuntimeError, ValueError, IndexError, TypeError)) and not isinstance(
        error, NotImplementedError
    )


def _is_random(func) -> bool:
    if torch.Tag.nondeterministic_seeded in func.tags:
        return True
    lowering = get_lowering(func)
    return lowering is not None and lowering.random


def _first_line(error: Exception) -> str:
    return (str(error).splitlines() or [""])[0][:200]


def _name(func) -> str:
    return f"{func.namespace}.{func._schema.name.split('::')[-1]}.{func._overloadname}"


def _compare(func, inputs: _Inputs, out, report: ShadowReport) -> list[str] | None:
    """The differences between the tpu run (done) and a CPU run of ``func``; None when CPU cannot run it."""
    cpu_args, cpu_kwargs, cpu_storages = inputs.on_cpu()
    unified = False
    try:
        expected = func(*cpu_args, **cpu_kwargs)
    except Exception as error:  # noqa: BLE001 (CPU may lack the kernel: then unchecked, not a divergence)
        expected = None
        meta = _meta_run(func, inputs)
        if _refused(error) and isinstance(meta, Exception) and _refused(meta):
            # CPU and the meta kernel refuse these inputs (baddbmm of float32 and bfloat16): PyTorch
            # raises where tpu computed something.
            return [f"PyTorch refuses these inputs and tpu accepted them: {type(error).__name__}: {_first_line(error)}"]
        dtypes = {
            x.dtype
            for x in tree_flatten((inputs.args, inputs.kwargs))[0]
            if isinstance(x, torch.Tensor) and x.is_floating_point()
        }
        if len(dtypes) > 1 and not isinstance(meta, Exception):
            # Where tpu follows the meta kernel's dtypes (float32 statistics of a bfloat16 layer norm),
            # CPU's kernel may refuse them in its backward: ask it with every float in one dtype.
            cpu_args, cpu_kwargs, cpu_storages = inputs.on_cpu(unify=True)
            unified = True
            try:
                expected = func(*cpu_args, **cpu_kwargs)
            except Exception:  # noqa: BLE001
                pass
        if expected is None:
            report.unchecked.setdefault(_name(func), f"{type(error).__name__}: {_first_line(error)}")
            return None
    wide_cache: list = []

    def wide_run():
        if not wide_cache:
            args, kwargs, storages = inputs.on_cpu(widen=True)
            wide_cache.append((tree_flatten(func(*args, **kwargs))[0], storages))
        return wide_cache[0]

    problems = []
    name = _name(func)
    uninitialised = func in _UNINITIALISED
    actual_flat, expected_flat = tree_flatten(out)[0], tree_flatten(expected)[0]
    if len(actual_flat) != len(expected_flat):
        return [f"tpu returns {len(actual_flat)} values, CPU {len(expected_flat)}"]
    for i, (a, e) in enumerate(zip(actual_flat, expected_flat)):
        label = f"output {i}" if len(actual_flat) > 1 else "output"
        if isinstance(a, torch.Tensor) != isinstance(e, torch.Tensor):
            problems.append(f"{label}: tpu gives {type(a).__name__}, CPU {type(e).__name__}")
            continue
        if not isinstance(a, torch.Tensor):
            if isinstance(a, float) and isinstance(e, float):
                a, e = torch.tensor(a, dtype=torch.float64), torch.tensor(e, dtype=torch.float64)
            elif a != e:
                problems.append(f"{label}: tpu gives {a!r}, CPU {e!r}")
                continue
            else:
                continue
        a = _host(a)
        e = e.detach().resolve_conj().resolve_neg()
        if i in _WORKSPACES.get(func, ()):
            report.workspaces[name] += 1
            if a.dtype != e.dtype:
                problems.append(f"{label}: tpu gives {_meta(a)}, CPU {_meta(e)}")
            continue
        if uninitialised:
            if a.shape != e.shape or a.dtype != e.dtype:
                problems.append(f"{label}: tpu gives {_meta(a)}, CPU {_meta(e)}")
            continue
        if (a.dtype != e.dtype or a.shape != e.shape) and _meta_output(func, inputs, i) == (a.shape, a.dtype):
            # PyTorch's backends disagree here and tpu follows the meta kernel (as CUDA does):
            # native_layer_norm's statistics of a bfloat16 input are float32 there, bfloat16 on
            # CPU; _embedding_bag's unused max_indices are empty there, one per bag on CPU.
            report.meta_conformant[name] += 1
            if a.shape != e.shape:
                continue
            a = a.to(e.dtype)  # so judged at CPU's precision
        if (
            i == 1
            and func in _TIES
            and not torch.equal(a, e)
            and _same_ties(func, cpu_args, cpu_kwargs, a, expected_flat[0])
        ):
            report.ties[name] += 1
            continue
        undefined = _undefined_casts(func, cpu_args, e)
        if undefined is not None and undefined.shape == a.shape:
            report.undefined_casts[name] += 1
            e = torch.where(undefined, a, e)
        verdict = _judge(a, e, lambda i=i: wide_run()[0][i], report)
        if verdict:
            problems.append(f"{label} {_meta(e)}: {verdict}")
    if uninitialised:
        return problems
    # Writes: the whole storage behind each written argument (its base and other views too),
    # and any storage the tpu side replaced although the schema does not say it writes it.
    written = {}
    for argument, value in _written(func, inputs.args, inputs.kwargs):
        values = value if isinstance(value, (list, tuple)) else [value]
        for k, t in enumerate(values):
            if isinstance(t, TpuTensor):
                where = f"argument '{argument}'" + (f" (tensor {k} of {len(values)})" if len(values) > 1 else "")
                written.setdefault(id(t._storage), (where, t))
    for key, (storage, array) in inputs.before.items():
        if storage.array is not array and key not in written:
            written[key] = ("an argument it should not write", None)
    for key, (where, tensor) in written.items():
        storage = inputs.before[key][0]
        a = jax_to_host(storage.array).reshape(-1)
        e = cpu_storages[key]
        if e.dtype != a.dtype and unified:
            e = e.to(a.dtype)
        if func is aten.copy_.default and tensor is not None and tensor is inputs.args[0]:
            dst = cpu_args[0]
            undefined = _undefined_casts(func, cpu_args, dst)
            if undefined is not None:
                # The same elements in the storage: where the written view lies in it.
                places = torch.arange(e.numel()).as_strided(dst.size(), dst.stride(), dst.storage_offset())
                flat = torch.zeros(e.numel(), dtype=torch.bool)
                flat[places[undefined]] = True
                e = torch.where(flat, a, e)
        verdict = _judge(a, e, lambda key=key: wide_run()[1][key], report)
        if verdict:
            owner = _owner(storage)
            problems.append(f"{where}, written in place{owner} (storage {_meta(e)}): {verdict}")
    return problems


def _owner(storage) -> str:
    """Which known parameter, gradient or buffer lives in ``storage`` (for optimizer steps)."""
    for root in list(_roots):
        for name, p in root.named_parameters():
            if isinstance(p, TpuTensor) and p._storage is storage:
                return f" = parameter {name}"
            if isinstance(p.grad, TpuTensor) and p.grad._storage is storage:
                return f" = gradient of {name}"
        for name, b in root.named_buffers():
            if isinstance(b, TpuTensor) and b._storage is storage:
                return f" = buffer {name}"
    return ""


_roots: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def _inputs_text(inputs: _Inputs) -> str:
    parts = []
    for x in tree_flatten((inputs.args, inputs.kwargs))[0]:
        if isinstance(x, TpuTensor):
            _, dtype, size, *_ = inputs.keys[id(x)]
            parts.append(f"{list(size)} {str(dtype).replace('torch.', '')}")
        elif isinstance(x, torch.Tensor):
            parts.append(f"{_meta(x)} ({x.device})")
        elif isinstance(x, (int, float, bool)):
            parts.append(repr(x))
        if len(parts) >= 8:
            parts.append("...")
            break
    return ", ".join(parts)


# --- the per-op hook -------------------------------------------------------------------


_sessions: list[ShadowReport] = []
_pending: ShadowMismatch | None = None
_hook_handles: list = []


def _raise_pending() -> None:
    global _pending
    error, _pending = _pending, None
    assert error is not None, "_raise_pending is called only with a pending mismatch"
    raise error


def _check(run, func, args, kwargs):
    if _pending is not None and torch._C._current_autograd_node() is None:
        _raise_pending()
    if not _sessions or get_mode() != "debug" or getattr(_local, "busy", False) or func in _NOT_COMPARED:
        return run(func, args, kwargs)
    report = _sessions[-1]
    inputs = _Inputs(args, kwargs)
    out = run(func, args, kwargs)
    name = _name(func)
    if _is_random(func):
        report.random[name] += 1
        return out
    in_engine = torch._C._current_autograd_node() is not None
    _local.busy = True
    # One PyTorch thread for the CPU side: between ops its OpenMP workers spin, fighting XLA:CPU's
    # own pool for the cores (an elementwise op on 256x256 took 1 ms instead of 10 us on 2 cores).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        problems = _compare(func, inputs, out, report)
        if problems is None:
            return out
        report.checked[name] += 1
        if problems:
            error = _mismatch(name, inputs, problems, in_engine)
            if not in_engine:
                raise error
            _defer(error)
    except ShadowMismatch:
        raise
    except Exception as error:  # noqa: BLE001
        if not in_engine:
            raise
        # An exception cannot leave the autograd engine (the process would abort): keep it for later.
        _defer(RuntimeError(f"tpurec.debug.shadow: comparing {name} failed: {type(error).__name__}: {error}"))
    finally:
        torch.set_num_threads(threads)
        _local.busy = False
    return out


def _defer(error) -> None:
    global _pending
    if _pending is None:
        _pending = error


_SHOWN = 4


def _mismatch(name: str, inputs: _Inputs, problems: list[str], in_engine: bool) -> ShadowMismatch:
    module = _current_module()
    user = _user_lines(traceback.extract_stack())  # backward runs on the caller's thread (core/device.py)
    inner = user[0] if user else None
    lines = [f"tpurec.debug.shadow: {name} on tpu differs from PyTorch CPU on the same inputs"]
    lines.append(f"  module: {module or 'none (outside any nn.Module forward)'}")
    lines.append(f"  {'backward called at' if in_engine else 'at'}: {inner or 'unknown'}")
    lines.extend(f"  called from: {line}" for line in user[1:])
    lines.append(f"  inputs: {_inputs_text(inputs)}")
    lines.extend(f"  {p}" for p in problems[:_SHOWN])
    if len(problems) > _SHOWN:
        lines.append(f"  ... and {len(problems) - _SHOWN} more outputs or written arguments that differ")
    if in_engine:
        lines.append("  (found during backward; raised at the next tpu op, as errors cannot cross the autograd engine)")
    details = "\n".join(problems)
    return ShadowMismatch("\n".join(lines), name, module, inner, details)


def _track_roots(module, args) -> None:
    if not torch.compiler.is_compiling() and not _stack():
        _roots.add(module)


def _start(report: ShadowReport) -> None:
    if not _sessions:
        _hook_handles.extend(
            [
                torch.nn.modules.module.register_module_forward_pre_hook(_track_roots),
                torch.nn.modules.module.register_module_forward_pre_hook(_forward_pre),
                torch.nn.modules.module.register_module_forward_hook(_forward_post, always_call=True),
            ]
        )
        core.install_shadow(_check)  # the op runtime, loaded now if no tpu op ran yet
    _sessions.append(report)


def _stop(report: ShadowReport) -> None:
    _sessions.remove(report)
    if not _sessions:
        core.install_shadow(None)
        for handle in _hook_handles:
            handle.remove()
        _hook_handles.clear()
        _stack().clear()


@contextlib.contextmanager
def shadow(rtol: float | None = None, atol: float | None = None) -> Iterator[ShadowReport]:
    """Checks every ATen op on tpu tensors in the block against PyTorch CPU.

    The block runs in debug mode (each op synchronously). Each op also runs on CPU
    copies of its inputs; the first whose outputs or in-place writes differ raises
    :class:`ShadowMismatch` (during backward: at the next tpu op after it, or at the
    end of the block).

    Args:
        rtol, atol: tolerance for floating results, ``|tpu - cpu| <= atol + rtol * |cpu|``;
            default per dtype (:data:`DEFAULT_TOLERANCES`, float32: 1e-4, 1e-5). A miss is
            still accepted when tpu is no farther from the op run in float64 than
            :data:`FLOAT64_FACTOR` times CPU is. Integers, bools and NaN positions must match.

    Yields:
        A :class:`ShadowReport` counting the ops compared.
    """
    report = ShadowReport(rtol=rtol, atol=atol)
    with mode("debug"):
        _start(report)
        try:
            yield report
        finally:
            _stop(report)
    if _pending is not None:
        _raise_pending()


def _from_environment() -> None:
    if config.get("TPUREC_SHADOW") == "off":
        return
    if get_mode() != "debug":
        raise ValueError(
            f"TPUREC_SHADOW=cpu compares each op as it runs, which needs TPUREC_MODE=debug (it is {get_mode()!r})"
        )
    _start(ShadowReport())
    atexit.register(_finish_environment)


def _finish_environment() -> None:
    # A divergence found in the last backward of a script, with no tpu op after it to raise it.
    if _pending is not None:
        print(str(_pending), file=sys.stderr)


_from_environment()
