"""Counters, the in-memory program cache and the persistent XLA cache, shared by all modes."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import itertools
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch.autograd.profiler as _torch_profiler
from jax import monitoring
from jax._src import core as jax_core

from tpurec import config
from tpurec.cache import cache_root, writable_cache_root
from tpurec.dense.trace_context import traced_as_spmd
from tpurec.core import profiler as _profiler

__all__ = [
    "Stats",
    "stats",
    "reset_stats",
    "register_stats_source",
    "ProgramCache",
    "Program",
    "programs",
    "cache_root",
    "enable_disk_cache",
    "stubbed_execution",
    "release_programs",
    "drop_programs_with",
    "keep_mapping_headroom",
]

log = logging.getLogger("tpurec.runtime")


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
    global _stats
    _stats = Stats()
    for _, reset in _stats_sources.values():
        reset()


def counters() -> Stats:
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


# --- hooks that the layers above install at import -------------------------------
# tpurec.core.recompiles and tpurec.core.fused import this module, so it reaches them
# through these slots instead of importing them.


def _no_observer(program: Any) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def _no_pending_work(reason: str) -> None:
    return None


_compile_observer: Callable[[Any], contextlib.AbstractContextManager] = _no_observer
_flush_pending_work: Callable[[str], object] = _no_pending_work


def observe_compilations(observer: Callable[[Any], contextlib.AbstractContextManager]) -> None:
    """Sets what wraps each new program's first run (its compilation).

    Args:
        observer: called with the program; returns a context manager around the run
            (``tpurec.core.recompiles.compiling``: a profiler range and the recompilation check).
    """
    global _compile_observer
    _compile_observer = observer


def flush_pending_work_with(flush: Callable[[str], object]) -> None:
    """Sets what :func:`synchronize` runs before it waits (``tpurec.core.fused.flush``).

    Args:
        flush: called with the sync reason; runs deferred work.
    """
    global _flush_pending_work
    _flush_pending_work = flush


_serials = itertools.count()


class Program:
    """One traced function: ``raw`` (traceable) and its jitted form.

    The fused mode calls ``raw`` inside a larger trace; eager calls ``jitted``.
    """

    # origin/reused/__weakref__: for recompilation diagnostics (tpurec/core/recompiles.py).
    __slots__ = (
        "raw",
        "jitted",
        "serial",
        "ran",
        "out_avals",
        "metas",
        "_options",
        "_spmd",
        "_stub",
        "origin",
        "reused",
        "__weakref__",
    )

    def __init__(self, raw: Callable, **jit_options) -> None:
        self.raw = raw
        self.jitted = jax.jit(raw, **jit_options)
        self.serial = next(_serials)
        self.ran = False
        # Per output (shape, dtype), or None where there is no tensor: set by the fused mode's first recording.
        self.out_avals: list | None = None
        self.metas: list | None = None
        self._options = jit_options
        self._spmd = None
        self._stub = None  # see stubbed_execution
        self.origin: tuple | None = None  # ("op", cache key) or ("fused", key, device): what this program is
        self.reused = False

    def __call__(self, *args):
        _stats.executions += 1
        if self.ran and not _mesh_arrays_exist and not _torch_profiler._is_profiler_enabled and not _stubbed:
            # The common case of a warm program, with no frame more than needed (an eager op's host cost).
            self.reused = True
            return self.jitted(*args)
        if _stubbed:
            if self._stub is None:
                self._stub = make_stub(self.raw, self._options)
            return self._stub(*args)
        jitted = self.jitted
        on_mesh = False
        if _mesh_arrays_exist:
            args, on_mesh = _onto_common_mesh(args)
            if _TRACE is not None:
                _trace(self, args, on_mesh)
            if on_mesh:
                # Global arrays decide where the program runs: XLA partitions it
                # over their mesh (SPMD) instead of pinning it to one device.
                if self._spmd is None:
                    options = {k: v for k, v in self._options.items() if k != "out_shardings"}
                    self._spmd = jax.jit(traced_as_spmd(self.raw), **options)
                jitted = self._spmd
        out = self._execute(jitted, args)
        if on_mesh and _lockstep():
            # See _lockstep: the next mesh program may start only once this one is done.
            jax.block_until_ready(out)
        return out

    def _execute(self, jitted: Callable, args: tuple) -> Any:
        """Runs ``jitted`` on ``args``, compiling (and accounting for it) on the first run."""
        if self.ran:
            self.reused = True  # ran twice: its family is warm (recompilation diagnostics)
            if _torch_profiler._is_profiler_enabled:  # tpurec.profiler hook: an execute range
                with _profiler.record(f"tpurec::execute {_profiler.program_label(self.origin)}"):
                    return jitted(*args)
            return jitted(*args)
        start = time.perf_counter()
        try:
            with _compile_observer(self):  # tpurec hook: compile range + recompilation diagnostics
                out = jitted(*args)
        finally:
            _stats.compile_seconds += time.perf_counter() - start
        self.ran = True
        return out


# --- stubbed execution: a step's host cost without its computation ---------------------------

_stubbed = False
_stubs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def stubbed_execution():
    """Runs every program as a stub that computes nothing: outputs shaped like the real ones.

    For measuring the host: a step run under it issues the same programs with the same
    arguments (the same JAX calls, donations and tensor bookkeeping), but XLA computes
    nothing, so the main thread's CPU time is what Python, PyTorch, tpurec and JAX need to
    issue the step. On XLA:CPU the computation shares the host's cores: it runs partly on the
    calling thread and evicts its caches, which a TPU's host does not see. The values computed
    under it are meaningless (zeros, or a donated input passed through): a model trained under
    it is spoilt. Work pending on entry runs for real first; work recorded inside runs as stubs
    on exit. Meant for single-device steps (the dense benchmarks).

    Example::

        with tpurec.core.runtime.stubbed_execution():
            train_step()  # host time only: the model's values are garbage afterwards
    """
    global _stubbed
    _flush_pending_work("stubbed execution")
    previous, _stubbed = _stubbed, True
    try:
        yield
        _flush_pending_work("stubbed execution")
    finally:
        _stubbed = previous


def execution_stubbed() -> bool:
    """Whether programs run as stubs (:func:`stubbed_execution`)."""
    return _stubbed


def make_stub(raw: Callable, options: dict) -> Callable:
    """``raw``'s stub: jitted with the same ``options`` (donation, placement), it returns outputs shaped like ``raw``'s.

    Each output is a donated input of its shape and dtype where there is one, else zeros.
    """

    def zeros(*traced):
        shapes = jax.eval_shape(raw, *traced)
        # The zero is computed from an input with about 2000 flops: XLA cannot fold it into a
        # constant (a constant output is copied on every call), and XLA:CPU runs a program of
        # fewer than 1000 flops inline on the calling thread, real programs asynchronously.
        leaves = [x for x in jax.tree.leaves(traced) if jnp.size(x) and not _extended(x.dtype)]
        seed = jnp.asarray(leaves[0]).ravel()[0].real.astype(jnp.float32) if leaves else jnp.float32(0)
        seed = jnp.nan_to_num(seed, nan=0.0, posinf=0.0, neginf=0.0)  # an inf input (a mask) gives 0, not nan
        zero = jnp.sum(jnp.arange(1024, dtype=jnp.float32) * seed) * 0

        # A donated input of an output's shape and dtype is returned as it is: its buffer becomes
        # the output's without being written (an optimizer's parameters and state).
        donated: dict[tuple, list] = {}
        for k in _donated_positions(options, len(traced)):
            for x in jax.tree.leaves(traced[k]):
                donated.setdefault((x.shape, x.dtype), []).append(x)

        def like(s):
            spare = donated.get((s.shape, s.dtype))
            if spare:
                return spare.pop()
            if _extended(s.dtype):
                return jnp.zeros(s.shape, s.dtype)
            return jnp.broadcast_to(zero.astype(s.dtype), s.shape)

        return jax.tree.map(like, shapes)

    return jax.jit(zeros, **options)


def _donated_positions(options: dict, count: int) -> tuple:
    positions = options.get("donate_argnums", ())
    positions = (positions,) if isinstance(positions, int) else tuple(positions)
    return tuple(k for k in positions if k < count)


def _extended(dtype) -> bool:
    return jnp.issubdtype(dtype, jax.dtypes.extended)


def run_stub(owner: Any, raw: Callable, options: dict, args: tuple) -> Any:
    """Calls the stub of ``raw`` (:func:`make_stub`, kept as long as ``owner`` lives) on ``args``."""
    stub = _stubs.get(owner)
    if stub is None:
        stub = _stubs[owner] = make_stub(raw, options)
    return stub(*args)


def _lockstep() -> bool:
    """Mesh programs run one at a time, each finished before the next starts.

    True for a multi-process job on XLA:CPU (``$TPUREC_CPU_LOCKSTEP=0`` turns it off).
    XLA:CPU dispatches programs that span several local devices asynchronously
    (``jax_cpu_enable_async_dispatch`` does not apply to them), and with several
    such programs queued it may start a later one on some local devices before
    an earlier one on the others; the two processes' gloo collectives then wait
    on each other forever (5 of 28 runs of the 2-process test hung,
    docs/sharding.md). With one mesh program in flight at a time they cannot.
    """
    global _LOCKSTEP
    if _LOCKSTEP is None:
        _LOCKSTEP = (
            bool(config.get("TPUREC_CPU_LOCKSTEP")) and jax.process_count() > 1 and jax.default_backend() == "cpu"
        )
    return bool(_LOCKSTEP)


_LOCKSTEP: bool | None = None


# $TPUREC_TRACE_PROGRAMS=PREFIX: every program run on a mesh appends one line to
# PREFIX.<pid> (thread, op, caller, input shardings). Multi-controller JAX needs
# every process to run the same programs in the same order; diffing the files of
# a hung multi-process job shows whether they did (docs/sharding.md).
_TRACE = None
if config.get("TPUREC_TRACE_PROGRAMS"):
    _TRACE = open(config.get("TPUREC_TRACE_PROGRAMS") + f".{os.getpid()}", "w", buffering=1)


def _describe(x: Any) -> str:
    """``dtype[shape]@placement`` of an array input, the type name of anything else."""
    if not isinstance(x, jax.Array):
        return type(x).__name__
    sharding = x.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        where = str(sharding.spec)
    else:
        where = f"devices{sorted(d.id for d in sharding.device_set)}"
    return f"{x.dtype}{list(x.shape)}@{where}"


def _trace(program: Program, args: tuple, on_mesh: bool) -> None:
    """Writes one line about ``program`` about to run on ``args`` to the trace file."""
    import threading
    import traceback

    callers = [f for f in traceback.extract_stack(limit=16)[:-2] if "/tpurec/" not in f.filename]
    caller = f"{callers[-1].filename.rsplit('/', 1)[-1]}:{callers[-1].lineno}" if callers else "?"
    origin = program.origin
    name = origin[1][0] if origin and origin[0] == "op" else origin
    inputs = [_describe(a) for a in jax.tree.leaves(args)]
    _TRACE.write(
        f"{threading.current_thread().name} serial={program.serial} mesh={on_mesh} first={not program.ran} "
        f"{str(name)[:80]} at {caller} {inputs}\n"
    )


# Set by tpurec.sparse.sharding once a global (mesh) array may reach a program:
# until then programs skip the per-call look at their inputs' shardings.
_mesh_arrays_exist = False


def mesh_arrays_in_use() -> None:
    """Tells programs that inputs may be global arrays laid out on a mesh."""
    global _mesh_arrays_exist
    _mesh_arrays_exist = True


def mesh_arrays_exist() -> bool:
    """True once :func:`mesh_arrays_in_use` was called in this process."""
    return _mesh_arrays_exist


def _is_global(x) -> bool:
    return (
        isinstance(x, jax.Array)
        and isinstance(x.sharding, jax.sharding.NamedSharding)
        and len(x.sharding.device_set) > 1
    )


def _onto_common_mesh(args: tuple) -> tuple[tuple, bool]:
    """Replicates single-device inputs onto the mesh of the global inputs, if any.

    A program mixing both (a loss scale made on ``tpu:0`` times a batch-sharded
    activation) could not run otherwise: jit needs all inputs on one device set.
    """
    leaves = jax.tree.leaves(args)
    mesh_sharding = next((x.sharding for x in leaves if _is_global(x)), None)
    if mesh_sharding is None:
        return args, False
    replicated = jax.sharding.NamedSharding(mesh_sharding.mesh, jax.sharding.PartitionSpec())

    def place(x):
        if not isinstance(x, jax.Array) or _is_global(x):
            return x
        if jax.process_count() == 1:
            return jax.device_put(x, replicated)
        # Several processes: every process holds the same local value; each
        # builds its own devices' copies of it.
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, replicated, lambda index: host[index])

    return jax.tree.map(place, args), True


class ProgramCache:
    """Programs keyed by structure: op, shapes, dtypes, static arguments.

    And by the flags that change programs (``tpurec.config.program_settings()``): each
    setting has its own table, so a program traced under one is never run under another.
    """

    def __init__(self) -> None:
        self._tables: dict[tuple, dict[Any, Any]] = {}
        self._fast_tables: dict[tuple, dict[Any, Any]] = {}
        # The last settings fast_table() was asked under, and their table.
        self._fast_settings: tuple | None = None
        self._fast_table: dict[Any, Any] = {}

    @property
    def _programs(self) -> dict[Any, Any]:
        """The programs of the current settings."""
        settings = config.program_settings()
        table = self._tables.get(settings)
        if table is None:
            table = self._tables[settings] = {}
        return table

    def fast_table(self) -> dict[Any, Any]:
        """The calls of the current settings that a caller may repeat with no key building.

        ``tpurec.core.calls`` keeps here, per op and argument metadata, what a repeated
        call needs (the program, where its inputs come from, its outputs' metadata), so
        that a cached op skips the calling convention's split. Cleared with the programs.
        """
        settings = config.program_settings()
        if settings is self._fast_settings:  # the same tuple object while no setting changed
            return self._fast_table
        table = self._fast_tables.get(settings)
        if table is None:
            table = self._fast_tables[settings] = {}
        self._fast_settings, self._fast_table = settings, table
        return table

    def get(self, key, build: Callable[[], Any]):
        entry = self._programs.get(key)
        if entry is None:
            keep_mapping_headroom()
            _stats.programs_built += 1
            entry = self._programs[key] = build()
            entry.origin = ("op", key)
        else:
            _stats.cache_hits += 1
        return entry

    def __len__(self) -> int:
        return sum(len(table) for table in self._tables.values())

    def clear(self) -> None:
        self._tables.clear()
        self._fast_tables.clear()
        self._fast_settings = None


programs = ProgramCache()


# --- memory mappings: a long process must not run out of them ---------------------------
# XLA:CPU maps each loaded executable's code and data (3 mappings per program, measured), and
# tpurec keeps every program it builds. Linux refuses new mappings past vm.max_map_count
# (65,530 by default); XLA then fails inside LLVM and the process dies (SIGSEGV while the C++
# exception unwinds), so a long eager process or test session over thousands of shapes must
# drop programs before that. Dropping only costs compiling them again.

_droppers: list[Callable[[], int]] = []
_CHECK_EVERY = 256  # programs built between two readings of /proc/self/maps
_programs_built = 0  # by tpurec in this process, never reset: the check's clock
_checked_at = 0


def drop_programs_with(drop: Callable[[], int]) -> None:
    """Registers another cache of compiled programs that :func:`release_programs` empties.

    Args:
        drop: empties the cache; returns how many programs it held.
    """
    _droppers.append(drop)


def _drop_op_programs() -> int:
    count = len(programs)
    programs.clear()
    return count


drop_programs_with(_drop_op_programs)


def release_programs() -> int:
    """Drops every compiled program tpurec and JAX keep; each is built again when next used.

    Tensors, modules and optimizer state are untouched. Programs that Dynamo keeps for
    ``torch.compile`` graphs are Dynamo's (``torch._dynamo.reset()`` drops them).

    Returns:
        How many tpurec programs were dropped.
    """
    dropped = sum(drop() for drop in _droppers)
    jax.clear_caches()
    gc.collect()
    return dropped


def mapping_count() -> int | None:
    """How many memory mappings this process holds (None where ``/proc`` does not say)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: maps.read(1 << 20), b""))
    except OSError:
        return None


