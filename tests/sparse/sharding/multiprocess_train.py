"""Trains a sharded torchrec DLRM for the multi-process tests.

Under torchrun (``torchrun --nproc-per-node 2 multiprocess_train.py OUT``, 4 CPU
devices per process) every process feeds its half of each global batch; alone
(8 devices) one process feeds it all. Process 0 writes the losses, the final
tables and slots and the dense parameters to ``OUT`` (``.npz``).
"""

from __future__ import annotations

import os
import sys

import numpy as np

GLOBAL_BATCH = 16
STEPS = 10


def _kjt(features, lo: int, hi: int):
    """The KJT of samples ``[lo, hi)`` from per-feature (lengths, values) of the global batch."""
    import torch
    from torchrec import KeyedJaggedTensor

    keys, lengths, values = [], [], []
    for name, (ls, vs) in features.items():
        starts = np.concatenate([[0], np.cumsum(ls)])
        keys.append(name)
        lengths.append(ls[lo:hi])
        values.append(vs[starts[lo] : starts[hi]])
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.from_numpy(np.concatenate(values)), lengths=torch.from_numpy(np.concatenate(lengths))
    )


def build(plan_kind: str = "mixed"):
    """The sharded DLRM (seeded) under the mixed plan, or every table row-wise."""
    import torch
    from torchrec import EmbeddingBagCollection as TorchrecEBC
    from torchrec import EmbeddingBagConfig
    from torchrec.distributed.sharding_plan import (
        column_wise,
        construct_module_sharding_plan,
        data_parallel,
        row_wise,
        table_row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingPlan
    from torchrec.models.dlrm import DLRM

    import tpurec
    import tpurec.sparse as sp

    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=rows, feature_names=[f"f{i}"])
        for i, rows in enumerate((40, 23, 17, 30, 64))
    ]
    meta = TorchrecEBC(tables=tables, device=torch.device("meta"))
    generators = (
        {
            "t0": table_wise(rank=6),
            "t1": row_wise(),
            "t2": column_wise(ranks=[1, 5]),
            "t3": data_parallel(),
            "t4": table_row_wise(host_index=0),
        }
        if plan_kind == "mixed"
        else {t.name: row_wise() for t in tables}
    )
    module_plan = construct_module_sharding_plan(meta, generators, local_size=4, world_size=8, device_type="cpu")
    torch.manual_seed(0)
    model = DLRM(
        embedding_bag_collection=TorchrecEBC(tables),
        dense_in_features=5,
        dense_arch_layer_sizes=[16, 8],
        over_arch_layer_sizes=[16, 1],
    )
    model = sp.from_torchrec(model, optimizer=sp.Adagrad(learning_rate=0.1)).to("tpu")
    return tables, tpurec.shard(model, ShardingPlan({"sparse_arch.embedding_bag_collection": module_plan}))


def _batches(tables):
    """The global batches: (per-feature (lengths, ids), dense, labels), the same in every process."""
    import torch

    rng = np.random.default_rng(0)
    for _ in range(STEPS):
        features = {}
        for t in tables:
            ls = rng.integers(0, 5, GLOBAL_BATCH)
            features[t.feature_names[0]] = (ls, rng.integers(0, t.num_embeddings, int(ls.sum())))
        dense = torch.from_numpy(rng.standard_normal((GLOBAL_BATCH, 5)).astype(np.float32))
        labels = torch.from_numpy(rng.integers(0, 2, GLOBAL_BATCH).astype(np.float32))
        yield features, dense, labels


def _pipelined(tables, model, optimizer, lo: int, hi: int, graphed: bool = False) -> list[float]:
    """The same steps through tpurec.sparse.TrainPipeline (this process's samples ``[lo, hi)``).

    ``graphed``: ``TrainPipeline(graphed=True)``, whose third step is captured and replayed after.
    """
    import torch

    import tpurec.sparse as sp
    from tpurec.sparse.sharding import distribute_batch

    class Train(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, batch):
            dense, kjt, labels = batch
            logits = self.model(dense, kjt).squeeze(-1)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                logits, distribute_batch(labels, self.model.mesh)
            )
            return loss, loss.detach()

    local = ((dense[lo:hi], _kjt(features, lo, hi), labels[lo:hi]) for features, dense, labels in _batches(tables))
    pipeline = sp.TrainPipeline(Train(model), optimizer, "tpu", graphed=graphed)
    losses = []
    while True:
        try:
            losses.append(pipeline.progress(local).item())
        except StopIteration:
            break
    pipeline.close()
    if graphed:
        assert pipeline._graph is not None and pipeline._graph.captured, "the graphed pipeline captured no step"
    return losses


def _results(model, losses: list[float], prefix: str = "") -> dict[str, np.ndarray]:
    full, slots = model.sparse_arch.embedding_bag_collection.full_tables()
    arrays = {f"{prefix}losses": np.array(losses)}
    arrays.update({f"{prefix}table/{k}": v for k, v in full.items()})
    arrays.update({f"{prefix}slot/{k}/{s}": v for k, d in slots.items() for s, v in d.items()})
    arrays.update(
        {
            f"{prefix}dense/{k}": v.cpu().numpy()
            for k, v in model.state_dict().items()
            if "embedding_bag_collection" not in k
        }
    )
    return arrays


def main(out: str, checkpoint_dir: str | None = None) -> None:
    """Trains STEPS steps in the plain loop (then saves the checkpoint), then the same steps
    from the same start through TrainPipeline and through TrainPipeline(graphed=True); process 0
    writes the three results (``pipeline/...``, ``graphed/...``)."""
    import tpurec
    import tpurec.distributed

    if "RANK" in os.environ:
        tpurec.distributed.initialize()
    import jax
    import torch

    from tpurec.sparse.checkpoint import sharded as checkpoint
    from tpurec.sparse.sharding import distribute_batch

    tables, model = build()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05)

    rank, count = jax.process_index(), jax.process_count()
    local = GLOBAL_BATCH // count
    lo, hi = rank * local, (rank + 1) * local
    losses = []
    for features, dense, labels in _batches(tables):
        optimizer.zero_grad()
        logits = model(dense[lo:hi], _kjt(features, lo, hi)).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, distribute_batch(labels[lo:hi], model.mesh))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    if checkpoint_dir:
        checkpoint.save(model, checkpoint_dir)  # every process writes its own shards
    arrays = _results(model, losses)

    # The pipeline: with several processes its worker validates and routes each
    # batch, and the step packs it (the capacity agreement is a collective).
    _tables, model = build()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05)
    arrays.update(_results(model, _pipelined(tables, model, optimizer, lo, hi), prefix="pipeline/"))

    # Captured steps: the staged sharded lookups and a fused dense optimizer, in fused mode.
    _tables, model = build()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05, fused=True)
    with tpurec.mode("fused"):
        losses = _pipelined(tables, model, optimizer, lo, hi, graphed=True)
    arrays.update(_results(model, losses, prefix="graphed/"))
    if rank == 0:
        np.savez(out, **arrays)


if __name__ == "__main__":
    import faulthandler

    # A hung collective must fail the test with the stacks, not stall it.
    faulthandler.dump_traceback_later(float(os.environ.get("TPUREC_TEST_HANG_SECONDS", "400")), exit=True)
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
