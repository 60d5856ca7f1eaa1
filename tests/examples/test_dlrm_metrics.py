"""examples/dlrm: held-out metrics (torchrec.metrics), TensorBoard and JSON-lines logs, throughput lines."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from test_dlrm_train import SMALL, run_script
from torchmetrics.classification import BinaryAUROC

from dlrm import checkpoint
from dlrm.metrics import HeldOutMetrics


def test_held_out_metrics_match_their_definitions():
    generator = torch.Generator().manual_seed(0)
    metrics = HeldOutMetrics()
    logits, labels = [], []
    for size in (64, 64, 37):  # a short last batch too
        x = torch.randn(size, generator=generator) * 2
        y = (torch.rand(size, generator=generator) < torch.sigmoid(x - 0.5)).float()
        metrics.update(x, y)
        logits.append(x)
        labels.append(y)
    result = metrics.compute()
    y = torch.cat(labels).double()
    p = torch.sigmoid(torch.cat(logits)).double()  # float32 probabilities, summed in float64 (as TorchRec)
    bits = -(y * torch.log2(p) + (1 - y) * torch.log2(1 - p)).mean().item()
    rate = y.mean().item()
    base = -(rate * math.log2(rate) + (1 - rate) * math.log2(1 - rate))
    assert result.samples == 165
    assert result.log_loss == pytest.approx(bits, rel=1e-9)
    assert result.normalized_entropy == pytest.approx(bits / base, rel=1e-9)
    # TorchRec accumulates the float32 predictions in its own order and dtype (relative 1e-6).
    assert result.calibration == pytest.approx(p.sum().item() / y.sum().item(), rel=1e-6)
    assert result.auc == pytest.approx(BinaryAUROC()(p.float(), y.long()).item(), abs=1e-6)


def _bar_rate(stderr: str) -> str:
    """The last samples_per_s the progress bar showed."""
    return re.findall(r"samples_per_s=([\w,]+)", stderr)[-1]


@pytest.mark.slow
def test_tensorboard_metrics_file_and_throughput_lines_through_resumes(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    common = [
        *SMALL, "--adagrad", "--learning_rate", "0.05", "--lr_warmup_steps", "5", "--lr_decay_start", "5",
        "--checkpoint_dir", str(tmp_path / "ck"), "--tensorboard_dir", str(tmp_path / "tb"),
        "--metrics_file", str(tmp_path / "metrics.jsonl"), "--validation_freq_within_epoch", "8",
    ]  # fmt: skip
    # 10 steps: all warm-up, so no throughput figure; a resume to 23: 13 steps, 3 of them timed;
    # a resume of the finished run: nothing left to time.
    lines = []
    for limit, resume in ((10, []), (23, ["--resume"]), (23, ["--resume"])):
        out = run_script(*common, "--limit_train_batches", str(limit), *resume)
        assert out.returncode == 0, out.stderr[-3000:]
        lines.append(out.stdout.strip().splitlines()[-1])
        if len(lines) == 2:
            summary = re.search(r"([\d,]+) samples/s over the 3 steps after 10 warm-up steps", lines[1])
            assert summary, lines[1]
            assert _bar_rate(out.stderr) == summary.group(1)  # the bar's last figure is the summary's
    assert "throughput not measured: this run trained 10 step(s), all within the 10 warm-up steps" in lines[0]
    assert "throughput not measured: no training step was left to run" in lines[2]

    saved = torch.load(tmp_path / "ck" / checkpoint.FILE_NAME, weights_only=True)
    losses = saved["extra"]["progress"]["history"]["losses"]
    assert len(losses) == 23
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["stage"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 24))  # each step once, across the resumes
    assert [r["loss"] for r in train] == pytest.approx(losses, abs=0)
    assert [r["lr"] for r in train[:6]] == pytest.approx([0.01, 0.02, 0.03, 0.04, 0.05, 0.05])  # the warm-up
    assert [r["step"] for r in records if r["stage"] == "val"] == [8, 10, 16, 23]
    throughput = [r for r in records if r["stage"] == "throughput"]
    assert throughput and all(r["step"] > 10 and r["timed_steps"] <= 3 for r in throughput)

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/samples_per_s", "val/auc", "val/ne", "val/calibration"} <= scalars
    assert {"test/auc", "test/ne", "test/calibration", "test/log_loss"} <= scalars
    by_step = {e.step: e.value for e in events.Scalars("train/loss")}
    assert sorted(by_step) == list(range(1, 24))
    assert [by_step[s] for s in range(1, 24)] == pytest.approx(losses, rel=1e-6)  # stored as float32
