"""One rank of the default-plan DMP tests (``torchrun --nproc-per-node N dmp_default_plan_worker.py OUT CASE[,CASE...]``).

TorchRec's own ``DistributedModelParallel`` with the plans TorchRec makes when the user names
no compute kernel, on ``cpu`` (gloo) and on ``tpu`` in the same process, from the same starting
tables, trained ``STEPS`` steps of ``torch.optim.SGD(model.parameters())`` on this rank's slice of
every global batch. Each rank writes ``OUT.<CASE>.<device>.<rank>.npz``: the global loss of every
step and its tables after training (each local shard with its offsets; a data-parallel table
whole). The test compares the two devices; for the EmbeddingCollection, whose sharded lookups
TorchRec 1.9.2 does not run on CPU with gloo (its sequence all-to-all fails: "Split sizes doesn't
match total dim 0 size"), it compares the tpu model with :func:`sequence_reference`, the same
collection trained by TorchRec on CPU in one process on the whole batch. The cases:

* ``planner``: no plan at all (DMP's own ``EmbeddingShardingPlanner`` over the default
  sharders), tables of dims 8 and 16;
* ``constructed``: ``construct_module_sharding_plan`` with TorchRec's ``row_wise()``,
  ``table_wise()``, ``column_wise()`` and ``data_parallel()``, no compute kernel named, so every
  table gets the ``DENSE`` kernel (dims 8 and 16);
* ``sequence``: the same for an ``EmbeddingCollection`` (row-, table-wise and data-parallel);
* ``placement``: a row-wise plan built for a host of ``N`` devices (``local_size=N``), which
  places rank ``r``'s shard on ``tpu:r``; sharding it on tpu must raise tpurec's ``ValueError``
  on every rank, its text written to ``OUT.placement.<rank>``.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import sys
from collections import OrderedDict
from typing import Any, cast

import numpy as np

GLOBAL_BATCH = 8
STEPS = 4
LEARNING_RATE = 0.1
# name, rows, dim: dims of 8 are below the multiple of 16 TorchRec's TPU kernel takes.
TABLES = (("t0", 40, 8), ("t1", 30, 8), ("t2", 20, 16), ("t3", 24, 8))
SEQUENCE_DIM = 8
CASES = ("planner", "constructed", "sequence", "placement")


def _tables(case: str) -> tuple[tuple[str, int, int], ...]:
    if case == "sequence":
        return tuple((n, r, SEQUENCE_DIM) for n, r, _d in TABLES)
    return TABLES


def _collection(case: str):
    """TorchRec's EmbeddingBagCollection (an EmbeddingCollection for ``sequence``) on meta."""
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig

    meta = torch.device("meta")
    if case == "sequence":
        configs = [
            EmbeddingConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f{n}"])
            for n, r, d in _tables(case)
        ]
        return EmbeddingCollection(tables=configs, device=meta)
    bags = [
        EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f{n}"])
        for n, r, d in _tables(case)
    ]
    return EmbeddingBagCollection(tables=bags, device=meta)


def _sharder(case: str):
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    return EmbeddingCollectionSharder() if case == "sequence" else EmbeddingBagCollectionSharder()


