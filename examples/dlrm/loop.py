"""The training loop: steps, progress bar, validation, checkpoints, profile, plot.

Training steps go through :func:`make_pipeline`'s ``progress(iterator)``:
``tpurec.sparse.TrainPipeline`` (TorchRec's ``TrainPipeline.progress`` shape), which prepares
the next batch on the host while the device runs this one; with ``--mode graphed
--steps_per_call K`` one call runs up to K captured steps in one program. The losses stay on
the device: the pipeline reads a call's losses once the next call is issued, so the host never
waits for the steps it has just dispatched, and a loss that is not finite stops the run naming
its step (:class:`NonFiniteLoss`). Validation, checkpoints, the end of the warm-up and the
profile keep step granularity: a call never runs past one of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from typing import Any, Callable, Iterator, NoReturn

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
from dlrm.metrics_log import MetricsLog

WARMUP_STEPS = 10
CAPTURED_STEP = 3  # --mode graphed: TrainPipeline runs two plain steps, then captures the third


class NonFiniteLoss(Exception):
    """A training step's loss is nan or inf: the run stops (``train.py`` exits with status 1).

    Attributes:
        step: the step, counted from 1 over the whole run (as the history and the metrics log count).
        value: the loss read.
    """

    def __init__(self, step: int, value: float) -> None:
        super().__init__(
            f"the training loss of step {step} is {value}: the model diverged (lower --learning_rate, or check "
            "the data); the steps issued after it ran and are not in the history or a checkpoint"
        )
        self.step, self.value = step, value


class PipelinedStep:
    """Training steps through ``tpurec.sparse.TrainPipeline``, their losses read one call behind.

    The pipeline reads, preprocesses and transfers the next batches on a worker thread while
    the device runs the current step; :class:`TrainStep` wraps the model to give it the
    ``model(batch) -> (loss, output)`` shape (TorchRec's ``DLRMTrain``) the pipeline expects.

    Args:
        model: the model (its tables update themselves in the backward).
        optimizer: the dense optimizer.
        device: where the model lives.
        forward: the callable to run the model with (the model, or its
            ``torch.compile`` form).
        graphed: capture the step and replay it (``TrainPipeline(graphed=True)``).
        steps_per_call: with ``graphed``, the captured steps one call may run in one program.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        device: str,
        forward: Callable | None = None,
        graphed: bool = False,
        steps_per_call: int = 1,
    ) -> None:
        self.model, self.optimizer, self.device = model, optimizer, device
        self.forward = model if forward is None else forward
        self.train_module = TrainStep(model, self.forward)
        self.graphed = graphed
        self.steps_per_call = steps_per_call
        self.launches = 0  # calls that ran several steps in one program
        self.launched_steps = 0  # the steps those calls ran
        self.pipeline = sparse.TrainPipeline(
            self.train_module, optimizer, device, graphed=graphed, steps_per_call=steps_per_call
        )

    def progress(self, batches: Iterator[Batch], max_steps: int = 1) -> int:
        """Trains on the next batches of ``batches``: one step, or with ``steps_per_call`` up to
        ``max_steps`` (at most ``steps_per_call``) in one program.

        Returns:
            The number of steps run (their losses come from :meth:`losses`).

        Raises:
            StopIteration: ``batches`` is exhausted.
            FloatingPointError: the loss of a step read here is not finite.
        """
        before = self.pipeline.steps
        if self.steps_per_call > 1:
            self.pipeline.progress(batches, max_steps=max(1, min(max_steps, self.steps_per_call)))
        else:
            self.pipeline.progress(batches)
        ran = self.pipeline.steps - before
        if ran > 1:
            self.launches += 1
            self.launched_steps += ran
        return ran

    def losses(self, wait: bool = False) -> list[tuple[int, float]]:
        """The (pipeline step, loss) pairs read since the last call (``wait``: of every step issued)."""
        return self.pipeline.losses(wait=wait)

    def wait_for_compiles(self) -> None:
        """Waits for the program of several steps that the pipeline compiles in the background."""
        self.pipeline.wait_for_compiles()

    def close(self) -> None:
        """Stops the pipeline's worker (at the end of an epoch)."""
        self.pipeline.close()


