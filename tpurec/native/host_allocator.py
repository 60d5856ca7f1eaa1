"""Keeps freed host memory for reuse, so XLA:CPU does not fault in fresh pages on every run.

XLA:CPU allocates each run's buffers, among them one temporary buffer for the
whole program, with ``malloc`` on a runtime thread. glibc serves a request
above its mmap threshold (at most 32 MiB), or one too large for a thread's
arena, with freshly mapped pages and unmaps them on ``free``; the next run
faults in and zeroes the same amount again. A fused DLRM dense step at batch
4096 (``python -m tpurec.bench modes``) faulted in 128 MB per step (32,000
minor page faults), about 40 ms of a 165 ms step.

:func:`tune` asks glibc to serve every thread from the main heap, never from
fresh mappings, and to keep up to 2 GiB of freed memory instead of returning
it to the kernel: the buffers of one run are reused by the next, with no page
faults (measured: 0.2 faults per step, 125 ms). It is what ``MALLOC_ARENA_MAX=1
MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=...`` would do, applied at ``import
tpurec``, which comes before JAX starts its CPU runtime threads. The cost: the
process keeps its peak heap; threads share one arena. ``TPUREC_TUNE_MALLOC=0``
leaves the allocator alone. Other C libraries (musl, macOS) are left alone.

Example::

    from tpurec.native import host_allocator
    host_allocator.tune()  # True where glibc took the settings
"""

from __future__ import annotations

import ctypes
import platform

from tpurec import config

__all__ = ["tune", "tuned"]

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_KEEP_BYTES = 2**31 - 1  # mallopt takes a C int

_tuned = False


def tune() -> bool:
    """Applies the settings above once; returns whether they are in effect."""
    global _tuned
    if _tuned:
        return True
    if not config.get("TPUREC_TUNE_MALLOC") or platform.system() != "Linux":
        return False
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    ok = all(
        mallopt(param, value) == 1
        for param, value in (
            (_M_ARENA_MAX, 1),
            (_M_MMAP_MAX, 0),
            (_M_TRIM_THRESHOLD, _KEEP_BYTES),
        )
    )
    _tuned = ok
    return ok


def tuned() -> bool:
    """Whether :func:`tune` took effect in this process."""
    return _tuned
