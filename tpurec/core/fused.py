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

import weakref

import jax

from tpurec import config
from tpurec.core import profiler, runtime
from tpurec.core.device import jax_device
from tpurec.core.tensor import holders

__all__ = ["Pending", "record", "flush", "is_pending", "pending_ops", "clear_programs"]


class Pending:
    """The not yet computed output ``index`` of a recorded node."""

    __slots__ = ("node", "index", "shape", "dtype", "value")

    def __init__(self, node: "_Node", index: int, aval) -> None:
        self.value = None  # the jax.Array, once a flush computed it
        self.node = node
        self.index = index
        self.shape = tuple(aval.shape)
        self.dtype = aval.dtype


class _Node:
    __slots__ = ("program", "inputs", "__weakref__")

    def __init__(self, program: runtime.Program, inputs: tuple) -> None:
        self.program = program
        self.inputs = inputs


class _Window:
    def __init__(self) -> None:
        self.device = 0  # one window, one device: a node for another device flushes first
        self.nodes: list[_Node] = []
        self.storages: weakref.WeakSet = weakref.WeakSet()
        # Buffers that storages dropped for a pending value: donated if nobody else holds them.
        self.replaced: dict[int, jax.Array] = {}


_window = _Window()
_fused_programs: dict = {}


def clear_programs() -> None:
    """Forgets the compiled fused programs: the next window of each structure is traced again."""
    _fused_programs.clear()


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
    if _window.nodes and device != _window.device:
        flush("device change")
        inputs = tuple(resolve(x) for x in inputs)
    if len(_window.nodes) >= max_ops():
        flush("graph size limit")
        inputs = tuple(resolve(x) for x in inputs)
    _window.device = device
    if program.out_avals is None:
        program.out_avals = jax.eval_shape(program.raw, *map(_abstract, inputs))
    node = _Node(program, inputs)
    _window.nodes.append(node)
    return [None if aval is None else Pending(node, i, aval) for i, aval in enumerate(program.out_avals)]


def track(storage, replaced=None) -> None:
    """Remembers a storage whose array becomes pending, so the flush fills it in.

    Args:
        storage: the storage.
        replaced: the concrete array it held before, a candidate for donation.
    """
    _window.storages.add(storage)
    if isinstance(replaced, jax.Array):
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


def flush(reason: str) -> None:
    """Runs every recorded op as one program and fills in the live storages."""
    window = _window
    if not window.nodes:
        return
    nodes, storages = window.nodes, [s for s in window.storages if isinstance(s.array, Pending)]
    device = window.device
    replaced = window.replaced
    window.nodes, window.storages, window.replaced = [], weakref.WeakSet(), {}
    counters = runtime.counters()
    counters.sync_points[reason] += 1
    with profiler.record(f"tpurec::sync ({reason})"):  # tpurec.profiler hook
        _flush(nodes, storages, device, replaced, counters)


# synchronize() (in runtime, a layer below) runs the pending window first.
runtime.flush_pending_work_with(flush)


def _flush(nodes: list, storages: list, device: int, replaced: dict, counters: runtime.Stats) -> None:
    """Builds (or reuses) the program of one window of ``nodes``, runs it and fills in ``storages``."""
    node_index = {id(n): j for j, n in enumerate(nodes)}
    external: list = []
    external_index: dict[int, int] = {}
    wiring = []
    for node in nodes:
        sources = []
        for x in node.inputs:
            if isinstance(x, Pending):
                sources.append((node_index[id(x.node)], x.index))
            elif isinstance(x, jax.Array):
                k = external_index.get(id(x))
                if k is None:
                    k = external_index[id(x)] = len(external)
                    external.append(x)
                sources.append((-1, k))
            else:  # a runtime scalar: its Python type shapes the trace
                sources.append((-2 - len(external), type(x)))
                external.append(x)
        wiring.append((node.program.serial, tuple(sources)))
    # Sorted, so the key does not depend on the order the weak set yields storages.
    outputs = sorted({(node_index[id(s.array.node)], s.array.index) for s in storages})
    seen = {where: k for k, where in enumerate(outputs)}
    donate = tuple(
        k for k, x in enumerate(external)
        if isinstance(x, jax.Array) and id(x) in replaced and holders(x) == 0 and not x.is_deleted()
    )
    key = (tuple(wiring), tuple(outputs), donate, device)

    program = _fused_programs.get(key)
    if program is None:
        counters.programs_built += 1
        raws = [n.program.raw for n in nodes]
        plan = [w[1] for w in wiring]

        def fused(donated, kept):
            ext = _merge(donated, kept, donate)
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
        program = _fused_programs[key] = runtime.Program(fused, donate_argnums=(0,), out_shardings=placed)
        program.origin = ("fused", key, device)  # for recompilation diagnostics
    else:
        counters.cache_hits += 1
    counters.fused_graphs += 1
    counters.fused_ops += len(nodes)
    counters.donated_buffers += len(donate)
    donated_set = set(donate)
    values = program(
        [x for k, x in enumerate(external) if k in donated_set],
        [x for k, x in enumerate(external) if k not in donated_set],
    )
    for storage in storages:
        p = storage.array
        p.value = storage.array = values[seen[(node_index[id(p.node)], p.index)]]


def _merge(donated: list, kept: list, donate: tuple) -> list:
    """The external inputs in their original order, from the donated and kept lists."""
    merged, d, k = [], iter(donated), iter(kept)
    wanted = set(donate)
    for position in range(len(donated) + len(kept)):
        merged.append(next(d) if position in wanted else next(k))
    return merged
