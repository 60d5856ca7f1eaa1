"""One rank of the TrainPipelineSparseDist test (``torchrun --nproc-per-node N dmp_pipeline_worker.py OUT PLAN``).

dmp_worker.py's ``EmbeddingBagCollection`` (its tables, batches, loss and plans), inside a model
whose forward takes a TorchRec ``Batch`` and returns ``(loss, loss)``, is sharded by
``DistributedModelParallel`` on the tpu device and trained ``dmp_worker.STEPS`` steps of SGD
twice from the same starting tables: by TorchRec's ``TrainPipelineSparseDist`` (the input
distribution of batch i+1 issued before batch i's forward) and by the plain loop (forward,
backward, step per batch). Each rank writes ``OUT.<rank>.npz``: the global losses of each way
(``pipeline_losses``, ``loop_losses``), the class names of the modules the pipeline rewrote
(``pipelined``) and its local shards after each (``pipeline|<t>|<i>``,
``loop|<t>|<i>``, with ``|offsets``).
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


def _model_class():
    import torch
    from torchrec.datasets.utils import Batch

    class PooledLoss(torch.nn.Module):
        """dmp_worker's loss of the collection's pooled lookups of ``batch.sparse_features``."""

        def __init__(self, device: str) -> None:
            super().__init__()
            self.collection = dmp_worker._collection("mixed", device)
            self.mix = dmp_worker._mix("mixed", "tpu")  # a fixed projection, no parameter or buffer

        def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
            pooled = self.collection(batch.sparse_features)
            loss = dmp_worker._loss(dmp_worker._pooled(pooled), batch.labels, self.mix)
            return loss, loss.detach()

    return PooledLoss


def _shard(plan_name: str):
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
    model = _model_class()("meta")
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    model = DistributedModelParallel(model, device=torch.device("tpu"), plan=plan, sharders=[sharder])
    start = dmp_worker._weights("mixed")
    result = model.load_state_dict(
        OrderedDict((f"collection.embedding_bags.{n}.weight", torch.from_numpy(w)) for n, w in start.items()),
        strict=False,
    )
    if result.unexpected_keys or [k for k in result.missing_keys if "embedding_bags" in k]:
        raise AssertionError(f"loading the starting tables: {result}")
    return model


def _batches():
    """This rank's slice of dmp_worker's global batches, as TorchRec Batches on the CPU."""
    import torch
    import torch.distributed as dist
    from torchrec.datasets.utils import Batch

    local = dmp_worker.GLOBAL_BATCH // dist.get_world_size()
    samples = slice(dist.get_rank() * local, (dist.get_rank() + 1) * local)
    return [
        Batch(
            dense_features=torch.zeros(local, 1),
            sparse_features=dmp_worker._kjt(ids, samples),
            labels=torch.from_numpy(target[samples]),
        )
        for ids, target in dmp_worker._batches()
    ]


def _global(loss) -> float:
    import torch.distributed as dist

    loss = loss.detach().clone()
    dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # equal slices: the mean of the means
    return loss.item()


def _shards(model, prefix: str) -> dict[str, np.ndarray]:
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor

    arrays: dict[str, np.ndarray] = {}
    for key, value in model.state_dict().items():
        if isinstance(value, ShardedTensor):
            for i, shard in enumerate(value.local_shards()):
                name = f"{prefix}|{key.split('.')[-2]}|{i}"
                arrays[name] = shard.tensor.detach().cpu().numpy()
                arrays[name + "|offsets"] = np.array(shard.metadata.shard_offsets)
    return arrays


def main(out_path: str, plan_name: str) -> None:
    import torch
    import torch.distributed as dist
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    import tpurec  # noqa: F401 (registers the "tpu" backend)

    dist.init_process_group("cpu:gloo,tpu:tpu", timeout=datetime.timedelta(seconds=60))
    device = torch.device("tpu")
    arrays: dict[str, np.ndarray] = {}

    model = _shard(plan_name)
    optimizer = torch.optim.SGD(model.parameters(), lr=dmp_worker.LEARNING_RATE)
    pipeline = TrainPipelineSparseDist(model, optimizer, device)
    batches, losses = iter(_batches()), []
    while True:
        try:
            losses.append(_global(pipeline.progress(batches)))
        except StopIteration:
            break
    arrays["pipeline_losses"] = np.array(losses)
    # The pipeline rewrote the sharded collection's forward to take the input it distributed ahead
    # (a model it cannot trace would run unpipelined, the same numbers).
    pipelined = getattr(pipeline, "_pipelined_modules")  # noqa: B009 (TorchRec's private field)
    arrays["pipelined"] = np.array([type(m).__name__ for m in pipelined])
    arrays.update(_shards(model, "pipeline"))

    model = _shard(plan_name)
    optimizer = torch.optim.SGD(model.parameters(), lr=dmp_worker.LEARNING_RATE)
    losses = []
    for batch in _batches():
        optimizer.zero_grad()
        loss, _ = model(batch.to(device))
        loss.backward()
        optimizer.step()
        losses.append(_global(loss))
    arrays["loop_losses"] = np.array(losses)
    arrays.update(_shards(model, "loop"))
    np.savez(f"{out_path}.{dist.get_rank()}.npz", **cast(dict[str, Any], arrays))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    faulthandler.dump_traceback_later(float(os.environ.get("TPUREC_TEST_HANG_SECONDS", "150")), exit=True)
    main(sys.argv[1], sys.argv[2])
