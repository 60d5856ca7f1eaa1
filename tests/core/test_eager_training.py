"""Training on tpu matches CPU step by step, and a warm loop never recompiles."""

import pytest
import torch

import tpurec

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-4),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.05),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05),
}


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 16, generator=g)
    y = (x[:, :1] + 0.5 * x[:, 1:2] > 0).float()
    return x, y


def train(device, make_optimizer, steps, schedule=False, on_step=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
    ).to(device)
    optimizer = make_optimizer(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.9) if schedule else None
    x, y = (t.to(device) for t in data())
    losses = []
    for step in range(steps):
        if on_step:
            on_step(step)
        optimizer.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x), y)
        loss.backward()
        optimizer.step()
        if scheduler:
            scheduler.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_mlp_training_matches_cpu(name):
    cpu = train("cpu", OPTIMIZERS[name], 50)
    tpu = train("tpu", OPTIMIZERS[name], 50)
    assert cpu[-1] < cpu[0]
    for step, (a, b) in enumerate(zip(tpu, cpu)):
        assert abs(a - b) <= 1e-4 * abs(b), (step, a, b)


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_warm_loop_makes_no_compilations(name):
    marks = {}

    def on_step(step):
        if step == 5:
            tpurec.reset_stats()
            marks["reset"] = True

    train("tpu", OPTIMIZERS[name], 25, schedule=True, on_step=on_step)
    stats = tpurec.stats()
    assert marks and stats["executions"] > 0
    assert stats["compilations"] == 0, stats
