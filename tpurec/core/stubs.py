"""Stubbed execution: a step's host cost without its computation (the dense benchmarks' host time)."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable

import jax
import jax.numpy as jnp

from tpurec.core.sync import flush_pending_work

__all__ = ["execution_stubbed", "make_stub", "run_stub", "stubbed_execution"]

# Read by every program's call (tpurec.core.runtime.Program): whether it runs as a stub.
active = False
_stubs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def stubbed_execution():
    """Runs every program as a stub that computes nothing: outputs shaped like the real ones.

    For measuring the host: a step run under it issues the same programs with the same
    arguments (the same JAX calls, donations and tensor bookkeeping), but XLA computes
    nothing, so the main thread's CPU time is what Python, PyTorch, tpurec and JAX need to
    issue the step. On XLA:CPU the computation shares the host's cores: it runs partly on the
    calling thread and evicts its caches, which a TPU's host does not see. The values computed
    under it are meaningless (zeros, or a donated input passed through): a model trained under
    it is spoilt. Work pending on entry runs for real first; work recorded inside runs as stubs
    on exit. Meant for single-device steps (the dense benchmarks).

    Example::

        with tpurec.core.stubbed_execution():
            train_step()  # host time only: the model's values are garbage afterwards
    """
    global active
    flush_pending_work("stubbed execution")
    previous, active = active, True
    try:
        yield
        flush_pending_work("stubbed execution")
    finally:
        active = previous


def execution_stubbed() -> bool:
    """Whether programs run as stubs (:func:`stubbed_execution`)."""
    return active


def make_stub(raw: Callable, options: dict) -> Callable:
    """``raw``'s stub: jitted with the same ``options`` (donation, placement), it returns outputs shaped like ``raw``'s.

    Each output is a donated input of its shape and dtype where there is one, else zeros.
    """

    def zeros(*traced):
        shapes = jax.eval_shape(raw, *traced)
        # The zero is computed from an input with about 2000 flops: XLA cannot fold it into a
        # constant (a constant output is copied on every call), and XLA:CPU runs a program of
        # fewer than 1000 flops inline on the calling thread, real programs asynchronously.
        leaves = [x for x in jax.tree.leaves(traced) if jnp.size(x) and not _extended(x.dtype)]
        seed = jnp.asarray(leaves[0]).ravel()[0].real.astype(jnp.float32) if leaves else jnp.float32(0)
        seed = jnp.nan_to_num(seed, nan=0.0, posinf=0.0, neginf=0.0)  # an inf input (a mask) gives 0, not nan
        zero = jnp.sum(jnp.arange(1024, dtype=jnp.float32) * seed) * 0

        # A donated input of an output's shape and dtype is returned as it is: its buffer becomes
        # the output's without being written (an optimizer's parameters and state).
        donated: dict[tuple, list] = {}
        for k in _donated_positions(options, len(traced)):
            for x in jax.tree.leaves(traced[k]):
                donated.setdefault((x.shape, x.dtype), []).append(x)

        def like(s):
            spare = donated.get((s.shape, s.dtype))
            if spare:
                return spare.pop()
            if _extended(s.dtype):
                return jnp.zeros(s.shape, s.dtype)
            return jnp.broadcast_to(zero.astype(s.dtype), s.shape)

        return jax.tree.map(like, shapes)

    return jax.jit(zeros, **options)


def _donated_positions(options: dict, count: int) -> tuple:
    positions = options.get("donate_argnums", ())
    positions = (positions,) if isinstance(positions, int) else tuple(positions)
    return tuple(k for k in positions if k < count)


def _extended(dtype) -> bool:
    return jnp.issubdtype(dtype, jax.dtypes.extended)


def run_stub(owner: Any, raw: Callable, options: dict, args: tuple) -> Any:
    """Calls the stub of ``raw`` (:func:`make_stub`, kept as long as ``owner`` lives) on ``args``."""
    stub = _stubs.get(owner)
    if stub is None:
        stub = _stubs[owner] = make_stub(raw, options)
    return stub(*args)
