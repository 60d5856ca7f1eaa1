"""What a lowering may know about the program being traced, beyond its operands.

Two facts, both set while a program is traced and read by lowerings that swap
XLA's op for a native XLA:CPU kernel (:mod:`tpurec.dense.native_matmul`):

* whether XLA will partition the program over a mesh (SPMD): its partitioner
  cannot split a custom call and would gather the operands onto every device,
  so such programs keep XLA's ops;
* which values are transposes of others: XLA folds a transpose into its own dot
  but not into a custom call, so a kernel that reads transposed operands is
  handed the source and a flag instead of a materialized copy. Reading a
  transposed view (:func:`tpurec.core.views.read_view`) and the compiled
  graphs' ``permute``/``transpose`` go through :func:`transpose`.

Example::

    y = transpose(x, (0, 2, 1))
    assert transposed_from(y) == (x, (0, 2, 1))
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Callable

import jax.numpy as jnp

__all__ = ["traced_as_spmd", "tracing_spmd", "transpose", "transposed_from"]

_spmd = threading.local()


def tracing_spmd() -> bool:
    """True while a program that XLA will partition over a mesh is being traced."""
    return getattr(_spmd, "active", False)


def traced_as_spmd(raw: Callable) -> Callable:
    """``raw`` with :func:`tracing_spmd` true while it runs (wrap a function before ``jax.jit``)."""

    @functools.wraps(raw)
    def traced(*args, **kwargs):
        outer = tracing_spmd()
        _spmd.active = True
        try:
            return raw(*args, **kwargs)
        finally:
            _spmd.active = outer

    return traced


# id(result) -> (weak reference to the result, source, permutation); an entry
# goes when its result does, so nothing outlives the trace that made it.
_TRANSPOSES: dict[int, tuple[weakref.ref, object, tuple[int, ...]]] = {}


def transpose(x, perm) -> jnp.ndarray:
    """``jnp.transpose(x, perm)``, remembered for :func:`transposed_from`.

    A transpose of a remembered transpose is one transpose of its source (and the
    source itself when the two cancel), so it too can be read in place.
    """
    perm = tuple(perm)
    if perm == tuple(range(len(perm))):
        return x
    found = transposed_from(x)
    if found is not None:
        source, first = found
        return transpose(source, tuple(first[p] for p in perm))
    out = jnp.transpose(x, perm)
    key = id(out)
    try:
        ref = weakref.ref(out, lambda _, key=key: _TRANSPOSES.pop(key, None))
    except TypeError:  # not weakly referenceable: not remembered
        return out
    _TRANSPOSES[key] = (ref, x, perm)
    return out


def transposed_from(x) -> tuple[object, tuple[int, ...]] | None:
    """``(source, perm)`` when ``x`` is ``transpose(source, perm)`` of the same trace, else None."""
    entry = _TRANSPOSES.get(id(x))
    if entry is None or entry[0]() is not x:
        return None
    _, source, perm = entry
    if getattr(source, "_trace", None) is not getattr(x, "_trace", None):
        return None
    return source, perm
