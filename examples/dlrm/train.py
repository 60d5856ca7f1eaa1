"""Train TorchRec's DLRM on the "tpu" device, on synthetic click data.

The model is plain TorchRec (``torchrec.models.dlrm.DLRM`` over an
``EmbeddingBagCollection``); ``tpurec.sparse.from_torchrec`` swaps in the
SparseCore-shaped embedding module with a fused row-wise Adagrad, and the model
moves with ``.to("tpu")``. The data has a learnable signal: each click is drawn
from a hidden logistic model over the dense features and hidden per-id scores,
so the loss falls well below log(2) and the AUC rises above 0.5.

Run with ``make train`` or ``.venv/bin/python examples/dlrm/train.py --help``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torchmetrics.functional.classification import binary_auroc
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.models.dlrm import DLRM

import tpurec
import tpurec.sparse as sparse

DENSE_FEATURES = 13


class SyntheticClicks:
    """Batches of (dense features, KJT of ids, labels) from a fixed hidden model."""

    def __init__(self, num_tables: int, rows: int, ids_per_bag: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.keys = [f"cat_{i}" for i in range(num_tables)]
        self.rows, self.ids_per_bag = rows, ids_per_bag
        self.dense_weight = rng.normal(size=DENSE_FEATURES) / np.sqrt(DENSE_FEATURES)
        self.id_scores = rng.normal(size=(num_tables, rows)) / np.sqrt(num_tables)
        self.rng = rng

    def batch(self, size: int) -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
        rng = self.rng
        dense = rng.normal(size=(size, DENSE_FEATURES)).astype(np.float32)
        logit = dense @ self.dense_weight
        lengths, values = [], []
        for t in range(len(self.keys)):
            # Bags of 1..ids_per_bag ids, skewed towards small ids as real categorical data is.
            n = rng.integers(1, self.ids_per_bag + 1, size=size)
            ids = np.minimum(rng.zipf(1.3, size=n.sum()) - 1, self.rows - 1)
            bag = np.repeat(np.arange(size), n)
            logit += np.bincount(bag, weights=self.id_scores[t, ids], minlength=size) / n
            lengths.append(n)
            values.append(ids)
        labels = (rng.random(size) < 1 / (1 + np.exp(-2 * logit))).astype(np.float32)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=self.keys,
            values=torch.from_numpy(np.concatenate(values)),
            lengths=torch.from_numpy(np.concatenate(lengths)),
        )
        return torch.from_numpy(dense), kjt, torch.from_numpy(labels)


def build_model(keys: list[str], rows: int, dim: int, device: str, capacity: int) -> torch.nn.Module:
    tables = [EmbeddingBagConfig(name=f"t_{k}", embedding_dim=dim, num_embeddings=rows, feature_names=[k]) for k in keys]
    model = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables),
        dense_in_features=DENSE_FEATURES,
        dense_arch_layer_sizes=[64, dim],
        over_arch_layer_sizes=[64, 32, 1],
    )
    model = sparse.from_torchrec(
        model, optimizer=sparse.RowWiseAdagrad(learning_rate=0.05), capacities=sparse.Capacity(capacity)
    )
    return model.to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--ids-per-bag", type=int, default=4)
    parser.add_argument("--device", default="tpu")
    parser.add_argument("--mode", choices=tpurec.modes.MODES, default="fused")
    parser.add_argument("--log-every", type=int, default=25)
    args = parser.parse_args()

    torch.manual_seed(0)
    data = SyntheticClicks(args.tables, args.rows, args.ids_per_bag)
    # Tables of one dim share a stack, and every bag has at most ids_per_bag ids:
    # a batch never needs more than this (static, so no batch recompiles).
    model = build_model(data.keys, args.rows, args.dim, args.device, capacity=args.batch * args.tables * args.ids_per_bag)
    dense_optimizer = torch.optim.Adagrad([p for p in model.parameters() if p.requires_grad], lr=0.05)
    held_out = [data.batch(args.batch) for _ in range(8)]

    print(f"DLRM on {args.device} (XLA:{tpurec.platform().upper()}), mode {args.mode}: "
          f"{args.tables} tables x {args.rows} rows x dim {args.dim}, batch {args.batch}")
    losses, start = [], None
    with tpurec.mode(args.mode):
        for step in range(args.steps):
            if step == 10:  # after warm-up: count compilations and time the steady state
                tpurec.reset_stats()
                start = time.perf_counter()
            dense, kjt, labels = data.batch(args.batch)
            dense_optimizer.zero_grad()
            logits = model(dense.to(args.device), kjt).squeeze(-1)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.to(args.device))
            loss.backward()
            dense_optimizer.step()
            losses.append(loss.item())
            if (step + 1) % args.log_every == 0 or step == 0:
                window = losses[-args.log_every:]
                print(f"step {step + 1:>5}  loss {sum(window) / len(window):.4f}")
        elapsed = time.perf_counter() - start if start else float("nan")
        stats = tpurec.stats()
        with torch.no_grad():
            scores = torch.cat([torch.sigmoid(model(d.to(args.device), k).squeeze(-1)).cpu() for d, k, _ in held_out])
            labels = torch.cat([y for _, _, y in held_out])
    steady = max(args.steps - 10, 1)
    print(f"held-out AUC {binary_auroc(scores, labels.long()).item():.4f}; "
          f"{steady * args.batch / elapsed:,.0f} samples/s after warm-up; "
          f"{stats['compilations']} compilations after warm-up")


if __name__ == "__main__":
    main()
