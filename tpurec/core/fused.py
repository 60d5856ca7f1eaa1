"""DeferAndFuse: record ops as pending nodes, run them as one XLA program at a sync point.

Each recorded node is an eager op program (``runtime.Program``) whose inputs
are concrete jax.Arrays, runtime scalars, or outputs of earlier nodes. Its
outputs are :class:`Pending` values with known shape and dtype, stored in the
tensors' storages. At a sync point the window of nodes becomes one function
that calls each node's traceable ``raw`` program in order and returns only the
outputs that live storages still hold; it is compiled once per structure
(programs, wiring, live outputs), so a steady training loop reuses it.
"""

from __future__ import annotations

import math
import weakref

import jax
import numpy as np
from jax._src.lax.lax import _convert_element_type

from tpurec import config
from tpurec.core import accounting, headroom, profiler, runtime, sync
from tpurec.core.device import jax_device
from tpurec.core.tensor import NOT_ARRAYS, fill, holders

__all__ = ["Pending", "record", "flush", "is_pending", "pending_ops", "clear_programs"]


try:  # JAX's concrete array type: ``type(x) is`` it is cheaper than ``isinstance(x, jax.Array)``
    from jax._src.array import ArrayImpl as _ArrayImpl
except ImportError:  # another JAX layout: every check takes the isinstance path
    _ArrayImpl = jax.Array


class Pending:
    """The not yet computed output ``index`` of a recorded node."""

    __slots__ = ("node", "index", "shape", "dtype", "value")

    def __init__(self, node: "_Node", index: int, shape: tuple, dtype) -> None:
        self.value = None  # the jax.Array, once a flush computed it
        self.node = node
        self.index = index
        self.shape = shape
        self.dtype = dtype


NOT_ARRAYS.add(Pending)


class _Node:
    __slots__ = ("program", "inputs", "position", "window", "__weakref__")

    def __init__(self, program: runtime.Program, inputs: tuple, position: int, window: int) -> None:
        self.program = program
        self.inputs = inputs
        self.position = position  # its place in the window
        self.window = window  # the window's serial: a pending value of an earlier window is no input


class _Steady:
    """One window structure that ran: what a later window is expected to repeat (replay).

    ``wiring`` is the window's node list (program serials and where each input comes from);
    ``programs`` its compiled programs by live outputs and donated inputs; ``next`` the
    structure of the window that followed it last time on its device. A training step with
    several windows (a loss read in the middle splits it) makes a cycle of them. A window
    recorded node for node as the expected one (checked as each op is recorded: one small
    comparison per op) runs the program found here, with no key built over the whole window
    at the sync point.
    """

    __slots__ = ("wiring", "programs", "next", "numbers")

    def __init__(self, wiring: tuple) -> None:
        self.wiring = wiring
        self.programs: dict = {}
        self.next: _Steady | None = None
        # The packed Python numbers (floats, ints, bools) of its last run, None before the first: a
        # captured step (tpurec.core.graphs) must repeat a structure that ran, with the same numbers.
        self.numbers: tuple | None = None


class _Window:
    def __init__(self, serial: int = 0) -> None:
        self.serial = serial
        self.device = 0  # one window, one device: a node for another device flushes first
        self.limit = 1  # TPUREC_FUSED_MAX_OPS, read when the first node is recorded
        self.nodes: list[_Node] = []
        # Weak references to the storages given pending values (plain references: a WeakSet's
        # callbacks would cost more per op than sorting out the dead ones at the flush).
        self.storages: list[weakref.ref] = []
        # Buffers that storages dropped for a pending value: donated if nobody else holds them.
        self.replaced: dict[int, jax.Array] = {}
        # The window's structure, built as ops are recorded: per node (program serial, sources),
        # its external inputs (concrete arrays once each, runtime scalars) in order.
        self.wiring: list[tuple] = []
        self.external: list = []
        self.external_index: dict[int, int] = {}
        self.expected: _Steady | None = None  # the structure this window should repeat (see _Steady)
        self.matching = True  # every node so far is the expected one


_window = _Window()
_fused_programs: dict = {}
# The sync points of a step being captured (tpurec.core.graphs), None when there is none.
capture_sync_points: list | None = None
# Window structures that ran, by wiring, and the last one run on each device.
_steady: dict[tuple, _Steady] = {}
_last: dict[int, _Steady] = {}


def clear_programs() -> int:
    """Forgets the compiled fused programs: the next window of each structure is traced again.

    Returns:
        How many programs were forgotten.
    """
    count = len(_fused_programs)
    _fused_programs.clear()
    _steady.clear()
    _last.clear()
    return count


headroom.drop_programs_with(clear_programs)


def max_ops() -> int:
    return config.get("TPUREC_FUSED_MAX_OPS")


def is_pending(value) -> bool:
    return isinstance(value, Pending)


def pending_ops() -> int:
    """How many ops wait for the next sync point."""
    return len(_window.nodes)


def _abstract(value):
    if isinstance(value, Pending):
        return jax.ShapeDtypeStruct(value.shape, value.dtype)
    return value


