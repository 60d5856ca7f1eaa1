"""Recompilation diagnostics: why a warm program compiled again.

Every new XLA program (an eager op program, a fused window, a compiled graph
variant) is compared with the programs of the same *family* (the same ATen op,
the fused windows of one device synced from one line of user code, the
graphs Dynamo made for one frame). When
the family is warm (one of its programs has been reused at least once, so the
loop reached a steady state) the new program is a **recompilation**: it is
reported with

* what changed in the cache key compared with the nearest existing program
  ("shape of argument 0 (self) changed from [512, 13] to [511, 13]", "static
  argument 'dim' changed from 0 to 1", "a new fused-window structure: ..."),
  plus Dynamo's guard failure for compiled graphs;
* the user's line that triggered it (the op call, the sync point, the call of
  the compiled module);
* a hint (fixed batch sizes or padding, static capacities, ``mark_dynamic``,
  moving a sync point).

``TPUREC_LOG=recompiles`` logs each report (logger ``tpurec.recompiles``, level
WARNING) as it happens; :func:`explain_recompiles` returns the reports since the
last ``tpurec.reset_stats()``; ``tpurec.stats()`` has ``recompilations`` and
``recompile_reasons`` (one-line reason -> count).

Example::

    tpurec.reset_stats()
    for batch in loader:
        train_step(batch)
    for report in tpurec.explain_recompiles():
        print(report)
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import linecache
import logging
import os
import sys
import sysconfig
import time
import weakref
from typing import Any, Iterator

import torch
from torch._C._dynamo.eval_frame import set_eval_frame

from tpurec import config
from tpurec.core import accounting, errors, profiler, runtime

__all__ = ["Recompilation", "explain_recompiles", "compiling", "logging_enabled"]

log = logging.getLogger("tpurec.recompiles")


def logging_enabled() -> bool:
    """``TPUREC_LOG`` names ``recompiles`` (a comma-separated list of topics)."""
    topics = config.get("TPUREC_LOG")
    return "recompiles" in topics or "all" in topics


@dataclasses.dataclass
class Recompilation:
    """One recompilation of a warm program.

    Attributes:
        program: what compiled again: ``"op aten.mm.default"``, ``"fused window (57 ops)"``,
            ``"forward graph (frame 0, compile 1)"``.
        reason: the first change, in one line (the key of ``stats()["recompile_reasons"]``).
        changes: every change found against the nearest existing program.
        user_line: ``file:line in function: code`` of the user's code that triggered it.
        hint: how to avoid it.
        seconds: how long the compilation (with its first run) took.
        from_disk: the program was loaded from the persistent cache instead of compiled.
    """

    program: str
    reason: str
    changes: list[str]
    user_line: str
    hint: str
    seconds: float = 0.0
    from_disk: bool = False

    def __str__(self) -> str:
        lines = [
            f"tpurec: recompiled {self.program} ({self.seconds:.3f} s{', from the disk cache' if self.from_disk else ''})"
        ]
        lines += [f"  changed: {c}" for c in self.changes]
        lines.append(f"  at: {self.user_line}")
        lines.append(f"  hint: {self.hint}")
        return "\n".join(lines)


def explain_recompiles() -> list[Recompilation]:
    """The recompilations since the last ``tpurec.reset_stats()``, oldest first.

    Example::

        for report in tpurec.explain_recompiles():
            print(report)
    """
    return list(accounting.counters().recompile_reports)


# --- the hook at each new program's first run ------------------------------------------

# family -> [(key, weak reference to the owner: a runtime.Program or a compiled graph variant)]
_families: dict[Any, list] = collections.defaultdict(list)
# Dynamo's guard_failures: code object -> (its reasons list, how many were already reported).
# The list itself is kept: torch._dynamo.reset() clears the dict and a later failure starts a
# new list, which a count alone cannot tell from the old one.
_guard_failures_seen: dict = {}


@contextlib.contextmanager
def compiling(owner: Any) -> Iterator[None]:
    """Wraps the first run of a new program: a profiler range, then the recompilation check.

    Args:
        owner: a ``runtime.Program`` or a compiled graph variant with an ``origin``
            (``("op", key)``, ``("fused", key, device)`` or ``("graph", graph, signature)``)
            and a ``reused`` flag.
    """
    origin = getattr(owner, "origin", None)
    disk_hits = accounting.counters().disk_hits
    start = time.perf_counter()
    # JAX traces and compiles in Python that logs. In a torch.compile graph break's eager region
    # Dynamo's frame hook is on, and it would compile logging.Logger.debug frames (numpy arrays in
    # their arguments count as tensors): a graph break that CPU never has.
    prior_hook = set_eval_frame(None)
    try:
        with profiler.record(f"tpurec::compile {profiler.program_label(origin)}"), accounting.compile_accounting(owner):
            yield
    finally:
        set_eval_frame(prior_hook)
    if origin is None:
        return
    seconds = time.perf_counter() - start
    try:
        _note(owner, origin, seconds, accounting.counters().disk_hits > disk_hits)
    except Exception as error:  # noqa: BLE001 (diagnostics must never break a run)
        log.debug("tpurec: recompilation check failed: %r", error)


# Every program's first run (in runtime, a layer below) goes through compiling().
runtime.observe_compilations(compiling)


def _note(owner: Any, origin: tuple, seconds: float, from_disk: bool) -> None:
    user_line = _user_line()
    family, key = _family_and_key(origin, user_line)
    entries = _families[family]
    live = [(k, o) for k, ref in entries if (o := ref()) is not None]
    entries[:] = [(k, weakref.ref(o)) for k, o in live]
    if live and any(getattr(o, "reused", False) for _, o in live):
        report = _explain(origin, key, [k for k, _ in live], user_line)
        report.seconds, report.from_disk = seconds, from_disk
        accounting.counters().recompile_reports.append(report)
        if logging_enabled():
            log.warning("%s", report)
    entries.append((key, weakref.ref(owner)))


def _family_and_key(origin: tuple, user_line: str) -> tuple[Any, Any]:
    """Which programs a new one is compared with, and its key.

    Fused windows are grouped by the line of their sync point too: a window is a
    recompilation of what the *same code* compiled before (another loop's windows,
    or the first steps of this one, are warm-up, not recompilations). Op programs
    are grouped by op only: the same op runs from many lines.
    """
    kind = origin[0]
    if kind == "op":
        key = origin[1]
        return ("op", key[0]), key
    if kind == "fused":
        return ("fused", origin[2], user_line), origin[1]
    graph, signature = origin[1], origin[2]
    return ("graph", _graph_lineage(graph)), (graph, signature)


# (Dynamo frame id, graph kind) -> the lineage token of the graphs Dynamo compiled for it since its compile 0.
_lineages: dict[tuple, object] = {}


def _graph_lineage(graph: Any) -> object:
    """A token shared by the graphs of one kind that Dynamo compiled for one frame.

    Dynamo numbers frames from 0 again after ``torch._dynamo.reset()``: a frame's
    compile 0 starts a new lineage, so a new model is never compared with an old one.
    """
    token = getattr(graph, "lineage", None)
    if token is not None:
        return token
    compile_id = getattr(graph, "compile_id", None)
    if compile_id is None:
        token = object()
    else:
        key = (compile_id[0], graph.name.split("#")[0])
        if compile_id[1] == 0 or key not in _lineages:
            _lineages[key] = object()
        token = _lineages[key]
    graph.lineage = token
    return token


# --- explaining a difference ---------------------------------------------------------


_HINT_SHAPE = (
    "input shapes changed (a new batch size?): keep every batch the same size (DataLoader(drop_last=True), or pad "
    "the last batch); sparse inputs keep static capacities (tpurec.sparse.Capacity); under torch.compile, "
    "torch._dynamo.mark_dynamic(x, 0) traces once, but XLA still compiles one program per size"
)
_HINT_STATIC = (
    "a value compiled into the program changed: ints, bools and other non-float arguments are static, so each new "
    "value compiles again; pass values that change every step as tensors (float arguments are runtime inputs)"
)
_HINT_DTYPE = "an input's dtype changed: convert inputs once, before the loop, so every step sees the same dtypes"
_HINT_LAYOUT = (
    "an input is a view with another layout (strides/offset) or a different underlying tensor: call .contiguous() "
    "on it, or build it the same way every step"
)
_HINT_FUSED = (
    "the ops recorded between two sync points changed: a sync point (.item(), .cpu(), print, a data-dependent op) "
    "in another place, Python control flow that depends on values, or a different number of steps per window; "
    "keep one sync point per step (e.g. read the loss every N steps at the same place)"
)


def _explain(origin: tuple, key: Any, existing: list, user_line: str) -> Recompilation:
    kind = origin[0]
    if kind == "op":
        changes, hint = _nearest(key, existing, _op_changes)
        program = f"op {_op_name(key[0])}"
    elif kind == "fused":
        changes, hint = _nearest(key, existing, _fused_changes)
        program = f"fused window ({len(key[0])} ops)"
    else:
        changes, hint = _nearest(key, existing, _graph_changes)
        graph = key[0]
        compile_id = getattr(graph, "compile_id", None)
        where = f"frame {compile_id[0]}, compile {compile_id[1]}" if compile_id else graph.name
        program = f"{graph.name.split('#')[0]} graph ({where})"
        dynamo = _new_guard_failures()
        if dynamo:
            changes = changes + [f"Dynamo guard failed: {dynamo}"]
    if not changes:
        changes = ["the cache key changed in a way tpurec cannot describe"]
    return Recompilation(program, changes[0], changes, user_line, hint)


def _nearest(key: Any, existing: list, differ) -> tuple[list[str], str]:
    """The changes against the existing key with the fewest (weighted) changes, and a hint."""
    best = None
    for other in existing:
        score, changes, hint = differ(other, key)
        if best is None or score < best[0]:
            best = (score, changes, hint)
    return best[1], best[2]


def _op_name(op: Any) -> str:
    return str(op) if isinstance(op, torch._ops.OpOverload) else f"'{op}'"


def _show(value: Any) -> str:
    return str(list(value)) if isinstance(value, tuple) else repr(value)


def _spec_changes(name: str, old: tuple, new: tuple) -> tuple[list[str], str]:
    """Changes between two argument specs of an eager program key (see tpurec.dense.calling.split)."""
    if old == new:
        return [], ""
    if old[0] != new[0]:
        return [f"{name} was {_spec_kind(old)}, now {_spec_kind(new)}"], _HINT_STATIC
    tag = old[0]
    if tag == "t":
        _, shape0, dtype0, size0, stride0, offset0, *_ = old
        _, shape1, dtype1, size1, stride1, offset1, *_ = new
        if dtype0 != dtype1:
            return [f"dtype of {name} changed from {dtype0} to {dtype1}"], _HINT_DTYPE
        if size0 != size1:
            return [f"shape of {name} changed from {_show(size0)} to {_show(size1)}"], _HINT_SHAPE
        return [
            f"layout of {name} changed: storage {_show(shape0)} -> {_show(shape1)}, strides {_show(stride0)} -> "
            f"{_show(stride1)}, offset {offset0} -> {offset1}"
        ], _HINT_LAYOUT
    if tag == "list":
        changes, hint = [], ""
        for i, (a, b) in enumerate(zip(old[1], new[1])):
            c, h = _spec_changes(f"{name}[{i}]", a, b)
            changes += c
            hint = hint or h
        if len(old[1]) != len(new[1]):
            changes.append(f"{name} has {len(new[1])} tensors instead of {len(old[1])}")
            hint = hint or _HINT_STATIC
        return changes, hint
    if tag == "s":
        return [f"dtype of the scalar tensor {name} changed from {old[1]} to {new[1]}"], _HINT_DTYPE
    if tag in ("d", "dl"):
        return [f"Python type of {name} changed from {old[1]} to {new[1]}"], _HINT_STATIC
    return [f"static value of {name} changed from {_show(old[1])} to {_show(new[1])}"], _HINT_STATIC


def _spec_kind(spec: tuple) -> str:
    return {
        "t": "a tensor",
        "s": "a CPU scalar tensor",
        "list": "a tensor list",
        "d": "a Python number",
        "dl": "a list of numbers",
        "none": "None",
        "c": "a static value",
    }.get(spec[0], spec[0])


def _op_changes(old: Any, new: Any) -> tuple[float, list[str], str]:
    """Changes between two eager program keys
    ``(op, arg_specs, kw_specs, target_specs, shared_targets, placed_on)``."""
    if not (
        isinstance(old, tuple)
        and isinstance(new, tuple)
        and len(old) == 6
        and len(new) == 6
        and isinstance(new[0], torch._ops.OpOverload)
    ):
        return _generic_changes(old, new)
    op = new[0]
    names = [a.name for a in op._schema.arguments]
    changes: list[str] = []
    hint = ""
    for i, (a, b) in enumerate(zip(old[1], new[1])):
        c, h = _spec_changes(f"argument {i} ({names[i] if i < len(names) else '?'})", a, b)
        changes += c
        hint = hint or h
    if len(old[1]) != len(new[1]):
        changes.append(f"called with {len(new[1])} positional arguments instead of {len(old[1])}")
        hint = hint or _HINT_STATIC
    old_kw, new_kw = dict(old[2]), dict(new[2])
    for name in sorted(set(old_kw) | set(new_kw)):
        if name not in old_kw or name not in new_kw:
            changes.append(f"keyword argument {name!r} {'added' if name in new_kw else 'dropped'}")
            hint = hint or _HINT_STATIC
            continue
        c, h = _spec_changes(f"keyword argument {name!r}", old_kw[name], new_kw[name])
        changes += c
        hint = hint or h
    for i, (a, b) in enumerate(zip(old[3], new[3])):
        c, h = _spec_changes(f"written tensor {i}", a, b)
        changes += c
        hint = hint or h
    if old[4] != new[4]:
        changes.append("written tensors share storage differently (which written tensors are views of one buffer)")
    if old[5] != new[5]:
        changes.append(f"placed on tpu:{new[5]} instead of tpu:{old[5]}")
    return _distance(old, new), changes, hint or _HINT_STATIC


def _distance(old: Any, new: Any) -> float:
    """How many leaves of two nested keys differ (dims of shapes count one by one); among
    keys with as many differences, sizes closer in value are nearer (512 is nearer 511 than 64)."""
    if old == new:
        return 0
    if isinstance(old, tuple) and isinstance(new, tuple):
        return sum(_distance(a, b) for a, b in zip(old, new)) + 4 * abs(len(old) - len(new))
    if type(old) is int and type(new) is int:
        return 1 + 0.001 * abs(old - new) / (abs(old) + abs(new))
    return 1


def _generic_changes(old: Any, new: Any) -> tuple[float, list[str], str]:
    """Differing leaves of two nested tuples (keys of tpurec's internal programs)."""
    changes: list[str] = []

    def walk(path: str, a: Any, b: Any) -> None:
        if a == b:
            return
        if isinstance(a, tuple) and isinstance(b, tuple) and all(type(x) is int for x in a + b):
            changes.append(f"shape {_show(a)} changed to {_show(b)}")
            return
        if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) and len(changes) < 8:
            for i, (x, y) in enumerate(zip(a, b)):
                walk(f"{path}[{i}]", x, y)
            return
        changes.append(f"key component {path or 'key'} changed from {_show(a)} to {_show(b)}")

    walk("", old, new)
    shape_like = any(c.startswith("shape ") for c in changes)
    return _distance(old, new), changes, _HINT_SHAPE if shape_like else _HINT_STATIC


