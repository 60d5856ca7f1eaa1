"""``torch.distributed``'s ``"tpu"`` backend: c10d collectives on tpu tensors as XLA collectives.

``init_process_group("tpu")`` (or ``"cpu:gloo,tpu:tpu"``) builds a :class:`TpuBackend` per group
through :func:`create`. Each call takes the tensors' jax arrays (on this process's device), runs
the collective of :mod:`tpurec.distributed.collectives` across the group's devices and writes the
result into the output tensors on the device. The output tensors hold the result as soon as the
call returns (as a pending device value); :meth:`TpuWork.wait` waits until it is computed.
"""

from __future__ import annotations

import datetime
import functools
import os
import socket
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, Store

from tpurec.distributed import collectives
from tpurec.distributed.agreement import Agreement, CollectiveMismatch

__all__ = ["TpuBackend", "TpuWork", "create"]


class TpuWork(dist.Work):
    """A collective's handle: its outputs are already in place; :meth:`wait` waits for the values."""

    def __init__(self, outputs: list[torch.Tensor], arrays: Sequence[jax.Array]) -> None:
        super().__init__()
        self._outputs = outputs
        self._arrays = list(arrays)
        self._future: torch.futures.Future = torch.futures.Future()
        self._future.set_result(outputs)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Blocks until the collective's results are computed."""
        jax.block_until_ready(self._arrays)
        return True

    def is_completed(self) -> bool:
        """The results are computed."""
        return all(a.is_ready() for a in self._arrays)  # pyright: ignore[reportAttributeAccessIssue] (jax's ArrayImpl)

    def is_success(self) -> bool:
        return self.is_completed()

    def exception(self) -> None:
        return None

    def result(self) -> list[torch.Tensor]:
        """The output tensors."""
        return self._outputs

    def get_future(self) -> torch.futures.Future:
        """A future holding the output tensors (as DDP's communication hooks expect)."""
        return self._future


def _tensors(args: tuple) -> list[torch.Tensor]:
    """Every tensor in a call's arguments (lists of lists included)."""
    found: list[torch.Tensor] = []
    for a in args:
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(_tensors(tuple(a)))
    return found


def _cpu_to_gloo(method: Callable) -> Callable:
    """Sends a call whose tensors are all on the CPU to the group's gloo group (the same method name)."""

    @functools.wraps(method)
    def call(self: TpuBackend, *args: Any) -> Any:
        devices = {t.device.type for t in _tensors(args)}
        if devices == {"cpu"}:
            return getattr(self._gloo(), method.__name__)(*args)
        if len(devices) > 1:
            raise TypeError(
                f"{method.__name__}: the tensors of one call must all be on tpu (an XLA collective) or all on the CPU "
                f"(gloo), got tensors on {sorted(devices)}"
            )
        return method(self, *args)

    return call


def _reduce_name(op: Any) -> str:
    """c10d's ReduceOp (or its RedOpType) as a name of :data:`collectives.REDUCE_OPS`."""
    name = getattr(getattr(op, "op", op), "name", None)
    if name not in collectives.REDUCE_OPS:
        raise ValueError(
            f"reduce op {op} is not supported by the tpu backend; use one of {', '.join(collectives.REDUCE_OPS)}"
        )
    return name


