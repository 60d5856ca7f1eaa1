"""The host cost of one cached op: tpurec eager and fused next to PyTorch's own CPU eager.

On a TPU the device finishes a small op in microseconds, so what the host needs to
*issue* an op decides whether the device waits on Python. This benchmark measures
it per op kind on a small tensor (``--size`` x ``--size`` float32):

* ``add``: ``a + b`` (an elementwise op with a new output);
* ``view``: ``a[1:]`` (a view: no program, only metadata);
* ``add_``: ``a.add_(b)`` (in place);
* ``matmul``: ``a @ b``.

Configurations: ``cpu_pytorch`` (the same op on PyTorch CPU tensors: the peer),
``eager`` (tpurec issues one cached XLA program per op, asynchronously) and
``fused`` (tpurec records the op into the fused window; the window's flush is
timed on its own and reported as ``flush_us``, not in the per-op figure).

Two floors, measured in the same run, bound what a Python-level device can reach:

* ``floor_subclass``: PyTorch's own round trip through a tensor subclass's
  ``__torch_dispatch__`` that does nothing but make its output tensor
  (``_make_wrapper_subclass``): the least any op on a Python device costs, before the
  device does anything (fused recording's floor);
* ``floor_jax``: JAX's call of the op as a cached ``jax.jit`` function on the same
  arrays (the least an eager op that runs a compiled program costs on top of the first).

Per op and configuration: ``wall_ns`` (median over ``--repeats`` timed loops of
``--ops`` ops, wall time per op, without waiting for the device) and ``host_ns``
(the main thread's CPU time per op: XLA:CPU runs programs on its own threads, so
this is the time Python and tpurec spend issuing the op). After warm-up no
configuration may compile: ``compilations`` must be 0. ``vs_cpu`` is
``host_ns / cpu_pytorch host_ns`` of the same run, ``vs_cpu_wall`` the same of ``wall_ns``.
Where the thread clock ticks too coarsely to time a loop (``thread_clock_tick_us``: 10 ms
under gVisor, as on some TPU machines), ``host_ns`` and ``vs_cpu`` are None.

Example::

    python -m tpurec.bench dispatch --ops 500 --repeats 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch

import tpurec
from tpurec.bench import clocks
from tpurec.cli import HelpFormatter
from tpurec.core import max_fused_ops

OPS = ("add", "view", "add_", "matmul")
CONFIGS = ("cpu_pytorch", "eager", "fused", "floor_subclass", "floor_jax")


def _op(name: str, a: torch.Tensor, b: torch.Tensor) -> Callable[[], object]:
    """The op ``name`` as a call on fixed inputs (an in-place op scales so values stay finite)."""
    if name == "add":
        return lambda: a + b
    if name == "view":
        return lambda: a[1:]
    if name == "add_":
        return lambda: a.add_(b, alpha=1e-6)
    if name == "matmul":
        return lambda: a @ b
    raise ValueError(f"unknown op {name!r}; choose from {OPS}")


class _Bare(torch.Tensor):
    """A tensor subclass whose every op only makes a new (empty, metadata-only) output: the dispatch floor."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # pyright: ignore[reportAssignmentType]

    @staticmethod
    def __new__(cls, size: tuple):
        return torch.Tensor._make_wrapper_subclass(cls, size, dtype=torch.float32, device=torch.device("meta"))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _Bare(args[0].shape)


def _jax_op(name: str, a, b) -> Callable[[], object]:
    """The op ``name`` as a cached ``jax.jit`` call on jax arrays."""
    import jax

    if name == "view":
        view = jax.jit(lambda x: x[1:])
        return lambda: view(a)
    if name == "matmul":
        matmul = jax.jit(lambda x, y: x @ y)
        return lambda: matmul(a, b)
    add = jax.jit(lambda x, y: x + y)  # add and add_ (JAX arrays are immutable)
    return lambda: add(a, b)


def _time_loop(call: Callable[[], object], ops: int) -> tuple[float, float]:
    """Wall and main-thread CPU seconds of ``ops`` calls (outputs dropped as they come)."""
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(ops):
        call()
    return time.perf_counter() - wall, time.thread_time() - cpu


