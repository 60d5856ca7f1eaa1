"""Native XLA:CPU kernels of the sparse op set, registered with XLA's FFI.

Same signatures and semantics as :mod:`tpurec.sparse.kernels.reference`
(float32 tables only); threads own partitions ``id % P`` (DESIGN.md, contract 4).
``sparse_cpu.cc`` (the kernels) and ``preprocess_cpu.cc`` (KJT -> CSR
preprocessing, see :mod:`tpurec.sparse.kernels.native.preprocess`) are compiled
with g++ into one library on first use, into a cache directory
(``$TPUREC_CACHE_DIR/native`` or ``~/.cache/tpurec/native``), keyed by a hash
of the sources, compiler and flags.

The gradient ops alias their table/slot outputs to the inputs
(``input_output_aliases``): only touched rows are written, and with the inputs
donated by the caller the update is in place (no table copy).

Environment:
    TPUREC_CPU_THREADS: worker threads (default: the CPUs this process may use).
    TPUREC_NATIVE_MARCH_NATIVE=1: build with ``-march=native``.
    CXX: the compiler (default ``g++``).

Example::

    from tpurec.sparse.kernels import native
    out = jax.jit(native.sparse_dense_matmul, static_argnames="batch_size")(rp, ids, samples, gains, table, batch_size=32)
"""

from __future__ import annotations

import collections
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
import jax.numpy as jnp

__all__ = [
    "NativeBuildError",
    "TRACE_COUNTS",
    "library_path",
    "load_library",
    "sparse_dense_matmul",
    "sparse_dense_matmul_grad_with_sgd",
    "sparse_dense_matmul_grad_with_adagrad",
    "sparse_dense_matmul_grad_with_rowwise_adagrad",
    "sparse_dense_matmul_grad_with_adam",
]

_SOURCE = Path(__file__).with_name("sparse_cpu.cc")
_PREPROCESS_SOURCE = Path(__file__).with_name("preprocess_cpu.cc")
# Symbol in the .so -> FFI target name.
_TARGETS = {
    "TpurecSparseDenseMatmul": "tpurec_sparse_dense_matmul",
    "TpurecGradSgd": "tpurec_sparse_dense_matmul_grad_with_sgd",
    "TpurecGradAdagrad": "tpurec_sparse_dense_matmul_grad_with_adagrad",
    "TpurecGradRowwiseAdagrad": "tpurec_sparse_dense_matmul_grad_with_rowwise_adagrad",
    "TpurecGradAdam": "tpurec_sparse_dense_matmul_grad_with_adam",
}

TRACE_COUNTS: collections.Counter = collections.Counter()
"""Kernel name -> times JAX traced it (a trace is a compilation)."""


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
    if os.environ.get("TPUREC_NATIVE_MARCH_NATIVE") == "1":
        flags.append("-march=native")
    elif platform.machine() in ("x86_64", "AMD64") and "avx2" in _cpu_flags():
        flags.append("-mavx2")  # wider vectors for the dim loops; only where this CPU has them
    return flags


