"""XLA collectives between the processes of a c10d group, on each process's local jax arrays.

Each collective is one jitted ``shard_map`` program over a mesh of the group's devices (one per
process): the caller's local array becomes its block of a global ``jax.Array``
(``jax.make_array_from_single_device_arrays``, no copy), the program runs XLA's collective
(``psum``, ``all_gather``, ``all_to_all``, ...), and the caller gets its own block of the result
back, still on its device. Programs are cached per (collective, shapes, dtype, group), so a training loop
compiles each once.

This module knows nothing of torch; :mod:`tpurec.distributed.backend` maps c10d calls onto it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tpurec.core import drop_programs_with

__all__ = [
    "REDUCE_OPS",
    "Group",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "all_to_all_uneven",
    "broadcast",
    "reduce_scatter",
    "scatter",
]

# jax.Device, which pyright cannot use as a type (it is a variable in jax's stubs).
Device = Any

_AXIS = "ranks"
# The reductions all_reduce and reduce_scatter take (c10d's ReduceOp names).
REDUCE_OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")


class Group:
    """The processes of one c10d group, in group-rank order, and their meshes.

    Args:
        processes: the JAX process index of each group rank (torch's global rank).
    """

    def __init__(self, processes: Sequence[int]) -> None:
        self.processes = tuple(int(p) for p in processes)
        self.rank = self.processes.index(jax.process_index())
        self._meshes: dict[Device, Mesh] = {}

    @property
    def size(self) -> int:
        """Ranks in the group."""
        return len(self.processes)

    def mesh(self, device: Device) -> Mesh:
        """The mesh of each rank's device at ``device``'s local index (one device per process)."""
        mesh = self._meshes.get(device)
        if mesh is None:
            mesh = self._meshes[device] = self._make_mesh(device)
        return mesh

    def _make_mesh(self, device: Device) -> Mesh:
        index = jax.local_devices().index(device)
        devices = []
        for process in self.processes:
            local = jax.local_devices(process_index=process)
            if index >= len(local):
                raise RuntimeError(f"process {process} has no local device {index} for this collective")
            devices.append(local[index])
        return Mesh(np.array(devices), (_AXIS,))


# (collective, group processes, device index, shapes, dtype, static arguments) -> jitted program.
_programs: dict[tuple, Callable] = {}


def cached_program_count() -> int:
    """How many collective programs this process has built (each compiles once)."""
    return len(_programs)


def _drop_programs() -> int:
    count = len(_programs)
    _programs.clear()
    return count


drop_programs_with(_drop_programs)


def _run(name: str, group: Group, local: jax.Array, static: tuple, body: Callable, *extra: jax.Array) -> jax.Array:
    """Runs ``body`` (one rank's block -> one rank's block) over the group; this rank's result block.

    ``local`` is this rank's block (at least 1-d); ``extra`` are replicated inputs (the same on
    every rank). The program is built once per key and reused.
    """
    device = next(iter(local.devices()))
    mesh = group.mesh(device)
    key = (
        name,
        group.processes,
        mesh.devices.tolist().index(device),
        local.shape,
        local.dtype,
        static,
        tuple((e.shape, e.dtype) for e in extra),
    )
    program = _programs.get(key)
    if program is None:
        mapped = jax.shard_map(
            body, mesh=mesh, in_specs=(P(_AXIS),) + (P(),) * len(extra), out_specs=P(_AXIS), check_vma=False
        )
        program = _programs[key] = jax.jit(mapped)
    blocks = [_global(local, mesh)] + [_replicated(e, mesh) for e in extra]
    out = program(*blocks)
    return out.addressable_data(0)


def _global(local: jax.Array, mesh: Mesh) -> jax.Array:
    """``local`` as this process's block (along axis 0) of a global array over ``mesh``."""
    shape = (local.shape[0] * mesh.size,) + tuple(local.shape[1:])
    return jax.make_array_from_single_device_arrays(shape, NamedSharding(mesh, P(_AXIS)), [local])


