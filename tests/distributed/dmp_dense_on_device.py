"""Measures tpurec's DENSE tpu kernel (DMP's data-parallel and default-kernel tables) on a TPU.

Run on a machine with a TPU (``python tests/distributed/dmp_dense_on_device.py``); writes
``$OUT/dmp_dense_on_device.json`` (or ./dmp_dense_on_device.json). One process (a world of one,
``"cpu:gloo,tpu:tpu"``): TorchRec's ``EmbeddingBagCollection`` with tables of dims 4, 8, 12, 16
and 24 (TorchRec's own tpu kernel takes multiples of 16 only), plain and weighted, every table
data-parallel on TorchRec's ``DENSE`` kernel, sharded by ``DistributedModelParallel`` on tpu from
the same starting tables as the same collection on CPU. For each collection: the largest absolute
difference of the pooled lookups and of the table gradients (the gradient of the sum of the
pooled values times a fixed projection) from the CPU collection's, and the seconds the first and
a later lookup with backward took.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from collections import OrderedDict
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist

import tpurec

DIMS = (4, 8, 12, 16, 24)
BATCH = 256


def _collection(weighted: bool, device: str) -> Any:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    configs = [
        EmbeddingBagConfig(name=f"t{d}", embedding_dim=d, num_embeddings=1000, feature_names=[f"f{d}"]) for d in DIMS
    ]
    return EmbeddingBagCollection(tables=configs, is_weighted=weighted, device=torch.device(device))


def _batch(weighted: bool) -> Any:
    from torchrec import KeyedJaggedTensor

    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 6, BATCH * len(DIMS))
    values = rng.integers(0, 1000, int(lengths.sum()))
    weights = torch.from_numpy(rng.uniform(0.1, 2.0, values.size).astype(np.float32)) if weighted else None
    return KeyedJaggedTensor(
        keys=[f"f{d}" for d in DIMS], values=torch.from_numpy(values), lengths=torch.from_numpy(lengths),
        weights=weights,
    )  # fmt: skip


def measure(weighted: bool) -> dict[str, Any]:
    """The lookups and table gradients of the DMP collection on tpu against the CPU collection."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, data_parallel
    from torchrec.distributed.types import ShardingPlan

    rng = np.random.default_rng(1)
    tables = OrderedDict(
        (f"embedding_bags.t{d}.weight", torch.from_numpy(rng.uniform(-1, 1, (1000, d)).astype(np.float32)))
        for d in DIMS
    )
    mix = torch.from_numpy(rng.uniform(-1, 1, sum(DIMS)).astype(np.float32))
    reference = _collection(weighted, "cpu")
    reference.load_state_dict(tables)
    batch = _batch(weighted)
    want = reference(batch).values()
    (want * mix).sum().backward()
    sharder = cast(Any, EmbeddingBagCollectionSharder())
    plan = construct_module_sharding_plan(
        _collection(weighted, "meta"), {f"t{d}": data_parallel() for d in DIMS}, sharder=sharder, local_size=1,
        world_size=1, device_type="tpu",
    )  # fmt: skip
    model = DistributedModelParallel(
        _collection(weighted, "meta"), device=torch.device("tpu"), plan=ShardingPlan({"": plan}), sharders=[sharder]
    )
    model.load_state_dict(tables)
    seconds = []
    got = None
    for _ in range(3):
        model.zero_grad()
        began = time.perf_counter()
        out = model(batch.to(torch.device("tpu"))).wait()
        got = out.to_dict()
        (out.values() * mix.to("tpu")).sum().backward()
        torch.tpu.synchronize()  # pyright: ignore[reportAttributeAccessIssue]
        seconds.append(time.perf_counter() - began)
    assert got is not None
    want_by_key = reference(batch).to_dict()
    params = dict(model.named_parameters())
    result: dict[str, Any] = {"seconds_first": seconds[0], "seconds_last": seconds[-1], "tables": {}}
    for d in DIMS:
        name = next(n for n in params if n.endswith(f"t{d}.weight"))
        grad = cast(torch.Tensor, params[name].grad).cpu()
        ref_grad = cast(torch.Tensor, reference.embedding_bags[f"t{d}"].weight.grad)
        result["tables"][f"dim {d}"] = {
            "lookup_max_abs_diff": float((got[f"f{d}"].detach().cpu() - want_by_key[f"f{d}"].detach()).abs().max()),
            "grad_max_abs_diff": float((grad - ref_grad).abs().max()),
        }
    return result


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("cpu:gloo,tpu:tpu", rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))
    report = {"platform": tpurec.platform(), "plain": measure(False), "weighted": measure(True)}
    dist.destroy_process_group()
    path = os.path.join(os.environ.get("OUT", "."), "dmp_dense_on_device.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
