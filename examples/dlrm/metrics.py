"""Held-out metrics: AUC (torchmetrics) and normalized entropy.

Normalized entropy (He et al., "Practical Lessons from Predicting Clicks on
Ads at Facebook", 2014) is the mean log loss divided by the entropy of the
base click rate: 1.0 is no better than always predicting the average rate.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torchmetrics.classification import BinaryAUROC


@dataclasses.dataclass
class EvalResult:
    """Metrics of one pass over held-out data."""

    auc: float
    normalized_entropy: float
    log_loss: float
    samples: int


class HeldOutMetrics:
    """Accumulates logits and labels (on the host) and computes AUC and NE."""

    def __init__(self) -> None:
        self.auroc = BinaryAUROC()
        self.loss_sum = 0.0
        self.label_sum = 0.0
        self.samples = 0

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Adds a batch (``logits`` and ``labels`` of shape ``[B]``, any device)."""
        logits = logits.detach().float().cpu().reshape(-1)
        labels = labels.detach().float().cpu().reshape(-1)
        self.auroc.update(torch.sigmoid(logits), labels.long())
        self.loss_sum += float(torch.nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="sum"))
        self.label_sum += float(labels.sum())
        self.samples += labels.numel()

    def compute(self) -> EvalResult:
        """AUC, normalized entropy and log loss of everything added."""
        if self.samples == 0:
            raise ValueError("no held-out samples: check --limit_val_batches / --limit_test_batches and the data")
        log_loss = self.loss_sum / self.samples
        p = min(max(self.label_sum / self.samples, 1e-12), 1 - 1e-12)
        base_entropy = -(p * math.log(p) + (1 - p) * math.log(1 - p))
        return EvalResult(
            auc=float(self.auroc.compute()),
            normalized_entropy=log_loss / base_entropy,
            log_loss=log_loss,
            samples=self.samples,
        )
