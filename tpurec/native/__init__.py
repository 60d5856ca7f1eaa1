"""tpurec's native XLA:CPU library: one shared library, built from C++ on first use.

The sources beside this file are compiled with g++ into one library, into a
cache directory (``$TPUREC_CACHE_DIR/native`` or ``~/.cache/tpurec/native``),
keyed by a hash of the sources, compiler and flags:

* ``sparse_cpu.cc``: the sparse op set's kernels (:mod:`tpurec.sparse.kernels.native`);
* ``preprocess_cpu.cc``: KJT -> CSR preprocessing (:mod:`tpurec.sparse.kernels.native.preprocess`);
* ``matmul_cpu.cc``: batched products of small matrices (:mod:`tpurec.dense.native_matmul`);
* ``threads.h``, ``xla_workers.h``: how many threads native code may use, and how the
  kernels share XLA's intra-op threads.

Kernels are registered with XLA's FFI (``jax.ffi``) for platform ``cpu`` under
the names in :data:`FFI_TARGETS`; other functions are plain C, called through ctypes.

Environment:
    TPUREC_CPU_THREADS: at most this many threads per kernel call (the kernels run on XLA's
        intra-op thread pool; default: its size, at most the CPUs this process may use).
    TPUREC_NATIVE_MARCH_NATIVE=1: build with ``-march=native``.
    CXX: the compiler (default ``g++``).

Example::

    from tpurec import native
    native.ensure_registered()  # build (or find in the cache) and register
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import platform
import subprocess
import tempfile
import threading
from pathlib import Path

import jax

from tpurec import config
from tpurec.cache import writable_cache_root

__all__ = ["FFI_TARGETS", "NativeBuildError", "ensure_registered", "library_path", "load_library"]

_HERE = Path(__file__).parent
_SOURCES = tuple(_HERE / name for name in ("sparse_cpu.cc", "preprocess_cpu.cc", "matmul_cpu.cc"))
_HEADERS = (_HERE / "threads.h", _HERE / "xla_workers.h")

FFI_TARGETS = {
    # symbol in the library -> FFI target name
    "TpurecSparseDenseMatmul": "tpurec_sparse_dense_matmul",
    "TpurecGradSgd": "tpurec_sparse_dense_matmul_grad_with_sgd",
    "TpurecGradAdagrad": "tpurec_sparse_dense_matmul_grad_with_adagrad",
    "TpurecGradRowwiseAdagrad": "tpurec_sparse_dense_matmul_grad_with_rowwise_adagrad",
    "TpurecGradAdam": "tpurec_sparse_dense_matmul_grad_with_adam",
    "TpurecBatchedMatmul": "tpurec_batched_matmul",
}


class NativeBuildError(RuntimeError):
    """Compiling or loading the native kernels failed (the message has the compiler output)."""


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _flags() -> list[str]:
    # -ffp-contract=off: no fused multiply-adds, so rounding matches XLA's.
    flags = ["-O3", "-fPIC", "-shared", "-std=c++17", "-pthread", "-ffp-contract=off"]
    if config.get("TPUREC_NATIVE_MARCH_NATIVE"):
        flags.append("-march=native")
    elif platform.machine() in ("x86_64", "AMD64") and "avx2" in _cpu_flags():
        flags.append("-mavx2")  # wider vectors for the dim loops; only where this CPU has them
    return flags


def _cache_dir() -> Path:
    root = writable_cache_root()
    if root is None:  # persistence off: build once per user in the temp folder
        return Path(tempfile.gettempdir()) / f"tpurec-native-{os.getuid()}"
    return Path(root) / "native"


def _compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise NativeBuildError(f"C++ compiler {cxx!r} is not usable: {e}") from e


def library_path() -> Path:
    """Builds the kernels' shared library if not cached; returns its path."""
    cxx = os.environ.get("CXX", "g++")
    flags = _flags()
    include = jax.ffi.include_dir()
    key = hashlib.sha256()
    sources = [src.read_bytes() for src in (*_SOURCES, *_HEADERS)]
    for part in (*sources, _compiler_version(cxx).encode(), " ".join(flags).encode(), jax.__version__.encode()):
        key.update(part)
        key.update(b"\0")
    if "-march=native" in flags:
        key.update(repr(sorted(_cpu_flags())).encode())  # a shared cache may serve other CPUs
    out_dir = _cache_dir()
    out = out_dir / f"tpurec_cpu-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    # One process compiles; the others wait on the lock and then find the file.
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.exists():
            return out
        fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
        os.close(fd)
        cmd = [cxx, *flags, "-isystem", include, "-I", str(_HERE), *map(str, _SOURCES), "-o", tmp]
        try:
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                raise NativeBuildError(
                    f"compiling {', '.join(s.name for s in _SOURCES)} failed (exit {result.returncode}):\n  {' '.join(cmd)}\n{result.stderr}{result.stdout}"
                )
            os.replace(tmp, out)  # atomic: readers never see a half-written library
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return out


_LOCK = threading.Lock()
_LOADED: ctypes.CDLL | None = None


def load_library() -> ctypes.CDLL:
    """Builds (if needed) and loads the native library; registers its FFI targets once.

    Returns:
        The loaded library (its plain C functions are callable through ctypes).
    """
    ensure_registered()
    assert _LOADED is not None
    return _LOADED


def ensure_registered() -> None:
    """Builds and loads the library once and registers its FFI targets with XLA:CPU."""
    global _LOADED
    with _LOCK:
        if _LOADED is not None:
            return
        # The kernels read TPUREC_CPU_THREADS themselves and would ignore a bad value: refuse it here.
        config.get("TPUREC_CPU_THREADS")
        path = library_path()
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            raise NativeBuildError(f"loading {path} failed: {e}") from e
        for symbol, target in FFI_TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
        _LOADED = lib