def _replicated(value: jax.Array, mesh: Mesh) -> jax.Array:
    """``value`` (the same in every process) as a replicated global array over ``mesh``."""
    return jax.make_array_from_single_device_arrays(value.shape, NamedSharding(mesh, P()), [value])


def _reduce(op: str, stacked: jax.Array) -> jax.Array:
    """Reduces ``stacked`` (ranks on axis 0) by c10d's ``op``, keeping the dtype."""
    if op in ("SUM", "AVG"):
        total = jnp.sum(stacked, axis=0, dtype=stacked.dtype)
        return total / stacked.shape[0] if op == "AVG" else total
    if op == "PRODUCT":
        return jnp.prod(stacked, axis=0, dtype=stacked.dtype)
    if op == "MIN":
        return jnp.min(stacked, axis=0)
    if op == "MAX":
        return jnp.max(stacked, axis=0)
    combine = {"BAND": jnp.bitwise_and, "BOR": jnp.bitwise_or, "BXOR": jnp.bitwise_xor}[op]
    return functools.reduce(combine, [stacked[i] for i in range(stacked.shape[0])])


def _check_op(op: str, dtype: np.dtype) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"reduce op {op} is not supported on tpu; use one of {', '.join(REDUCE_OPS)}")
    if op == "AVG" and not jnp.issubdtype(dtype, jnp.inexact):
        raise TypeError(f"ReduceOp.AVG needs a floating-point tensor, got {dtype} (use SUM and divide)")
    if op in ("BAND", "BOR", "BXOR") and not (jnp.issubdtype(dtype, jnp.integer) or dtype == jnp.bool_):
        raise TypeError(f"ReduceOp.{op} needs an integer or bool tensor, got {dtype}")


def _at_least_1d(local: jax.Array) -> jax.Array:
    return local.reshape(1) if local.ndim == 0 else local


def all_reduce(group: Group, local: jax.Array, op: str) -> jax.Array:
    """Every rank's ``local`` reduced by ``op``; this rank's copy."""
    _check_op(op, local.dtype)
    n = group.size
    dtype = local.dtype
    work = local
    if dtype == jnp.bool_:
        # As on CPU: a bool sum is "any", a product "all".
        work = local.astype(jnp.int8)
        op = {"SUM": "MAX", "PRODUCT": "MIN"}.get(op, op)

    def body(x: jax.Array) -> jax.Array:
        if op in ("SUM", "AVG"):
            total = lax.psum(x, _AXIS)
            return total / n if op == "AVG" else total
        if op == "MAX":
            return lax.pmax(x, _AXIS)
        if op == "MIN":
            return lax.pmin(x, _AXIS)
        return _reduce(op, lax.all_gather(x, _AXIS))

    out = _run("all_reduce", group, _at_least_1d(work), (op,), body)
    return out.reshape(local.shape).astype(dtype)


def broadcast(group: Group, local: jax.Array, src: int) -> jax.Array:
    """Group rank ``src``'s ``local`` (every rank passes an array of the same shape)."""

    def body(x: jax.Array) -> jax.Array:
        return lax.all_gather(x, _AXIS)[src]

    return _run("broadcast", group, _at_least_1d(local), (src,), body).reshape(local.shape)


def all_gather(group: Group, local: jax.Array) -> jax.Array:
    """Every rank's ``local`` stacked on a new leading axis, in group-rank order."""

    def body(x: jax.Array) -> jax.Array:  # x: (1, *local.shape)
        return lax.all_gather(x[0], _AXIS)[None]

    out = _run("all_gather", group, local[None], (), body)
    return out[0]


def reduce_scatter(group: Group, local: jax.Array, op: str) -> jax.Array:
    """``local`` (``group.size`` blocks along axis 0) reduced over the ranks; this rank's block."""
    _check_op(op, local.dtype)
    n = group.size
    if local.ndim == 0 or local.shape[0] % n:
        raise ValueError(f"reduce_scatter: the input's first dimension must be a multiple of the group size {n}")

    def body(x: jax.Array) -> jax.Array:
        if op in ("SUM", "AVG") and x.dtype != jnp.bool_:
            total = lax.psum_scatter(x, _AXIS, scatter_dimension=0, tiled=True)
            return total / n if op == "AVG" else total
        received = lax.all_to_all(x, _AXIS, 0, 0, tiled=True)  # block i: rank i's part for this rank
        return _reduce(op, received.reshape((n, -1) + x.shape[1:]))

    return _run("reduce_scatter", group, local, (op,), body)


