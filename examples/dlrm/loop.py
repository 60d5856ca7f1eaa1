"""The training loop: steps, progress bar, validation, checkpoints, profile, plot.

One training step goes through :func:`make_pipeline`'s ``progress(iterator)``:
``tpurec.sparse.TrainPipeline`` (TorchRec's ``TrainPipeline.progress`` shape),
which prepares the next batch on the host while the device runs this one. The loss stays on the device;
it is read every ``--loss_every`` steps, all but the newest step's, so the host
never waits for the step it has just dispatched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import nn
from torchrec.datasets.utils import Batch
from tqdm import tqdm

import tpurec
import tpurec.sparse as sparse
from dlrm import checkpoint
from dlrm.data import Loader
from dlrm.flags import Config, ConfigError
from dlrm.metrics import EvalResult, HeldOutMetrics

WARMUP_STEPS = 10


def end_step() -> None:
    """Marks a step boundary: in fused mode the step's recorded ops run now, as
    one program, without waiting for it (XLA dispatch is asynchronous)."""
    if tpurec.get_mode() == "fused":
        tpurec.flush("step")  # the window flush behind torch.tpu.synchronize, minus the wait


class PipelinedStep:
    """One training step per ``progress`` call through ``tpurec.sparse.TrainPipeline``.

    The pipeline reads, preprocesses and transfers batch ``i + 1`` on a worker
    thread while step ``i`` runs; :class:`TrainStep` wraps the model to give it
    the ``model(batch) -> (loss, output)`` shape (TorchRec's ``DLRMTrain``) the
    pipeline expects.

    Args:
        model: the model (its tables update themselves in the backward).
        optimizer: the dense optimizer.
        device: where the model lives.
        forward: the callable to run the model with (the model, or its
            ``torch.compile`` form).
        graphed: capture the step and replay it (``TrainPipeline(graphed=True)``).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: str,
        forward: Callable | None = None,
        graphed: bool = False,
    ) -> None:
        self.model, self.optimizer, self.device = model, optimizer, device
        self.forward = model if forward is None else forward
        self.train_module = TrainStep(model, self.forward)
        self.graphed = graphed
        self.pipeline = sparse.TrainPipeline(self.train_module, optimizer, device, graphed=graphed)

    def progress(self, batches: Iterator[Batch]) -> torch.Tensor:
        """Trains on the next batch of ``batches``.

        Returns:
            The batch's mean loss, on the device (not read).

        Raises:
            StopIteration: ``batches`` is exhausted.
        """
        loss, _logits, _labels = self.pipeline.progress(batches)
        if self.graphed:
            loss = loss.clone()  # a replay refills the captured loss; the caller keeps each step's
        end_step()
        return loss

    def close(self) -> None:
        """Stops the pipeline's worker (at the end of an epoch)."""
        self.pipeline.close()


class ReplayableBatches:
    """An epoch's batch iterator that remembers numpy's global generator state
    before each read: TorchRec's Criteo readers shuffle with it, and the
    pipeline reads ahead, so a checkpoint after step ``s`` must store the state
    from before batch ``s`` was read, not the current one."""

    def __init__(self, batches: Iterator[Batch], first: int = 0) -> None:
        self.batches, self.read = batches, first
        self.states: dict[int, Any] = {}

    def __iter__(self) -> "ReplayableBatches":
        return self

    def __next__(self) -> Batch:
        state = np.random.get_state()
        batch = next(self.batches)
        self.states[self.read] = state
        self.states.pop(self.read - 16, None)
        self.read += 1
        return batch

    def state_before(self, index: int) -> Any:
        """numpy's generator state from just before batch ``index`` was read."""
        return self.states[index] if index < self.read else np.random.get_state()


def make_pipeline(model: nn.Module, optimizer: torch.optim.Optimizer, cfg: Config, device: str) -> PipelinedStep:
    """The training step: the one place where the step's machinery is chosen."""
    forward = torch.compile(model, backend="tpu") if cfg.mode == "compile" else model
    return PipelinedStep(model, optimizer, device, forward, graphed=cfg.mode == "graphed")