def _program_keys() -> dict[int, Any]:
    """Eager program serial -> its cache key (to describe the ops of fused windows)."""
    return {program.serial: key for key, program in runtime.programs._programs.items()}


def _fused_changes(old: tuple, new: tuple) -> tuple[int, list[str], str]:
    """Changes between two fused-window keys ``(wiring, outputs, donate, device)``."""
    keys = _program_keys()
    old_ops, new_ops = old[0], new[0]

    def op_of(entry):
        key = keys.get(entry[0])
        return key[0] if isinstance(key, tuple) else None

    if len(old_ops) != len(new_ops) or any(op_of(a) != op_of(b) for a, b in zip(old_ops, new_ops)):
        first = next(
            (j for j, (a, b) in enumerate(zip(old_ops, new_ops)) if op_of(a) != op_of(b)),
            min(len(old_ops), len(new_ops)),
        )
        was = _op_name(op_of(old_ops[first])) if first < len(old_ops) else "the end of the window"
        now = _op_name(op_of(new_ops[first])) if first < len(new_ops) else "the end of the window"
        change = (
            f"a new fused-window structure: {len(new_ops)} ops (nearest existing window: {len(old_ops)}); "
            f"first different op at position {first}: {now} (was {was})"
        )
        return 1000 + abs(len(old_ops) - len(new_ops)) + (len(old_ops) - first), [change], _HINT_FUSED
    changes: list[str] = []
    hint = ""
    changed_ops = 0
    # ATen ops first: they are what the user wrote; allocations and copies follow from them.
    order = sorted(range(len(new_ops)), key=lambda j: not isinstance(op_of(new_ops[j]), torch._ops.OpOverload))
    for j in order:
        a, b = old_ops[j], new_ops[j]
        if a == b:
            continue
        old_key, new_key = keys.get(a[0]), keys.get(b[0])
        if old_key is not None and new_key is not None and old_key != new_key:
            changed_ops += 1
            if changed_ops <= 3:
                _, c, h = _op_changes(old_key, new_key)
                changes += [f"op {j} of {len(new_ops)} ({_op_name(new_key[0])}): {x}" for x in c[:2]]
                hint = hint or h
        elif a[1] != b[1]:
            changed_ops += 1
            if changed_ops <= 3:
                changes.append(f"op {j} of {len(new_ops)} ({_op_name(op_of(b))}) takes its inputs from other ops")
                hint = hint or _HINT_FUSED
    if changed_ops > 3:
        changes.append(f"... {changed_ops - 3} more ops with changed inputs")
    if old[1] != new[1]:
        changes.append(
            f"the window returns {len(new[1])} live tensors instead of {len(old[1])} (tensors still referenced at the "
            "sync point differ)"
        )
        hint = hint or _HINT_FUSED
    if old[2] != new[2]:
        changes.append("different input buffers could be donated (a tensor is referenced elsewhere in one of them)")
        hint = hint or _HINT_FUSED
    return changed_ops + (old[1] != new[1]) + (old[2] != new[2]), changes, hint or _HINT_FUSED


