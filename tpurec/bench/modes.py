"""A DLRM-sized dense training step in eager, fused and compiled mode next to PyTorch on CPU.

Bottom MLP 13-512-256-64, dot interaction with 26 (fixed) embedding vectors,
top MLP 512-256-1, BCE loss, Adagrad; batch 512 and 4096. Losses are read one call behind:
after issuing a call (a step, or several), the loop reads the previous call's losses, so the
host never waits on the step it just issued and runs at most one call ahead of the device.

Configurations (``--modes``):

* ``cpu_pytorch``: the same model and data on PyTorch's CPU device (the reference);
* ``eager``, ``fused``: the model on ``tpu`` in that execution mode;
* ``fused_adagrad``: as ``fused``, with ``torch.optim.Adagrad(fused=True)``: the update is one
  ``_fused_adagrad_`` op instead of PyTorch's ``_foreach_*`` ops (the same arithmetic);
* ``compiled``: ``torch.compile(model, backend="tpu")`` in fused mode: the compiled
  forward and backward graphs join the fused window with the eager loss and
  optimizer ops, so a step is one XLA program;
* ``compiled_eager``: ``torch.compile`` in eager mode: the two compiled graphs run as
  programs of their own, and the loss and each optimizer op as eager programs;
* ``compiled_optim``: as ``compiled``, and ``torch.compile(optimizer.step, backend="tpu")``
  too (PyTorch's compiled optimizer): the update is one graph whose writes to the
  parameters and the optimizer state are stored by the backend, not one eager op each.
* ``graphed``: as ``fused_adagrad``, with the step captured by ``tpurec.graph`` on its third
  call (after two steps that make the optimizer's state) and replayed from then on: one
  program call per step, no Python of the model, autograd or optimizer.
* ``graphed_k8``: as ``graphed``, with :data:`STEPS_PER_CALL` (8) steps per program call
  (``TpuGraph.replay_steps`` over 8 stacked copies of the batch, Keras' ``steps_per_execution``):
  one launch per 8 steps. Its losses are checked against ``graphed``'s (or ``fused_adagrad``'s)
  step for step (``losses_match_single_steps``: bit for bit). Per-step times are a call's time
  divided by its steps.

The machine may be shared, so the configurations run **interleaved**: after each
one's warm-up, rounds of ``--round-steps`` steps of every configuration in turn,
so that a change in load hits all of them alike. Reported per configuration: the
median and minimum wall time of a step, the median process CPU time of a step
(less sensitive to other processes than wall time), the median **host time** of a
step (``host_ms_per_step``: the main thread's CPU time; XLA:CPU runs programs on
threads of its own and a wait for a result costs no CPU, so this is what Python,
PyTorch and tpurec need to issue the step: the figure that decides whether a TPU
would wait on the host), the programs run per step and
the compilations after warm-up (must be 0) and where the warm-up's compile seconds went
(``compile``: seconds, by phase and by kind of program, from ``tpurec.stats()``). After the timed rounds, each tpu configuration
runs as many steps again with its XLA programs stubbed (``tpurec.core.stubbed_execution``:
the same JAX calls, arguments and bookkeeping, no computation), one configuration after the
other: ``host_ms_per_step_stubbed`` is their median main-thread CPU time. On XLA:CPU the computation shares the two cores with
Python (small programs run on the calling thread; large ones evict its caches), so the
stubbed figure is the closer one to what a TPU's host would spend; the stubbed steps spoil
the model, so they come after every loss is taken. ``pytorch_cpu_host_floor`` is PyTorch's own
host time for the step: the model on PyTorch CPU at batch 1 with ``Adagrad(fused=True)``, where the
computation is negligible (what PyTorch's C++ eager path costs; see ``pytorch_host_floor``). ``load_average`` is the 1-minute load
before and after the run (``os.getloadavg``); compare ratios from one run only.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import time
from typing import Callable

import torch

import tpurec
from tpurec.bench import clocks
from tpurec.bench.captured import WARMUP, captured_step
from tpurec.bench.compile_report import compile_since
from tpurec.bench.lazy_losses import handle, values
from tpurec.bench.rounds import run_in_rounds
from tpurec.cli import HelpFormatter, add_batch_size
from tpurec.core import stubbed_execution

NUM_SPARSE = 26
EMBEDDING_DIM = 64
CONFIGS = (
    "cpu_pytorch",
    "eager",
    "fused",
    "fused_adagrad",
    "compiled",
    "compiled_eager",
    "compiled_optim",
    "graphed",
    "graphed_k8",
)
STEPS_PER_CALL = 8  # graphed_k8's steps per program call


class DenseStep(torch.nn.Module):
    """DLRM's dense side: bottom MLP, pairwise dot interaction, top MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.bottom = torch.nn.Sequential(
            torch.nn.Linear(13, 512),
            torch.nn.ReLU(),
            torch.nn.Linear(512, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, EMBEDDING_DIM),
            torch.nn.ReLU(),
        )
        pairs = (NUM_SPARSE + 1) * NUM_SPARSE // 2
        self.top = torch.nn.Sequential(
            torch.nn.Linear(EMBEDDING_DIM + pairs, 512),
            torch.nn.ReLU(),
            torch.nn.Linear(512, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 1),
        )
        rows, cols = torch.triu_indices(NUM_SPARSE + 1, NUM_SPARSE + 1, offset=1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        d = self.bottom(dense)
        features = torch.cat([d.unsqueeze(1), sparse], dim=1)
        dots = torch.bmm(features, features.transpose(1, 2))
        interactions = dots[:, self.rows, self.cols]
        return self.top(torch.cat([d, interactions], dim=1))


@dataclasses.dataclass
class _Config:
    """One configuration's training state and what was measured of it."""

    name: str
    step: Callable[[], float]  # one call, its loss read at once (device_time exports steps with it)
    mode: str
    on_tpu: bool
    issue: Callable[[], tuple[object, int]]  # one call: its losses (lazy_losses.handle), its steps
    wall_ms: list[float] = dataclasses.field(default_factory=list)
    cpu_ms: list[float] = dataclasses.field(default_factory=list)
    host_ms: list[float] = dataclasses.field(default_factory=list)
    stubbed_host_ms: list[float] = dataclasses.field(default_factory=list)
    losses: list[float] = dataclasses.field(default_factory=list)
    all_losses: list[float] = dataclasses.field(default_factory=list)  # every step's, warm-up included
    steps_run: int = 0  # timed steps
    programs: int = 0
    compilations: int = 0
    first_loss: float | None = None  # of the first (warm-up) step, before any update
    unread: tuple[object, int] | None = None  # the last call's losses, read after the next call is issued
    compile: dict | None = None  # what the warm-up compiled
    min_warmup: int = 0  # warm-up steps whatever --warmup says (graphed_k8: up to its first launch)


def _make(name: str, batch: int, fused_optimizer: bool = False) -> _Config:
    """Builds the model, optimizer and batch of configuration ``name`` (same weights and data in all).

    ``fused_optimizer``: ``Adagrad(fused=True)`` in any configuration (always in ``fused_adagrad`` and ``graphed``).
    """
    device = "cpu" if name == "cpu_pytorch" else "tpu"
    torch.manual_seed(0)
    model = DenseStep().to(device)
    compiled = name.startswith("compiled")
    forward = torch.compile(model, backend="tpu") if compiled else model
    # graphed: a captured step keeps the optimizer's state on the device
    fused = fused_optimizer or name in ("fused_adagrad", "graphed", "graphed_k8")
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.01, fused=True if fused else None)
    update = torch.compile(optimizer.step, backend="tpu") if name == "compiled_optim" else optimizer.step
    g = torch.Generator().manual_seed(1)
    dense = torch.randn(batch, 13, generator=g).to(device)
    sparse = torch.randn(batch, NUM_SPARSE, EMBEDDING_DIM, generator=g).to(device)
    labels = torch.rand(batch, 1, generator=g).round().to(device)

    def train() -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(forward(dense, sparse), labels)
        loss.backward()
        update()
        return loss

    if name == "graphed_k8":
        # The same batch at every step, as in the other configurations, stacked once for the launches.
        stacked = {t: t.unsqueeze(0).expand(STEPS_PER_CALL, *t.shape).contiguous() for t in (dense, sparse, labels)}
        issue = _steps_per_call(train, stacked, STEPS_PER_CALL)
    else:
        one = captured_step(train) if name == "graphed" else train

        def issue() -> tuple[object, int]:
            return handle(one()), 1

    def step() -> float:
        taken, _ = issue()
        return values(taken)[-1]

    mode = (
        "fused"
        if name in ("fused", "fused_adagrad", "compiled", "compiled_optim", "graphed", "graphed_k8")
        else "eager"
    )
    config = _Config(name, step, mode, device == "tpu", issue)
    if name == "graphed_k8":
        config.min_warmup = WARMUP + 1 + STEPS_PER_CALL  # the plain steps, the capture, a launch (compiled)
    return config