def place_model(model: nn.Module, cfg: Config) -> nn.Module:
    """Places ``model`` on ``--num_devices`` devices: one device as it is, several
    through ``tpurec.shard`` (tables sharded by tpurec's TPU planner, the dense
    part data-parallel; ``--batch_size`` is per device, as in ``dlrm_main.py``)."""
    available = torch.tpu.device_count()
    if cfg.num_devices > available:
        raise ConfigError(
            f"--num_devices {cfg.num_devices} but only {available} tpu device(s) are visible"
            + (
                " (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N makes N)"
                if tpurec.platform() == "cpu"
                else ""
            )
        )
    if cfg.num_devices == 1:
        return model
    import jax
    from jax.sharding import Mesh

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))[: cfg.num_devices]
    mesh = Mesh(np.array(devices), ("devices",))
    try:
        return tpurec.shard(model, mesh=mesh, planner_batch_size=cfg.batch_size * cfg.num_devices)
    except ValueError as e:
        raise ConfigError(f"--num_devices {cfg.num_devices}: {str(e).splitlines()[0]}") from None


class TrainStep(nn.Module):
    """``model(batch) -> (loss, (loss, logits, labels))``, TorchRec's ``DLRMTrain``
    convention; on a mesh the labels are split like the model's inputs."""

    def __init__(self, model: nn.Module, forward: Callable) -> None:
        super().__init__()
        self.model = model
        self.forward_fn = forward

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        logits = self.forward_fn(batch.dense_features, batch.sparse_features).squeeze(-1)
        labels = batch.labels
        mesh = getattr(self.model, "mesh", None)
        if mesh is not None:
            from tpurec.sparse.sharding import distribute_batch

            labels = distribute_batch(labels, mesh)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.float())
        return loss, (loss.detach(), logits.detach(), labels.detach())


def evaluate(model: nn.Module, forward: Callable, loader: Loader, device: str, stage: str) -> EvalResult:
    """AUC and normalized entropy of ``model`` over ``loader``'s batches."""
    model.eval()
    metrics = HeldOutMetrics()
    try:
        with torch.no_grad():
            with tqdm(total=len(loader), desc=f"Evaluating {stage} set", leave=False, file=sys.stderr) as bar:
                for batch in loader.epoch_batches(0):
                    logits = forward(batch.dense_features.to(device), batch.sparse_features).squeeze(-1)
                    metrics.update(logits, batch.labels)
                    bar.update(1)
    finally:
        model.train()
    if metrics.samples == 0:
        raise ConfigError(f"the {stage} set is empty: check the data and --limit_{stage}_batches")
    return metrics.compute()


@dataclasses.dataclass
class History:
    """What a run measured: per-step training loss and held-out metrics."""

    losses: list[float] = dataclasses.field(default_factory=list)
    val: list[dict[str, float]] = dataclasses.field(default_factory=list)
    test: dict[str, float] | None = None


@dataclasses.dataclass
class RunResult:
    """The outcome of :func:`train`."""

    history: History
    samples_per_second: float
    compilations_after_warmup: int | None
    final: EvalResult


class StepTrace:
    """``--profile_dir``: ``tpurec.profile`` (a torch profiler trace plus XLA's
    device trace) of three steps, started two steps into the run (after the
    first compilations)."""

    FIRST, STEPS = 2, 3

    def __init__(self, directory: str | None, run_start: int) -> None:
        self.directory, self.first = directory, run_start + self.FIRST
        self.stack: contextlib.ExitStack | None = None

    def before_step(self, global_step: int) -> None:
        if self.directory and global_step == self.first:
            self.stack = contextlib.ExitStack()
            try:
                self.stack.enter_context(tpurec.profile(self.directory))
            except ValueError as e:
                self.stack = None
                raise ConfigError(f"--profile_dir: {e}") from None

    def after_step(self, global_step: int, force: bool = False) -> None:
        if self.stack is not None and (force or global_step >= self.first + self.STEPS):
            self.stack.close()  # waits for the steps' device work, then writes the traces
            self.stack = None