def _graph_changes(old: tuple, new: tuple) -> tuple[int, list[str], str]:
    """Changes between two (graph, input signature) keys of compiled graphs."""

    def tensors(signature):
        return [s for s in signature if s[0] != "scalar"]

    a, b = old[1], new[1]
    same_graph = old[0] is new[0]
    if not same_graph:
        # Dynamo's dynamic graphs take sizes as extra int inputs: compare the tensors.
        a, b = tensors(a), tensors(b)
    changes: list[str] = []
    hint = ""
    for i, (x, y) in enumerate(zip(a, b)):
        if x == y:
            continue
        if x[0] == "scalar" or y[0] == "scalar":
            changes.append(
                f"input {i}: size value {x[1] if x[0] == 'scalar' else _show(x[0])} -> "
                f"{y[1] if y[0] == 'scalar' else _show(y[0])}"
            )
            hint = hint or _HINT_SHAPE
        elif x[1] != y[1]:
            changes.append(f"input {i}: dtype {x[1]} -> {y[1]}")
            hint = hint or _HINT_DTYPE
        else:
            changes.append(f"input {i}: shape {_show(x[0])} -> {_show(y[0])}")
            hint = hint or _HINT_SHAPE
    # Tensor shapes first: a changed size value only mirrors them (the dynamic dim's value).
    changes.sort(key=lambda c: "size value" in c)
    if len(a) != len(b):
        changes.append(f"the graph takes {len(b)} inputs instead of {len(a)}")
    if not same_graph and not changes:
        changes.append("Dynamo traced the code again (a new graph with the same inputs)")
    return len(changes) + (0 if same_graph else 1), changes, hint or _HINT_STATIC