class ReplayableBatches:
    """An epoch's batch iterator that remembers numpy's global generator state
    before each read: TorchRec's Criteo readers shuffle with it, and the
    pipeline reads ahead, so a checkpoint after step ``s`` must store the state
    from before batch ``s`` was read, not the current one."""

    def __init__(self, batches: Iterator[Batch], first: int = 0, keep: int = 16) -> None:
        self.batches, self.read, self.keep = batches, first, keep
        self.states: dict[int, Any] = {}

    def __iter__(self) -> "ReplayableBatches":
        return self

    def __next__(self) -> Batch:
        state = np.random.get_state()
        batch = next(self.batches)
        self.states[self.read] = state
        self.states.pop(self.read - self.keep, None)  # more than the pipeline reads ahead
        self.read += 1
        return batch

    def state_before(self, index: int) -> Any:
        """numpy's generator state from just before batch ``index`` was read."""
        return self.states[index] if index < self.read else np.random.get_state()


def embedding_optimizers(model: nn.Module) -> list[sparse.EmbeddingOptimizer]:
    """The fused embedding optimizer configs of ``model``'s collections (each once)."""
    found: dict[int, sparse.EmbeddingOptimizer] = {}
    for module in model.modules():
        config = getattr(module, "optimizer", None)
        if isinstance(config, sparse.EmbeddingOptimizer):
            found[id(config)] = config
    return list(found.values())


def set_learning_rate(
    tables: list[sparse.EmbeddingOptimizer], optimizer: torch.optim.Optimizer, lr: float
) -> list[float]:
    """Sets the learning rate of the tables' fused optimizers and of every dense parameter group.

    As in ``dlrm_main.py``, one rate for both: its scheduler sets every group of its combined
    optimizer, and TorchRec's fused table optimizers take the new rate at the ``zero_grad()``
    that starts the next step, before that step's backward updates the tables. Both are runtime
    inputs of the step's programs (a new value never recompiles).

    Returns:
        The learning rate of each parameter group: the tables' first, then the dense optimizer's
        (``--print_lr``'s groups).
    """
    for config in tables:
        config.learning_rate = lr
    for group in optimizer.param_groups:
        group["lr"] = lr
    return [c.learning_rate for c in tables[:1]] + [g["lr"] for g in optimizer.param_groups]


def print_lr(step_in_epoch: int, lrs: list[float]) -> None:
    """``--print_lr``: one line per parameter group, as ``dlrm_main.py`` prints them before each step."""
    for i, lr in enumerate(lrs):
        tqdm.write(f"lr: {step_in_epoch} {i} {lr:.6f}", file=sys.stdout)


def make_pipeline(model: nn.Module, optimizer: torch.optim.Optimizer, cfg: Config, device: str) -> PipelinedStep:
    """The training step: the one place where the step's machinery is chosen."""
    forward = torch.compile(model, backend="tpu") if cfg.mode == "compile" else model
    return PipelinedStep(
        model, optimizer, device, forward, graphed=cfg.mode == "graphed", steps_per_call=cfg.steps_per_call
    )


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
    """The outcome of :func:`train`.

    Attributes:
        history: what the run measured.
        samples_per_second: training throughput after the warm-up steps, or None when this
            process ran no step after them.
        timed_steps: the steps that throughput is over.
        steps_run: the training steps this process ran (after a resume, those after the checkpoint).
        compilations_after_warmup: XLA compilations of the timed training steps (None if unmeasured).
        final: the test metrics.
        warmup_steps: the steps before the throughput's clock started.
        launches: calls that ran several captured steps in one program (``--steps_per_call``).
        launched_steps: the steps those calls ran.
    """

    history: History
    samples_per_second: float | None
    timed_steps: int
    steps_run: int
    compilations_after_warmup: int | None
    final: EvalResult
    warmup_steps: int = WARMUP_STEPS
    launches: int = 0
    launched_steps: int = 0


