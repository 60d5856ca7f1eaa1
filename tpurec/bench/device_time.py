"""A step's device time on a real TPU, next to the host time measured here.

On XLA:CPU the device and Python share the host's cores, so a step's wall time says
little about how long a TPU would need for it. This benchmark takes the XLA programs that
a fused (or compiled) training step runs, exports them for the ``tpu`` platform with
``jax.export`` (StableHLO, serialized; CPU-only native kernels are behind
``lax.platform_dependent``, so the exported programs keep XLA's own ops), and times them on
a machine that has a TPU and JAX, but needs neither torch nor tpurec there.

Two steps:

* ``python -m tpurec.bench device_time export --out DIR`` (here): runs warm-up steps of
  the ``bench modes`` dense step (batch 512 and 4096; ``fused``, and ``compiled_optim`` with
  each compiled graph deferred to the loss read and dispatched at once,
  ``TPUREC_FUSED_COMPILED_GRAPHS``) and of the ``bench transformer`` tiny BERT step
  (``compiled``, both ways). Per step it measures the host time (main thread CPU ms) and the
  host time at which each fused program is enqueued, captures the programs and their inputs,
  and writes ``DIR/<name>.p<k>.jaxexport`` (program k), ``DIR/<name>.p<k>.npz`` (its inputs,
  small ones as they are) and ``DIR/index.json``.
* ``python tpurec/bench/device_time.py run DIR`` (on the TPU machine; only JAX and numpy
  are imported): prints JSON per step: device ms (the programs waited for one by one, and
  a pipelined loop), and the step **replayed** on the device as the host ran it (each
  program enqueued at its measured host time, the host's work in between a busy wait, all
  programs waited for where the last call returned, as the step's ``loss.item()`` does, then
  the host's remaining work).

Inputs larger than ``--max-saved-mb`` are not saved; the runner fills them with normal
random values of the right shape and dtype (a step's time does not depend on the values
of its dense floats).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

__all__ = ["export_steps", "run_exported"]


# --- export (needs torch and tpurec) ------------------------------------------------


def _spy_programs(before: Callable[[Any, tuple], None], after: Callable[[], None] | None = None):
    """A context in which every fused program call is passed to ``before(program, args)`` first.

    ``after()`` runs once the call has returned (the program is enqueued, not finished).
    """
    from tpurec.core import Program

    original = Program.__call__

    def spy(self, *args):
        if self.origin is None or self.origin[0] != "fused":
            return original(self, *args)
        before(self, args)
        out = original(self, *args)
        if after is not None:
            after()
        return out

    @contextlib.contextmanager
    def installed():
        Program.__call__ = spy
        try:
            yield
        finally:
            Program.__call__ = original

    return installed()


def _schedule(step: Callable[[], Any], steps: int) -> tuple[float, list[float], float]:
    """Host ms of a step; per fused program it runs, the host ms at which it is enqueued; when the last call returned.

    Host time is the main thread's CPU time (waits for a result cost none), counted from the
    step's start; each figure is the median over ``steps`` steps.
    """
    totals: list[float] = []
    offsets: list[list[float]] = []
    returned: list[float] = []
    for _ in range(steps):
        calls: list[float] = []
        last: list[float] = []
        start = time.thread_time()
        with _spy_programs(
            lambda program, args: calls.append((time.thread_time() - start) * 1e3),
            lambda: last.append((time.thread_time() - start) * 1e3),
        ):
            step()
        totals.append((time.thread_time() - start) * 1e3)
        if offsets and len(calls) != len(offsets[0]):
            raise RuntimeError(f"a warm step ran {len(calls)} fused programs, an earlier one {len(offsets[0])}")
        offsets.append(calls)
        returned.append(last[-1])
    return statistics.median(totals), [statistics.median(c) for c in zip(*offsets)], statistics.median(returned)


def _capture_step(step: Callable[[], Any]) -> list[tuple[Any, Any]]:
    """Runs ``step`` once; returns each fused program it ran, in order, with its arguments (numpy copies)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    captured: list = []

    def record(program, args):
        # Copied before the call: the program donates (deletes) some of its inputs.
        captured.append((program, jax.tree_util.tree_map(lambda x: np.asarray(jnp.asarray(x)), args)))

    with _spy_programs(record):
        step()
    if not captured:
        raise RuntimeError("the step ran no fused program")
    return captured


CONFIGS = (
    "modes_fused",
    "modes_compiled_optim",
    "modes_compiled_optim_dispatch",
    "transformer_compiled",
    "transformer_compiled_dispatch",
)