def mapping_budget() -> int | None:
    """``TPUREC_MAPPING_BUDGET``, or 3/4 of the kernel's ``vm.max_map_count`` (None if unknown)."""
    budget = config.get("TPUREC_MAPPING_BUDGET")
    if budget is not None:
        return budget
    try:
        with open("/proc/sys/vm/max_map_count") as limit:
            return int(limit.read()) * 3 // 4
    except (OSError, ValueError):
        return None


def keep_mapping_headroom() -> None:
    """Drops the compiled programs when the process holds more mappings than its budget.

    Called where tpurec builds a program (an op's or a fused window's). It reads
    ``/proc/self/maps`` once per 256 programs built, outside any trace, so a warm loop
    never pays for it.
    """
    global _programs_built, _checked_at
    _programs_built += 1
    if _programs_built - _checked_at < _CHECK_EVERY or not jax_core.trace_state_clean():
        return
    _checked_at = _programs_built
    budget = mapping_budget()
    held = mapping_count()
    if budget is None or held is None or held <= budget:
        return
    dropped = release_programs()
    log.warning(
        "tpurec: this process held %d memory mappings, over its budget of %d (TPUREC_MAPPING_BUDGET; the "
        "kernel refuses more than vm.max_map_count); dropped %d compiled programs, now %s mappings. "
        "They compile again when used.",
        held,
        budget,
        dropped,
        mapping_count(),
    )


