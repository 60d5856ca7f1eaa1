"""Held-out metrics from ``torchrec.metrics``: AUC, normalized entropy, calibration, log loss.

TorchRec's own metric classes (``AUCMetric``, ``NEMetric`` with its log loss,
``CalibrationMetric``), as a TorchRec training job reports them, over one task of unit weights:

* normalized entropy (He et al., "Practical Lessons from Predicting Clicks on Ads at Facebook",
  2014): the mean log loss divided by the entropy of the base click rate; 1.0 is no better than
  always predicting the average rate;
* calibration: the sum of the predicted click probabilities over the number of clicks (1.0 is
  calibrated).

The metrics run on the host (each batch's predictions are copied there) and never synchronise
across processes themselves: the ``--dist dmp`` path gathers every rank's predictions first.
"""

from __future__ import annotations

import dataclasses

import torch
from torchrec.metrics.auc import AUCMetric
from torchrec.metrics.calibration import CalibrationMetric
from torchrec.metrics.metrics_config import RecComputeMode, RecTaskInfo
from torchrec.metrics.ne import NEMetric
from torchrec.metrics.rec_metric import RecMetric

TASK = "DefaultTask"
# Every held-out sample counts: the window spans the whole pass.
WINDOW = 2**62


@dataclasses.dataclass
class EvalResult:
    """Metrics of one pass over held-out data.

    Attributes:
        auc: area under the ROC curve.
        normalized_entropy: the log loss over the entropy of the pass's click rate.
        log_loss: the mean cross entropy in bits (TorchRec's ``logloss``, base-2 logarithms).
        calibration: predicted clicks over actual clicks.
        samples: how many samples the pass had.
    """

    auc: float
    normalized_entropy: float
    log_loss: float
    calibration: float
    samples: int

    def summary(self) -> dict[str, float]:
        """The figures a run's history keeps: ``auc``, ``ne``, ``calibration``."""
        return {"auc": self.auc, "ne": self.normalized_entropy, "calibration": self.calibration}

    def line(self) -> str:
        """``<auc>, NE <ne>, calibration <calibration>``: the figures as the script prints them."""
        return f"{self.auc:.6f}, NE {self.normalized_entropy:.4f}, calibration {self.calibration:.4f}"


def _metric(kind: type[RecMetric], batch_size: int, **kwargs) -> RecMetric:
    return kind(
        world_size=1,
        my_rank=0,
        batch_size=batch_size,
        tasks=[RecTaskInfo(name=TASK)],
        compute_mode=RecComputeMode.UNFUSED_TASKS_COMPUTATION,
        window_size=WINDOW,
        sync_on_compute=False,  # one process's view; --dist dmp gathers the ranks' predictions first
        **kwargs,
    )


class HeldOutMetrics:
    """Accumulates a pass's predictions (on the host) in TorchRec's metrics.

    Args:
        batch_size: the pass's batch size (TorchRec's metrics size their buffers by it).
    """

    def __init__(self, batch_size: int = 1) -> None:
        # batch_size only sizes TorchRec's bookkeeping; any batch size may be added.
        self.auc = _metric(AUCMetric, batch_size)
        self.ne = _metric(NEMetric, batch_size, include_logloss=True)
        self.calibration = _metric(CalibrationMetric, batch_size)
        self.samples = 0

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Adds a batch (``logits`` and ``labels`` of shape ``[B]``, any device)."""
        predictions = torch.sigmoid(logits.detach().float().cpu().reshape(-1))
        labels = labels.detach().float().cpu().reshape(-1)
        if labels.numel() == 0:
            return
        batch = {
            "predictions": {TASK: predictions},
            "labels": {TASK: labels},
            "weights": {TASK: torch.ones_like(labels)},
        }
        for metric in (self.auc, self.ne, self.calibration):
            metric.update(**batch)
        self.samples += labels.numel()

    def compute(self) -> EvalResult:
        """AUC, normalized entropy, log loss and calibration of everything added."""
        if self.samples == 0:
            raise ValueError("no held-out samples: check --limit_val_batches / --limit_test_batches and the data")
        values = {}
        for metric in (self.auc, self.ne, self.calibration):
            values.update({name.split("|", 1)[1]: float(v) for name, v in metric.compute().items()})
        return EvalResult(
            auc=values["window_auc"],
            normalized_entropy=values["lifetime_ne"],
            log_loss=values["lifetime_logloss"],
            calibration=values["lifetime_calibration"],
            samples=self.samples,
        )
