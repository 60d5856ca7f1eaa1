"""tpurec's native XLA:CPU library: one shared library, built from C++ on first use.

The sources beside this file are compiled with g++ into one library, into a
cache directory (``$TPUREC_CACHE_DIR/native`` or ``~/.cache/tpurec/native``),
keyed by a hash of the sources, compiler and flags (the build id). Beside each
library a record (``.json``) keeps its build id, size and sha256; a library is
loaded only when it matches its record, and rebuilt otherwise (a truncated,
damaged, empty or foreign file would crash the process that loads it). Builds
go to a temporary file in the same folder, are synced to disk and renamed into
place under a file lock, so concurrent processes build once and never load a
half-written library. The library holds:

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
import json
import os
import platform
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Callable, Sequence
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


def _build_id(cxx: str, flags: list[str]) -> str:
    """What the library is built from: sources, compiler, flags, JAX version (and CPU, for -march=native)."""
    key = hashlib.sha256()
    sources = [src.read_bytes() for src in (*_SOURCES, *_HEADERS)]
    for part in (*sources, _compiler_version(cxx).encode(), " ".join(flags).encode(), jax.__version__.encode()):
        key.update(part)
        key.update(b"\0")
    if "-march=native" in flags:
        key.update(repr(sorted(_cpu_flags())).encode())  # a shared cache may serve other CPUs
    return key.hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _record_path(library: Path) -> Path:
    """The record beside a library: its build id, size and content hash (JSON)."""
    return library.with_suffix(".json")


def _verified(library: Path, build_id: str) -> bool:
    """True when ``library`` is the complete, unaltered output of the build ``build_id``.

    A truncated, bit-flipped, empty or foreign file kills the process that loads it
    (SIGBUS, SIGILL, SIGSEGV) or fails to load, so nothing is loaded on its name alone.
    """
    try:
        record = json.loads(_record_path(library).read_text())
        if not isinstance(record, dict) or record.get("build_id") != build_id:
            return False
        if library.stat().st_size != record.get("size"):
            return False  # cheap first: a truncated file is caught without reading it
        return _sha256(library) == record.get("sha256")
    except (OSError, ValueError):
        return False


def _write_durably(path: Path, data: bytes) -> None:
    """Writes ``path`` atomically: a temporary file in the same folder, fsync, then rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync a folder; the renames are still atomic
    finally:
        os.close(fd)


def _build(cxx: str, flags: list[str], out: Path, build_id: str, compile_args: Sequence[str] | None = None) -> None:
    """Compiles a library to ``out`` and records it; the caller holds the folder's lock.

    ``compile_args`` are the include options and sources (default: the kernels' sources,
    against JAX's FFI headers).
    """
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=out.name + ".", suffix=".tmp")
    os.close(fd)
    if compile_args is None:
        compile_args = ["-isystem", jax.ffi.include_dir(), "-I", str(_HERE), *map(str, _SOURCES)]
    cmd = [cxx, *flags, *compile_args, "-o", tmp]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            sources = ", ".join(Path(a).name for a in compile_args if a.endswith(".cc"))
            raise NativeBuildError(
                f"compiling {sources} failed (exit {result.returncode}):\n  {' '.join(cmd)}\n{result.stderr}{result.stdout}"
            )
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        record = {"build_id": build_id, "size": os.path.getsize(tmp), "sha256": _sha256(Path(tmp))}
        # The library first, then its record: a reader in between sees a record that does
        # not match, waits on the lock, and then finds both.
        os.replace(tmp, out)  # atomic: a process that has the old file open keeps its copy
        _write_durably(_record_path(out), json.dumps(record).encode())
        _fsync_dir(out.parent)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _remove_leftovers(out_dir: Path) -> None:
    """Removes temporary files of builds that were killed (only the lock holder builds)."""
    for leftover in out_dir.glob("tpurec_*-*.tmp"):
        try:
            leftover.unlink()
        except OSError:
            pass


def library_path() -> Path:
    """Builds the kernels' shared library unless a verified build is cached; returns its path.

    The library is used only when its content hash and build id match the record written
    beside it when it was built. Anything else (a truncated, damaged, empty or foreign file,
    a library without a record) is rebuilt, under a lock so that concurrent processes build
    once, and replaced atomically.
    """
    cxx = os.environ.get("CXX", "g++")
    flags = _flags()
    build_id = _build_id(cxx, flags)
    return verified_build("tpurec_cpu", build_id, lambda out: _build(cxx, flags, out, build_id))


def verified_build(name: str, build_id: str, build: Callable[[Path], None]) -> Path:
    """The cached library ``name`` of build ``build_id``, built by ``build(path)`` unless verified.

    Args:
        name: the library's file name prefix (``tpurec_<what>``).
        build_id: a hash of everything the library is built from.
        build: compiles the library to the path it is given and records it (see :func:`_build`).

    Returns:
        The library's path, matching its build record.
    """
    out_dir = _cache_dir()
    out = out_dir / f"{name}-{build_id[:16]}.so"
    if _verified(out, build_id):
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    # One process compiles; the others wait on the lock and then find the verified file.
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _verified(out, build_id):
            return out
        _remove_leftovers(out_dir)
        if out.exists():
            warnings.warn(
                f"tpurec: the native library {out} does not match its build record (damaged, "
                "truncated or replaced); rebuilding it.",
                RuntimeWarning,
                stacklevel=3,
            )
        build(out)
        if not _verified(out, build_id):  # e.g. another program writes into the folder
            raise NativeBuildError(f"the native library built at {out} does not match its build record")
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