def _plan(case: str, device: str, local_size: int = 1):
    """TorchRec's ``construct_module_sharding_plan`` with its default kernels, or None for ``planner``."""
    import torch.distributed as dist
    from torchrec.distributed.sharding_plan import (
        column_wise,
        construct_module_sharding_plan,
        data_parallel,
        row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingPlan

    n = dist.get_world_size()
    if case == "planner":
        return None
    if case == "placement":
        per_table = {name: row_wise() for name, _r, _d in _tables(case)}
    elif case == "sequence":
        # A table-wise table on each rank (tpurec's all-to-all wants each rank's block of the same width).
        per_table = {"t0": row_wise(), "t1": table_wise(rank=n - 1), "t2": table_wise(rank=0), "t3": data_parallel()}
    else:
        per_table = {"t0": row_wise(), "t1": table_wise(rank=n - 1), "t2": column_wise(ranks=[0, 1]),
                     "t3": data_parallel()}  # fmt: skip
    module_plan = construct_module_sharding_plan(
        _collection(case),
        per_table,
        sharder=cast(Any, _sharder(case)),
        local_size=local_size,
        world_size=n,
        device_type=device,
    )
    kernels = {name: p.compute_kernel for name, p in module_plan.items()}  # pyright: ignore[reportAttributeAccessIssue]
    if set(kernels.values()) != {"dense"}:
        raise AssertionError(f"TorchRec's default kernels are {kernels}, not dense")
    return ShardingPlan({"": module_plan})


def _start(case: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {n: rng.uniform(-0.5, 0.5, (r, d)).astype(np.float32) for n, r, d in _tables(case)}


def _batches(case: str):
    """STEPS global batches: per feature per sample 0-3 ids, and a target per sample."""
    rng = np.random.default_rng(1)
    for _ in range(STEPS):
        ids = {}
        for n, rows, _d in _tables(case):
            lengths = rng.integers(0, 4, GLOBAL_BATCH)
            ids[n] = [rng.integers(0, rows, int(k)).tolist() for k in lengths]
        yield ids, rng.standard_normal(GLOBAL_BATCH).astype(np.float32)


def _kjt(case: str, ids: dict[str, list[list[int]]], samples: slice):
    import torch
    from torchrec import KeyedJaggedTensor

    names = [n for n, _r, _d in _tables(case)]
    return KeyedJaggedTensor(
        keys=[f"f{n}" for n in names],
        values=torch.tensor([v for n in names for s in ids[n][samples] for v in s], dtype=torch.int64),
        lengths=torch.tensor([len(s) for n in names for s in ids[n][samples]], dtype=torch.int64),
    )


def _loss(case: str, out, target, mix):
    """A pooled collection: mean squared error of a fixed projection of the pooled embeddings; an
    unpooled one: every looked-up row's squared projection, summed, over the samples."""
    import torch

    names = [n for n, _r, _d in _tables(case)]
    if case == "sequence":
        parts = [((out[f"f{n}"].values() * mix[:SEQUENCE_DIM]).sum(1) - 0.1).pow(2).sum() for n in names]
        return torch.stack(parts).sum() / target.shape[0]
    by_key = out.to_dict()
    pooled = torch.cat([by_key[f"f{n}"] for n in names], dim=1)
    return ((pooled * mix).sum(1) - target).pow(2).mean()


def train(out_path: str, case: str, device: str) -> None:
    """Shards the collection on ``device`` with the case's plan, trains it, writes its npz."""
    import torch
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torchrec.distributed.model_parallel import DistributedModelParallel

    rank, n = dist.get_rank(), dist.get_world_size()
    plan = _plan(case, device)
    model = DistributedModelParallel(
        _collection(case), device=torch.device(device), plan=plan, sharders=[cast(Any, _sharder(case))]
    )
    prefix = "embeddings" if case == "sequence" else "embedding_bags"
    result = model.load_state_dict(
        OrderedDict((f"{prefix}.{name}.weight", torch.from_numpy(w)) for name, w in _start(case).items())
    )
    if result.missing_keys or result.unexpected_keys:
        raise AssertionError(f"loading the starting tables: {result}")
    off_device = [name for name, p in model.named_parameters() if p.numel() and p.device.type != device]
    if off_device:
        raise AssertionError(f"parameters off {device}: {off_device}")

    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    dims = sum(d for _n, _r, d in _tables(case))
    mix = torch.from_numpy(np.random.default_rng(2).uniform(-1, 1, dims).astype(np.float32)).to(device)
    local = GLOBAL_BATCH // n
    samples = slice(rank * local, (rank + 1) * local)
    losses = []
    for ids, target in _batches(case):
        optimizer.zero_grad()
        out = model(_kjt(case, ids, samples).to(torch.device(device)))
        out = out.wait() if hasattr(out, "wait") else out
        loss = _loss(case, out, torch.from_numpy(target[samples]).to(device), mix)
        loss.backward()
        optimizer.step()
        loss = loss.detach().cpu()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # equal slices: the mean of the means is the global loss
        losses.append(loss.item())

    saved: dict[str, np.ndarray] = {"losses": np.array(losses)}
    for key, value in model.state_dict().items():
        name = key.split(".")[-2]
        if isinstance(value, ShardedTensor):
            for i, shard in enumerate(value.local_shards()):
                if shard.tensor.device.type != device:
                    raise AssertionError(f"{key}: a local shard lives on {shard.tensor.device}")
                saved[f"{name}|{i}|offsets"] = np.array(shard.metadata.shard_offsets)
                saved[f"{name}|{i}"] = shard.tensor.detach().cpu().numpy()
        else:
            saved[f"{name}|whole|offsets"] = np.zeros(2, dtype=np.int64)
            saved[f"{name}|whole"] = value.detach().cpu().numpy()
    np.savez(f"{out_path}.{case}.{device}.{rank}.npz", **cast(dict[str, Any], saved))


def sequence_reference() -> tuple[list[float], dict[str, np.ndarray]]:
    """The EmbeddingCollection on CPU, one process, the whole batch: losses and trained tables."""
    import torch
    from torchrec import EmbeddingCollection, EmbeddingConfig

    configs = [
        EmbeddingConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f{n}"])
        for n, r, d in _tables("sequence")
    ]
    collection = EmbeddingCollection(tables=configs, device=torch.device("cpu"))
    weights = {n: cast(torch.Tensor, collection.embeddings[n].weight) for n, _r, _d in _tables("sequence")}
    with torch.no_grad():
        for n, w in _start("sequence").items():
            weights[n].copy_(torch.from_numpy(w))
    optimizer = torch.optim.SGD(collection.parameters(), lr=LEARNING_RATE)
    mix = torch.from_numpy(np.random.default_rng(2).uniform(-1, 1, SEQUENCE_DIM * len(TABLES)).astype(np.float32))
    losses = []
    for ids, target in _batches("sequence"):
        optimizer.zero_grad()
        loss = _loss("sequence", collection(_kjt("sequence", ids, slice(None))), torch.from_numpy(target), mix)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {n: w.detach().numpy().copy() for n, w in weights.items()}


def placement(out_path: str) -> None:
    """Shards a plan that puts rank ``r`` on ``tpu:r`` (``local_size`` = the world): tpurec's
    ``ValueError`` on every rank, at the same point (no collective waits on a rank that went on)."""
    import torch
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel

    plan = _plan("placement", "tpu", local_size=dist.get_world_size())
    try:
        DistributedModelParallel(
            _collection("placement"), device=torch.device("tpu"), plan=plan,
            sharders=[cast(Any, _sharder("placement"))],
        )  # fmt: skip
        outcome = "sharded without an error"
    except ValueError as error:
        outcome = f"ValueError: {error}"
    with open(f"{out_path}.placement.{dist.get_rank()}", "w") as f:
        f.write(outcome.replace("\n", " ") + "\n")


def main(out_path: str, cases: list[str]) -> None:
    import torch.distributed as dist

    import tpurec  # noqa: F401 (registers the "tpu" backend)

    dist.init_process_group("cpu:gloo,tpu:tpu", timeout=datetime.timedelta(seconds=60))
    for case in cases:
        if case not in CASES:
            raise ValueError(f"unknown case {case!r}: use one of {CASES}")
        if case == "placement":
            placement(out_path)
            continue
        for device in ("tpu",) if case == "sequence" else ("cpu", "tpu"):
            train(out_path, case, device)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    # A hung collective ends this rank with every thread's stack instead of stalling the test.
    faulthandler.dump_traceback_later(float(os.environ.get("TPUREC_TEST_HANG_SECONDS", "150")), exit=True)
    main(sys.argv[1], sys.argv[2].split(","))
