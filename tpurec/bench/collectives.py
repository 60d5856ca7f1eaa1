"""The cost of each ``torch.distributed`` collective on tpu tensors next to gloo on CPU tensors.

Starts ``--processes`` processes on this machine (each one tpu device; on a machine without
TPUs one XLA:CPU device per process), joins them with ``init_process_group("tpu")``, and times
each collective on float32 tensors of each ``--sizes`` (elements per rank's input) twice: on tpu
tensors through the ``"tpu"`` backend (an XLA collective over the processes' devices) and on
CPU tensors through a gloo group of the same ranks. Collectives:

* ``all_reduce`` (SUM), ``broadcast`` (from rank 0);
* ``all_gather_into_tensor`` (the output is ``processes`` x the input);
* ``reduce_scatter_tensor`` (SUM; the output is the input / ``processes``);
* ``all_to_all_single_even`` (equal segments) and ``all_to_all_single_uneven`` (segments of
  different sizes, one of them empty, from a split matrix every rank knows).

Each call is synchronous (it returns when its result is computed). Per collective, size and
backend: ``ms`` is the median over ``--repeats`` timed calls (after ``--warmup`` untimed ones)
on each rank, the largest over the ranks; ``tpu_vs_gloo`` is the tpu figure over gloo's. Every
process is bounded by ``--timeout`` seconds; on a failure the command exits with the failing
rank's last lines.

Example::

    python -m tpurec.bench collectives --processes 2 --sizes 1024 1048576 --repeats 20
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tpurec.cli import HelpFormatter, error, positive_int

COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single_even",
    "all_to_all_single_uneven",
)


def _free_port_pair() -> int:
    """A port p with p and p + 1 free (the c10d store, then JAX's coordinator, as under torchrun)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports on 127.0.0.1")


def uneven_splits(n: int, elements: int) -> list[list[int]]:
    """Rows rank ``i`` sends rank ``j``: about ``elements`` per rank, in unequal parts, some empty.

    Weights ``(i + 2 j) % (n + 1)`` give each rank a different spread and a zero where the
    weight is 0 (rank 0 sends nothing to itself).
    """
    matrix = []
    for i in range(n):
        weights = [(i + 2 * j) % (n + 1) for j in range(n)]
        total = sum(weights) or 1
        row = [elements * w // total for w in weights]
        row[max(range(n), key=lambda j: weights[j])] += elements - sum(row)  # exactly `elements` in all
        matrix.append(row)
    return matrix


def _worker_env(rank: int, processes: int, port: int) -> dict[str, str]:
    env = dict(os.environ)
    # One XLA:CPU device per process (one tpu device per process, as on a pod); a device count
    # set for the launching process (tests set 8) does not apply to the workers.
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=1".strip()
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(processes),
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
    )
    return env


def launch(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Runs the worker in ``spec["processes"]`` processes; rank 0's result.

    Raises:
        RuntimeError: a rank failed or the launch ran past ``timeout`` seconds (every process
            of the launch is then killed); the message has the failing rank's last lines.
    """
    n = spec["processes"]
    with tempfile.TemporaryDirectory(prefix="tpurec-bench-collectives-") as folder:
        spec_path = Path(folder) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        out_path = Path(folder) / "result.json"
        port = _free_port_pair()
        procs = []
        logs = []
        for rank in range(n):
            log = open(Path(folder) / f"rank{rank}.log", "w+")
            logs.append(log)
            command = [sys.executable, "-m", "tpurec.bench.collectives", str(spec_path), str(out_path)]
            # Each rank in its own session: a timeout kills it with whatever it started.
            procs.append(subprocess.Popen(command, env=_worker_env(rank, n, port), stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))  # fmt: skip
        deadline = time.monotonic() + timeout
        failed: tuple[int, str] | None = None
        try:
            for rank, proc in enumerate(procs):
                try:
                    code = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    failed = (rank, f"did not finish within {timeout:g} s (--timeout)")
                    break
                if code != 0:
                    failed = (rank, f"exited with status {code}")
                    break
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        if failed is not None:
            rank, why = failed
            logs[rank].seek(0)
            tail = " | ".join(line.strip() for line in logs[rank].read().splitlines()[-3:])
            for log in logs:
                log.close()
            raise RuntimeError(f"rank {rank} of the {n}-process benchmark {why}: {tail}")
        for log in logs:
            log.close()
        return json.loads(out_path.read_text())


def main(argv: list[str] | None = None, prog: str = "python -m tpurec.bench collectives") -> dict:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--processes", type=positive_int, default=2, help="processes (ranks), at least 2")
    parser.add_argument("--sizes", type=positive_int, nargs="+", default=[1024, 1 << 20],
                        help="float32 elements in each rank's input")  # fmt: skip
    parser.add_argument("--repeats", type=positive_int, default=20, help="timed calls per collective and size")
    parser.add_argument("--warmup", type=positive_int, default=3, help="untimed calls first (compilation)")
    parser.add_argument("--collectives", nargs="+", default=list(COLLECTIVES), choices=COLLECTIVES,
                        help="collectives to time")  # fmt: skip
    parser.add_argument("--timeout", type=positive_int, default=900, help="seconds the whole run may take")
    args = parser.parse_args(argv)
    if args.processes < 2:
        parser.error("--processes must be at least 2 (a collective of one rank moves nothing)")
    if any(s % args.processes for s in args.sizes):
        parser.error(
            f"every --sizes value must be a multiple of --processes ({args.processes}): reduce_scatter_tensor "
            f"and the even all_to_all split the input into equal parts (got {args.sizes})"
        )
    spec = {
        "processes": args.processes,
        "sizes": args.sizes,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "collectives": args.collectives,
    }
    load_before = os.getloadavg()[0]
    try:
        result = launch(spec, args.timeout)
    except RuntimeError as e:
        raise SystemExit(error(prog, str(e))) from None
    result["load_average"] = {"before": load_before, "after": os.getloadavg()[0]}
    return result


# --- one rank ------------------------------------------------------------------------------


def _calls(name: str, n: int, rank: int, elements: int, device: str, group: Any) -> Any:
    """A synchronous call of collective ``name`` on fresh float32 tensors on ``device``."""
    import torch
    import torch.distributed as dist

    if name == "all_reduce":
        # Zeros: repeated sums in place stay finite (the time does not depend on the values).
        zeros = torch.zeros(elements, device=device)
        return lambda: dist.all_reduce(zeros, group=group)
    x = torch.arange(elements, dtype=torch.float32).to(device) + rank
    if name == "broadcast":
        return lambda: dist.broadcast(x, 0, group=group)
    if name == "all_gather_into_tensor":
        out = torch.empty(n * elements, device=device)
        return lambda: dist.all_gather_into_tensor(out, x, group=group)
    if name == "reduce_scatter_tensor":
        out = torch.empty(elements // n, device=device)
        return lambda: dist.reduce_scatter_tensor(out, x, group=group)
    if name == "all_to_all_single_even":
        out = torch.empty(elements, device=device)
        return lambda: dist.all_to_all_single(out, x, group=group)
    matrix = uneven_splits(n, elements)
    sends, gets = matrix[rank], [row[rank] for row in matrix]
    out = torch.empty(sum(gets), device=device)
    return lambda: dist.all_to_all_single(out, x, gets, sends, group=group)


def _median_ms(call: Any, repeats: int, warmup: int, barrier: Any) -> float:
    for _ in range(warmup):
        call()
    barrier()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2] * 1e3


def _worker(spec_path: str, out_path: str) -> None:
    import datetime

    import torch.distributed as dist

    import tpurec

    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group("tpu", timeout=datetime.timedelta(seconds=120))
    rank, n = dist.get_rank(), dist.get_world_size()
    gloo: Any = dist.new_group(backend="gloo")  # every rank is a member: a ProcessGroup

    def barrier() -> None:
        dist.barrier(group=gloo)

    rows = []
    with tpurec.mode("eager"):  # each call runs at once (fused mode would defer the copies around it)
        for elements in spec["sizes"]:
            for name in spec["collectives"]:
                row: dict[str, Any] = {"collective": name, "elements": elements}
                for backend, device, group in (("tpu", "tpu", None), ("gloo", "cpu", gloo)):
                    mine = _median_ms(_calls(name, n, rank, elements, device, group), spec["repeats"],
                                      spec["warmup"], barrier)  # fmt: skip
                    every: list[Any] = [None] * n
                    dist.all_gather_object(every, mine, group=gloo)
                    row[f"{backend}_ms"] = max(every)  # the slowest rank decides
                row["tpu_vs_gloo"] = row["tpu_ms"] / row["gloo_ms"]
                rows.append(row)
    if rank == 0:
        result = {
            "benchmark": "collectives",
            "platform": tpurec.platform(),
            "processes": n,
            "dtype": "float32",
            "repeats": spec["repeats"],
            "warmup": spec["warmup"],
            "cpu_count": os.cpu_count(),
            "results": rows,
        }
        Path(out_path).write_text(json.dumps(result))
    barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