def _steps_per_call(
    train: Callable[[], torch.Tensor], stacked: dict[torch.Tensor, torch.Tensor], k: int
) -> Callable[[], tuple[object, int]]:
    """``train`` run plainly for :data:`WARMUP` calls and captured on the next, as ``captured_step`` does
    (one step per call), then ``k`` steps per call: ``replay_steps`` over the static inputs' stacked batches."""
    graph = tpurec.TpuGraph()
    calls = [0]
    loss: list[torch.Tensor] = []

    def issue() -> tuple[object, int]:
        calls[0] += 1
        if calls[0] <= WARMUP:
            return handle(train()), 1
        if not loss:
            with tpurec.graph(graph):
                loss.append(train())
            return handle(loss[0]), 1
        (series,) = graph.replay_steps(stacked, collect=loss)
        return handle(series), k

    return issue


def _run_steps(config: _Config, steps: int, record: bool) -> None:
    """Runs calls of ``config`` until ``steps`` steps ran; each call's losses are read after the next is issued."""
    context = tpurec.mode(config.mode) if config.on_tpu else contextlib.nullcontext()
    with context:
        before = tpurec.stats()
        done = 0
        while done < steps:
            wall, cpu, host = time.perf_counter(), time.process_time(), time.thread_time()
            taken, count = config.issue()
            _read(config, record)
            config.unread = (taken, count)
            done += count
            if record:
                config.wall_ms.append((time.perf_counter() - wall) * 1e3 / count)
                config.cpu_ms.append((time.process_time() - cpu) * 1e3 / count)
                config.host_ms.append((time.thread_time() - host) * 1e3 / count)
        # The last call's losses: waited for here, its time counted to that call's steps.
        wall, cpu, host = time.perf_counter(), time.process_time(), time.thread_time()
        count = config.unread[1] if config.unread else 1
        _read(config, record)
        if record:
            config.wall_ms[-1] += (time.perf_counter() - wall) * 1e3 / count
            config.cpu_ms[-1] += (time.process_time() - cpu) * 1e3 / count
            config.host_ms[-1] += (time.thread_time() - host) * 1e3 / count
            config.steps_run += done
        after = tpurec.stats()
    if record and config.on_tpu:
        config.programs += after["executions"] - before["executions"]
        config.compilations += after["compilations"] - before["compilations"]