def _cache_dir() -> Path:
    from tpurec.core.runtime import cache_root

    root = cache_root()
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
    sources = [src.read_bytes() for src in (_SOURCE, _PREPROCESS_SOURCE)]
    for part in (*sources, _compiler_version(cxx).encode(), " ".join(flags).encode(), jax.__version__.encode()):
        key.update(part)
        key.update(b"\0")
    if "-march=native" in flags:
        key.update(repr(sorted(_cpu_flags())).encode())  # a shared cache may serve other CPUs
    out_dir = _cache_dir()
    out = out_dir / f"sparse_cpu-{key.hexdigest()[:16]}.so"
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
        cmd = [cxx, *flags, "-isystem", include, str(_SOURCE), str(_PREPROCESS_SOURCE), "-o", tmp]
        try:
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                raise NativeBuildError(
                    f"compiling {_SOURCE.name} failed (exit {result.returncode}):\n  {' '.join(cmd)}\n{result.stderr}{result.stdout}"
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
    _ensure_registered()
    assert _LOADED is not None
    return _LOADED


def _ensure_registered() -> None:
    global _LOADED
    with _LOCK:
        if _LOADED is not None:
            return
        path = library_path()
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            raise NativeBuildError(f"loading {path} failed: {e}") from e
        for symbol, target in _TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
        _LOADED = lib


def _csr(row_pointers, embedding_ids, sample_ids, gains):
    """The CSR operands, refusing (not casting) other dtypes: an int64 id of
    ``2**32 + 1`` cast to int32 would silently read row 1."""
    arrays = {"row_pointers": row_pointers, "embedding_ids": embedding_ids, "sample_ids": sample_ids, "gains": gains}
    out = []
    for (name, a), want in zip(arrays.items(), (jnp.int32, jnp.int32, jnp.int32, jnp.float32)):
        a = jnp.asarray(a)
        if a.dtype != want:
            raise TypeError(f"native kernels take {jnp.dtype(want)} {name}, got {a.dtype}; convert it after checking the values fit")
        if a.ndim != 1:
            raise ValueError(f"native kernels take a 1-D {name}, got shape {a.shape}")
        out.append(a)
    return tuple(out)


def _check_f32(**arrays) -> None:
    for name, a in arrays.items():
        if jnp.result_type(a) != jnp.float32:
            raise TypeError(f"native kernels take float32 {name}, got {jnp.result_type(a)} (use the reference kernel)")


def sparse_dense_matmul(row_pointers, embedding_ids, sample_ids, gains, table, *, batch_size: int):
    """Pooled lookup ``out[s] = sum_i gains[i] * table[ids[i]]``; see the reference kernel.

    Returns:
        ``[batch_size, dim]`` float32.
    """
    TRACE_COUNTS["sparse_dense_matmul"] += 1
    _ensure_registered()
    _check_f32(table=table)
    call = jax.ffi.ffi_call(
        _TARGETS["TpurecSparseDenseMatmul"], jax.ShapeDtypeStruct((batch_size, table.shape[1]), jnp.float32)
    )
    return call(*_csr(row_pointers, embedding_ids, sample_ids, gains), table)


def _grad(symbol, op_name, csr, grad_output, hyper, table, slots):
    TRACE_COUNTS[op_name] += 1
    _ensure_registered()
    _check_f32(grad_output=grad_output, table=table, **{f"slot{i}": s for i, s in enumerate(slots)})
    # Scalars go in as one f32 operand, not as attributes: a new learning rate
    # (or Adam step) must not recompile. Each is rounded to f32 from the same
    # expression the reference uses, so both kernels see the same value.
    hyper = jnp.stack([jnp.asarray(h).astype(jnp.float32) for h in hyper])
    state = (table, *slots)
    first = 6  # operands: 4 CSR arrays, grad_output, hyper, then the state
    call = jax.ffi.ffi_call(
        _TARGETS[symbol],
        [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in state],
        input_output_aliases={first + i: i for i in range(len(state))},
    )
    out = call(*_csr(*csr), grad_output, hyper, *state)
    return tuple(out) if len(state) > 1 else out[0]


def sparse_dense_matmul_grad_with_sgd(row_pointers, embedding_ids, sample_ids, gains, grad_output, table, *, learning_rate):
    """SGD on the touched rows: ``w -= lr * g``. Returns the updated table."""
    return _grad(
        "TpurecGradSgd", "sparse_dense_matmul_grad_with_sgd", (row_pointers, embedding_ids, sample_ids, gains),
        grad_output, [learning_rate], table, (),
    )


def sparse_dense_matmul_grad_with_adagrad(
    row_pointers, embedding_ids, sample_ids, gains, grad_output, table, accumulator, *, learning_rate, eps
):
    """Adagrad: ``m += g**2; w -= lr * g / (sqrt(m) + eps)``. Returns ``(table, accumulator)``."""
    return _grad(
        "TpurecGradAdagrad", "sparse_dense_matmul_grad_with_adagrad", (row_pointers, embedding_ids, sample_ids, gains),
        grad_output, [learning_rate, eps], table, (accumulator,),
    )


def sparse_dense_matmul_grad_with_rowwise_adagrad(
    row_pointers, embedding_ids, sample_ids, gains, grad_output, table, accumulator, *, learning_rate, eps, weight_decay
):
    """Row-wise Adagrad with L2 weight decay. Returns ``(table, accumulator)``, ``accumulator`` is ``[rows]``."""
    return _grad(
        "TpurecGradRowwiseAdagrad", "sparse_dense_matmul_grad_with_rowwise_adagrad",
        (row_pointers, embedding_ids, sample_ids, gains), grad_output, [learning_rate, eps, weight_decay], table,
        (accumulator,),
    )


def sparse_dense_matmul_grad_with_adam(
    row_pointers,
    embedding_ids,
    sample_ids,
    gains,
    grad_output,
    table,
    momentum1,
    momentum2,
    *,
    learning_rate,
    beta1,
    beta2,
    eps,
    weight_decay,
    step,
):
    """Lazy Adam on the touched rows (``step`` counts from 1). Returns ``(table, momentum1, momentum2)``."""
    hyper = [
        learning_rate, beta1, 1.0 - beta1, beta2, 1.0 - beta2, eps, weight_decay,
        1.0 - beta1**step, 1.0 - beta2**step,  # bias corrections, as the reference writes them
    ]
    return _grad(
        "TpurecGradAdam", "sparse_dense_matmul_grad_with_adam", (row_pointers, embedding_ids, sample_ids, gains),
        grad_output, hyper, table, (momentum1, momentum2),
    )
