"""Where a run's numbers go besides stdout: TensorBoard and a JSON-lines file.

``--tensorboard_dir DIR`` writes TensorBoard event files through ``torch.utils.tensorboard``'s
``SummaryWriter`` (``tensorboard --logdir DIR`` shows them); ``--metrics_file PATH`` appends one
JSON object per line. Both get the same records:

* ``train``: each step's loss and learning rate (``train/loss``, ``train/lr``), written when the
  loss is read from the device (one call behind the steps issued);
* ``throughput``: samples per second after the warm-up steps (``train/samples_per_s``), at each
  loss read once measured;
* ``val`` / ``test``: AUC, normalized entropy, calibration, log loss and the number of samples of
  each held-out pass (``val/auc``, ...).

Steps count training steps over the whole run, so a resumed run continues the curves.
"""

from __future__ import annotations

import json
import os
from typing import Any

from dlrm.flags import ConfigError
from dlrm.metrics import EvalResult


class MetricsLog:
    """Writes a run's records to TensorBoard and/or a JSON-lines file (either may be None: not written).

    Args:
        tensorboard_dir: ``--tensorboard_dir``.
        metrics_file: ``--metrics_file`` (appended to, so a resumed run adds to it).
    """

    def __init__(self, tensorboard_dir: str | None, metrics_file: str | None) -> None:
        self.writer: Any = None
        self.file: Any = None
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ConfigError(
                    f"--tensorboard_dir needs the tensorboard package ({e}); pip install 'tensorboard>=2.21,<3'"
                ) from None
            self.writer = SummaryWriter(tensorboard_dir)
        if metrics_file:
            directory = os.path.dirname(os.path.abspath(metrics_file))
            try:
                os.makedirs(directory, exist_ok=True)
                self.file = open(metrics_file, "a", encoding="utf-8")
            except OSError as e:
                raise ConfigError(f"--metrics_file {metrics_file}: {e.strerror or e}") from None

    def _record(self, record: dict[str, Any]) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")

    def train(self, step: int, loss: float, lr: float) -> None:
        """The loss and learning rate of training step ``step`` (from 1)."""
        if self.writer is not None:
            self.writer.add_scalar("train/loss", loss, step)
            self.writer.add_scalar("train/lr", lr, step)
        self._record({"stage": "train", "step": step, "loss": loss, "lr": lr})

    def throughput(self, step: int, samples_per_second: float, timed_steps: int) -> None:
        """Samples per second over the ``timed_steps`` steps after the warm-up, as of step ``step``."""
        if self.writer is not None:
            self.writer.add_scalar("train/samples_per_s", samples_per_second, step)
        self._record(
            {"stage": "throughput", "step": step, "samples_per_s": samples_per_second, "timed_steps": timed_steps}
        )

    def held_out(self, stage: str, step: int, result: EvalResult) -> None:
        """The metrics of a validation (``stage="val"``) or test pass after training step ``step``."""
        values = {
            "auc": result.auc,
            "ne": result.normalized_entropy,
            "calibration": result.calibration,
            "log_loss": result.log_loss,
        }
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(f"{stage}/{name}", value, step)
        self._record({"stage": stage, "step": step, **values, "samples": result.samples})

    def flush(self) -> None:
        """Makes everything written so far readable (at validations, so a crash loses little)."""
        if self.writer is not None:
            self.writer.flush()
        if self.file is not None:
            self.file.flush()

    def close(self) -> None:
        """Flushes and closes the writers."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.file is not None:
            self.file.close()
            self.file = None
