"""Train the same small MLP on "tpu" and on "cpu", side by side.

The only tpurec-specific lines are ``import tpurec`` and the device string.
Run with ``make quickstart`` (or ``.venv/bin/python examples/quickstart.py``).
"""

import argparse
import time

import torch

import tpurec


def make_data(n: int = 512, features: int = 16, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, 1, generator=g)
    y = (x @ w + 2.0 * torch.randn(n, 1, generator=g) > 0).float()  # noisy labels: the loss stays well above 0
    return x, y


def train(device: str, steps: int, lr: float) -> tuple[list[float], float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
    ).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    x, y = (t.to(device) for t in make_data())
    losses = []
    start = time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args()

    cpu, cpu_s = train("cpu", args.steps, args.lr)
    tpurec.reset_stats()
    tpu, tpu_s = train("tpu", args.steps, args.lr)
    print(f"tpu device backed by XLA:{tpurec.platform().upper()}")
    print(f"{'step':>5} {'loss (tpu)':>12} {'loss (cpu)':>12}")
    for step in list(range(0, args.steps, max(1, args.steps // 10))) + [args.steps - 1]:
        print(f"{step:>5} {tpu[step]:>12.6f} {cpu[step]:>12.6f}")
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(tpu, cpu))
    stats = tpurec.stats()
    print(
        f"max relative difference {worst:.2e}; tpu {tpu_s:.2f}s, cpu {cpu_s:.2f}s; "
        f"{stats['compilations']} compilations, {stats['executions']} executions"
    )


if __name__ == "__main__":
    main()
