"""tpurec's persistent cache folder, shared by compiled programs and built native kernels.

Nothing in it depends on where it is: a warm folder moved or copied elsewhere (with
``TPUREC_CACHE_DIR`` pointing at the new place) serves its compiled programs and its
native library as before.
"""

from __future__ import annotations

import functools
import os
import tempfile
import time
import warnings
from typing import Any

from tpurec import config

__all__ = ["cache_root", "every_process_writes_its_programs", "writable_cache_root"]


def cache_root() -> str | None:
    """tpurec's persistent cache folder (``$TPUREC_CACHE_DIR``, default ``~/.cache/tpurec``).

    Holds ``xla/`` (compiled programs) and ``native/`` (built kernels).
    ``TPUREC_CACHE_DIR=off`` turns persistence off: None.
    """
    root = config.get("TPUREC_CACHE_DIR")
    if root and root.lower() in ("off", "none", "0"):
        return None
    if root:
        return root
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tpurec")


def writable_cache_root() -> str | None:
    """:func:`cache_root` if it can be written, else a private temporary folder (one warning).

    An unusable cache folder (read-only, a file in its place) must not stop tpurec from
    working: it only costs the compiled programs and built kernels of earlier runs.
    """
    root = cache_root()
    return None if root is None else _writable(root)


@functools.lru_cache(maxsize=None)
def _writable(root: str) -> str:
    try:
        os.makedirs(root, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
        return root
    except OSError as error:
        fallback = tempfile.mkdtemp(prefix="tpurec-cache-")
        warnings.warn(
            f"tpurec: the cache folder {root!r} is not writable ({type(error).__name__}: {error}); using "
            f"{fallback!r} for this process, so programs and kernels built earlier are not reused. Set "
            "TPUREC_CACHE_DIR to a writable folder (or TPUREC_CACHE_DIR=off to keep nothing).",
            RuntimeWarning,
            stacklevel=2,
        )
        return fallback


def every_process_writes_its_programs() -> None:
    """Each process of a multi-process job writes the programs of its own devices to the persistent cache.

    JAX writes cache entries from process 0 only (on a shared file system, every process compiling the same
    program would write the same entry). A program on one process's own devices is keyed by those devices, so
    no other process writes its entry, but JAX does not write it either: every process but the first compiled
    each of its programs again in every run (on 2 XLA:CPU ranks, process 1 spent 24 of its 40 s compiling
    what process 0 read from the cache). Programs that span processes keep JAX's rule.
    """
    from jax._src import compilation_cache, compiler, distributed

    original = compiler._compile_and_write_cache
    if getattr(original, "writes_every_process", False):
        return

    def compile_and_write_cache(
        backend: Any,
        computation: Any,
        executable_devices: Any,
        compile_options: Any,
        host_callbacks: Any,
        module_name: str,
        cache_key: str,
    ) -> Any:
        if distributed.global_state.process_id == 0 or not executable_devices.is_fully_addressable or host_callbacks:
            return original(
                backend, computation, executable_devices, compile_options, host_callbacks, module_name, cache_key
            )
        start = time.monotonic()
        executable = compiler.backend_compile_and_load(
            backend, computation, executable_devices, compile_options, host_callbacks
        )
        seconds = time.monotonic() - start
        if seconds >= compiler.config.persistent_cache_min_compile_time_secs.value:
            try:
                compilation_cache.put_executable_and_time(cache_key, module_name, executable, backend, int(seconds))
            except Exception as error:  # as JAX's own write: a cache that cannot be written costs only time
                warnings.warn(
                    f"Error writing persistent compilation cache entry for {module_name!r}: "
                    f"{type(error).__name__}: {error}",
                    stacklevel=2,
                )
        return executable

    compile_and_write_cache.writes_every_process = True  # pyright: ignore[reportFunctionMemberAccess]
    compiler._compile_and_write_cache = compile_and_write_cache