def enable_disk_cache(path: str | None = None) -> str | None:
    """Turns on XLA's persistent compilation cache, shared by all processes.

    Args:
        path: the folder; defaults to ``xla/`` under :func:`cache_root` (a private temporary
            folder, with a warning, if that one is not writable).

    The cache keys do not depend on the folder's path: a warm cache that is moved or
    copied elsewhere (``TPUREC_CACHE_DIR`` pointing at the new place) is still hit.

    Returns:
        The folder in use, or None when persistence is off.
    """
    if path is None:
        root = writable_cache_root()
        if root is None:
            return None
        path = os.path.join(root, "xla")
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    # Cache every program: eager mode compiles many small ones, each cheap but numerous.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    # JAX otherwise also turns on XLA:GPU's autotuning cache, under this folder: its absolute
    # path then becomes part of every program's cache key, so a moved or copied cache would
    # miss on every program. tpurec compiles for CPU and TPU, which that cache does not serve.
    jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
    return path


def synchronize() -> None:
    """Runs pending fused work and waits for every computation on the tpu devices."""
    with _profiler.record("tpurec::sync (synchronize)"):  # tpurec.profiler hook
        _flush_pending_work("synchronize")
        for device in jax.local_devices():
            jax.device_put(0, device).block_until_ready()
        jax.effects_barrier()
