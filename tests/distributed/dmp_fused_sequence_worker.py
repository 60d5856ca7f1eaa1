"""One rank of the FUSED ``EmbeddingCollection`` DMP test (``torchrun ... dmp_fused_sequence_worker.py OUT RUN[,RUN]``).

A run is ``<plan>:<optimizer>``: TorchRec's own ``EmbeddingCollection`` (born on meta; two tables of
dim 8, one read by two features), ``apply_optimizer_in_backward(<optimizer>)`` on it, TorchRec's planner
with the ``FUSED`` kernel and every table ``<plan>`` (table- or row-wise), sharded by
``DistributedModelParallel`` on tpu. ``STEPS`` steps on this rank's samples of each global batch: the
loss weighs every id's embedding (:func:`loss`). Each rank writes ``OUT.<plan>.<optimizer>.<rank>.npz``:
its losses and table shards with their offsets. :func:`reference` is TorchRec's unsharded collection
with the same in-backward optimizer on CPU, on the whole batch (DMP divides the tables' gradients by
the world size, so its loss is the whole batch's over the world size).
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
STEPS = 5
TABLES = (("s0", 12, ("a", "b")), ("s1", 10, ("c",)))
DIM = 8
OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "sgd": ("torch.optim.SGD", {"lr": 0.1}),
    # eps given: FBGEMM's default is 1e-8, torch's 1e-10; TorchRec hands FBGEMM the given one.
    "adagrad": ("torch.optim.Adagrad", {"lr": 0.1, "eps": 1e-8}),
}


def _resolve(path: str) -> Any:
    import importlib

    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def collection(device: str):
    import torch
    from torchrec import EmbeddingCollection, EmbeddingConfig

    configs = [
        EmbeddingConfig(name=n, embedding_dim=DIM, num_embeddings=r, feature_names=list(f)) for n, r, f in TABLES
    ]
    return EmbeddingCollection(tables=configs, device=torch.device(device))


def weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {n: rng.uniform(-0.5, 0.5, (r, DIM)).astype(np.float32) for n, r, _f in TABLES}


def features() -> list[str]:
    return [f for _n, _r, fs in TABLES for f in fs]


def batches():
    """STEPS global batches: per feature, per sample 0-3 ids (repeats included)."""
    rng = np.random.default_rng(1)
    rows = {f: r for _n, r, fs in TABLES for f in fs}
    for _ in range(STEPS):
        yield {
            f: [rng.integers(0, rows[f], int(k)).tolist() for k in rng.integers(0, 4, GLOBAL_BATCH)] for f in features()
        }


def kjt(ids: dict[str, list[list[int]]], samples: slice):
    import torch
    from torchrec import KeyedJaggedTensor

    keys = features()
    lengths = [len(s) for f in keys for s in ids[f][samples]]
    values = [v for f in keys for s in ids[f][samples] for v in s]
    return KeyedJaggedTensor(
        keys=keys, values=torch.tensor(values, dtype=torch.int64), lengths=torch.tensor(lengths, dtype=torch.int64)
    )


def loss(out: Any, ids: dict[str, list[list[int]]], samples: slice, device: str):
    """Each id's embedding weighed by a value of its own (its row and position), summed."""
    import torch

    total = torch.zeros((), device=device)
    for f in features():
        flat = [(v, i) for s in ids[f][samples] for i, v in enumerate(s)]
        if not flat:
            continue
        w = torch.tensor([[((v * 7 + i * 3 + c) % 9 - 4) / 8 for c in range(DIM)] for v, i in flat])
        total = total + (out[f].values() * w.to(device)).sum()
    return total


def reference(optimizer: str, world: int) -> tuple[list[float], dict[str, np.ndarray]]:
    """TorchRec's unsharded collection on CPU with the in-backward optimizer, the whole batch: losses, tables."""
    import torch
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    model = collection("cpu")
    with torch.no_grad():
        for n, w in weights().items():
            cast(torch.Tensor, model.embeddings[n].weight).copy_(torch.from_numpy(w))
    cls, kwargs = OPTIMIZERS[optimizer]
    apply_optimizer_in_backward(_resolve(cls), model.parameters(), dict(kwargs))
    losses = []
    for ids in batches():
        value = loss(model(kjt(ids, slice(None))), ids, slice(None), "cpu") / world
        value.backward()
        losses.append(value.item())
    return losses, {n: cast(torch.Tensor, model.embeddings[n].weight).detach().numpy().copy() for n, _r, _f in TABLES}


def train_sharded(out_path: str, plan_name: str, optimizer: str) -> None:
    import torch
    import torch.distributed as dist
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ModuleSharder
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    rank, n = dist.get_rank(), dist.get_world_size()
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=n, compute_device="tpu", local_world_size=1),
        constraints={
            name: ParameterConstraints(sharding_types=[plan_name], compute_kernels=["fused"]) for name, _r, _f in TABLES
        },
    )
    sharder = cast(ModuleSharder[torch.nn.Module], EmbeddingCollectionSharder())
    model_ec = collection("meta")
    cls, kwargs = OPTIMIZERS[optimizer]
    apply_optimizer_in_backward(_resolve(cls), model_ec.parameters(), dict(kwargs))
    plan = planner.collective_plan(model_ec, [sharder], dist.GroupMember.WORLD)
    got = {name: (p.sharding_type, p.compute_kernel) for name, p in plan.plan[""].items()}  # pyright: ignore
    if got != {name: (plan_name, "fused") for name, _r, _f in TABLES}:
        raise AssertionError(f"the planner chose {got}")
    model = DistributedModelParallel(model_ec, device=torch.device("tpu"), plan=plan, sharders=[sharder])
    result = model.load_state_dict(
        OrderedDict((f"embeddings.{name}.weight", torch.from_numpy(w)) for name, w in weights().items())
    )
    if result.missing_keys or result.unexpected_keys:
        raise AssertionError(f"loading the starting tables: {result}")
    local = GLOBAL_BATCH // n
    samples = slice(rank * local, (rank + 1) * local)
    losses = []
    for ids in batches():
        out = model(kjt(ids, samples).to(torch.device("tpu")))
        out = out.wait() if hasattr(out, "wait") else out
        value = loss(out, ids, samples, "tpu")
        value.backward()
        value = value.detach()
        dist.all_reduce(value)  # the whole batch's loss over the world size, as the reference's
        losses.append(value.item() / n)
    saved: dict[str, np.ndarray] = {"losses": np.array(losses)}
    state = model.state_dict()
    for name, _r, _f in TABLES:
        for shard in state[f"embeddings.{name}.weight"].local_shards():
            r0, c0 = shard.metadata.shard_offsets
            saved[f"table|{name}|{r0}|{c0}"] = shard.tensor.detach().cpu().numpy()
    np.savez(f"{out_path}.{plan_name}.{optimizer}.{rank}.npz", **cast(dict[str, Any], saved))


def main(out_path: str, runs: list[str]) -> None:
    import torch.distributed as dist

    import tpurec  # noqa: F401 (registers the "tpu" backend)

    dist.init_process_group("cpu:gloo,tpu:tpu", timeout=datetime.timedelta(seconds=60))
    for run in runs:
        plan, _, optimizer = run.partition(":")
        train_sharded(out_path, plan, optimizer)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    faulthandler.dump_traceback_later(float(os.environ.get("TPUREC_TEST_HANG_SECONDS", "150")), exit=True)
    main(sys.argv[1], sys.argv[2].split(","))