def _steps(configs: list[str], batches: list[int]) -> dict[str, tuple[Callable[[], Any], str, str | None]]:
    """name -> (step, mode, TPUREC_FUSED_COMPILED_GRAPHS or None: no compiled graph) of each configuration."""
    from tpurec.bench import modes, transformer

    steps: dict[str, tuple[Callable[[], Any], str, str | None]] = {}
    for batch in batches:
        for name, base, graphs in (
            ("fused", "fused", None),
            ("compiled_optim", "compiled_optim", "defer"),
            ("compiled_optim_dispatch", "compiled_optim", "dispatch"),
        ):
            if f"modes_{name}" in configs:
                config = modes._make(base, batch)
                steps[f"modes_{name}_b{batch}"] = (config.step, config.mode, graphs)
    for name, graphs in (("transformer_compiled", "defer"), ("transformer_compiled_dispatch", "dispatch")):
        if name in configs:
            steps[f"{name}_b8x32"] = (transformer._configs(8, 32)[1].step, "fused", graphs)
    return steps


def export_steps(
    out: str,
    batches: list[int],
    warmup: int,
    host_steps: int,
    max_saved_mb: float,
    platform: str = "tpu",
    configs: list[str] | None = None,
) -> dict:
    """Exports the fused programs of each configuration's step for ``platform`` into ``out``; returns the index."""
    import jax
    import numpy as np

    import tpurec

    # For "cpu" (to check the runner here) the programs use XLA's own dots, as a TPU program does:
    # tpurec's native XLA:CPU kernels are custom calls that only a process with tpurec serves.
    def settings(graphs: str | None):
        values: dict[str, Any] = {} if graphs is None else {"fused_compiled_graphs": graphs}
        if platform == "cpu":
            values["native_matmul"] = False
        return tpurec.config.override(**values)

    os.makedirs(out, exist_ok=True)
    index: dict = {"jax_version": jax.__version__, "steps": {}}
    for name, (step, mode, graphs) in _steps(list(configs or CONFIGS), batches).items():
        programs = []
        with tpurec.mode(mode), settings(graphs):
            for _ in range(warmup):
                step()
            host, offsets, returned = _schedule(step, host_steps)
            captured = _capture_step(step)
            if len(captured) != len(offsets):
                raise RuntimeError(f"{name}: the captured step ran {len(captured)} programs, not {len(offsets)}")
            for k, ((program, args), offset) in enumerate(zip(captured, offsets)):
                arrays, tree = jax.tree_util.tree_flatten(args)  # numpy copies (see _capture_step)
                specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
                # Traced again here, under the same settings as the step.
                exported = jax.export.export(jax.jit(program.raw), platforms=(platform,))(
                    *jax.tree_util.tree_unflatten(tree, specs)
                )
                stem = f"{name}.p{k}"
                with open(os.path.join(out, f"{stem}.jaxexport"), "wb") as f:
                    f.write(exported.serialize())
                saved = {f"a{i}": a for i, a in enumerate(arrays) if a.nbytes <= max_saved_mb * 2**20}
                np.savez(os.path.join(out, f"{stem}.npz"), allow_pickle=False, **saved)
                programs.append(
                    {
                        "file": stem,
                        "enqueued_at_host_ms": offset,
                        "inputs": [[list(a.shape), str(a.dtype)] for a in arrays],
                        "input_bytes": int(sum(a.nbytes for a in arrays)),
                    }
                )
        index["steps"][name] = {
            "host_ms_per_step": host,
            "last_call_returned_at_host_ms": returned,
            "compiled_graphs": graphs,
            "programs": programs,
        }
        at = ", ".join(f"{p['enqueued_at_host_ms']:.2f}" for p in programs)
        print(f"exported {name}: {len(programs)} programs enqueued at host ms {at} of {host:.2f}", file=sys.stderr)
    with open(os.path.join(out, "index.json"), "w") as f:
        json.dump(index, f, indent=1)
    return index


# --- run (needs only JAX and numpy) ---------------------------------------------------


def _spin_until(deadline: float) -> None:
    while time.perf_counter() < deadline:
        pass


