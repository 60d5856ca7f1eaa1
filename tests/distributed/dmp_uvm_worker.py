"""One rank of the host-memory kernel DMP test (``torchrun --nproc-per-node N dmp_uvm_worker.py OUT OPTIMIZER``).

TorchRec's ``DistributedModelParallel`` with tables planned on TorchRec's ``FUSED_UVM`` and
``FUSED_UVM_CACHING`` compute kernels (``construct_module_sharding_plan``: a row-wise and a
column-wise ``fused_uvm`` table, a table-wise ``fused_uvm_caching`` table, and a table-wise
``fused`` table beside them), the optimizer in the backward from
``apply_optimizer_in_backward(OPTIMIZER)``, on ``cpu`` (gloo, TorchRec's FBGEMM kernel) and on
``tpu`` in the same process, from the same starting tables, ``STEPS`` steps on this rank's slice of
every global batch. Each rank writes ``OUT.<device>.<rank>.npz``: the global loss of every step,
its table shards with their offsets, and how many warnings about the host-memory kernels
sharding the model gave (tpurec warns once per process that they run in device memory on tpu).
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import sys
import warnings
from collections import OrderedDict
from typing import Any, cast

import numpy as np

GLOBAL_BATCH = 8
STEPS = 5
# name, rows, dim, sharding, compute kernel (dims of 16: tpurec's fused kernel takes any width).
TABLES = (
    ("t0", 40, 16, "row_wise", "fused_uvm"),
    ("t1", 30, 16, "table_wise", "fused_uvm_caching"),
    ("t2", 20, 32, "column_wise", "fused_uvm"),
    ("t3", 24, 16, "table_wise", "fused"),
)
OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "sgd": ("torch.optim.SGD", {"lr": 0.1}),
    "rowwise": ("torchrec.optim.RowWiseAdagrad", {"lr": 0.1}),
}


def _collection():
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    configs = [
        EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f{n}"])
        for n, r, d, _s, _k in TABLES
    ]
    return EmbeddingBagCollection(tables=configs, device=torch.device("meta"))


def start() -> dict[str, np.ndarray]:
    """The starting tables."""
    rng = np.random.default_rng(0)
    return {n: rng.uniform(-0.5, 0.5, (r, d)).astype(np.float32) for n, r, d, _s, _k in TABLES}


def _batches():
    """STEPS global batches: per feature per sample 0-3 ids (repeats included), and a target per sample."""
    rng = np.random.default_rng(1)
    for _ in range(STEPS):
        ids = {n: [rng.integers(0, r, int(k)).tolist() for k in rng.integers(0, 4, GLOBAL_BATCH)]
               for n, r, _d, _s, _k in TABLES}  # fmt: skip
        yield ids, rng.standard_normal(GLOBAL_BATCH).astype(np.float32)


def _kjt(ids: dict[str, list[list[int]]], samples: slice):
    import torch
    from torchrec import KeyedJaggedTensor

    names = [n for n, _r, _d, _s, _k in TABLES]
    return KeyedJaggedTensor(
        keys=[f"f{n}" for n in names],
        values=torch.tensor([v for n in names for s in ids[n][samples] for v in s], dtype=torch.int64),
        lengths=torch.tensor([len(s) for n in names for s in ids[n][samples]], dtype=torch.int64),
    )


def _resolve(path: str) -> Any:
    import importlib

    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def train(out_path: str, optimizer: str, device: str) -> None:
    """Shards the collection on ``device`` with the host-memory kernels, trains it, writes its npz."""
    import torch
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    rank, n = dist.get_rank(), dist.get_world_size()
    per_table = {
        "t0": row_wise(compute_kernel="fused_uvm"),
        "t1": table_wise(rank=n - 1, compute_kernel="fused_uvm_caching"),
        "t2": column_wise(ranks=[0, 1], compute_kernel="fused_uvm"),
        "t3": table_wise(rank=0, compute_kernel="fused"),
    }
    collection = _collection()
    cls, kwargs = OPTIMIZERS[optimizer]
    apply_optimizer_in_backward(_resolve(cls), collection.parameters(), dict(kwargs))
    sharder = cast(Any, EmbeddingBagCollectionSharder())
    module_plan = construct_module_sharding_plan(
        collection, per_table, sharder=sharder, local_size=1, world_size=n, device_type=device
    )
    kernels = {name: p.compute_kernel for name, p in module_plan.items()}  # pyright: ignore[reportAttributeAccessIssue]
    if kernels != {n: k for n, _r, _d, _s, k in TABLES}:
        raise AssertionError(f"the plan's kernels are {kernels}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = DistributedModelParallel(
            collection, device=torch.device(device), plan=ShardingPlan({"": module_plan}), sharders=[sharder]
        )
    host_memory_warnings = [str(w.message) for w in caught if "fused_uvm" in str(w.message)]
    result = model.load_state_dict(
        OrderedDict((f"embedding_bags.{name}.weight", torch.from_numpy(w)) for name, w in start().items())
    )
    if result.missing_keys or result.unexpected_keys:
        raise AssertionError(f"loading the starting tables: {result}")

    dims = sum(d for _n, _r, d, _s, _k in TABLES)
    mix = torch.from_numpy(np.random.default_rng(2).uniform(-1, 1, dims).astype(np.float32)).to(device)
    local = GLOBAL_BATCH // n
    samples = slice(rank * local, (rank + 1) * local)
    losses = []
    for ids, target in _batches():
        by_key = model(_kjt(ids, samples).to(torch.device(device))).wait().to_dict()
        pooled = torch.cat([by_key[f"f{name}"] for name, _r, _d, _s, _k in TABLES], dim=1)
        loss = ((pooled * mix).sum(1) - torch.from_numpy(target[samples]).to(device)).pow(2).mean()
        loss.backward()  # the tables are updated here
        model.fused_optimizer.step()
        loss = loss.detach().cpu()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # equal slices: the mean of the means is the global loss
        losses.append(loss.item())

    saved: dict[str, np.ndarray] = {
        "losses": np.array(losses),
        "host_memory_warnings": np.array(host_memory_warnings, dtype=str),
    }
    for key, value in model.state_dict().items():
        name = key.split(".")[-2]
        if not isinstance(value, ShardedTensor):
            raise AssertionError(f"{key}: the state_dict holds a {type(value).__name__}")
        for i, shard in enumerate(value.local_shards()):
            if shard.tensor.device.type != device:
                raise AssertionError(f"{key}: a local shard lives on {shard.tensor.device}")
            saved[f"{name}|{i}|offsets"] = np.array(shard.metadata.shard_offsets)
            saved[f"{name}|{i}"] = shard.tensor.detach().cpu().numpy()
    np.savez(f"{out_path}.{device}.{rank}.npz", **cast(dict[str, Any], saved))


def main(out_path: str, optimizer: str) -> None:
    import torch.distributed as dist

    import tpurec  # noqa: F401 (registers the "tpu" backend)

    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}: use one of {tuple(OPTIMIZERS)}")
    dist.init_process_group("cpu:gloo,tpu:tpu", timeout=datetime.timedelta(seconds=60))
    for device in ("cpu", "tpu"):
        train(out_path, optimizer, device)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    # A hung collective ends this rank with every thread's stack instead of stalling the test.
    faulthandler.dump_traceback_later(float(os.environ.get("TPUREC_TEST_HANG_SECONDS", "150")), exit=True)
    main(sys.argv[1], sys.argv[2])
