"""``dlrm_main.py``'s learning-rate policy: linear warm-up, then a quadratic decay.

TorchRec's DLRM example (``torchrec_dlrm/lr_scheduler.py``, ``LRPolicyScheduler``, from the
MLPerf DLRM reference) scales every parameter group's base learning rate by a factor of the
scheduler's step count ``c`` (1 when the scheduler is built, one more after each training step,
so training step ``s`` (from 0) runs at ``c = s + 1``):

* warm-up, ``c < W``: ``c / W``;
* decay, ``D <= c < D + N``: ``((N - (c - D)) / N) ** 2``, never below ``1e-7 / base``;
* otherwise, with ``N = 0``: 1 (no schedule);
* otherwise, with ``N > 0``: the factor of the last warm-up or decay step before ``c`` (so
  between the warm-up and the decay it stays at ``(W - 1) / W``, and after the decay at its
  last value).

``W``, ``D`` and ``N`` are ``--lr_warmup_steps``, ``--lr_decay_start`` and
``--lr_decay_steps``. Where TorchRec's scheduler has no value (a step of the last kind with no
warm-up or decay step before it; it raises ``AttributeError`` there) or refuses the flags
(``D < W``), :func:`check` says so instead.
"""

from __future__ import annotations

import dataclasses

MIN_LR = 1e-7  # the decay's floor, as TorchRec's


@dataclasses.dataclass(frozen=True)
class LRPolicy:
    """The learning rate of each step.

    Attributes:
        base_lr: ``--learning_rate``.
        warmup_steps: ``--lr_warmup_steps`` (W).
        decay_start: ``--lr_decay_start`` (D).
        decay_steps: ``--lr_decay_steps`` (N).
    """

    base_lr: float
    warmup_steps: int = 0
    decay_start: int = 0
    decay_steps: int = 0

    @property
    def constant(self) -> bool:
        """True when every step runs at ``base_lr`` (no warm-up, no decay)."""
        return self.warmup_steps <= 1 and self.decay_steps == 0

    def _warmup(self, count: int) -> float:
        return self.base_lr * (1.0 - (self.warmup_steps - count) / self.warmup_steps)

    def _decay(self, count: int) -> float:
        scale = ((self.decay_steps - (count - self.decay_start)) / self.decay_steps) ** 2
        return max(MIN_LR, self.base_lr * scale)

    def _held(self, count: int) -> float | None:
        """The value TorchRec's scheduler keeps at ``count``: its last warm-up or decay value."""
        last_decay = min(count, self.decay_start + self.decay_steps) - 1
        if last_decay >= max(self.decay_start, 1):
            return self._decay(last_decay)
        last_warmup = min(count, self.warmup_steps) - 1
        if last_warmup >= 1:
            return self._warmup(last_warmup)
        return None

    def at_count(self, count: int) -> float | None:
        """The learning rate at scheduler step count ``count`` (from 1), or None where TorchRec's has none."""
        if count < self.warmup_steps:
            return self._warmup(count)
        if self.decay_start <= count < self.decay_start + self.decay_steps:
            return self._decay(count)
        if self.decay_steps == 0:
            return self.base_lr
        return self._held(count)

    def at_step(self, step: int) -> float:
        """The learning rate of training step ``step`` (from 0, counted over the whole run)."""
        lr = self.at_count(step + 1)
        if lr is None:  # excluded by check()
            raise ValueError(f"no learning rate for step {step} under {self}")
        return lr


def check(policy: LRPolicy) -> str | None:
    """What is wrong with the flags, in one line, or None when TorchRec's scheduler accepts them."""
    w, d, n = policy.warmup_steps, policy.decay_start, policy.decay_steps
    for name, value in (("lr_warmup_steps", w), ("lr_decay_start", d), ("lr_decay_steps", n)):
        if value < 0:
            return f"--{name} must be 0 or more, got {value}"
    if d < w:
        # TorchRec's LRPolicyScheduler exits with this message.
        return (
            f"Learning rate warmup must finish before the decay starts (--lr_decay_start {d} < --lr_warmup_steps {w})"
        )
    if n > 0 and policy.at_count(1) is None:
        return (
            f"--lr_decay_steps {n} with --lr_decay_start {d} and --lr_warmup_steps {w} leaves the steps before the "
            "decay without a learning rate in TorchRec's LRPolicyScheduler (it fails there); warm up over at least "
            "2 steps (--lr_warmup_steps) or start the decay at step 0 or 1 (--lr_decay_start)"
        )
    return None