def record(program: runtime.Program, inputs: tuple, device: int = 0) -> list:
    """Records ``program(*inputs)`` for ``tpu:device``; returns its outputs as Pending values."""
    window = _window
    if window.nodes:
        if device != window.device:
            flush("device change")
            inputs = tuple(resolve(x) for x in inputs)
        elif len(window.nodes) >= window.limit:
            flush("graph size limit")
            inputs = tuple(resolve(x) for x in inputs)
        window = _window
    nodes = window.nodes
    position = len(nodes)
    if not position:
        window.device = device
        window.limit = max_ops()  # read once a window: a change applies from the next one
        last = _last.get(device)
        window.expected = None if last is None else last.next or last
    outs = program.out_avals
    if outs is None:
        avals = jax.eval_shape(program.raw, *map(_abstract, inputs))
        outs = program.out_avals = [None if a is None else (tuple(a.shape), a.dtype) for a in avals]
    sources = []
    external = window.external
    for x in inputs:
        kind = type(x)
        if kind is Pending:
            node = x.node
            if node.window != window.serial:
                if x.value is None:
                    raise RuntimeError("internal error: a pending value was dropped by a flush while still in use")
                x = x.value  # computed by an earlier window: a concrete input
                kind = type(x)
            else:
                sources.append((node.position, x.index))
                continue
        if kind is _ArrayImpl or isinstance(x, jax.Array):
            k = window.external_index.get(id(x))
            if k is None:
                k = window.external_index[id(x)] = len(external)
                external.append(x)
            sources.append((-1, k))
        else:  # a runtime scalar: its Python type shapes the trace
            sources.append((-2 - len(external), kind))
            external.append(x)
    entry = (program.serial, tuple(sources))
    if window.matching:
        expected = window.expected
        window.matching = (
            expected is not None and position < len(expected.wiring) and expected.wiring[position] == entry
        )
    window.wiring.append(entry)
    node = _Node(program, inputs, position, window.serial)
    nodes.append(node)
    if len(outs) == 1 and outs[0] is not None:  # most ops
        out = outs[0]
        return [Pending(node, 0, out[0], out[1])]
    return [None if out is None else Pending(node, i, out[0], out[1]) for i, out in enumerate(outs)]


def track(storage, replaced=None) -> None:
    """Remembers a storage whose array becomes pending, so the flush fills it in.

    Args:
        storage: the storage.
        replaced: the concrete array it held before, a candidate for donation.
    """
    _window.storages.append(weakref.ref(storage))
    if replaced is not None and (type(replaced) is _ArrayImpl or isinstance(replaced, jax.Array)):
        _window.replaced[id(replaced)] = replaced


def resolve(value):
    """A concrete value for ``value``, flushing when it is pending."""
    if isinstance(value, Pending):
        if value.value is None:
            flush("value needed")
        if value.value is None:
            raise RuntimeError("internal error: a pending value was dropped by a flush while still in use")
        return value.value
    return value


def flush(reason: str) -> tuple | None:
    """Runs every recorded op as one program and fills in the live storages.

    Returns:
        None when nothing was recorded, else the window followed by what ``_flush`` returns
        (read by a captured step, ``tpurec.core.graphs``).
    """
    global _window
    window = _window
    if not window.nodes:
        return None
    _window = _Window(window.serial + 1)
    counters = accounting.counters()
    counters.sync_points[reason] += 1
    if capture_sync_points is not None:
        capture_sync_points.append(reason)
    with profiler.record(f"tpurec::sync ({reason})"):  # tpurec.profiler hook
        return (window, *_flush(window, counters))


# synchronize() (in sync, a layer below) runs the pending window first.
sync.flush_pending_work_with(flush)


def _flush(window: _Window, counters: accounting.Stats) -> tuple:
    """Builds (or reuses) the program of one recorded ``window``, runs it and fills in its live storages.

    Returns:
        The program, its argument positions per group, (storage, pending value, where) per
        filled storage, the output index of each ``where``, the arguments the program was
        called with, and the packed numbers of the last window of the same structure (None:
        none ran before).
    """
    nodes, external, replaced, device = window.nodes, window.external, window.replaced, window.device
    # Each live storage with a pending value of this window, once, and where that value comes from.
    # (Storage._array, not the property: read for every storage of every window.)
    live: dict[int, tuple] = {}
    for ref in window.storages:
        storage = ref()
        if storage is not None:
            value = storage._array
            if type(value) is Pending:
                live[id(storage)] = (storage, value, (value.node.position, value.index))
    filled = list(live.values())
    # Sorted, so the key does not depend on the order the storages were tracked in.
    outputs = tuple(sorted({where for _, _, where in filled}))
    seen = {where: k for k, where in enumerate(outputs)}
    donate = tuple(
        k
        for k, x in enumerate(external)
        if id(x) in replaced and isinstance(x, jax.Array) and holders(x) == 0 and not x.is_deleted()
    )
    steady = window.expected
    if window.matching and steady is not None and len(nodes) == len(steady.wiring):
        wiring = steady.wiring  # recorded node for node as expected: a replay, no key built again
    else:
        wiring = tuple(window.wiring)
        steady = _steady.get(wiring)
        if steady is None:
            steady = _steady[wiring] = _Steady(wiring)
    last = _last.get(device)
    if last is not None:
        last.next = steady
    _last[device] = steady
    built = steady.programs.get((outputs, donate))
    if built is None:
        key = (wiring, outputs, donate, device)
        built = _fused_programs.get(key)
        if built is None:
            headroom.keep_mapping_headroom()
            counters.programs_built += 1
            built = _fused_programs[key] = _build(nodes, [w[1] for w in wiring], outputs, donate, device)
            built[0].origin = ("fused", key, device)  # for recompilation diagnostics
        else:
            counters.cache_hits += 1
        steady.programs[(outputs, donate)] = built
    else:
        counters.cache_hits += 1
    counters.fused_graphs += 1
    counters.fused_ops += len(nodes)
    counters.donated_buffers += len(donate)
    program, positions, sizes = built
    arguments = _arguments(external, positions)
    previous_numbers, steady.numbers = steady.numbers, arguments[2:5]
    values = program(*arguments)
    for storage, pending, where in filled:
        k = seen[where]
        pending.value = value = values[k]
        fill(storage, value, sizes[k])
    return program, positions, filled, seen, arguments, previous_numbers


