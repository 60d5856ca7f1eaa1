"""A tiny transformer's training step compiled on tpu next to single-thread PyTorch CPU.

A BERT masked-LM from a tiny ``transformers`` config (2 layers, hidden 64, 2 heads,
intermediate 128, vocabulary 128: no download) trains on one fixed batch of
``--batch-size`` sequences of ``--length`` tokens with SGD. Configurations:

* ``cpu_pytorch``: the model on PyTorch's CPU device with one intra-op thread (the peer);
* ``compiled``: ``torch.compile(model, backend="tpu", dynamic=False)`` and
  ``torch.compile(optimizer.step, backend="tpu")`` in fused mode (one program per step);
* ``compiled_dispatch``: the same with ``TPUREC_FUSED_COMPILED_GRAPHS=dispatch``: each compiled
  graph is enqueued when it is called, so the device runs the forward while Python records
  the backward (three programs per step);
* ``graphed``: as ``compiled``, with the step captured by ``tpurec.graph`` on its third call
  and replayed from then on (``TpuGraph.replay()``: one program call per step, none of the
  model's, autograd's or the optimizer's Python).

They run interleaved (``tpurec.bench.rounds``); reported per configuration: median and
minimum wall ms of a step, median host ms (the main thread's CPU time), the last loss,
and for tpu the compilations after warm-up (must be 0) and ``host_ms_per_step_stubbed``: the
median host ms of as many steps again with the XLA programs stubbed
(``tpurec.core.stubbed_execution``; see ``bench modes``), run after every loss is
taken, one configuration after the other. Compare ratios from one run only.

Example::

    python -m tpurec.bench transformer --steps 20
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import os
import statistics
import time
from typing import Callable

import torch

import tpurec
from tpurec.bench import clocks
from tpurec.bench.captured import captured_step
from tpurec.bench.rounds import run_in_rounds
from tpurec.bench.text import VOCAB, tiny_bert
from tpurec.cli import HelpFormatter, add_batch_size, positive_int
from tpurec.core import stubbed_execution


@dataclasses.dataclass
class _Config:
    """One configuration's step and what was measured of it."""

    name: str
    step: Callable[[], float]
    wall_ms: list[float] = dataclasses.field(default_factory=list)
    host_ms: list[float] = dataclasses.field(default_factory=list)
    stubbed_host_ms: list[float] = dataclasses.field(default_factory=list)
    losses: list[float] = dataclasses.field(default_factory=list)
    compilations: int = 0


def _model() -> torch.nn.Module:
    return tiny_bert(hidden=64, intermediate=128, positions=512)


def _configs(batch: int, length: int) -> list[_Config]:
    cpu = _model()
    ids = torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    cpu_optimizer = torch.optim.SGD(cpu.parameters(), lr=0.05)

    def cpu_step() -> float:
        cpu_optimizer.zero_grad()
        loss = cpu(**inputs).loss
        loss.backward()
        cpu_optimizer.step()
        return loss.item()

    def tpu_step(captured: bool = False) -> Callable[[], float]:
        # Its own copy of the weights: each configuration trains from the same start.
        tpu = copy.deepcopy(cpu).to("tpu")
        tpu_inputs = {name: t.to("tpu") for name, t in inputs.items()}
        tpu_optimizer = torch.optim.SGD(tpu.parameters(), lr=0.05)
        forward = torch.compile(tpu, backend="tpu", dynamic=False)
        update = torch.compile(tpu_optimizer.step, backend="tpu")

        def train() -> torch.Tensor:
            tpu_optimizer.zero_grad()
            loss = forward(**tpu_inputs).loss
            loss.backward()
            update()
            return loss

        issue = captured_step(train) if captured else train
        return lambda: issue().item()

    return [
        _Config("cpu_pytorch", cpu_step),
        _Config("compiled", tpu_step()),
        _Config("compiled_dispatch", tpu_step()),
        _Config("graphed", tpu_step(captured=True)),
    ]


def _run_steps(config: _Config, steps: int, record: bool, stubbed: bool = False) -> None:
    on_cpu = config.name == "cpu_pytorch"
    threads = torch.get_num_threads()
    if on_cpu:
        torch.set_num_threads(1)
    try:
        graphs = "dispatch" if config.name == "compiled_dispatch" else "defer"
        stubs = stubbed_execution() if stubbed else contextlib.nullcontext()
        with tpurec.mode("eager" if on_cpu else "fused"), tpurec.config.override(fused_compiled_graphs=graphs), stubs:
            before = tpurec.stats()["compilations"]
            for _ in range(steps):
                wall, host = time.perf_counter(), time.thread_time()
                loss = config.step()
                if record and stubbed:
                    config.stubbed_host_ms.append((time.thread_time() - host) * 1e3)
                elif record:
                    config.wall_ms.append((time.perf_counter() - wall) * 1e3)
                    config.host_ms.append((time.thread_time() - host) * 1e3)
                    config.losses.append(loss)
            if record and not on_cpu and not stubbed:
                config.compilations += tpurec.stats()["compilations"] - before
    finally:
        torch.set_num_threads(threads)


def main(argv: list[str] | None = None, prog: str = "python -m tpurec.bench transformer") -> dict:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--steps", type=positive_int, default=20, help="timed steps per configuration")
    parser.add_argument("--warmup", type=positive_int, default=5, help="untimed steps per configuration first")
    parser.add_argument(
        "--round-steps", type=positive_int, default=5, help="steps of one configuration before the next one's"
    )
    add_batch_size(parser, "sequences per step", type=positive_int, default=8)
    parser.add_argument("--length", type=positive_int, default=32, help="tokens per sequence (at most 512)")
    args = parser.parse_args(argv)
    if args.length > 512:
        parser.error(f"--length {args.length} exceeds the model's 512 positions")
    load_before = os.getloadavg()[0]
    configs = _configs(args.batch, args.length)
    for config in configs:
        _run_steps(config, args.warmup, record=False)
    run_in_rounds(configs, _run_steps, args.steps, args.round_steps)
    # Then the tpu configurations with their programs stubbed (host time only; it spoils the models).
    for config in configs[1:]:  # one after the other (see bench modes)
        _run_steps(config, args.warmup, record=False, stubbed=True)
        _run_steps(config, args.steps, record=True, stubbed=True)
    result: dict = {
        "benchmark": "transformer",
        "platform": tpurec.platform(),
        "batch": args.batch,
        "length": args.length,
        "load_average": {"before": load_before, "after": os.getloadavg()[0]},
        "thread_clock_tick_us": clocks.thread_clock_tick() * 1e6,
    }
    for config in configs:
        fine = clocks.fine_enough(min(config.wall_ms) / 1e3)  # else host figures would be clock ticks
        result[config.name] = {
            "step_ms": statistics.median(config.wall_ms),
            "min_step_ms": min(config.wall_ms),
            "host_ms_per_step": statistics.median(config.host_ms) if fine else None,
            "host_ms_per_step_stubbed": statistics.median(config.stubbed_host_ms)
            if config.stubbed_host_ms and fine
            else None,
            "last_loss": config.losses[-1],
        }
    for config in configs[1:]:
        result[config.name]["compilations_after_warmup"] = config.compilations
        result[f"{config.name}_speedup_vs_cpu"] = result["cpu_pytorch"]["step_ms"] / result[config.name]["step_ms"]
    return result
