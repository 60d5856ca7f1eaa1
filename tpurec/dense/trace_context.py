"""What a lowering may know about the program being traced, beyond its operands.

Three facts, all set while a program is traced and read by lowerings that swap
XLA's op for a native XLA:CPU kernel (:mod:`tpurec.dense.native_matmul`):

* whether XLA will partition the program over a mesh (SPMD): its partitioner
  cannot split a custom call and would gather the operands onto every device,
  so such programs keep XLA's ops;
* which values are transposes of others: XLA folds a transpose into its own dot
  but not into a custom call, so a kernel that reads transposed operands is
  handed the source and a flag instead of a materialized copy. Reading a
  transposed view (:func:`tpurec.core.views.read_view`) and the compiled
  graphs' ``permute``/``transpose`` go through :func:`transpose`;
* which values can produce their own transpose more cheaply than a copy: the
  transpose of a product is the product of the transposed operands in the other
  order (autograd transposes ``bmm``'s gradient for a transposed operand), so a
  kernel output registers a *transposer* (:func:`remember_transposer`) that
  :func:`transpose` calls instead of copying; XLA then drops the untransposed
  product if nothing else reads it.

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

__all__ = ["remember_transposer", "traced_as_spmd", "tracing_spmd", "transpose", "transposed_from"]

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
# id(value) -> (weak reference to the value, transposer); same lifetime rule.
_TRANSPOSERS: dict[int, tuple[weakref.ref, Callable]] = {}


def _remember(table: dict, value, entry: tuple) -> None:
    key = id(value)
    try:
        ref = weakref.ref(value, lambda _, key=key: table.pop(key, None))
    except TypeError:  # not weakly referenceable: not remembered
        return
    table[key] = (ref, *entry)


def _recall(table: dict, value) -> tuple | None:
    """What :func:`_remember` stored for ``value`` (without the reference), if it still is ``value``'s."""
    entry = table.get(id(value))
    if entry is None or entry[0]() is not value:
        return None
    return entry[1:]


def remember_transposer(value, transposer: Callable) -> None:
    """Lets :func:`transpose` compute ``transpose(value, perm)`` as ``transposer(perm)``.

    Args:
        value: a value of the program being traced (a kernel's output).
        transposer: ``perm -> array`` equal to ``jnp.transpose(value, perm)``, or None
            where it has no cheaper way than the copy.
    """
    _remember(_TRANSPOSERS, value, (transposer,))


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
    transposer = _recall(_TRANSPOSERS, x)
    if transposer is not None:
        out = transposer[0](perm)
        if out is not None:
            return out
    out = jnp.transpose(x, perm)
    _remember(_TRANSPOSES, out, (x, perm))
    return out


def transposed_from(x) -> tuple[object, tuple[int, ...]] | None:
    """``(source, perm)`` when ``x`` is ``transpose(source, perm)`` of the same trace, else None."""
    found = _recall(_TRANSPOSES, x)
    if found is None:
        return None
    source, perm = found
    if getattr(source, "_trace", None) is not getattr(x, "_trace", None):
        return None
    return source, perm