# How each external input of a window travels to its program (see _groups).
_DONATED, _KEPT, _FLOAT, _INT, _BOOL, _OTHER = range(6)
_PACKED = {float: _FLOAT, int: _INT, bool: _BOOL}
_PACKED_DTYPES = {_FLOAT: np.float64, _INT: np.int64, _BOOL: np.bool_}


def _groups(plan: list, size: int, donate: tuple) -> tuple:
    """Per external input of a window, the argument group it is passed in.

    Arrays are donated or kept; runtime scalars of type float, int and bool are packed into
    one numpy array per type, since JAX transfers each Python scalar argument on its own
    (about 1.4 us each, and an optimizer step has dozens); other scalars pass as they are.
    """
    groups = [_KEPT] * size
    for k in donate:
        groups[k] = _DONATED
    for sources in plan:
        for j, kind in sources:
            if j < -1:
                groups[-2 - j] = _PACKED.get(kind, _OTHER)
    return tuple(groups)


def _arguments(external: list, positions: tuple) -> tuple:
    """The program's arguments: (donated, kept, floats, ints, bools, others); a type not present is None.

    ``positions``: per group, the positions of the external inputs it takes (see _build).
    """
    donated, kept, floats, ints, bools, others = positions
    return (
        [external[k] for k in donated],
        [external[k] for k in kept],
        np.array([external[k] for k in floats], dtype=np.float64) if floats else None,
        np.array([external[k] for k in ints], dtype=np.int64) if ints else None,
        np.array([external[k] for k in bools], dtype=np.bool_) if bools else None,
        [external[k] for k in others] if others else None,
    )


def _unpacked(packed, index: int, kind: type):
    """Element ``index`` of a packed scalar group, typed as JAX types a Python ``kind`` argument.

    A Python float or int argument is a weakly typed scalar of the default dtype (it does not
    promote the arrays it meets); a bool is a plain bool scalar.
    """
    value = packed[index]
    if kind is bool:
        return value
    return _convert_element_type(value, jax.dtypes.canonicalize_dtype(np.dtype(kind)), weak_type=True)


def _build(nodes: list, plan: list, outputs: tuple, donate: tuple, device: int) -> tuple:
    """The program of a window; per argument group the positions of the external inputs it takes; its outputs' bytes.

    The program calls each node's traceable program in order and returns the live outputs.
    """
    raws = [n.program.raw for n in nodes]
    size = 1 + max((i if j == -1 else -2 - j for sources in plan for j, i in sources if j < 0), default=-1)
    groups = _groups(plan, size, donate)
    positions = tuple(tuple(k for k, g in enumerate(groups) if g == group) for group in range(6))
    kinds = {-2 - j: kind for sources in plan for j, kind in sources if j < -1}

    def fused(*lists):
        ext: list = [None] * size  # the external inputs in their original order
        for group, (values, where) in enumerate(zip(lists, positions)):
            for n, k in enumerate(where):
                ext[k] = _unpacked(values, n, kinds[k]) if group in _PACKED_DTYPES else values[n]
        results = []
        for raw, sources in zip(raws, plan):
            args = []
            for j, i in sources:
                if j == -1:
                    args.append(ext[i])
                elif j < -1:
                    args.append(ext[-2 - j])
                else:
                    args.append(results[j][i])
            results.append(raw(*args))
        return [results[j][i] for j, i in outputs]

    placed = jax.sharding.SingleDeviceSharding(jax_device(device))
    sizes: list[int | None] = []  # None: the memory accounting asks the array
    for j, i in outputs:
        shape, dtype = nodes[j].program.out_avals[i]
        try:
            sizes.append(math.prod(shape) * np.dtype(dtype).itemsize)
        except TypeError:  # a JAX extended dtype
            sizes.append(None)
    return runtime.Program(fused, donate_argnums=(0,), out_shardings=placed), positions, tuple(sizes)
