"""The runtime's counters (``tpurec.stats()``) and the accounting of compilations by JAX's reports."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
from typing import Any, Callable

from jax import monitoring

from tpurec.core import profiler as _profiler

__all__ = [
    "Stats",
    "compile_accounting",
    "counters",
    "listen_to_jax",
    "register_stats_source",
    "reset_stats",
    "stats",
]


@dataclasses.dataclass
class Stats:
    """What the runtime did since the last :func:`reset_stats`.

    Attributes:
        compile_requests: XLA compilations asked for (each new program's first run).
        disk_hits: of those, served from the persistent cache on disk.
        programs_built: programs traced (new entries of the in-memory cache).
        cache_hits: calls served by a program already in memory.
        executions: compiled programs run.
        compile_seconds: time spent tracing and compiling (or loading from disk): the wall time of
            new programs' first runs.
        compile_phases: seconds by phase, as JAX reports them: ``tracing`` (Python to jaxpr),
            ``lowering`` (jaxpr to StableHLO), ``xla_compile`` (XLA's compiler) and ``cache_load``
            (an executable read from the persistent cache instead). Counts JAX work outside
            tpurec's programs too (shape inference).
        compiles_by_program: per kind of program (``op <name>``, ``fused window (<n> ops)``,
            ``<name> graph`` of ``torch.compile``, ``captured step x<k>``): how many compiled, their
            first runs' wall seconds, and those seconds' phases as in ``compile_phases``.
        fused_graphs: graphs run by the fused mode.
        fused_ops: ops in those graphs.
        donated_buffers: input buffers a fused graph reused for its outputs (in-place updates).
        sync_points: fused-mode flushes by reason.
        ops_by_name: ATen ops dispatched to the tpu device, by overload name.
        host_fallbacks: ops that failed on the device during backward and ran on the
            host instead (``TPUREC_HOST_FALLBACK``), by overload name.
        host_ops: data-dependent ops (nonzero, masked_select, unique...) run on the host by design.
        recompile_reports: recompilations of warm programs (tpurec/core/recompiles.py); ``as_dict``
            gives their number (``recompilations``) and reasons (``recompile_reasons``).
    """

    compile_requests: int = 0
    disk_hits: int = 0
    programs_built: int = 0
    cache_hits: int = 0
    executions: int = 0
    compile_seconds: float = 0.0
    fused_graphs: int = 0
    fused_ops: int = 0
    donated_buffers: int = 0
    compile_phases: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(_PHASES, 0.0))
    compiles_by_program: dict = dataclasses.field(default_factory=dict)
    sync_points: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    ops_by_name: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    host_fallbacks: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    host_ops: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    recompile_reports: list = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(dataclasses.replace(self, recompile_reports=[]))
        del d["recompile_reports"]
        d["recompilations"] = len(self.recompile_reports)
        d["recompile_reasons"] = dict(collections.Counter(r.reason for r in self.recompile_reports))
        d["compilations"] = self.compile_requests - self.disk_hits
        d["ops_per_fused_graph"] = self.fused_ops / self.fused_graphs if self.fused_graphs else 0.0
        d["sync_points"] = dict(self.sync_points)
        d["ops_by_name"] = dict(self.ops_by_name)
        d["host_fallbacks"] = dict(self.host_fallbacks)
        d["host_ops"] = dict(self.host_ops)
        return d


# JAX's duration events -> the phase of a compilation they time.
_PHASE_OF_EVENT = {
    "/jax/core/compile/jaxpr_trace_duration": "tracing",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lowering",
    "/jax/core/compile/backend_compile_duration": "xla_compile",
    "/jax/compilation_cache/cache_retrieval_time_sec": "cache_load",
}
_PHASES = ("tracing", "lowering", "xla_compile", "cache_load")

_stats = Stats()

# Counters kept above the core (e.g. sparse's dropped entries), reported by stats()
# under their name: name -> (snapshot, reset). See register_stats_source.
_stats_sources: dict[str, tuple[Callable[[], Any], Callable[[], None]]] = {}


def register_stats_source(name: str, snapshot: Callable[[], Any], reset: Callable[[], None]) -> None:
    """Adds a counter kept by a layer above the core to :func:`stats` (the layer calls this at import).

    Args:
        name: its key in :func:`stats` (must not be one of the runtime's own).
        snapshot: returns its current value (a copy).
        reset: sets it back to zero (called by :func:`reset_stats`).
    """
    if name in {f.name for f in dataclasses.fields(Stats)}:
        raise ValueError(f"stats source {name!r} would hide the runtime counter of that name")
    _stats_sources[name] = (snapshot, reset)


def stats() -> dict[str, Any]:
    """A snapshot of the runtime counters.

    ``compilations`` counts XLA compilations that were really performed (not
    served from the disk cache); a warm training loop must keep it at 0.

    Example::

        tpurec.reset_stats()
        train_step()
        assert tpurec.stats()["compilations"] == 0

    Counters of the layers above are included under their names (``dropped_entries``:
    entries that collections with ``overflow="drop"`` left out, by feature).
    """
    d = _stats.as_dict()
    for name, (snapshot, _) in _stats_sources.items():
        d[name] = snapshot()
    return d


def reset_stats() -> None:
    """Sets every counter of :func:`stats` back to zero."""
    zero = Stats()
    # In place: the layers above keep the object (counters()) on their hot paths.
    for field in dataclasses.fields(Stats):
        setattr(_stats, field.name, getattr(zero, field.name))
    for _, reset in _stats_sources.values():
        reset()


def counters() -> Stats:
    """The live counters (one object for the process; :func:`reset_stats` zeroes it in place)."""
    return _stats


def _on_event(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _stats.disk_hits += 1


def _on_duration(event: str, duration_secs: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _stats.compile_requests += 1
    phase = _PHASE_OF_EVENT.get(event)
    if phase is None:
        return
    if phase == "cache_load":  # timed inside the backend compile, reported before it: not XLA's compiler
        _stats.compile_phases["xla_compile"] -= duration_secs
    _stats.compile_phases[phase] += duration_secs
    compiling = _compiling_now()
    if compiling:
        record = compiling[-1]
        if phase == "cache_load":
            record["xla_compile"] -= duration_secs
        record[phase] += duration_secs


# Per thread (JAX reports a compilation on the thread that compiles), the per-program records of
# the compilations under way, innermost last (see compile_accounting).
_compiling = threading.local()


def _compiling_now() -> list[dict]:
    stack = getattr(_compiling, "stack", None)
    if stack is None:
        stack = _compiling.stack = []
    return stack


def _compile_label(origin: Any) -> str:
    """The kind of program that ``origin`` (``Program.origin``) describes, for ``compiles_by_program``."""
    if origin is None:
        return "op"
    kind = origin[0]
    if kind == "op":
        return f"op {origin[1][0]}"[:80]
    if kind == "fused":
        return f"fused window ({len(origin[1][0])} ops)"
    return _profiler.program_label(origin)


@contextlib.contextmanager
def compile_accounting(owner: Any):
    """Accounts the first run of a new program (its compilation) to its kind in ``compiles_by_program``.

    Args:
        owner: a ``Program`` or a compiled graph variant, with an ``origin`` (or none).
    """
    record = dict.fromkeys(_PHASES, 0.0)
    stack = _compiling_now()
    stack.append(record)
    start = time.perf_counter()
    try:
        yield
    finally:
        stack.pop()
        seconds = time.perf_counter() - start
        label = _compile_label(getattr(owner, "origin", None))
        entry = _stats.compiles_by_program.get(label)
        if entry is None:
            entry = _stats.compiles_by_program[label] = {"programs": 0, "seconds": 0.0, **dict.fromkeys(_PHASES, 0.0)}
        entry["programs"] += 1
        entry["seconds"] += seconds
        for phase, value in record.items():
            entry[phase] += value


_listening = False


def listen_to_jax() -> None:
    """Registers the two JAX monitoring listeners behind :func:`stats` (once, for the process)."""
    global _listening
    if _listening:
        return
    _listening = True
    monitoring.register_event_listener(_on_event)
    monitoring.register_event_duration_secs_listener(_on_duration)