def plot(path: str, history: History) -> None:
    """Writes a PNG of the training loss and the validation AUC."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_auc) = plt.subplots(1, 2, figsize=(10, 4))
    steps = np.arange(1, len(history.losses) + 1)
    ax_loss.plot(steps, history.losses, lw=0.8, label="training loss")
    if len(history.losses) >= 10:
        k = max(len(history.losses) // 20, 2)
        smooth = np.convolve(history.losses, np.ones(k) / k, mode="valid")
        ax_loss.plot(steps[k - 1 :], smooth, lw=2, label=f"mean of {k}")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("binary cross entropy")
    ax_loss.legend()
    if history.val:
        ax_auc.plot([v["step"] for v in history.val], [v["auc"] for v in history.val], "o-", label="validation AUC")
    if history.test:
        ax_auc.axhline(history.test["auc"], color="C2", ls="--", label="test AUC")
    ax_auc.set_xlabel("step")
    ax_auc.set_ylabel("AUC")
    ax_auc.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def train(
    cfg: Config,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loaders: dict[str, Loader],
    device: str = "tpu",
    log: Callable[[str], None] = print,
) -> RunResult:
    """Trains ``--epochs`` epochs with validation, checkpoints and a test pass.

    Args:
        cfg: the run's config.
        model: the model (on ``device``).
        optimizer: the dense optimizer.
        loaders: "train", "val" and "test" loaders.
        device: the model's device.
        log: where result lines go (stdout).

    Returns:
        The history, throughput and final test metrics.
    """
    history = History()
    start_epoch, start_step, global_step = 0, 0, 0
    numpy_state = None
    if cfg.resume:
        restored = checkpoint.load(cfg.checkpoint_dir, model, optimizer)
        progress, numpy_state = restored["progress"], restored["numpy_random_state"]
        start_epoch, start_step, global_step = progress["epoch"], progress["step_in_epoch"], progress["global_step"]
        history = History(**progress["history"])
        log(f"resumed from {cfg.checkpoint_dir} at epoch {start_epoch}, step {start_step} ({global_step} steps done)")
    pipeline = make_pipeline(model, optimizer, cfg, device)
    run_start = global_step
    pending: list[torch.Tensor] = []
    trace = StepTrace(cfg.profile_dir, run_start)
    # Throughput and compilations count training steps only: validation and
    # checkpoint time and programs are left out.
    timer: dict[str, Any] = {"start": None, "samples": 0, "eval_compilations": 0, "eval_seconds": 0.0}

    def read_losses(keep_newest: bool) -> None:
        # All but (optionally) the newest loss: those steps have finished or are about to.
        ready = pending[:-1] if keep_newest else pending[:]
        del pending[: len(ready)]
        history.losses.extend(float(t) for t in ready)

    def save(epoch: int, step_in_epoch: int, batches: ReplayableBatches | None) -> None:
        if cfg.checkpoint_dir:
            read_losses(keep_newest=False)
            numpy_state = batches.state_before(step_in_epoch) if batches is not None else np.random.get_state()
            checkpoint.save(
                cfg.checkpoint_dir,
                model,
                optimizer,
                {
                    "epoch": epoch,
                    "step_in_epoch": step_in_epoch,
                    "global_step": global_step,
                    "history": dataclasses.asdict(history),
                },
                numpy_state=numpy_state,
            )

    def validate(epoch: int, step_in_epoch: int, batches: ReplayableBatches | None) -> None:
        before, began = tpurec.stats()["compilations"], time.perf_counter()
        result = evaluate(model, pipeline.forward, loaders["val"], device, "val")
        history.val.append({"step": global_step, "auc": result.auc, "ne": result.normalized_entropy})
        lr = f", lr {cfg.learning_rate}" if cfg.print_lr else ""
        tqdm.write(
            f"AUROC over val set: {result.auc:.6f}, NE {result.normalized_entropy:.4f} "
            f"(epoch {epoch}, step {global_step}{lr}).",
            file=sys.stdout,
        )
        save(epoch, step_in_epoch, batches)
        timer["eval_compilations"] += tpurec.stats()["compilations"] - before
        timer["eval_seconds"] += time.perf_counter() - began

    with tpurec.mode("fused" if cfg.mode in ("compile", "graphed") else cfg.mode):
        for epoch in range(start_epoch, cfg.epochs):
            total = len(loaders["train"])
            skip = start_step if epoch == start_epoch else 0
            if skip >= total:
                continue  # this epoch was finished before the checkpoint
            source = loaders["train"].epoch_batches(epoch)
            for _ in range(skip):  # replay the data order up to the checkpoint
                next(source)
            if numpy_state is not None:  # then the shuffling from there on
                np.random.set_state(numpy_state)
                numpy_state = None
            batches = ReplayableBatches(source, first=skip)
            bar = tqdm(total=total, initial=skip, desc=f"Epoch {epoch}", file=sys.stderr, dynamic_ncols=True)
            window_start, window_samples = time.perf_counter(), 0
            step_in_epoch = skip
            try:
                while True:
                    if global_step - run_start == WARMUP_STEPS:
                        tpurec.synchronize()
                        tpurec.reset_stats()
                        timer.update(start=time.perf_counter(), samples=0, eval_compilations=0, eval_seconds=0.0)
                    trace.before_step(global_step)
                    try:
                        loss = pipeline.progress(batches)
                    except StopIteration:
                        break
                    pending.append(loss)
                    global_step += 1
                    step_in_epoch += 1
                    window_samples += cfg.batch_size * cfg.num_devices
                    if timer["start"] is not None:
                        timer["samples"] += cfg.batch_size * cfg.num_devices
                    bar.update(1)
                    trace.after_step(global_step)
                    if len(pending) >= cfg.loss_every:
                        read_losses(keep_newest=True)
                        now = time.perf_counter()
                        window = history.losses[-cfg.loss_every :]
                        bar.set_postfix(
                            loss=f"{sum(window) / len(window):.4f}",
                            samples_per_s=f"{window_samples / max(now - window_start, 1e-9):,.0f}",
                        )
                        window_start, window_samples = now, 0
                    if (
                        cfg.validation_freq_within_epoch
                        and step_in_epoch % cfg.validation_freq_within_epoch == 0
                        and step_in_epoch < total
                    ):
                        validate(epoch, step_in_epoch, batches)
            except BaseException:
                pipeline.close()
                bar.leave = False  # clear the bar, so an error is the last line the user sees
                bar.close()
                raise
            bar.close()
            pipeline.close()
            trace.after_step(global_step, force=True)
            read_losses(keep_newest=False)
            validate(epoch, step_in_epoch, None)
            start_step = 0
        read_losses(keep_newest=False)
        tpurec.synchronize()
        elapsed = (
            time.perf_counter() - timer["start"] - timer["eval_seconds"] if timer["start"] is not None else float("nan")
        )
        compilations = (
            tpurec.stats()["compilations"] - timer["eval_compilations"] if timer["start"] is not None else None
        )
        final = evaluate(model, pipeline.forward, loaders["test"], device, "test")
    history.test = {"step": global_step, "auc": final.auc, "ne": final.normalized_entropy}
    log(f"AUROC over test set: {final.auc:.6f}, NE {final.normalized_entropy:.4f}, {final.samples} samples.")
    if cfg.plot:
        plot(cfg.plot, history)
        log(f"wrote {cfg.plot}")
    rate = timer["samples"] / elapsed if timer["start"] is not None and elapsed > 0 else float("nan")
    return RunResult(history=history, samples_per_second=rate, compilations_after_warmup=compilations, final=final)
