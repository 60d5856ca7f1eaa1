"""A DLRM training step: torchrec on CPU (FusedEmbeddingBagCollection + FBGEMM) vs tpurec on "tpu".

The DESIGN configuration by default: batch 2048, 26 tables x 100k rows x dim 64,
4 ids per bag, dense arch 13-512-256-64, over arch 512-256-1, row-wise Adagrad
for the tables and Adagrad for the dense part. Both sides train the same
model from the same weights on the same batches; the JSON has the median step
time, samples/s, the ratio, and the largest loss difference seen.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.models.dlrm import DLRM
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from torchrec.optim import RowWiseAdagrad

import tpurec
import tpurec.sparse as sparse


DENSE_LR = 0.005  # small enough that random labels do not blow the logits up


def _batches(n: int, batch: int, tables: int, rows: int, ids_per_bag: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    keys = [f"f{i}" for i in range(tables)]
    for _ in range(n):
        values = torch.from_numpy(rng.integers(0, rows, size=batch * tables * ids_per_bag))
        lengths = torch.full((batch * tables,), ids_per_bag, dtype=torch.int64)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)
        dense = torch.from_numpy(rng.standard_normal((batch, 13)).astype(np.float32))
        labels = torch.from_numpy(rng.integers(0, 2, batch).astype(np.float32))
        yield dense, kjt, labels


def _time(model, optimizer, batches, device: str, warmup: int) -> tuple[list[float], list[float]]:
    times, losses = [], []
    for step, (dense, kjt, labels) in enumerate(batches):
        start = time.perf_counter()
        optimizer.zero_grad()
        logits = model(dense.to(device), kjt).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.to(device))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
        if step + 1 == warmup:
            tpurec.reset_stats()
    return times[warmup:], losses


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m tpurec.bench dlrm", description=__doc__)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--ids-per-bag", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["fused", "eager"])
    args = parser.parse_args(argv)

    configs = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=args.dim, num_embeddings=args.rows, feature_names=[f"f{i}"])
        for i in range(args.tables)
    ]
    layers = {"dense_in_features": 13, "dense_arch_layer_sizes": [512, 256, args.dim], "over_arch_layer_sizes": [512, 256, 1]}
    torch.manual_seed(0)
    reference = DLRM(
        embedding_bag_collection=FusedEmbeddingBagCollection(configs, optimizer_type=RowWiseAdagrad, optimizer_kwargs={"lr": 0.05}),
        **layers,
    )
    state = {k: v.detach().clone() for k, v in reference.state_dict().items()}  # before training changes it
    total = args.steps + args.warmup
    make_batches = lambda: _batches(total, args.batch, args.tables, args.rows, args.ids_per_bag)  # noqa: E731

    peer_times, peer_losses = _time(
        reference, torch.optim.Adagrad(reference.parameters(), lr=DENSE_LR), make_batches(), "cpu", args.warmup
    )
    result = {
        "benchmark": "dlrm",
        "config": vars(args),
        "platform": tpurec.platform(),
        "torchrec_cpu": {"step_ms": statistics.median(peer_times) * 1e3, "samples_per_s": args.batch / statistics.median(peer_times)},
    }
    for mode in args.modes:
        ours = DLRM(embedding_bag_collection=EmbeddingBagCollection(configs), **layers)
        ours.load_state_dict(state)
        ours = sparse.from_torchrec(
            ours,
            optimizer=sparse.RowWiseAdagrad(learning_rate=0.05),
            capacities=sparse.Capacity(args.batch * args.tables * args.ids_per_bag),
        ).to("tpu")
        dense_params = [p for p in ours.parameters() if p.requires_grad]
        with tpurec.mode(mode):
            times, losses = _time(ours, torch.optim.Adagrad(dense_params, lr=DENSE_LR), make_batches(), "tpu", args.warmup)
        median = statistics.median(times)
        result[f"tpurec_{mode}"] = {
            "step_ms": median * 1e3,
            "samples_per_s": args.batch / median,
            "speedup_vs_torchrec_cpu": statistics.median(peer_times) / median,
            "max_loss_difference": max(abs(a - b) for a, b in zip(losses, peer_losses)),
            "compilations_after_warmup": tpurec.stats()["compilations"],
        }
    return result