def _read(config: _Config, record: bool) -> None:
    """Reads the losses of ``config``'s last call issued, if not read yet."""
    if config.unread is None:
        return
    read = values(config.unread[0])
    config.unread = None
    if config.first_loss is None:
        config.first_loss = read[0]
    config.all_losses.extend(read)
    if record:
        config.losses.extend(read)


def _run_stubbed_steps(config: _Config, steps: int, record: bool) -> None:
    """Steps with every program stubbed: only the main thread's CPU time is kept (the values are garbage)."""
    with tpurec.mode(config.mode), stubbed_execution():
        done = 0
        while done < steps:
            host = time.thread_time()
            _, count = config.issue()
            done += count
            if record:
                config.stubbed_host_ms.append((time.thread_time() - host) * 1e3 / count)


def _summary(config: _Config) -> dict:
    median = statistics.median(config.wall_ms)
    steps = config.steps_run
    fine = clocks.fine_enough(min(config.wall_ms) / 1e3)  # else the CPU clocks tick too coarsely for a step
    return {
        "step_ms": median,
        "min_step_ms": min(config.wall_ms),
        "cpu_ms_per_step": statistics.median(config.cpu_ms) if fine else None,
        "host_ms_per_step": statistics.median(config.host_ms) if fine else None,
        "host_ms_per_step_stubbed": statistics.median(config.stubbed_host_ms)
        if config.stubbed_host_ms and fine
        else None,
        "samples_per_s": None,  # filled in by the caller (needs the batch)
        "first_loss": config.first_loss,
        "last_loss": config.losses[-1],
        "programs_per_step": config.programs / steps if config.on_tpu else None,
        "compilations_after_warmup": config.compilations if config.on_tpu else None,
        "compile": config.compile,
    }


def _samevalues(config: _Config, reference: _Config) -> dict:
    """Whether ``config``'s losses equal ``reference``'s step for step (bit for bit), over the steps both ran."""
    n = min(len(config.all_losses), len(reference.all_losses))
    pairs = list(zip(config.all_losses[:n], reference.all_losses[:n]))
    return {
        "reference": reference.name,
        "steps_compared": n,
        "equal": all(a == b for a, b in pairs),
        "max_abs_difference": max((abs(a - b) for a, b in pairs), default=0.0),
        "first_differing_step": next((i for i, (a, b) in enumerate(pairs) if a != b), None),
    }