def run_exported(directory: str, iters: int) -> dict:
    """Times each exported step of ``directory`` on JAX's default device; returns the JSON.

    Per step: each program alone (waited for one by one), the programs in a loop waited for
    once at the end (pipelined), and the step replayed as the host ran it: each program is
    enqueued at the host time the export measured (the host's work in between is a busy
    wait); where the last call returned, all of them are waited for (the step's
    ``loss.item()``; a read that needs only an earlier program would wait less), and the
    host's work after that read follows. The replayed step's time is what a TPU behind this
    host would give per step.
    """
    import jax
    import numpy as np

    # tpurec runs JAX with 64-bit types on (int64 indices are program inputs).
    jax.config.update("jax_enable_x64", True)
    with open(os.path.join(directory, "index.json")) as f:
        index = json.load(f)
    device = jax.devices()[0]
    result: dict = {
        "benchmark": "device_time",
        "device": f"{device.platform} {getattr(device, 'device_kind', '')}",
        "jax_version": jax.__version__,
        "exported_with_jax": index["jax_version"],
        "steps": {},
    }
    rng = np.random.default_rng(0)
    for name, entry in index["steps"].items():
        calls = []
        for program in entry["programs"]:
            with open(os.path.join(directory, f"{program['file']}.jaxexport"), "rb") as f:
                exported = jax.export.deserialize(bytearray(f.read()))
            saved = np.load(os.path.join(directory, f"{program['file']}.npz"))
            flat = []
            for k, (shape, dtype) in enumerate(program["inputs"]):
                if f"a{k}" in saved:
                    value = saved[f"a{k}"]
                elif np.issubdtype(np.dtype(dtype), np.floating):
                    value = rng.standard_normal(shape).astype(dtype)
                else:
                    value = np.zeros(shape, dtype)
                flat.append(jax.device_put(value, device))
            args = jax.tree_util.tree_unflatten(exported.in_tree, flat)[0]
            call = jax.jit(exported.call)
            jax.block_until_ready(call(*args))  # compile
            calls.append((call, args, program["enqueued_at_host_ms"] / 1e3))
        single = []
        for _ in range(iters):
            total = 0.0
            for call, args, _ in calls:
                start = time.perf_counter()
                jax.block_until_ready(call(*args))
                total += time.perf_counter() - start
            single.append(total * 1e3)
        start = time.perf_counter()
        outs = None
        for _ in range(iters):
            for call, args, _ in calls:
                outs = call(*args)
        jax.block_until_ready(outs)
        pipelined = (time.perf_counter() - start) * 1e3 / iters
        host = entry["host_ms_per_step"]
        returned = entry["last_call_returned_at_host_ms"] / 1e3
        replayed = []
        for _ in range(iters):
            start = time.perf_counter()
            for call, args, at in calls:
                _spin_until(start + at)
                outs = call(*args)
            # The host's own work up to where its last call returned, then the step's read of
            # the loss (waits for every program), then the host's work after that read.
            _spin_until(start + returned)
            jax.block_until_ready(outs)
            _spin_until(time.perf_counter() + host / 1e3 - returned)
            replayed.append((time.perf_counter() - start) * 1e3)
        step_ms = statistics.median(replayed)
        result["steps"][name] = {
            "programs": len(calls),
            "compiled_graphs": entry["compiled_graphs"],
            "device_ms_median": statistics.median(single),
            "device_ms_min": min(single),
            "device_ms_pipelined": pipelined,
            "host_ms_per_step_exported_from": host,
            "host_over_device": host / pipelined,
            "replayed_step_ms": step_ms,
            "replayed_wait_ms": step_ms - host,
        }
    return result


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """tpurec.cli.HelpFormatter's behaviour (defaults shown), without importing tpurec: ``run`` needs only JAX."""


def main(argv: list[str] | None = None, prog: str = "python -m tpurec.bench device_time") -> dict:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=_HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    export = sub.add_parser("export", help="export the step programs for TPU (here)", formatter_class=_HelpFormatter)
    export.add_argument("--out", required=True, help="directory to write the programs and inputs to")
    # --batch-size, tpurec's one spelling; --batch (the earlier one) stays accepted, hidden.
    export.add_argument(
        "--batch-size", dest="batch", type=int, nargs="+", default=[512, 4096], help="bench modes batches"
    )
    export.add_argument("--batch", dest="batch", type=int, nargs="+", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    export.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    export.add_argument("--host-steps", type=int, default=20, help="steps timed for the host ms")
    export.add_argument("--max-saved-mb", type=float, default=1.0, help="larger inputs are made up on the TPU")
    export.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS, help="step programs to export")
    export.add_argument("--platform", default="tpu", choices=("tpu", "cpu"), help="cpu: to check the runner here")
    run = sub.add_parser("run", help="time the exported programs (on the TPU machine)", formatter_class=_HelpFormatter)
    run.add_argument("directory", help="the directory export wrote")
    run.add_argument("--iters", type=int, default=50, help="timed calls per program")
    args = parser.parse_args(argv)
    if args.command == "export":
        return export_steps(
            args.out, args.batch, args.warmup, args.host_steps, args.max_saved_mb, args.platform, args.configs
        )
    return run_exported(args.directory, args.iters)


if __name__ == "__main__":
    # Run as a file on the TPU machine: no tpurec (nor torch) import.
    json.dump(main(sys.argv[1:], prog="python tpurec/bench/device_time.py"), sys.stdout, indent=2)
    print()
