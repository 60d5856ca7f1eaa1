"""The shadow's dispatch hook: every ATen op on tpu tensors of a session, compared as it runs.

:func:`start` installs it (``tpurec.core.install_shadow``) with module hooks that record which
``nn.Module`` runs each op (forward, and backward through tags on the autograd nodes), and
:func:`stop` removes it. Each op goes to ``tpurec.debug.compare``; a difference raises
:class:`ShadowMismatch` naming the op, the module, the user's line and the difference (found
during backward, it is kept and raised at the next tpu op: errors cannot cross the autograd
engine).
"""

from __future__ import annotations

import os
import threading
import traceback
import weakref
from typing import Iterator

import torch
from torch.utils._pytree import tree_flatten

from tpurec import core
from tpurec.core import LIBRARY_DIRS, TpuTensor, get_mode
from tpurec.debug.compare import Inputs, ShadowReport, compare, is_random, op_name, roots, tensor_summary

__all__ = ["ShadowMismatch", "pending", "raise_pending", "start", "stop"]

aten = torch.ops.aten

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


def _inputs_text(inputs: Inputs) -> str:
    parts = []
    for x in tree_flatten((inputs.args, inputs.kwargs))[0]:
        if isinstance(x, TpuTensor):
            _, dtype, size, *_ = inputs.keys[id(x)]
            parts.append(f"{list(size)} {str(dtype).replace('torch.', '')}")
        elif isinstance(x, torch.Tensor):
            parts.append(f"{tensor_summary(x)} ({x.device})")
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


def pending() -> Exception | None:
    """The difference found during backward and not raised yet (errors cannot cross the autograd engine)."""
    return _pending


def raise_pending() -> None:
    """Raises the difference :func:`pending` holds (and forgets it)."""
    global _pending
    error, _pending = _pending, None
    assert error is not None, "raise_pending is called only with a pending mismatch"
    raise error


def _check(run, func, args, kwargs):
    if _pending is not None and torch._C._current_autograd_node() is None:
        raise_pending()
    if not _sessions or get_mode() != "debug" or getattr(_local, "busy", False) or func in _NOT_COMPARED:
        return run(func, args, kwargs)
    report = _sessions[-1]
    inputs = Inputs(args, kwargs)
    out = run(func, args, kwargs)
    name = op_name(func)
    if is_random(func):
        report.random[name] += 1
        return out
    in_engine = torch._C._current_autograd_node() is not None
    _local.busy = True
    # One PyTorch thread for the CPU side: between ops its OpenMP workers spin, fighting XLA:CPU's
    # own pool for the cores (an elementwise op on 256x256 took 1 ms instead of 10 us on 2 cores).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        problems = compare(func, inputs, out, report)
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


def _mismatch(name: str, inputs: Inputs, problems: list[str], in_engine: bool) -> ShadowMismatch:
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
        roots.add(module)


def start(report: ShadowReport) -> None:
    """Starts comparing every op into ``report`` (sessions nest: the innermost counts)."""
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


def stop(report: ShadowReport) -> None:
    """Ends the session of ``report``; the last one removes the hooks."""
    _sessions.remove(report)
    if not _sessions:
        core.install_shadow(None)
        for handle in _hook_handles:
            handle.remove()
        _hook_handles.clear()
        _stack().clear()
