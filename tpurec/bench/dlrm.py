"""A DLRM training step: torchrec on CPU (FusedEmbeddingBagCollection + FBGEMM) vs tpurec on "tpu".

The default configuration: batch 2048, 26 tables x 100k rows x dim 64,
4 ids per bag, dense arch 13-512-256-64, over arch 512-256-1, row-wise Adagrad
for the tables and Adagrad for the dense part. Both sides train the same
model (``torchrec.models.dlrm.DLRMTrain``) from the same weights on the same
batches; the JSON has the median step time, samples/s, the ratio, the largest loss
difference seen, and the median host time of a step (``host_ms_per_step``: the
main thread's CPU time; XLA:CPU runs programs on threads of its own, so this is
what the host needs to issue a step; for TorchRec on CPU it includes the part of
the compute that runs on the main thread itself) and, for tpurec, the same with every XLA
program stubbed (``host_ms_per_step_stubbed``, as in ``bench modes``: the main thread still pays
for XLA:CPU's computation through the shared cores, a TPU's host does not). tpurec runs its steps through
:class:`tpurec.sparse.TrainPipeline` (``--no-pipeline``: the plain loop), in
each of ``--modes`` (eager, fused, compiled = ``torch.compile(backend="tpu")``; graphed = the
fused step captured by :func:`tpurec.graph` on its third call and replayed: ``TrainPipeline(...,
graphed=True)``, or with ``--no-pipeline`` the plain loop with each batch copied into static dense
tensors and staged with ``EmbeddingBagCollection.stage``; graphed_k8 = as graphed, with 8 captured
steps per launch, ``TrainPipeline(..., graphed=True, steps_per_call=8)``, a call's time counted to
its steps in equal parts and its losses compared with graphed's step for step; neither a default).
Every configuration reads its losses one call behind: the previous call's once the next is
issued (the pipeline's ``losses()``, or ``tpurec.bench.lazy_losses`` for the plain loops and
the peers), so the host never waits on the call it just issued.
TorchRec and the tpurec modes run **interleaved**: after each one's warm-up,
rounds of ``--round-steps`` steps of each in turn, so that a change in the
machine's load hits all of them alike; ``load_average`` is the 1-minute load
before and after.

``--breakdown`` adds per-phase medians (read, preprocess, transfer, sparse
forward, dense forward+backward, sparse update, dense optimizer) for tpurec
(eager, synchronized after each phase) and the matching phases of torchrec;
``--plot DIR`` writes them as a PNG bar chart.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from pathlib import Path
from typing import Callable, Iterator, cast

import numpy as np
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from torchrec.optim import RowWiseAdagrad

import tpurec
import tpurec.sparse as sparse
from tpurec.bench import clocks, lazy_losses
from tpurec.bench.captured import captured_step
from tpurec.bench.rounds import run_in_rounds
from tpurec.cli import HelpFormatter, add_batch_size, non_negative_int, positive_int
from tpurec.core import stubbed_execution


DENSE_LR = 0.005  # small enough that random labels do not blow the logits up
STEPS_PER_CALL = 8  # graphed_k8's captured steps per launch
CAPTURED_STEP = 3  # TrainPipeline(graphed=True) runs two plain steps, then captures the third
PHASES = (
    "read",
    "preprocess",
    "transfer",
    "sparse_forward",
    "dense_forward_backward",
    "sparse_update",
    "dense_optimizer",
)


def _make_batch(rng: np.random.Generator, batch: int, tables: int, rows: int, ids_per_bag: int) -> Batch:
    keys = [f"f{i}" for i in range(tables)]
    values = torch.from_numpy(rng.integers(0, rows, size=batch * tables * ids_per_bag))
    lengths = torch.full((batch * tables,), ids_per_bag, dtype=torch.int64)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)
    dense = torch.from_numpy(rng.standard_normal((batch, 13)).astype(np.float32))
    labels = torch.from_numpy(rng.integers(0, 2, batch).astype(np.float32))
    return Batch(dense_features=dense, sparse_features=kjt, labels=labels)


def _batches(n: int, batch: int, tables: int, rows: int, ids_per_bag: int, seed: int = 0) -> Iterator[Batch]:
    """Synthetic batches, generated lazily (reading is part of a step's host work)."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        yield _make_batch(rng, batch, tables, rows, ids_per_bag)


class _Runner:
    """One configuration's training loop, stepped a few steps at a time so configurations interleave.

    Each runner reads its own copy of the same batch sequence. ``issue`` runs one call (one step,
    or with several steps per call up to that many) and returns how many steps it ran;
    ``collect(wait)`` returns the losses read since its last call: one call behind the calls
    issued (``tpurec.sparse.TrainPipeline.losses``, or ``tpurec.bench.lazy_losses``), and with
    ``wait`` every one. A call's time counts to each of its steps in equal parts.
    """

    def __init__(
        self,
        name: str,
        issue: Callable[[Iterator[Batch]], int],
        collect: Callable[[bool], list[float]],
        batches: Iterator[Batch],
        mode: str | None,
        close: Callable[[], None] = lambda: None,
        steps_per_call: int = 1,
        min_warmup: int = 0,
    ) -> None:
        self.name, self._issue, self._collect, self._batches, self.mode = name, issue, collect, batches, mode
        self.close, self.steps_per_call, self.min_warmup = close, steps_per_call, min_warmup
        self.times: list[float] = []  # per call: its wall time per step
        self.host_times: list[float] = []  # the main thread's CPU time per step of each call
        self.stubbed_host_times: list[float] = []  # the same with every XLA program stubbed
        self.losses: list[float] = []
        self.compilations = 0
        self.steps_run = 0  # timed steps

    def run(self, steps: int, record: bool) -> None:
        """Runs calls until ``steps`` steps ran (a call of several steps may run past them)."""
        context = tpurec.mode(self.mode) if self.mode else contextlib.nullcontext()
        with context:
            before = tpurec.stats()["compilations"]
            done, count = 0, 1
            while done < steps:
                start, host = time.perf_counter(), time.thread_time()
                count = self._issue(self._batches)
                # The losses read so far: the previous call's, once this one is issued (no wait on it).
                self.losses.extend(self._collect(False))
                elapsed = time.perf_counter() - start
                done += count
                if record:
                    self.times.append(elapsed / count)
                    self.host_times.append((time.thread_time() - host) / count)
            start, host = time.perf_counter(), time.thread_time()
            self.losses.extend(self._collect(True))  # the last call's, counted to it
            if record:
                self.times[-1] += (time.perf_counter() - start) / count
                self.host_times[-1] += (time.thread_time() - host) / count
                self.steps_run += done
            if record and self.mode:
                self.compilations += tpurec.stats()["compilations"] - before

    def run_stubbed(self, steps: int, record: bool) -> None:
        """Steps with every XLA program stubbed: only their main-thread CPU time is kept (the
        values, and the weights after them, are garbage)."""
        assert self.mode is not None, "only tpurec steps can be stubbed"
        with tpurec.mode(self.mode), stubbed_execution():
            done = 0
            while done < steps:
                host = time.thread_time()
                count = self._issue(self._batches)
                self._collect(True)
                done += count
                if record:
                    self.stubbed_host_times.append((time.thread_time() - host) / count)


def _one_call_behind(step: Callable[[Iterator[Batch]], object]) -> tuple[Callable, Callable]:
    """``issue`` and ``collect`` of a runner over a plain step returning its loss."""
    loop = lazy_losses.OneCallBehind(step)
    return loop.issue, loop.collect


def _pipelined(pipeline: sparse.TrainPipeline, steps_per_call: int) -> tuple[Callable, Callable]:
    """``issue`` and ``collect`` of a runner over ``pipeline``, which reads its losses one call behind."""

    def issue(batches: Iterator[Batch]) -> int:
        before = pipeline.steps
        if steps_per_call > 1:
            pipeline.progress(batches, max_steps=steps_per_call)
        else:
            pipeline.progress(batches)
        return pipeline.steps - before

    def collect(wait: bool) -> list[float]:
        return [value for _, value in pipeline.losses(wait=wait)]

    return issue, collect


def _plain_step(model, optimizer, device: str) -> Callable[[Iterator[Batch]], torch.Tensor]:
    def step(batches: Iterator[Batch]) -> torch.Tensor:
        b = next(batches)
        optimizer.zero_grad()
        loss, _ = model(Batch(b.dense_features.to(device), b.sparse_features, b.labels.to(device)))
        loss.backward()
        optimizer.step()
        return loss

    return step


def _graphed_step(model, optimizer, batch: int) -> Callable[[Iterator[Batch]], torch.Tensor]:
    """The plain fused step over static inputs, captured by ``tpurec.graph`` on its third call and
    replayed from then on; each batch is copied into the static dense tensors and staged as the
    collection's static CSR input (``EmbeddingBagCollection.stage``) first."""
    collection = model.model.sparse_arch.embedding_bag_collection
    static_dense = torch.zeros(batch, 13, device="tpu")
    static_labels = torch.zeros(batch, device="tpu")
    features: list[KeyedJaggedTensor] = []  # the batch's KJT, staged (a replay reads the staged CSR)

    def train() -> torch.Tensor:
        optimizer.zero_grad()
        loss, _ = model(Batch(static_dense, features[0], static_labels))
        loss.backward()
        optimizer.step()
        return loss

    issue = captured_step(train)

    def step(batches: Iterator[Batch]) -> torch.Tensor:
        b = next(batches)
        static_dense.copy_(b.dense_features)
        static_labels.copy_(b.labels)
        collection.stage(b.sparse_features)
        features[:] = [b.sparse_features]
        return issue()  # Runner.run reads the loss of each

    return step


def _stubbed_warmup(warmup: int) -> int:
    """Untimed stubbed steps before the timed ones: the stubs compile in the first two (fused
    mode compiles a window on its second step)."""
    return max(warmup, 2)


def _interleave(runners: list[_Runner], steps: int, warmup: int, round_steps: int) -> None:
    """Warms each runner up, then times rounds of ``round_steps`` steps of each in turn,
    so that a change in the machine's load hits every configuration alike. Then the tpurec
    runners' stubbed steps, one runner after the other (switching models every few steps
    would start each on cold caches), after a warm-up in which the stubs compile."""
    for runner in runners:
        runner.run(max(warmup, runner.min_warmup), record=False)
    run_in_rounds(runners, lambda runner, count, record: runner.run(count, record), steps, round_steps)
    for runner in runners:
        if runner.mode is not None:
            runner.run_stubbed(_stubbed_warmup(warmup), record=False)
            runner.run_stubbed(steps, record=True)
        runner.close()


def _phase_times(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    next_batch: Callable[[], Batch],
    embeddings: torch.nn.Module,
    steps: int,
    warmup: int,
    device: str,
) -> dict[str, float]:
    """Median ms per phase; the device is synchronized at every phase boundary.

    Sparse forward ends in a forward hook of the embedding module; the dense
    backward ends when the gradient of the pooled embeddings is ready (a tensor
    hook); the rest of the backward is the fused sparse update.
    """
    on_tpu = device != "cpu"
    sync = torch.tpu.synchronize if on_tpu else (lambda: None)
    marks: dict[str, float] = {}

    def grad_hook(grad: torch.Tensor) -> None:
        sync()
        marks["dense_backward_end"] = time.perf_counter()

    def forward_hook(module, inputs, output) -> None:
        sync()
        marks["sparse_forward_end"] = time.perf_counter()
        if output.values().requires_grad:
            output.values().register_hook(grad_hook)

    handle = embeddings.register_forward_hook(forward_hook)
    samples: dict[str, list[float]] = {p: [] for p in PHASES}
    try:
        for step in range(warmup + steps):
            t0 = time.perf_counter()
            b = next_batch()
            t_read = time.perf_counter()
            if on_tpu:
                csr = embeddings.preprocess(b.sparse_features)
                t_pre = time.perf_counter()
                embeddings.prefetch(b.sparse_features, csr)
                b = Batch(b.dense_features.to(device), b.sparse_features, b.labels.to(device))
                sync()
            else:
                t_pre = t_read  # torchrec reads the KJT inside its forward
            t_transfer = time.perf_counter()
            optimizer.zero_grad()
            loss, _ = model(b)
            sync()
            t_forward = time.perf_counter()
            loss.backward()
            sync()
            t_backward = time.perf_counter()
            optimizer.step()
            sync()
            t_end = time.perf_counter()
            loss.item()
            if step < warmup:
                continue
            dense_fwd = t_forward - marks["sparse_forward_end"]
            dense_bwd = marks["dense_backward_end"] - t_forward
            values = {
                "read": t_read - t0,
                "preprocess": t_pre - t_read,
                "transfer": t_transfer - t_pre,
                "sparse_forward": marks["sparse_forward_end"] - t_transfer,
                "dense_forward_backward": dense_fwd + dense_bwd,
                "sparse_update": t_backward - marks["dense_backward_end"],
                "dense_optimizer": t_end - t_backward,
            }
            for k, v in values.items():
                samples[k].append(v * 1e3)
    finally:
        handle.remove()
    out = {k: round(statistics.median(v), 3) for k, v in samples.items()}
    out["total"] = round(sum(out.values()), 3)
    return out


def _plot(result: dict, directory: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    breakdown = result.get("breakdown")
    if breakdown:
        fig, ax = plt.subplots(figsize=(8, 3.5))
        names = list(breakdown)
        left = np.zeros(len(names))
        for phase in PHASES:
            widths = np.array([breakdown[n][phase] for n in names])
            ax.barh(names, widths, left=left, label=phase.replace("_", " "))
            left += widths
        ax.set_xlabel("ms per step (phases synchronized)")
        ax.set_title("DLRM training step by phase")
        ax.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        path = out / "dlrm_breakdown.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(str(path))
    fig, ax = plt.subplots(figsize=(6, 3))
    runs = {k: v["step_ms"] for k, v in result.items() if isinstance(v, dict) and "step_ms" in v}
    ax.bar(list(runs), list(runs.values()))
    ax.set_ylabel("median step ms")
    ax.set_title(f"DLRM step, batch {result['config']['batch']}")
    fig.tight_layout()
    path = out / "dlrm_steps.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(str(path))
    return written


def _host_ms(host_times: list[float], step_times: list[float]) -> float | None:
    """The median host ms of a step, or None where the thread clock ticks too coarsely to time one."""
    return statistics.median(host_times) * 1e3 if clocks.fine_enough(min(step_times)) else None


def _embedding_bound(args: argparse.Namespace) -> dict:
    """The step's embedding traffic and, on a TPU of a known generation, its HBM-bandwidth bound.

    Bytes (float32): the forward reads each looked-up row; the backward reads and writes each
    touched row and its row-wise accumulator (at most one per lookup).
    """
    import jax

    from tpurec.sparse.planner.topology import generation_of_device_kind

    lookups = args.batch * args.tables * args.ids_per_bag
    nbytes = lookups * args.dim * 4 + lookups * (2 * args.dim * 4 + 8)
    out: dict = {"bytes_per_step": nbytes}
    device = jax.devices()[0]
    generation = generation_of_device_kind(str(device.device_kind)) if device.platform == "tpu" else None
    if generation is not None:
        out["hbm_gb_s"] = generation.hbm_bw_per_chip / 1e9
        out["hbm_bound_ms"] = nbytes / generation.hbm_bw_per_chip * 1e3
    return out


def main(argv: list[str] | None = None, prog: str = "python -m tpurec.bench dlrm") -> dict:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=HelpFormatter)
    add_batch_size(parser, "samples per training step", type=positive_int, default=2048)
    parser.add_argument("--tables", type=positive_int, default=26, help="embedding tables (one feature each)")
    parser.add_argument("--rows", type=positive_int, default=100_000, help="rows of each table")
    parser.add_argument("--dim", type=positive_int, default=64, help="embedding dimension")
    parser.add_argument("--ids-per-bag", type=positive_int, default=4, help="ids per sample and feature")
    parser.add_argument("--steps", type=positive_int, default=20, help="timed steps per configuration")
    parser.add_argument("--warmup", type=non_negative_int, default=3, help="untimed steps per configuration first")
    parser.add_argument(
        "--round-steps",
        type=positive_int,
        default=5,
        help="steps of one configuration before the next one's (configurations interleave)",
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["fused", "compiled", "eager"],
        choices=["fused", "compiled", "eager", "graphed", "graphed_k8"],
        help="graphed: the fused step captured by tpurec.graph and replayed; graphed_k8: as graphed, with "
        f"{STEPS_PER_CALL} captured steps per launch (TrainPipeline(steps_per_call={STEPS_PER_CALL})), its losses "
        "compared with graphed's step for step when both run",
    )
    parser.add_argument("--no-jax-peer", action="store_true", help="skip the plain-JAX peer (tpurec/bench/jax_peer.py)")
    parser.add_argument("--no-pipeline", action="store_true", help="plain loop instead of sparse.TrainPipeline")
    parser.add_argument(
        "--pipeline-workers",
        type=positive_int,
        default=2,
        help="threads of sparse.TrainPipeline that preprocess and transfer batches (its workers=)",
    )
    parser.add_argument("--breakdown", action="store_true", help="per-phase times of tpurec (eager) and torchrec")
    parser.add_argument("--plot", metavar="DIR", help="write PNG charts into DIR")
    args = parser.parse_args(argv)
    if "graphed_k8" in args.modes and args.no_pipeline:
        parser.error("--modes graphed_k8 runs its steps through TrainPipeline(steps_per_call=8): drop --no-pipeline")

    configs = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=args.dim, num_embeddings=args.rows, feature_names=[f"f{i}"])
        for i in range(args.tables)
    ]
    layers = {
        "dense_in_features": 13,
        "dense_arch_layer_sizes": [512, 256, args.dim],
        "over_arch_layer_sizes": [512, 256, 1],
    }
    torch.manual_seed(0)
    reference = DLRMTrain(
        DLRM(
            embedding_bag_collection=FusedEmbeddingBagCollection(
                configs, optimizer_type=RowWiseAdagrad, optimizer_kwargs={"lr": 0.05}
            ),
            **layers,
        )
    )
    state = {k: v.detach().clone() for k, v in reference.state_dict().items()}  # before training changes it
    # The measured steps, then the stubbed ones.
    total = args.steps + args.warmup + args.steps + _stubbed_warmup(args.warmup)
    batch_shape = (args.batch, args.tables, args.rows, args.ids_per_bag)
    make_batches = lambda: _batches(total, *batch_shape)  # noqa: E731

    def build(fused: bool = False):
        ours = DLRMTrain(DLRM(embedding_bag_collection=EmbeddingBagCollection(configs), **layers))
        ours.load_state_dict(state)
        ours = sparse.from_torchrec(
            ours,
            optimizer=sparse.RowWiseAdagrad(learning_rate=0.05),
            capacities=sparse.Capacity(args.batch * args.tables * args.ids_per_bag),
        ).to("tpu")
        # fused=True (graphed: its state, step counts included, stays on the device): the same arithmetic.
        dense = [p for p in ours.parameters() if p.requires_grad]
        return ours, torch.optim.Adagrad(dense, lr=DENSE_LR, fused=True if fused else None)

    runners = [
        _Runner(
            "torchrec_cpu",
            *_one_call_behind(_plain_step(reference, torch.optim.Adagrad(reference.parameters(), lr=DENSE_LR), "cpu")),
            make_batches(),
            None,
        )
    ]
    for mode in args.modes:
        graphed = mode in ("graphed", "graphed_k8")
        ours, optimizer = build(fused=graphed)
        if mode == "graphed" and args.no_pipeline:
            runners.append(
                _Runner(
                    "tpurec_graphed",
                    *_one_call_behind(_graphed_step(ours, optimizer, args.batch)),
                    make_batches(),
                    "fused",
                )
            )
            continue
        step_model: torch.nn.Module = (
            cast(torch.nn.Module, torch.compile(ours, backend="tpu")) if mode == "compiled" else ours
        )
        run_mode = "fused" if mode in ("compiled", "graphed", "graphed_k8") else mode
        if args.no_pipeline:
            runners.append(
                _Runner(
                    f"tpurec_{mode}",
                    *_one_call_behind(_plain_step(step_model, optimizer, "tpu")),
                    make_batches(),
                    run_mode,
                )
            )
            continue
        k = STEPS_PER_CALL if mode == "graphed_k8" else 1
        # The program of k steps compiles in the warm-up's first call of k steps (not in the background).
        pipeline = sparse.TrainPipeline(
            step_model,
            optimizer,
            torch.device("tpu"),
            graphed=graphed,
            steps_per_call=k,
            workers=args.pipeline_workers,
            compile_in_background=False,
        )
        runners.append(
            _Runner(
                f"tpurec_{mode}",
                *_pipelined(pipeline, k),
                # A call of k steps may run past a round's steps: more batches for it.
                _batches(total + k * (-(-args.steps // args.round_steps) + 4), *batch_shape)
                if k > 1
                else make_batches(),
                run_mode,
                close=pipeline.close,
                steps_per_call=k,
                # Two plain steps, the capture, then a call of k steps (its program compiles).
                min_warmup=CAPTURED_STEP + k if k > 1 else 0,
            )
        )
    if not args.no_jax_peer:
        from tpurec.bench.jax_peer import PlainJaxDlrm

        jax_peer = PlainJaxDlrm(
            tables=args.tables,
            rows=args.rows,
            dim=args.dim,
            dense_in=13,
            dense_sizes=layers["dense_arch_layer_sizes"],
            over_sizes=layers["over_arch_layer_sizes"],
            ids_per_bag=args.ids_per_bag,
            batch=args.batch,
            dense_lr=DENSE_LR,
        )

        def jax_peer_step(batches: Iterator[Batch]):
            b = next(batches)
            ids = b.sparse_features.values().numpy().reshape(args.tables, args.batch, args.ids_per_bag)
            return jax_peer.step(b.dense_features.numpy(), ids.transpose(1, 0, 2), b.labels.numpy())

        runners.append(_Runner("plain_jax", *_one_call_behind(jax_peer_step), make_batches(), None))
    load_before = os.getloadavg()[0]
    _interleave(runners, args.steps, args.warmup, args.round_steps)
    peer = runners[0]
    peer_median = statistics.median(peer.times)
    result = {
        "benchmark": "dlrm",
        "config": vars(args),
        "platform": tpurec.platform(),
        "load_average": {"before": load_before, "after": os.getloadavg()[0]},
        "thread_clock_tick_us": clocks.thread_clock_tick() * 1e6,
        "torchrec_cpu": {
            "step_ms": peer_median * 1e3,
            "host_ms_per_step": _host_ms(peer.host_times, peer.times),
            "samples_per_s": args.batch / peer_median,
        },
    }
    jax_runner = next((r for r in runners if r.name == "plain_jax"), None)
    if jax_runner is not None:
        result["plain_jax"] = {
            "step_ms": statistics.median(jax_runner.times) * 1e3,
            "samples_per_s": args.batch / statistics.median(jax_runner.times),
        }
    result["embedding_bound"] = _embedding_bound(args)
    for runner in runners[1:]:
        if runner is jax_runner:
            continue
        median = statistics.median(runner.times)
        result[runner.name] = {
            "step_ms": median * 1e3,
            "step_ms_range": [min(runner.times) * 1e3, max(runner.times) * 1e3],
            "host_ms_per_step": _host_ms(runner.host_times, runner.times),
            "host_ms_per_step_stubbed": _host_ms(runner.stubbed_host_times, runner.times),
            "samples_per_s": args.batch / median,
            "speedup_vs_torchrec_cpu": peer_median / median,
            "max_loss_difference": max(abs(a - b) for a, b in zip(runner.losses, peer.losses)),
            "compilations_after_warmup": runner.compilations,
            **(
                {"speedup_vs_plain_jax": statistics.median(jax_runner.times) / median} if jax_runner is not None else {}
            ),
            "pipeline": not args.no_pipeline,
            "steps_per_call": runner.steps_per_call,
            "timed_steps": runner.steps_run,
        }
    by_name = {runner.name: runner for runner in runners}
    if "tpurec_graphed_k8" in by_name and "tpurec_graphed" in by_name:
        k8, single = by_name["tpurec_graphed_k8"].losses, by_name["tpurec_graphed"].losses
        n = min(len(k8), len(single))
        result["tpurec_graphed_k8"]["losses_match_single_steps"] = {
            "reference": "tpurec_graphed",
            "steps_compared": n,
            "equal": k8[:n] == single[:n],
            "max_abs_difference": max((abs(a - b) for a, b in zip(k8[:n], single[:n])), default=0.0),
            "first_differing_step": next((i for i, (a, b) in enumerate(zip(k8[:n], single[:n])) if a != b), None),
        }

    if args.breakdown:
        rng = np.random.default_rng(1)
        next_batch = lambda: _make_batch(rng, args.batch, args.tables, args.rows, args.ids_per_bag)  # noqa: E731
        reference.load_state_dict(state)
        result["breakdown"] = {
            "torchrec_cpu": _phase_times(
                reference,
                torch.optim.Adagrad(reference.parameters(), lr=DENSE_LR),
                next_batch,
                reference.model.sparse_arch.embedding_bag_collection,
                args.steps,
                args.warmup,
                "cpu",
            )
        }
        ours, optimizer = build()
        with tpurec.mode("eager"):
            result["breakdown"]["tpurec_eager_synchronized"] = _phase_times(
                ours,
                optimizer,
                next_batch,
                ours.model.sparse_arch.embedding_bag_collection,
                args.steps,
                args.warmup,
                "tpu",
            )
    if args.plot:
        result["plots"] = _plot(result, args.plot)
    return result
