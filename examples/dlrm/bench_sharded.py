"""Per-step time of a sharded DLRM with and without ``tpurec.sparse.TrainPipeline``.

Usage (from the repository root)::

    python examples/dlrm/bench_sharded.py --devices 8 --batch 2048 --modes fused eager

TorchRec's ``DLRMTrain`` (dense arch 13-512-256-dim, over arch 512-256-1),
``--tables`` tables sharded by ``tpurec.shard`` over ``--devices`` devices with
a mixed plan (table ``i``: table-wise, row-wise, column-wise, data-parallel
for ``i % 4`` = 0..3), Adagrad for tables and dense part. Each mode trains the
same batches from the same weights twice, once in the plain loop (read,
preprocess and transfer inside the step) and once through the pipeline (the
worker prepares batch ``i + 1`` while step ``i`` runs), in alternating rounds;
each step reads its loss (``.item()``), so a step's time includes waiting for
the device. Mode ``graphed`` runs fused mode with a fused dense Adagrad
(``fused=True``) in both loops, and the pipeline with ``graphed=True``: its third
step is captured (``tpurec.graph``) and replayed from then on. Prints JSON: median
step times and host times (the main thread's CPU time of a step: what the host
needs to issue it, the figure that decides whether a TPU waits on it), their ratio, the largest loss
difference between the two loops (0: identical), the host time of preparing
one batch's ids alone (``sparse_host_prepare_ms``: validation, routing, packing
and the copies to the mesh, the most the pipeline can hide) and the machine
load. ``--dense-only`` adds the pipeline moving only the dense tensors ahead.

On CPU the devices are XLA host devices (``--xla_force_host_platform_device_count``,
set here before JAX starts); they share the machine's cores with the pipeline's
worker thread, so the overlap gained is bounded by the free cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Iterator


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_sharded.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=8, help="mesh size (on CPU: host devices made for this run)")
    p.add_argument("--batch", type=int, default=2048, help="global batch (split evenly over the devices)")
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=20_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--ids-per-bag", type=int, default=4)
    p.add_argument("--steps", type=int, default=10, help="timed steps per loop and round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilations)")
    p.add_argument("--rounds", type=int, default=2, help="plain/pipeline rounds, alternating which goes first")
    p.add_argument("--modes", nargs="+", default=["fused", "eager"], choices=["fused", "eager", "compiled", "graphed"])
    p.add_argument(
        "--dense-only",
        action="store_true",
        help="also time the pipeline moving only the dense tensors (the ids routed in the step)",
    )
    args = p.parse_args(argv)
    if args.batch % args.devices:
        p.error(f"--batch {args.batch} must be a multiple of --devices {args.devices}")
    if args.devices < 1 or args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        p.error("--devices, --steps and --rounds must be >= 1 and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Runs the benchmark; returns (and prints) the JSON result."""
    args = _parse(argv)
    if "jax" not in sys.modules:  # host devices must be made before JAX starts
        flag = f"--xla_force_host_platform_device_count={args.devices}"
        os.environ["XLA_FLAGS"] = " ".join(x for x in [os.environ.get("XLA_FLAGS", ""), flag] if x)
    import numpy as np
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.datasets.utils import Batch
    from torchrec.distributed.sharding_plan import (
        column_wise,
        construct_module_sharding_plan,
        data_parallel,
        row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingPlan
    from torchrec.models.dlrm import DLRM, DLRMTrain

    import tpurec
    import tpurec.sparse as sparse

    D = args.devices
    if torch.tpu.device_count() < D:
        raise SystemExit(f"--devices {D} but only {torch.tpu.device_count()} tpu devices are visible")
    configs = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=args.dim, num_embeddings=args.rows, feature_names=[f"f{i}"])
        for i in range(args.tables)
    ]
    kinds = [
        lambda i: table_wise(rank=i % D),
        lambda i: row_wise(),
        lambda i: column_wise(ranks=[i % D, (i + 1) % D]),
        lambda i: data_parallel(),
    ]
    generators = {c.name: kinds[i % 4](i) for i, c in enumerate(configs)}
    meta = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    plan = ShardingPlan(
        {
            "model.sparse_arch.embedding_bag_collection": construct_module_sharding_plan(
                meta, generators, local_size=D, world_size=D, device_type="cpu"
            )
        }
    )
    layers = {
        "dense_in_features": 13,
        "dense_arch_layer_sizes": [512, 256, args.dim],
        "over_arch_layer_sizes": [512, 256, 1],
    }
    torch.manual_seed(0)
    state = DLRMTrain(DLRM(embedding_bag_collection=EmbeddingBagCollection(configs), **layers)).state_dict()

    def build(mode: str):
        model = DLRMTrain(DLRM(embedding_bag_collection=EmbeddingBagCollection(configs), **layers))
        model.load_state_dict(state)
        model = sparse.from_torchrec(model, optimizer=sparse.Adagrad(learning_rate=0.05)).to("tpu")
        model = tpurec.shard(model, plan, mesh=_mesh(D))
        # graphed: a captured step keeps the optimizer's state on the device (a fused optimizer).
        optimizer = torch.optim.Adagrad(model.parameters(), lr=0.005, fused=True if mode == "graphed" else None)
        return (torch.compile(model, backend="tpu") if mode == "compiled" else model), optimizer

    def batches() -> Iterator[Batch]:
        # Generated lazily: reading a batch is part of the host work a step needs.
        rng = np.random.default_rng(0)
        for _ in range(args.warmup + args.steps):
            n = args.batch * args.tables * args.ids_per_bag
            kjt = KeyedJaggedTensor.from_lengths_sync(
                keys=[c.feature_names[0] for c in configs],
                values=torch.from_numpy(rng.integers(0, args.rows, n)),
                lengths=torch.full((args.batch * args.tables,), args.ids_per_bag, dtype=torch.int64),
            )
            dense = torch.from_numpy(rng.standard_normal((args.batch, 13)).astype(np.float32))
            labels = torch.from_numpy(rng.integers(0, 2, args.batch).astype(np.float32))
            yield Batch(dense_features=dense, sparse_features=kjt, labels=labels)

    def plain(mode: str) -> tuple[list[float], list[float], list[float]]:
        model, optimizer = build(mode)
        times, host, losses = [], [], []
        it = batches()
        for b in _timed(times, host):
            b = next(it, None)
            if b is None:
                break
            optimizer.zero_grad()
            loss, _ = model(Batch(b.dense_features.to("tpu"), b.sparse_features, b.labels.to("tpu")))
            loss.backward()
            optimizer.step()
            if tpurec.get_mode() == "fused":
                tpurec.flush("step")  # as the pipeline does: the step goes out as one program
            losses.append(loss.item())
        return times, host, losses

    def pipelined(mode: str, sparse_prefetch: bool = True) -> tuple[list[float], list[float], list[float]]:
        model, optimizer = build(mode)
        pipeline = sparse.TrainPipeline(model, optimizer, torch.device("tpu"), graphed=mode == "graphed")
        if not sparse_prefetch:
            # What the pipeline did before the sharded collection took prefetch():
            # only tensors move ahead (to one device); routing runs in the step.
            pipeline._collections, pipeline._mesh = [], None
        times, host, losses = [], [], []
        it = batches()
        for _ in _timed(times, host):
            try:
                loss, _, _ = pipeline.progress(it)
            except StopIteration:
                break
            losses.append(loss.item())
        pipeline.close()
        return times, host, losses

    result: dict = {
        "benchmark": "sharded dlrm step, plain loop vs TrainPipeline",
        "config": vars(args),
        "platform": tpurec.platform(),
        "cpu_cores": os.cpu_count(),
        "load_average_before": os.getloadavg(),
    }
    for mode in args.modes:
        loops = {
            "plain": lambda: plain(mode),
            "pipeline": lambda: pipelined(mode),
            "pipeline_dense_only": lambda: pipelined(mode, sparse_prefetch=False),
        }
        if not args.dense_only or mode == "graphed":
            del loops["pipeline_dense_only"]
        timed: dict[str, list[float]] = {name: [] for name in loops}
        hosts: dict[str, list[float]] = {name: [] for name in loops}
        loss_gap = 0.0
        with tpurec.mode("fused" if mode in ("compiled", "graphed") else mode):
            for r in range(args.rounds):
                order = list(loops) if r % 2 == 0 else list(reversed(loops))
                runs = {name: loops[name]() for name in order}
                for name, (times, host, _) in runs.items():
                    timed[name] += times[args.warmup :]
                    hosts[name] += host[args.warmup :]
                for name, (_, _, losses) in runs.items():
                    loss_gap = max(loss_gap, max(abs(a - b) for a, b in zip(runs["plain"][2], losses)))
        ms = {name: statistics.median(times) * 1e3 for name, times in timed.items()}
        result[mode] = {f"{name}_step_ms": round(value, 2) for name, value in ms.items()}
        result[mode].update({f"{name}_host_ms": round(statistics.median(h) * 1e3, 2) for name, h in hosts.items()})
        result[mode].update(
            {
                "speedup": round(ms["plain"] / ms["pipeline"], 3),
                "max_loss_difference": loss_gap,
                "samples_per_s_pipeline": round(args.batch / ms["pipeline"] * 1e3),
            }
        )
        if "pipeline_dense_only" in ms:
            result[mode]["speedup_dense_only"] = round(ms["plain"] / ms["pipeline_dense_only"], 3)
    # What the pipeline can hide at most: the host work of one batch for the
    # sharded collection (validate, route, pack, copy to the mesh), alone.
    model, _ = build("eager")
    ebc = model.model.sparse_arch.embedding_bag_collection
    prepare = []
    for b in batches():
        start = time.perf_counter()
        ebc.prefetch(b.sparse_features)
        for arrays in (
            ebc._prefetched[id(b.sparse_features)].batch["groups"] + ebc._prefetched[id(b.sparse_features)].batch["dp"]
        ):
            for a in arrays:
                a.block_until_ready()
        prepare.append(time.perf_counter() - start)
        ebc.clear_prefetched()
    result["sparse_host_prepare_ms"] = round(statistics.median(prepare) * 1e3, 2)
    result["load_average_after"] = os.getloadavg()
    print(json.dumps(result, indent=1))
    return result


def _mesh(devices: int):
    import jax
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id))[:devices]), ("devices",))


def _timed(times: list[float], host: list[float]) -> Iterator[None]:
    """Yields forever, appending the wall time of each iteration to ``times`` and the main thread's CPU time to ``host``."""
    while True:
        start, start_host = time.perf_counter(), time.thread_time()
        yield None
        times.append(time.perf_counter() - start)
        host.append(time.thread_time() - start_host)


if __name__ == "__main__":
    main()
