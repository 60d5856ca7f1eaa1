"""Running eager programs and reading tensor values.

A program (``runtime.Program``) is compiled once per key and then run eagerly, or
recorded into the fused window; :func:`value_of` and :func:`pending_value` read a
tpu tensor's values (a whole storage or a view of one).
"""

from __future__ import annotations

import jax
import torch

from tpurec.core import fused, modes, runtime
from tpurec.core.device import jax_device
from tpurec.core.tensor import Storage, TpuTensor, with_key, wrap
from tpurec.core.views import read_view, reinterpretation

__all__ = ["fresh", "fresh_with_key", "pending_value", "run_program", "store_array", "value_of"]


# --- running programs ---------------------------------------------------------


def _placed(index: int | None) -> dict:
    """jit options placing the outputs of a program without inputs on ``tpu:index``."""
    # keep_unused: a program that ignores an input's values still runs on its device.
    if index is None:
        return {"keep_unused": True}
    return {"out_shardings": jax.sharding.SingleDeviceSharding(jax_device(index))}


def _compile(key, fn, index: int | None = None) -> runtime.Program:
    """The cached program for ``key``; ``fn`` returns a list of arrays."""
    return runtime.programs.get(key, lambda: runtime.Program(fn, **_placed(index)))


def run_program(program: runtime.Program, *inputs, now: bool = False, device: int = 0) -> list:
    """Runs (eager, debug) or records (fused) ``program`` on ``tpu:device``; returns its outputs."""
    if not now and modes.get_mode() == "fused":
        return fused.record(program, inputs, device)
    if any(fused.is_pending(x) for x in inputs):
        inputs = tuple(fused.resolve(x) for x in inputs)
    outs = program(*inputs)
    if modes.get_mode() == "debug":
        for o in outs:
            if o is not None:
                o.block_until_ready()
    return outs


def store_array(storage: Storage, array) -> None:
    """Makes ``array`` (concrete, or pending in fused mode) the new contents of ``storage``."""
    if type(array) is _Pending:
        _track(storage, replaced=storage.array)
    storage.array = array


def fresh(array, index: int, dtype: torch.dtype | None = None) -> TpuTensor:
    """A tpu tensor owning ``array``; a pending one (fused mode) is filled in by the next flush."""
    t = wrap(array, index, dtype)
    if fused.is_pending(array):
        fused.track(t._storage)
    return t


def fresh_with_key(array, index: int, key: tuple, plain: bool = False) -> TpuTensor:
    """:func:`fresh` for an output whose tensor metadata (``TpuTensor._key``) is known.

    ``plain``: ``tpurec.core.tensor.is_plain(key)``, when the caller knows it.
    """
    storage = Storage(array, index)
    t = with_key(storage, key, plain)
    if type(array) is _Pending:
        _track(storage)
    return t


_Pending, _track = fused.Pending, fused.track


# --- reading values ---------------------------------------------------------


def _read_program(key):
    shape, dtype, size, stride, offset, storage_dtype = key
    reinterpret = reinterpretation(storage_dtype, dtype)

    def read(storage):
        return [read_view(storage, size, stride, offset, reinterpret)]

    return _compile(("read", key), read)


def value_of(t: TpuTensor, reason: str = "value needed") -> jax.Array:
    """The values of ``t`` as one concrete jax.Array shaped like ``t`` (a sync point)."""
    array = t._storage.array
    if fused.is_pending(array):
        fused.flush(reason)
        array = t._storage.array
    if t.is_full:
        return array
    return run_program(_read_program(t._key), array, now=True)[0]


def pending_value(t: TpuTensor):
    """``t``'s values without a sync point: in fused mode they may still be pending.

    A whole-storage tensor gives its storage's array (concrete or pending); a view
    runs (or, in fused mode, records) the same read program :func:`value_of` uses.
    """
    array = t._storage.array
    if t.is_full:
        return array
    return run_program(_read_program(t._key), array, device=t._storage.index)[0]