def measure(op: str, config: str, size: int, ops: int, repeats: int, warmup: int) -> dict:
    """One op in one configuration: per-op wall and host time, flush time (fused) and compilations.

    Args:
        op: one of ``OPS``.
        config: one of ``CONFIGS``.
        size: the tensors are ``size`` x ``size`` float32.
        ops: ops per timed loop (in fused mode, one window: keep it below ``TPUREC_FUSED_MAX_OPS``).
        repeats: timed loops; the median is reported.
        warmup: untimed loops first (compile and fill caches).
    """
    device = "tpu" if config in ("eager", "fused") else "cpu"
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(device)
    b = torch.randn(size, size, generator=generator).to(device)
    if config == "floor_subclass":
        call = _op(op, _Bare((size, size)), _Bare((size, size)))
    elif config == "floor_jax":
        import jax

        call = _jax_op(op, jax.device_put(a.numpy()), jax.device_put(b.numpy()))
    else:
        call = _op(op, a, b)
    mode = "fused" if config == "fused" else "eager"
    walls, hosts, flushes = [], [], []
    with tpurec.mode(mode):
        for index in range(warmup + repeats):
            if index == warmup:
                before = tpurec.stats()
            wall, host = _time_loop(call, ops)
            start = time.perf_counter()
            if device == "tpu":
                tpurec.synchronize()  # in fused mode: the flush of the window just recorded
            if index >= warmup:
                walls.append(wall / ops)
                hosts.append(host / ops)
                flushes.append(time.perf_counter() - start)
        after = tpurec.stats()
    # A loop's CPU time is read only where the thread clock ticks finely enough to time it (not under gVisor).
    fine = clocks.fine_enough(min(walls) * ops)
    result = {"wall_ns": statistics.median(walls) * 1e9, "host_ns": statistics.median(hosts) * 1e9 if fine else None}
    if device == "tpu":
        result["compilations"] = after["compile_requests"] - before["compile_requests"]
    if config == "fused":
        result["flush_us"] = statistics.median(flushes) * 1e6
    return result


def main(argv: list[str] | None = None, prog: str = "python -m tpurec.bench dispatch") -> dict:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--ops", type=int, default=500, help="ops per timed loop")
    parser.add_argument("--repeats", type=int, default=7, help="timed loops per op and configuration")
    parser.add_argument("--warmup", type=int, default=2, help="untimed loops first")
    parser.add_argument("--size", type=int, default=8, help="the tensors are SIZE x SIZE float32")
    parser.add_argument("--op", nargs="+", default=list(OPS), choices=OPS, help="ops to measure")
    parser.add_argument("--modes", nargs="+", default=list(CONFIGS), choices=CONFIGS, help="configurations")
    args = parser.parse_args(argv)
    if args.ops < 1 or args.repeats < 1 or args.warmup < 1 or args.size < 2:
        parser.error("--ops, --repeats and --warmup must be at least 1 and --size at least 2")
    if "fused" in args.modes and args.ops >= max_fused_ops():
        parser.error(f"--ops must stay below the fused window's limit ({max_fused_ops()} ops) to time recording alone")
    result: dict = {
        "benchmark": "dispatch",
        "platform": tpurec.platform(),
        "size": args.size,
        "ops_per_loop": args.ops,
        "thread_clock_tick_us": clocks.thread_clock_tick() * 1e6,
        "cpu_count": os.cpu_count(),
        "load_average": {"before": os.getloadavg()[0]},
        "ops": {},
    }
    for op in args.op:
        row = {config: measure(op, config, args.size, args.ops, args.repeats, args.warmup) for config in args.modes}
        if "cpu_pytorch" in row:
            peer = row["cpu_pytorch"]
            for config in args.modes:
                if config != "cpu_pytorch":
                    mine = row[config]
                    known = mine["host_ns"] is not None and peer["host_ns"]
                    mine["vs_cpu"] = mine["host_ns"] / peer["host_ns"] if known else None
                    mine["vs_cpu_wall"] = mine["wall_ns"] / peer["wall_ns"]
        result["ops"][op] = row
    result["load_average"]["after"] = os.getloadavg()[0]
    return result