def _new_guard_failures() -> str:
    """Dynamo guard failures recorded since the last call (why Dynamo traced again)."""
    try:
        from torch._dynamo.utils import guard_failures
    except ImportError:
        return ""
    fresh: list = []
    for code, reasons in list(guard_failures.items()):
        seen_list, seen = _guard_failures_seen.get(code, (None, 0))
        if seen_list is not reasons:  # torch._dynamo.reset() cleared them
            seen = 0
        fresh += reasons[seen:]
        _guard_failures_seen[code] = (reasons, len(reasons))
    return "; ".join(" ".join(str(r).split()) for r in fresh[-2:])


def current_compile_id() -> tuple[int, int] | None:
    """(frame id, compile id within the frame) of the Dynamo compilation in progress, if any."""
    compile_id = torch._guards.CompileContext.current_compile_id()
    if compile_id is None or compile_id.frame_id is None:
        return None
    return (compile_id.frame_id, compile_id.frame_compile_id)


# --- where in the user's code -----------------------------------------------------------

_PATHS = sysconfig.get_paths()
# Frames under these folders are not the user's: the libraries (tpurec, torch, jax...), the standard library and
# installed packages.
_LIBRARY_DIRS = errors.LIBRARY_DIRS + tuple(
    os.path.abspath(_PATHS[k]) + os.sep for k in ("stdlib", "purelib", "platlib")
)


def _user_line() -> str:
    """``file:line in function: code`` of the innermost frame outside tpurec, torch, jax and the stdlib."""
    node = torch._C._current_autograd_node()
    if node is not None:
        # The autograd engine runs backward ops on its own thread, with no user frame on the stack.
        return f"the backward pass (autograd node {node.name()}), started by .backward() in the user's code"
    # Walks the frames without reading source lines (traceback.extract_stack would read them all).
    frame = sys._getframe(1)
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if not (filename.startswith(_LIBRARY_DIRS) or frame.f_code.co_filename.startswith("<")):
            code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
            return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}" + (
                f": {code}" if code else ""
            )
        frame = frame.f_back
    return "(no user frame on the stack)"


if logging_enabled() and not log.handlers and not logging.getLogger().handlers:
    # Reports are the point of TPUREC_LOG=recompiles: print them even where logging is not configured.
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(_handler)