def pytorch_host_floor(steps: int, warmup: int) -> dict:
    """PyTorch's own host cost of the step: the same model on PyTorch CPU at batch 1.

    At batch 1 the computation is a small part of the step, so its main-thread CPU time is
    about what PyTorch's C++ eager path (its dispatcher, kernels, autograd engine, the modules'
    and ``Adagrad(fused=True)``'s Python) needs to issue the step: the floor of any device
    that PyTorch's eager code drives, next to which tpurec's stubbed host times are read.
    """
    config = _make("cpu_pytorch", 1, fused_optimizer=True)
    _run_steps(config, warmup, record=False)
    _run_steps(config, steps, record=True)
    fine = clocks.fine_enough(min(config.wall_ms) / 1e3)
    return {
        "batch": 1,
        "optimizer": "Adagrad(fused=True)",
        "host_ms_per_step": statistics.median(config.host_ms) if fine else None,
    }


def run_batch(batch: int, names: list[str], steps: int, warmup: int, round_steps: int) -> dict:
    """Measures every configuration in ``names`` at ``batch``, interleaved; returns the run's JSON."""
    run: dict = {"batch": batch}
    configs = []
    for name in names:
        try:
            before = tpurec.stats()
            config = _make(name, batch)
            _run_steps(config, max(warmup, config.min_warmup), record=False)
            config.compile = compile_since(before) if config.on_tpu else None
            configs.append(config)
        except Exception as error:  # reported, not hidden: the JSON says why a configuration is missing
            run[name] = {"error": f"{type(error).__name__}: {error}"[:500]}
    run_in_rounds(configs, _run_steps, steps, round_steps)
    # One configuration after the other, not in rounds: host CPU time barely depends on the
    # load, and each switch to another model starts on cold caches, which a training loop does not.
    for config in configs:
        if config.on_tpu:
            _run_stubbed_steps(config, warmup, record=False)  # the stubs compile here
            _run_stubbed_steps(config, steps, record=True)
    for config in configs:
        run[config.name] = _summary(config)
        run[config.name]["samples_per_s"] = batch / run[config.name]["step_ms"] * 1e3
    by_name = {config.name: config for config in configs}
    if "graphed_k8" in by_name:
        reference = by_name.get("graphed") or by_name.get("fused_adagrad")
        run["graphed_k8"]["losses_match_single_steps"] = (
            _samevalues(by_name["graphed_k8"], reference) if reference is not None else None
        )
    ratios = {}
    if "step_ms" in run.get("cpu_pytorch", {}):
        cpu_ms = run["cpu_pytorch"]["step_ms"]
        for name in names:
            if name != "cpu_pytorch" and "step_ms" in run.get(name, {}):
                ratios[f"{name}_speedup_vs_cpu"] = cpu_ms / run[name]["step_ms"]
    if "step_ms" in run.get("eager", {}) and "step_ms" in run.get("fused", {}):
        ratios["fused_speedup_vs_eager"] = run["eager"]["step_ms"] / run["fused"]["step_ms"]
    if "step_ms" in run.get("fused", {}) and "step_ms" in run.get("compiled", {}):
        ratios["compiled_speedup_vs_fused"] = run["fused"]["step_ms"] / run["compiled"]["step_ms"]
    if "step_ms" in run.get("graphed", {}) and "step_ms" in run.get("graphed_k8", {}):
        ratios["graphed_k8_speedup_vs_graphed"] = run["graphed"]["step_ms"] / run["graphed_k8"]["step_ms"]
    run["ratios"] = ratios
    return run


def main(argv: list[str] | None = None, prog: str = "python -m tpurec.bench modes") -> dict:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=HelpFormatter)
    add_batch_size(parser, "batch sizes to run (one configuration set each)", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per configuration first")
    parser.add_argument("--round-steps", type=int, default=5, help="steps of one configuration before the next one's")
    parser.add_argument("--modes", nargs="+", default=list(CONFIGS), choices=CONFIGS, help="configurations to run")
    args = parser.parse_args(argv)
    if min(args.batch) < 1 or args.steps < 1 or args.warmup < 0 or args.round_steps < 1:
        parser.error("--batch, --steps and --round-steps must be positive and --warmup at least 0")
    result = {
        "benchmark": "modes",
        "platform": tpurec.platform(),
        "torch_threads": torch.get_num_threads(),
        "thread_clock_tick_us": clocks.thread_clock_tick() * 1e6,
        "cpu_count": os.cpu_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "load_average": {"before": os.getloadavg()[0]},
        "runs": [],
    }
    for batch in args.batch:
        result["runs"].append(run_batch(batch, args.modes, args.steps, args.warmup, args.round_steps))
    result["pytorch_cpu_host_floor"] = pytorch_host_floor(max(args.steps, 20), args.warmup)
    result["load_average"]["after"] = os.getloadavg()[0]
    return result
