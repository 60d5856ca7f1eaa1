"""A DLRM-sized dense training step in eager, fused and compiled mode next to PyTorch on CPU.

Bottom MLP 13-512-256-64, dot interaction with 26 (fixed) embedding vectors,
top MLP 512-256-1, BCE loss, Adagrad; batch 512 and 4096. Times are the
median of the timed steps after warm-up; each step ends with ``loss.item()``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import tpurec

NUM_SPARSE = 26
EMBEDDING_DIM = 64


class DenseStep(torch.nn.Module):
    """DLRM's dense side: bottom MLP, pairwise dot interaction, top MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.bottom = torch.nn.Sequential(
            torch.nn.Linear(13, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256), torch.nn.ReLU(),
            torch.nn.Linear(256, EMBEDDING_DIM), torch.nn.ReLU(),
        )
        pairs = (NUM_SPARSE + 1) * NUM_SPARSE // 2
        self.top = torch.nn.Sequential(
            torch.nn.Linear(EMBEDDING_DIM + pairs, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256), torch.nn.ReLU(),
            torch.nn.Linear(256, 1),
        )
        rows, cols = torch.triu_indices(NUM_SPARSE + 1, NUM_SPARSE + 1, offset=1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        d = self.bottom(dense)
        features = torch.cat([d.unsqueeze(1), sparse], dim=1)
        dots = torch.bmm(features, features.transpose(1, 2))
        interactions = dots[:, self.rows, self.cols]
        return self.top(torch.cat([d, interactions], dim=1))


def _time_steps(device: str, batch: int, steps: int, warmup: int, mode: str | None, compiled: bool) -> dict:
    torch.manual_seed(0)
    model = DenseStep().to(device)
    forward = torch.compile(model, backend="tpu") if compiled else model
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    dense = torch.randn(batch, 13, generator=g).to(device)
    sparse = torch.randn(batch, NUM_SPARSE, EMBEDDING_DIM, generator=g).to(device)
    labels = torch.rand(batch, 1, generator=g).round().to(device)
    times, losses = [], []
    context = tpurec.mode(mode) if mode else _null()
    with context:
        for step in range(warmup + steps):
            if step == warmup:
                tpurec.reset_stats()
            start = time.perf_counter()
            optimizer.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(forward(dense, sparse), labels)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            times.append(time.perf_counter() - start)
    stats = tpurec.stats()
    timed = times[warmup:]
    return {
        "step_ms": statistics.median(timed) * 1e3,
        "samples_per_s": batch / statistics.median(timed),
        "last_loss": losses[-1],
        "compilations_after_warmup": stats["compilations"] if device == "tpu" else None,
    }


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m tpurec.bench modes", description=__doc__)
    parser.add_argument("--batch", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args(argv)
    result = {"benchmark": "modes", "platform": tpurec.platform(), "torch_threads": torch.get_num_threads(), "runs": []}
    for batch in args.batch:
        run = {"batch": batch}
        run["cpu_pytorch"] = _time_steps("cpu", batch, args.steps, args.warmup, None, False)
        for mode in ("eager", "fused"):
            run[mode] = _time_steps("tpu", batch, args.steps, args.warmup, mode, False)
        try:
            run["compiled"] = _time_steps("tpu", batch, args.steps, args.warmup, "eager", True)
        except Exception as error:  # reported, not hidden: the JSON says why compiled mode is missing
            run["compiled"] = {"error": f"{type(error).__name__}: {error}"[:500]}
        cpu_ms = run["cpu_pytorch"]["step_ms"]
        run["ratios"] = {
            f"{m}_speedup_vs_cpu": cpu_ms / run[m]["step_ms"] for m in ("eager", "fused", "compiled") if "step_ms" in run[m]
        }
        run["ratios"]["fused_speedup_vs_eager"] = run["eager"]["step_ms"] / run["fused"]["step_ms"]
        result["runs"].append(run)
    return result