class Throughput:
    """Samples per second of the training steps after the warm-up.

    Validation, checkpoints and their compilations are left out (:meth:`paused`). The clock
    runs from :meth:`start` (the warm-up's steps done) to :meth:`stop` (an epoch's steps done);
    the progress bar and the summary read the same :meth:`rate`.

    Args:
        samples_per_step: samples one training step trains on (all devices).
    """

    def __init__(self, samples_per_step: int) -> None:
        self.samples_per_step = samples_per_step
        self.began: float | None = None
        self.ended: float | None = None
        self.steps = 0
        self.excluded_seconds = 0.0
        self.eval_compilations = 0

    @property
    def measured(self) -> bool:
        """True once a step after the warm-up has run."""
        return self.began is not None and self.steps > 0

    def start(self) -> None:
        """Starts the clock (call after waiting for the warm-up steps)."""
        self.began, self.ended, self.steps = time.perf_counter(), None, 0
        self.excluded_seconds, self.eval_compilations = 0.0, 0

    def step_done(self, steps: int = 1) -> None:
        """Counts ``steps`` training steps (once the clock runs)."""
        if self.began is not None:
            self.steps += steps
            self.ended = None

    def stop(self) -> None:
        """Stops the clock at the end of an epoch (call after waiting for its last step)."""
        if self.began is not None and self.ended is None:
            self.ended = time.perf_counter()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Leaves out what runs inside (a validation, a checkpoint) and the programs it compiles."""
        running = self.began is not None and self.ended is None
        if running:
            tpurec.synchronize()  # the training steps queued so far finish on the clock
        before, began = tpurec.stats()["compilations"], time.perf_counter()
        try:
            yield
        finally:
            if self.began is not None:
                self.eval_compilations += tpurec.stats()["compilations"] - before
                if running:
                    self.excluded_seconds += time.perf_counter() - began

    def rate(self) -> float:
        """Samples per second so far (0 before any timed step)."""
        if not self.measured:
            return 0.0
        end = self.ended if self.ended is not None else time.perf_counter()
        seconds = end - self.began - self.excluded_seconds
        return self.steps * self.samples_per_step / seconds if seconds > 0 else float("inf")

    def shown(self) -> str:
        """The progress bar's figure: the rate, or that the warm-up is still running."""
        return f"{self.rate():,.0f}" if self.measured else "warm-up"


class StepTrace:
    """``--profile_dir``: ``tpurec.profile`` (a torch profiler trace plus XLA's
    device trace) of three steps, started two steps into the run (after the
    first compilations)."""

    FIRST, STEPS = 2, 3

    def __init__(self, directory: str | None, run_start: int) -> None:
        self.directory, self.first = directory, run_start + self.FIRST
        self.stack: contextlib.ExitStack | None = None

    def boundaries(self) -> list[int]:
        """The steps (counted over the run) before which the trace starts and after which it ends."""
        return [self.first, self.first + self.STEPS] if self.directory else []

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


