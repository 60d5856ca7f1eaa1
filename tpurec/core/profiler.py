"""tpurec's ranges in ``torch.profiler`` traces: the hooks the runtime core calls.

The ranges (``tpurec::dispatch``, ``tpurec::compile <program>``, ``tpurec::execute
<program>``, ``tpurec::sync (<reason>)``, ``tpurec::host_fallback <op>``) are described
in tpurec/profiler.py, which also has :func:`tpurec.profile`; that one sits above the
core because it synchronizes the device, these sit at its bottom.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch.autograd.profiler as _torch_profiler

__all__ = ["enabled", "record", "program_label"]


def enabled() -> bool:
    """Whether a ``torch.profiler`` (or autograd profiler) is recording now."""
    return _torch_profiler._is_profiler_enabled


def record(name: str) -> contextlib.AbstractContextManager:
    """A ``record_function`` range named ``name`` while profiling, otherwise a no-op."""
    if _torch_profiler._is_profiler_enabled:
        return _torch_profiler.record_function(name)
    return contextlib.nullcontext()


def program_label(origin: Any) -> str:
    """What kind of program an origin tuple (see ``runtime.Program.origin``) describes."""
    if origin is None:
        return "op"
    kind = origin[0]
    if kind == "fused":
        return "fused window"
    if kind == "steps":
        return f"captured step x{origin[1]}"
    if kind == "graph":
        return f"{origin[1].name.split('#')[0]} graph"
    return "op"
