"""The tpu device's PrivateUse1 hooks in C++ (``privateuse1_hooks.cc``), with pinned host memory.

PyTorch asks the current accelerator (tpu, in a process with tpurec) for a pinned host
allocator when a CPU tensor is made with ``pin_memory=True``, and the hooks a Python backend
can register provide none. DDP's reducer needs one on tpu: with ``find_unused_parameters=True``
or ``static_graph=True`` it stages its map of used parameters through a pinned tensor.

:func:`register` builds a small library against the running torch (cached like the kernels'
library, keyed by its source, the flags and torch's version) and makes its hooks PrivateUse1's.
They answer as the Python hooks do, and hand out pinned host memory: ordinary memory from
PyTorch's CPU allocator (JAX stages host memory for its transfers itself), for which
``is_pinned()`` is true. PyTorch takes PrivateUse1 hooks once per process, so this runs when
tpurec registers the device (``import tpurec``), before the Python hooks would be registered.

Example::

    import torch, tpurec
    torch.empty(4, pin_memory=True).is_pinned()  # True: tpurec registered the C++ hooks
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
from pathlib import Path
from typing import Callable

import torch

from tpurec import native

__all__ = ["failure", "guard_registered", "library_path", "register", "registered", "set_synchronize"]

_SOURCE = Path(__file__).with_name("privateuse1_hooks.cc")
_TORCH = Path(torch.__file__).parent

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_failure: str | None = None
_guard = False


def _flags() -> list[str]:
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return ["-O2", "-fPIC", "-shared", "-std=c++20", "-pthread", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]


def _compile_args() -> list[str]:
    lib = _TORCH / "lib"
    return ["-isystem", str(_TORCH / "include"), str(_SOURCE), f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"]


def library_path() -> Path:
    """Builds the hooks' library against the running torch unless a verified build is cached; its path."""
    cxx = os.environ.get("CXX", "g++")
    flags = _flags()
    key = hashlib.sha256()
    # Keyed by torch's build (the library uses its C++ classes), not by the compiler's version:
    # no numerics here, and a cached library then loads without running the compiler at import.
    parts = (_SOURCE.read_bytes(), cxx.encode(), " ".join(flags).encode(), torch.__version__.encode(),
             str(torch.version.git_version).encode())  # fmt: skip
    for part in parts:
        key.update(part)
        key.update(b"\0")
    build_id = key.hexdigest()
    return native.verified_build(
        "tpurec_torch_hooks", build_id, lambda out: native._build(cxx, flags, out, build_id, _compile_args())
    )


def register() -> bool:
    """Makes the C++ hooks PrivateUse1's, once per process; whether they are.

    A library that cannot be built or loaded (no compiler, say) leaves PrivateUse1 to the
    Python hooks: everything but pinned host memory works as before, and :func:`failure` says
    why.

    Returns:
        True when the C++ hooks are PrivateUse1's.
    """
    global _library, _failure, _guard
    with _lock:
        if _library is not None or _failure is not None:
            return _library is not None
        try:
            path = library_path()
            library = ctypes.CDLL(str(path))
        except (native.NativeBuildError, OSError) as e:
            _failure = f"the library of tpurec's C++ PrivateUse1 hooks could not be built or loaded: {e}"
            return False
        if not library.tpurec_register_privateuse1_hooks():
            _failure = "PrivateUse1 already had hooks when tpurec registered the tpu device (PyTorch takes them once)"
            return False
        _library = library
        # The device guard in C++ too (where PrivateUse1 has none yet); else the Python one serves.
        _guard = bool(library.tpurec_register_privateuse1_guard())
        return True


# int fn(char* error, int capacity): the C++ guard's way to call tpurec's synchronize().
_SYNCHRONIZE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int)
_synchronize_callback = None  # kept alive: C++ holds the pointer


def set_synchronize(synchronize: Callable[[], None]) -> None:
    """Gives the C++ device guard ``synchronize`` for ``torch.accelerator.synchronize()`` and stream syncs.

    Its exceptions reach the caller as a ``RuntimeError`` with their message. Does nothing where the
    C++ guard is not PrivateUse1's.
    """
    global _synchronize_callback
    if _library is None or not _guard:
        return

    def call(error: int, capacity: int) -> int:
        try:
            synchronize()
            return 0
        except BaseException as e:  # a C caller cannot take a Python exception: the message crosses
            text = f"{type(e).__name__}: {e}".encode(errors="replace")[: capacity - 1]
            ctypes.memmove(error, text + b"\0", len(text) + 1)
            return 1

    _synchronize_callback = _SYNCHRONIZE(call)
    _library.tpurec_set_synchronize(_synchronize_callback)


def guard_registered() -> bool:
    """Whether PrivateUse1's device guard is the C++ one of this library in this process."""
    return _guard


def registered() -> bool:
    """Whether the C++ hooks are PrivateUse1's in this process."""
    return _library is not None


def failure() -> str | None:
    """Why :func:`register` did not register the C++ hooks (None when it did or has not run)."""
    return _failure