class TpuBackend(dist.ProcessGroup):
    """The process group of the ``"tpu"`` backend (one tpu device per process).

    Collectives on tpu tensors run as XLA collectives; those on CPU tensors go to a gloo group of
    the same ranks (made on first use), so ``init_process_group("tpu")`` serves both, as
    ``"cpu:gloo,tpu:tpu"`` does. (c10d has no Python base for one device's backend: a Python
    backend is a whole ``ProcessGroup``.)

    Args:
        store: the group's store (for the gloo group of CPU tensors).
        rank: this process's rank in the group.
        size: ranks in the group.
        global_ranks: each group rank's global rank (torch's rank = JAX's process index).
        timeout: the gloo group's timeout.
    """

    def __init__(
        self, store: Store, rank: int, size: int, global_ranks: Sequence[int], timeout: datetime.timedelta
    ) -> None:
        super().__init__(rank, size)  # pyright: ignore[reportCallIssue] (the stubs lack this overload)
        self._store = store
        self._timeout = timeout
        self._cpu: Any = None
        self._group = collectives.Group(global_ranks)
        self._agreement = Agreement(store, rank, size, timeout)
        self._group_name = ""
        self._group_desc = ""
        if self._group.rank != rank:
            raise RuntimeError(
                f"tpu backend: group rank {rank} is JAX process {jax.process_index()}, expected process "
                f"{global_ranks[rank]} (torch's global ranks must equal JAX's process indices)"
            )

    def getBackendName(self) -> str:  # c10d's name
        return "tpu"

    # c10d keeps a group's name in its per-device C++ backends, which a Python group has none of;
    # these overrides (C++ names, called through c10d's trampoline) keep it on the group instead,
    # so that ``group.group_name`` and the functional collectives' lookup by name work.
    def getGroupName(self) -> str:
        """The name c10d registered this group under (what the functional collectives resolve)."""
        return self._group_name

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupDesc(self) -> str:
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    # -- helpers --------------------------------------------------------------------------

    def _gloo(self) -> Any:
        """The gloo group of the same ranks, for CPU tensors (every rank makes it on its first CPU call)."""
        if self._cpu is None:
            self._cpu = ProcessGroupGloo(
                PrefixStore("tpurec-cpu/", self._store), self.rank(), self.size(), self._timeout
            )
        return self._cpu

    def _local(self, name: str, t: torch.Tensor) -> jax.Array:
        """``t``'s values as a jax.Array on its one device (a sync point for pending values)."""
        if t.device.type != "tpu":
            raise TypeError(
                f"{name}: the tpu backend takes tpu tensors, got one on {t.device} (use a gloo group for CPU tensors)"
            )
        array = t.to_jax()  # pyright: ignore[reportAttributeAccessIssue] (a TpuTensor, checked above)
        if len(array.devices()) != 1:
            raise ValueError(
                f"{name}: the tensor is laid out over several devices (a tpurec.shard mesh tensor); c10d collectives "
                "take tensors on one tpu device per process"
            )
        return array

    def _agree(
        self,
        name: str,
        tensors: Sequence[torch.Tensor],
        static: Sequence[int] = (),
        payload: Sequence[int] = (),
        shapes: Sequence[Sequence[int]] | None = None,
    ) -> np.ndarray:
        """Every rank makes this call (see :mod:`tpurec.distributed.agreement`); every rank's ``payload``."""
        for t in tensors:
            _check_tpu(name, t)
        if shapes is None:
            shapes = [tuple(t.shape) for t in tensors]
        return self._agreement(name, shapes, str(tensors[0].dtype).removeprefix("torch."), static, payload)

    @staticmethod
    def _write(out: torch.Tensor, array: jax.Array) -> None:
        from tpurec.core import wrap

        with torch.no_grad():
            out.copy_(wrap(array.reshape(tuple(out.shape)), out.device.index))

    @staticmethod
    def _done(outputs: list[torch.Tensor], arrays: Sequence[jax.Array], opts: Any) -> TpuWork:
        work = TpuWork(outputs, arrays)
        if not getattr(opts, "asyncOp", True):
            work.wait()
        return work

    # -- collectives ----------------------------------------------------------------------

    @_cpu_to_gloo
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> TpuWork:
        op = _reduce_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        self._agree("all_reduce", tensors, (collectives.REDUCE_OPS.index(op),))
        arrays = []
        for t in tensors:
            result = collectives.all_reduce(self._group, self._local("all_reduce", t), op)
            self._write(t, result)
            arrays.append(result)
        return self._done(tensors, arrays, opts)

    @_cpu_to_gloo
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> TpuWork:
        return self.allreduce(tensors, opts)

    @_cpu_to_gloo
    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> TpuWork:
        self._agree("broadcast", tensors, (opts.rootRank,))
        arrays = []
        for t in tensors:
            result = collectives.broadcast(self._group, self._local("broadcast", t), opts.rootRank)
            self._write(t, result)
            arrays.append(result)
        return self._done(tensors, arrays, opts)

    @_cpu_to_gloo
    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> TpuWork:
        self._agree("all_gather_into_tensor", [input, output])
        n = self._group.size
        if output.numel() != input.numel() * n or output.dtype != input.dtype:
            raise ValueError(
                f"all_gather_into_tensor: the output must hold group size ({n}) x the input's elements of its dtype, "
                f"got output {tuple(output.shape)} {output.dtype} for input {tuple(input.shape)} {input.dtype}"
            )
        result = collectives.all_gather(self._group, self._local("all_gather_into_tensor", input))
        self._write(output, result)
        return self._done([output], [result], opts)

    @_cpu_to_gloo
    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> TpuWork:
        arrays = []
        for outs, t in zip(outputs, inputs, strict=True):
            self._agree("all_gather", [t])
            if len(outs) != self._group.size or any(o.shape != t.shape for o in outs):
                raise ValueError(
                    f"all_gather: give {self._group.size} output tensors shaped like the input {tuple(t.shape)}"
                )
            result = collectives.all_gather(self._group, self._local("all_gather", t))
            for i, o in enumerate(outs):
                self._write(o, result[i])
            arrays.append(result)
        return self._done([o for outs in outputs for o in outs], arrays, opts)

    @_cpu_to_gloo
    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> TpuWork:
        op = _reduce_name(opts.reduceOp)
        self._agree("reduce_scatter_tensor", [input, output], (collectives.REDUCE_OPS.index(op),))
        n = self._group.size
        if input.numel() != output.numel() * n or output.dtype != input.dtype:
            raise ValueError(
                f"reduce_scatter_tensor: the input must hold group size ({n}) x the output's elements of its dtype, "
                f"got input {tuple(input.shape)} {input.dtype} for output {tuple(output.shape)} {output.dtype}"
            )
        flat = self._local("reduce_scatter_tensor", input).reshape((n * output.numel(),))
        result = collectives.reduce_scatter(self._group, flat, op)
        self._write(output, result)
        return self._done([output], [result], opts)

    @_cpu_to_gloo
    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> TpuWork:
        op = _reduce_name(opts.reduceOp)
        arrays = []
        for out, ins in zip(outputs, inputs, strict=True):
            self._agree("reduce_scatter", [out], (collectives.REDUCE_OPS.index(op),))
            if len(ins) != self._group.size or any(i.shape != out.shape for i in ins):
                raise ValueError(
                    f"reduce_scatter: give {self._group.size} input tensors shaped like the output {tuple(out.shape)}"
                )
            stacked = jax.numpy.concatenate([self._local("reduce_scatter", i).reshape(-1) for i in ins])
            result = collectives.reduce_scatter(self._group, stacked, op)
            self._write(out, result)
            arrays.append(result)
        return self._done(outputs, arrays, opts)

    @_cpu_to_gloo
    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> TpuWork:
        name = "all_to_all_single"
        n = self._group.size
        if not input_split_sizes and not output_split_sizes:
            self._agree(name, [input, output])
            if input.shape != output.shape or (input.dim() and input.shape[0] % n):
                raise ValueError(
                    f"{name}: without split sizes the input and output must have one shape whose first dimension is "
                    f"a multiple of the group size {n}, got {tuple(input.shape)} and {tuple(output.shape)}"
                )
            result = collectives.all_to_all(self._group, self._local(name, input))
        else:
            ins = _splits(name, "input", input_split_sizes, input, n)
            outs = _splits(name, "output", output_split_sizes, output, n)
            # The rest of the shape must match; the first dimension differs between ranks.
            table = self._agree(name, [input], payload=ins + outs, shapes=[input.shape[1:], output.shape[1:]])
            sends, gets = table[:, :n], table[:, n:]
            if not np.array_equal(sends, gets.T):
                i, j = map(int, np.argwhere(sends != gets.T)[0])
                raise CollectiveMismatch(
                    f"{name}: rank {i} sends {sends[i, j]} rows to rank {j}, but rank {j} expects {gets[j, i]} from "
                    f"rank {i} (input_split_sizes on each rank must match output_split_sizes on its peers)"
                )
            local = self._local(name, input)
            result = collectives.all_to_all_uneven(self._group, local, sends, sum(outs))
        self._write(output, result)
        return self._done([output], [result], opts)

    @_cpu_to_gloo
    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> TpuWork:
        name = "all_to_all"
        n = self._group.size
        if len(inputs) != n or len(outputs) != n:
            raise ValueError(
                f"{name}: give {n} input and {n} output tensors (one per rank), got {len(inputs)} and {len(outputs)}"
            )
        rest = tuple(inputs[0].shape[1:]) if inputs[0].dim() else ()
        if any(t.dim() == 0 or tuple(t.shape[1:]) != rest for t in list(inputs) + list(outputs)):
            raise ValueError(f"{name}: every tensor must be at least 1-d with the same shape after the first dimension")
        ins = [int(t.shape[0]) for t in inputs]
        outs = [int(t.shape[0]) for t in outputs]
        table = self._agree(name, [inputs[0]], payload=ins + outs, shapes=[rest])
        sends, gets = table[:, :n], table[:, n:]
        if not np.array_equal(sends, gets.T):
            i, j = map(int, np.argwhere(sends != gets.T)[0])
            raise CollectiveMismatch(
                f"{name}: rank {i} sends {sends[i, j]} rows to rank {j}, but rank {j}'s output tensor {i} has {gets[j, i]} rows"
            )
        local = jax.numpy.concatenate([self._local(name, t) for t in inputs])
        result = collectives.all_to_all_uneven(self._group, local, sends, sum(outs))
        start = 0
        for t, rows in zip(outputs, outs):
            self._write(t, result[start : start + rows])
            start += rows
        return self._done(list(outputs), [result], opts)

    def barrier(self, opts: Any = None) -> TpuWork:
        from tpurec.core import jax_device

        device = jax_device(None)
        token = jax.device_put(np.zeros((1,), np.int32), device)
        self._agreement("barrier", [], "none")
        result = collectives.all_reduce(self._group, token, "SUM")
        work = TpuWork([], [result])
        work.wait()  # a barrier returns once every rank reached it
        return work

    @_cpu_to_gloo
    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> TpuWork:
        name = "gather"
        root = opts.rootRank
        t = inputs[0]
        self._agree(name, [t], (root,))
        mine = outputs[0] if outputs else []
        if self._group.rank == root and (len(mine) != self._group.size or any(o.shape != t.shape for o in mine)):
            raise ValueError(
                f"{name}: on the root rank give {self._group.size} output tensors shaped like the input {tuple(t.shape)}"
            )
        result = collectives.all_gather(self._group, self._local(name, t))
        if self._group.rank == root:
            for i, o in enumerate(mine):
                self._write(o, result[i])
        return self._done(list(mine), [result], opts)

    @_cpu_to_gloo
    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> TpuWork:
        name = "scatter"
        root = opts.rootRank
        out = outputs[0]
        self._agree(name, [out], (root,))
        n = self._group.size
        if self._group.rank == root:
            parts = inputs[0]
            if len(parts) != n or any(p.shape != out.shape for p in parts):
                raise ValueError(
                    f"{name}: on the root rank give {n} input tensors shaped like the output {tuple(out.shape)}"
                )
            local = jax.numpy.stack([self._local(name, p) for p in parts])
        else:
            device = next(iter(self._local(name, out).devices()))
            local = jax.device_put(np.zeros((n, *out.shape), _jax_dtype(out)), device)
        result = collectives.scatter(self._group, local, root)
        self._write(out, result)
        return self._done([out], [result], opts)

    @_cpu_to_gloo
    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> TpuWork:
        op = _reduce_name(opts.reduceOp)
        self._agree("reduce", tensors, (collectives.REDUCE_OPS.index(op), opts.rootRank))
        arrays = []
        for t in tensors:
            result = collectives.all_reduce(self._group, self._local("reduce", t), op)
            if self._group.rank == opts.rootRank:
                self._write(t, result)
            arrays.append(result)
        return self._done(tensors, arrays, opts)

    # The names torch.distributed's functions call (besides the Backend names above).
    all_gather_single = _allgather_base
    reduce_scatter_single = _reduce_scatter_base
    all_to_all_single = alltoall_base

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any
    ) -> TpuWork:
        works = [self._allgather_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return TpuWork(list(outputs), [a for w in works for a in w._arrays])

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any
    ) -> TpuWork:
        works = [self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return TpuWork(list(outputs), [a for w in works for a in w._arrays])

    @_cpu_to_gloo
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> TpuWork:
        raise NotImplementedError(_P2P)

    @_cpu_to_gloo
    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> TpuWork:
        raise NotImplementedError(_P2P)

    @_cpu_to_gloo
    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> TpuWork:
        raise NotImplementedError(_P2P)


_P2P = (
    "send/recv are not supported by the tpu backend yet: every rank must take part in each collective. Exchange "
    "tensors with all_to_all_single (split sizes of zero for the ranks that get nothing) or broadcast, or use a "
    "gloo group (new_group(backend='gloo')) for point-to-point messages of CPU tensors"
)


def _check_tpu(name: str, t: torch.Tensor) -> None:
    if t.device.type != "tpu":
        raise TypeError(
            f"{name}: the tpu backend takes tpu tensors, got one on {t.device} (CPU tensors go to gloo only when "
            "every tensor of the call is on the CPU)"
        )


def _jax_dtype(t: torch.Tensor) -> np.dtype:
    from tpurec.dense.registry import to_jax_dtype

    return np.dtype(to_jax_dtype(t.dtype))


def _splits(name: str, which: str, sizes: Sequence[int], t: torch.Tensor, n: int) -> list[int]:
    """Split sizes given or the even split, checked against the tensor."""
    rows = int(t.shape[0]) if t.dim() else 0
    if not sizes:
        if rows % n:
            raise ValueError(
                f"{name}: without {which}_split_sizes the {which}'s first dimension ({rows}) must be a multiple of {n}"
            )
        return [rows // n] * n
    sizes = [int(s) for s in sizes]
    if len(sizes) != n or any(s < 0 for s in sizes) or sum(sizes) != rows:
        raise ValueError(
            f"{name}: {which}_split_sizes {sizes} must be {n} non-negative sizes adding up to the {which}'s first "
            f"dimension ({rows})"
        )
    return sizes


def _join(store: Store, rank: int, size: int) -> None:
    """Joins this process to JAX's multi-controller runtime (once), for the default group."""
    from tpurec.distributed import startup as distributed

    if distributed.is_initialized() or size == 1:
        return
    if distributed.torchrun_settings() is not None:
        distributed.initialize()
        return
    # Not under torchrun: rank 0 chooses the coordinator's address and tells the others through the store.
    if rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        host = os.environ.get("MASTER_ADDR") or socket.gethostname()
        store.set("tpurec/coordinator", f"{host}:{port}")
    address = store.get("tpurec/coordinator").decode()
    distributed.initialize(address, size, rank)


def _warn_without_pinned_memory() -> None:
    """Says once why DDP's ``find_unused_parameters`` / ``static_graph`` will fail, where they will."""
    global _warned_pinned
    from tpurec.native import torch_hooks

    if _warned_pinned or torch_hooks.registered() or torch_hooks.failure() is None:
        return
    _warned_pinned = True
    warnings.warn(
        "tpu backend: DistributedDataParallel with find_unused_parameters=True or static_graph=True stages "
        "through pinned host memory, which tpurec's C++ PrivateUse1 hooks provide, and they are not "
        f"registered: {torch_hooks.failure()}. Install a C++ compiler (or set CXX) and restart the process.",
        RuntimeWarning,
        stacklevel=3,
    )


_warned_pinned = False


def create(options: Any, backend_options: Any = None) -> TpuBackend:
    """c10d's creator for ``"tpu"`` (extended API): the backend of one group."""
    _warn_without_pinned_memory()
    ranks = list(options.global_ranks_in_group) or list(range(options.group_size))
    if not options.global_ranks_in_group:
        _join(options.store, options.group_rank, options.group_size)
    if jax.process_count() != (dist.get_world_size() if dist.is_initialized() else options.group_size):
        raise RuntimeError(
            f"tpu backend: JAX has {jax.process_count()} processes but the job has "
            f"{dist.get_world_size() if dist.is_initialized() else options.group_size} ranks; call "
            "tpurec.distributed.initialize() before any tpu tensor is made, or let init_process_group do it"
        )
    return TpuBackend(options.store, options.group_rank, options.group_size, ranks, options.timeout)
