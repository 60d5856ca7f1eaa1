"""Compiled programs: ``Program`` (one traced function, run eagerly or inside a fused trace),
the in-memory program cache, programs over global (mesh) arrays, and XLA's persistent cache on disk.

The counters are ``tpurec.core.accounting``'s, sync points ``tpurec.core.sync``'s, stubbed
execution ``tpurec.core.stubs``' and the mapping headroom ``tpurec.core.headroom``'s.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from typing import Any, Callable

import jax
import numpy as np
import torch.autograd.profiler as _torch_profiler

from tpurec import config
from tpurec.cache import writable_cache_root
from tpurec.core import profiler as _profiler
from tpurec.core import stubs
from tpurec.core.accounting import counters
from tpurec.core.headroom import drop_programs_with, keep_mapping_headroom
from tpurec.dense.trace_context import traced_as_spmd

__all__ = [
    "Program",
    "ProgramCache",
    "enable_disk_cache",
    "is_global",
    "mesh_arrays_exist",
    "mesh_arrays_in_use",
    "observe_compilations",
    "programs",
]

# The process's counters: one object, zeroed in place by reset_stats (read on every call).
_stats = counters()

# --- the hook that tpurec.core.recompiles installs at import ---------------------------------
# recompiles imports this module, so each new program's first run reaches it through this slot.


def _no_observer(program: Any) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


_compile_observer: Callable[[Any], contextlib.AbstractContextManager] = _no_observer


def observe_compilations(observer: Callable[[Any], contextlib.AbstractContextManager]) -> None:
    """Sets what wraps each new program's first run (its compilation).

    Args:
        observer: called with the program; returns a context manager around the run
            (``tpurec.core.recompiles.compiling``: a profiler range and the recompilation check).
    """
    global _compile_observer
    _compile_observer = observer


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
        self._stub = None  # see tpurec.core.stubs
        self.origin: tuple | None = None  # ("op", cache key) or ("fused", key, device): what this program is
        self.reused = False

    def __call__(self, *args):
        _stats.executions += 1
        if self.ran and not _mesh_arrays_exist and not _torch_profiler._is_profiler_enabled and not stubs.active:
            # The common case of a warm program, with no frame more than needed (an eager op's host cost).
            self.reused = True
            return self.jitted(*args)
        if stubs.active:
            if self._stub is None:
                self._stub = stubs.make_stub(self.raw, self._options)
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


def _lockstep() -> bool:
    """Mesh programs run one at a time, each finished before the next starts.

    True on XLA:CPU (``$TPUREC_CPU_LOCKSTEP=0`` turns it off). XLA:CPU dispatches programs
    that span several local devices asynchronously (``jax_cpu_enable_async_dispatch`` does
    not apply to them), and with several such programs queued it may start a later one on
    some local devices before an earlier one on the others. Their collectives then wait on
    each other forever: across processes the gloo collectives hang (5 of 28 runs of the
    2-process test, docs/sharding.md); within one process XLA's in-process rendezvous gives
    up after 40 s and aborts the process ("Termination timeout for `all reduce ...`";
    alternating two jitted all-reduce programs over 8 host devices, 3000 calls without a
    wait, aborted in each of 3 tries). With one mesh program in flight at a time they cannot.
    """
    global _LOCKSTEP
    if _LOCKSTEP is None:
        _LOCKSTEP = bool(config.get("TPUREC_CPU_LOCKSTEP")) and jax.default_backend() == "cpu"
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


def is_global(x) -> bool:
    """Whether ``x`` is a global array: laid out on a mesh of more than one device."""
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
    mesh_sharding = next((x.sharding for x in leaves if is_global(x)), None)
    if mesh_sharding is None:
        return args, False
    replicated = jax.sharding.NamedSharding(mesh_sharding.mesh, jax.sharding.PartitionSpec())

    def place(x):
        if not isinstance(x, jax.Array) or is_global(x):
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


def _drop_op_programs() -> int:
    count = len(programs)
    programs.clear()
    return count


drop_programs_with(_drop_op_programs)


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