def all_to_all(group: Group, local: jax.Array) -> jax.Array:
    """Block ``j`` of ``local`` (``group.size`` equal blocks along axis 0) goes to rank ``j``."""
    n = group.size
    if local.ndim == 0 or local.shape[0] % n:
        raise ValueError(f"all_to_all: the input's first dimension must be a multiple of the group size {n}")

    def body(x: jax.Array) -> jax.Array:
        return lax.all_to_all(x, _AXIS, 0, 0, tiled=True)

    return _run("all_to_all", group, local, (), body)


def scatter(group: Group, local: jax.Array, src: int) -> jax.Array:
    """Rank ``src``'s ``local[j]`` to rank ``j`` (``local``: (group.size, ...), ignored on other ranks)."""

    def body(x: jax.Array) -> jax.Array:
        return lax.all_to_all(x, _AXIS, 0, 0, tiled=True)[src][None]

    return _run("scatter", group, local, (src,), body)[0]


def _bucket(count: int) -> int:
    """``count`` rounded up to a power of two: a loop with varying sizes compiles a few programs."""
    return 1 if count <= 1 else 1 << (count - 1).bit_length()


def all_to_all_uneven(group: Group, local: jax.Array, splits: np.ndarray, out_rows: int) -> jax.Array:
    """Uneven all-to-all: rank ``i`` sends its rows ``[off[i, j], off[i, j] + splits[i, j])`` to rank ``j``.

    Args:
        group: the ranks.
        local: this rank's rows to send (``splits[rank].sum()`` rows along axis 0).
        splits: ``(n, n)`` rows each rank sends each rank (the same matrix on every rank; see
            :func:`agree`), zeros included.
        out_rows: rows this rank receives (``splits[:, rank].sum()``).

    Returns:
        The received rows, rank 0's first (``out_rows`` along axis 0).

    Inside the program every segment is padded to one capacity (the largest segment, rounded up
    to a power of two), exchanged with XLA's all-to-all, and cut back to its size.
    """
    n = group.size
    capacity = _bucket(int(splits.max(initial=0)))
    rows_in = _bucket(int(splits.sum(axis=1).max(initial=0)))
    rows_out = _bucket(int(splits.sum(axis=0).max(initial=0)))
    rest = tuple(local.shape[1:])
    if local.shape[0] < rows_in:
        local = jnp.pad(local, [(0, rows_in - local.shape[0])] + [(0, 0)] * len(rest))
    matrix = jax.device_put(np.asarray(splits, dtype=np.int32), next(iter(local.devices())))

    def body(x: jax.Array, counts: jax.Array) -> jax.Array:
        me = lax.axis_index(_AXIS)
        sends = counts[me]  # (n,): rows to each rank
        starts = jnp.cumsum(sends) - sends
        slot = jnp.arange(capacity, dtype=jnp.int32)
        index = starts[:, None] + slot[None, :]  # (n, capacity)
        valid = slot[None, :] < sends[:, None]
        packed = jnp.where(valid.reshape(valid.shape + (1,) * len(rest)), x[jnp.where(valid, index, 0)], 0)
        received = lax.all_to_all(packed, _AXIS, 0, 0, tiled=True)  # (n, capacity, *rest): from rank i
        gets = counts[:, me]
        offsets = jnp.cumsum(gets) - gets
        row = jnp.arange(rows_out, dtype=jnp.int32)
        source = jnp.clip(jnp.searchsorted(offsets, row, side="right", method="compare_all") - 1, 0, n - 1)
        position = jnp.clip(row - offsets[source], 0, capacity - 1)
        return received[source, position]

    out = _run("all_to_all_uneven", group, local, (capacity, rows_out), body, matrix)
    return out[:out_rows]
