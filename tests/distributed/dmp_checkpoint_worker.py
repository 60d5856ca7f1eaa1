"""One rank of the DCP test of a DMP model (``torchrun --nproc-per-node N dmp_checkpoint_worker.py DIR SAVE:LOAD[,...]``).

For each pair of sharding types ``SAVE:LOAD`` (``table_wise``, ``row_wise``, ``column_wise`` or
``mixed``, dmp_worker's plans), in ``DIR/<SAVE>-<LOAD>``: TorchRec's ``EmbeddingBagCollection`` (dmp_worker.py's tables, batches and loss) is sharded by
``DistributedModelParallel`` on the tpu device with the ``SAVE_PLAN`` sharding type, trains
a few steps, and its ``state_dict`` is saved with ``torch.distributed.checkpoint.save`` under
``DIR/checkpoint``. A fresh DMP model sharded with ``LOAD_PLAN`` loads it with
``torch.distributed.checkpoint.load``; each rank then writes ``DIR/rank<r>.npz``: the trained
model's and the loaded model's tables gathered whole (``trained|<t>``, ``loaded|<t>``) and both
models' lookups of one batch (``trained_lookup``, ``loaded_lookup``).
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import sys
from collections import OrderedDict
from typing import Any, cast

import numpy as np

import dmp_worker  # the script's folder is first on sys.path

TRAIN_STEPS = 3


def _shard(plan_name: str):
    """A DMP model of dmp_worker's collection, every table sharded the way ``plan_name`` says."""
    import torch
    import torch.distributed as dist
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ModuleSharder

    types = {n: dmp_worker.MIXED[n] if plan_name == "mixed" else plan_name for n, _r, _d in dmp_worker.TABLES}
    constraints = {
        n: ParameterConstraints(sharding_types=[types[n]], compute_kernels=["unfused_tpu"], min_partition=16)
        for n in types
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=dist.get_world_size(), compute_device="tpu", local_world_size=1),
        constraints=constraints,
    )
    sharder = cast(ModuleSharder[torch.nn.Module], EmbeddingBagCollectionSharder())
    plan = planner.collective_plan(dmp_worker._collection("mixed", "meta"), [sharder], dist.GroupMember.WORLD)
    return DistributedModelParallel(
        dmp_worker._collection("mixed", "meta"), device=torch.device("tpu"), plan=plan, sharders=[sharder]
    )


def _whole(model) -> dict[str, np.ndarray]:
    """Every table of ``model`` gathered whole on every rank (all-gathered through the gloo group)."""
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor

    mine: dict[str, list[tuple[list[int], np.ndarray]]] = {}
    for key, value in model.state_dict().items():
        if isinstance(value, ShardedTensor):
            mine[key.split(".")[1]] = [
                (list(s.metadata.shard_offsets), s.tensor.detach().cpu().numpy()) for s in value.local_shards()
            ]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    tables = {n: np.full((r, d), np.nan, np.float32) for n, r, d in dmp_worker.TABLES}
    for theirs in everyone:
        for name, shards in theirs.items():
            for (r0, c0), block in shards:
                tables[name][r0 : r0 + block.shape[0], c0 : c0 + block.shape[1]] = block
    return tables


def save_and_load(directory: str, save_plan: str, load_plan: str) -> None:
    """Trains a model sharded by ``save_plan``, saves it with DCP, loads it into one sharded by ``load_plan``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_loader import load
    from torch.distributed.checkpoint.state_dict_saver import save

    rank, n = dist.get_rank(), dist.get_world_size()
    model = _shard(save_plan)
    start = dmp_worker._weights("mixed")
    model.load_state_dict(
        OrderedDict((f"embedding_bags.{name}.weight", torch.from_numpy(w)) for name, w in start.items())
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=dmp_worker.LEARNING_RATE)
    mix, local = dmp_worker._mix("mixed", "tpu"), dmp_worker.GLOBAL_BATCH // n
    samples = slice(rank * local, (rank + 1) * local)
    batches = list(dmp_worker._batches())
    for ids, target in batches[:TRAIN_STEPS]:
        optimizer.zero_grad()
        out = model(dmp_worker._kjt(ids, samples).to(torch.device("tpu"))).wait()
        dmp_worker._loss(dmp_worker._pooled(out), torch.from_numpy(target[samples]).to("tpu"), mix).backward()
        optimizer.step()

    checkpoint = os.path.join(directory, "checkpoint")
    save(model.state_dict(), checkpoint_id=checkpoint)

    fresh = _shard(load_plan)
    state = fresh.state_dict()
    load(state, checkpoint_id=checkpoint)
    result = fresh.load_state_dict(cast("OrderedDict[str, torch.Tensor]", state))
    if result.missing_keys or result.unexpected_keys:
        raise AssertionError(f"loading the checkpoint's state_dict: {result}")

    batch = dmp_worker._kjt(batches[TRAIN_STEPS][0], samples).to(torch.device("tpu"))
    with torch.no_grad():
        lookups = {
            name: dmp_worker._pooled(m(batch).wait()).cpu().numpy()
            for name, m in (("trained", model), ("loaded", fresh))
        }
    arrays: dict[str, np.ndarray] = {f"{k}_lookup": v for k, v in lookups.items()}
    for name, m in (("trained", model), ("loaded", fresh)):
        arrays.update({f"{name}|{t}": w for t, w in _whole(m).items()})
    np.savez(os.path.join(directory, f"rank{rank}.npz"), **cast(dict[str, Any], arrays))


def main(directory: str, pairs: list[str]) -> None:
    import torch.distributed as dist

    import tpurec  # noqa: F401 (registers the "tpu" backend)

    dist.init_process_group("cpu:gloo,tpu:tpu", timeout=datetime.timedelta(seconds=60))
    for pair in pairs:
        save_plan, load_plan = pair.split(":")
        save_and_load(os.path.join(directory, f"{save_plan}-{load_plan}"), save_plan, load_plan)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    faulthandler.dump_traceback_later(float(os.environ.get("TPUREC_TEST_HANG_SECONDS", "150")), exit=True)
    main(sys.argv[1], sys.argv[2].split(","))
