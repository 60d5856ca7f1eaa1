"""Compiled vs eager step time of a DLRM-sized dense step on the tpu device.

Run: ``python tests/compile/bench_dense_step.py [--batch 2048]`` (not a test).
DLRM (MLPerf) dense arch: bottom 13-512-256-64, dot interaction of 27
features (26 pooled embeddings of dim 64, given here as a dense input, plus
the bottom output), top 415-1024-1024-512-256-1, BCE loss, SGD.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import tpurec


class DLRMDense(nn.Module):
    def __init__(self, tables: int = 26, dim: int = 64) -> None:
        super().__init__()

        def mlp(sizes: list[int]) -> nn.Sequential:
            return nn.Sequential(*[m for a, b in zip(sizes, sizes[1:]) for m in (nn.Linear(a, b), nn.ReLU())][:-1])

        self.bottom = nn.Sequential(mlp([13, 512, 256, dim]), nn.ReLU())
        n = tables + 1
        self.register_buffer("pairs", torch.triu_indices(n, n, offset=1), persistent=False)
        self.top = mlp([dim + n * (n - 1) // 2, 1024, 1024, 512, 256, 1])

    def forward(self, dense, pooled, labels):
        x = self.bottom(dense)
        features = torch.cat([x.unsqueeze(1), pooled], dim=1)
        dots = torch.bmm(features, features.transpose(1, 2))
        inter = dots[:, self.pairs[0], self.pairs[1]]
        logits = self.top(torch.cat([x, inter], dim=1))
        return nn.functional.binary_cross_entropy_with_logits(logits, labels)


def measure(compiled: bool, batch: int, steps: int, warmup: int) -> tuple[float, dict, float]:
    torch.manual_seed(0)
    model = DLRMDense().to("tpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    dense = torch.randn(batch, 13, generator=g).to("tpu")
    pooled = torch.randn(batch, 26, 64, generator=g).to("tpu").requires_grad_()
    labels = (torch.rand(batch, 1, generator=g) > 0.5).float().to("tpu")
    fn = torch.compile(model, backend="tpu") if compiled else model

    def step():
        optimizer.zero_grad()
        loss = fn(dense, pooled, labels)
        loss.backward()
        optimizer.step()
        return loss

    for _ in range(warmup):
        loss = step()
    tpurec.synchronize()
    tpurec.reset_stats()
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    last = loss.item()
    tpurec.synchronize()
    return (time.perf_counter() - start) / steps, tpurec.stats(), last


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    for compiled in (False, True):
        seconds, stats, loss = measure(compiled, args.batch, args.steps, args.warmup)
        print(
            f"{'compiled' if compiled else 'eager   '}: {seconds * 1e3:8.1f} ms/step  loss {loss:.6f}  "
            f"warm compilations {stats['compilations']}  executions/step {stats['executions'] / args.steps:.0f}"
        )


if __name__ == "__main__":
    main()