def warmup_steps(cfg: Config) -> int:
    """Steps of a process before the throughput is timed: their programs compile.

    With ``--steps_per_call K`` the warm-up also holds the first call of K steps (after the
    two plain steps and the capture), whose program compiles in the background meanwhile.
    """
    return max(WARMUP_STEPS, CAPTURED_STEP + cfg.steps_per_call) if cfg.steps_per_call > 1 else WARMUP_STEPS


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

    Raises:
        NonFiniteLoss: a step's loss is nan or inf.
    """
    history = History()
    policy, table_optimizers = cfg.lr_policy, embedding_optimizers(model)
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
    warmup = warmup_steps(cfg)
    trace = StepTrace(cfg.profile_dir, run_start)
    metrics_log = MetricsLog(cfg.tensorboard_dir, cfg.metrics_file)
    timer = Throughput(cfg.batch_size * cfg.num_devices)
    shown = [len(history.losses)]  # the step whose loss the progress bar last showed

    def read_losses(wait: bool) -> None:
        # The losses the pipeline has read (one call behind; wait: all of them). Its steps count
        # from 0 at this process's first step; the history's count from 1 over the whole run.
        try:
            read = pipeline.losses(wait=wait)
        except FloatingPointError as error:
            diverged(error)
        record(read)

    def diverged(error: FloatingPointError) -> NoReturn:
        # The pipeline keeps the losses of the steps before the bad one: into the history first.
        record(pipeline.losses())
        raise NonFiniteLoss(run_start + error.step + 1, error.loss) from None  # type: ignore[attr-defined]

    def record(read: list[tuple[int, float]]) -> None:
        for index, value in read:
            assert run_start + index == len(history.losses), "the pipeline's losses come in step order"
            history.losses.append(value)
            step = len(history.losses)
            metrics_log.train(step, value, policy.at_step(step - 1))
        if read and timer.measured:
            metrics_log.throughput(len(history.losses), timer.rate(), timer.steps)

    def save(epoch: int, step_in_epoch: int, batches: ReplayableBatches | None) -> None:
        if cfg.checkpoint_dir:
            read_losses(wait=True)
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
        with timer.paused():
            result = evaluate(model, pipeline.forward, loaders["val"], device, "val")
            history.val.append({"step": global_step, **result.summary()})
            metrics_log.held_out("val", global_step, result)
            tqdm.write(f"AUROC over val set: {result.line()} (epoch {epoch}, step {global_step}).", file=sys.stdout)
            save(epoch, step_in_epoch, batches)
            metrics_log.flush()

    def steps_to_boundary(step_in_epoch: int, total: int) -> int:
        # Steps a call may run without passing the end of the warm-up, a validation, the profile's
        # first or last step, or the epoch's end: each of those happens between two steps.
        room = [total - step_in_epoch]
        done = global_step - run_start
        if done < warmup:
            room.append(warmup - done)
        if cfg.validation_freq_within_epoch:
            room.append(cfg.validation_freq_within_epoch - step_in_epoch % cfg.validation_freq_within_epoch)
        room.extend(b - global_step for b in trace.boundaries() if b > global_step)
        return max(1, min(room))

    try:
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
                batches = ReplayableBatches(source, first=skip, keep=2 * cfg.steps_per_call + 16)
                bar = tqdm(total=total, initial=skip, desc=f"Epoch {epoch}", file=sys.stderr, dynamic_ncols=True)
                step_in_epoch = skip
                try:
                    while True:
                        trace.before_step(global_step)
                        lrs = set_learning_rate(table_optimizers, optimizer, policy.at_step(global_step))
                        # A call of several steps only where it fits before the next boundary whole:
                        # a shorter one would compile a program of its own.
                        room = steps_to_boundary(step_in_epoch, total)
                        try:
                            ran = pipeline.progress(batches, room if room >= cfg.steps_per_call else 1)
                        except StopIteration:
                            break
                        except FloatingPointError as error:
                            diverged(error)
                        if cfg.print_lr:
                            for i in range(ran):  # one rate for the call's steps (graphed: a constant one)
                                print_lr(step_in_epoch + i, lrs)
                        global_step += ran
                        step_in_epoch += ran
                        timer.step_done(ran)
                        if global_step - run_start == warmup:
                            # Warm-up over (its programs compiled): time the steps from here on.
                            pipeline.wait_for_compiles()
                            tpurec.synchronize()
                            tpurec.reset_stats()
                            timer.start()
                        bar.update(ran)
                        trace.after_step(global_step)
                        read_losses(wait=False)
                        if len(history.losses) - shown[0] >= cfg.loss_every:
                            shown[0] = len(history.losses)
                            window = history.losses[-cfg.loss_every :]
                            bar.set_postfix(loss=f"{sum(window) / len(window):.4f}", samples_per_s=timer.shown())
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
                pipeline.close()
                trace.after_step(global_step, force=True)
                read_losses(wait=True)  # waits for the epoch's last step
                timer.stop()
                if history.losses:
                    bar.set_postfix(loss=f"{history.losses[-1]:.4f}", samples_per_s=timer.shown())
                bar.close()
                validate(epoch, step_in_epoch, None)
                start_step = 0
            read_losses(wait=True)
            compilations = tpurec.stats()["compilations"] - timer.eval_compilations if timer.measured else None
            final = evaluate(model, pipeline.forward, loaders["test"], device, "test")
        history.test = {"step": global_step, **final.summary()}
        metrics_log.held_out("test", global_step, final)
        if timer.measured:
            metrics_log.throughput(global_step, timer.rate(), timer.steps)
    finally:
        metrics_log.close()
    log(f"AUROC over test set: {final.line()}, {final.samples} samples.")
    if cfg.plot:
        plot(cfg.plot, history)
        log(f"wrote {cfg.plot}")
    return RunResult(
        history=history,
        samples_per_second=timer.rate() if timer.measured else None,
        timed_steps=timer.steps,
        steps_run=global_step - run_start,
        compilations_after_warmup=compilations,
        final=final,
        warmup_steps=warmup,
        launches=pipeline.launches,
        launched_steps=pipeline.launched_steps,
    )
