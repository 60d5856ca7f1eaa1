"""A step's device time on a real TPU, next to the host time measured here.

On XLA:CPU the device and Python share the host's cores, so a step's wall time says
little about how long a TPU would need for it. This benchmark takes the one XLA program
that a fused (or compiled) training step runs, exports it for the ``tpu`` platform with
``jax.export`` (StableHLO, serialized; CPU-only native kernels are behind
``lax.platform_dependent``, so the exported program keeps XLA's own ops), and times it on
a machine that has a TPU and JAX, but needs neither torch nor tpurec there.

Two steps:

* ``python -m tpurec.bench device_time export --out DIR`` (here): runs warm-up steps of
  the ``bench modes`` dense step (batch 512 and 4096; ``fused`` and ``compiled_optim``) and
  of the ``bench transformer`` tiny BERT step (``compiled``), captures each step's fused
  program and its inputs, and writes ``DIR/<name>.jaxexport`` (the program),
  ``DIR/<name>.npz`` (its inputs, small ones as they are) and ``DIR/index.json`` (per
  program: input shapes and dtypes, the host ms per step measured here).
* ``python tpurec/bench/device_time.py run DIR`` (on the TPU machine; only JAX and numpy
  are imported): runs each program ``--iters`` times and prints JSON: device ms per step
  (median of single runs waited for one by one, and the mean of a pipelined loop), next
  to the host ms per step from the export.

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


def _capture_step(step: Callable[[], Any]) -> tuple[Any, list]:
    """Runs ``step`` once; returns the fused program it ran and that program's arguments (numpy copies)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tpurec.core import runtime

    captured: list = []
    original = runtime.Program.__call__

    def spy(self, *args):
        if self.origin is not None and self.origin[0] == "fused":
            # Copied before the call: the program donates (deletes) some of its inputs.
            captured.append((self, jax.tree_util.tree_map(lambda x: np.asarray(jnp.asarray(x)), args)))
        return original(self, *args)

    runtime.Program.__call__ = spy
    try:
        step()
    finally:
        runtime.Program.__call__ = original
    if len(captured) != 1:
        raise RuntimeError(f"expected one fused program per step, the step ran {len(captured)}")
    return captured[0]


def _host_ms(step: Callable[[], Any], steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.thread_time()
        step()
        times.append((time.thread_time() - start) * 1e3)
    return statistics.median(times)


CONFIGS = ("modes_fused", "modes_compiled_optim", "transformer_compiled")


def _steps(configs: list[str], batches: list[int]) -> dict[str, tuple[Callable[[], Any], str]]:
    """name -> (step, mode) of each configuration exported."""
    from tpurec.bench import modes, transformer

    steps: dict[str, tuple[Callable[[], Any], str]] = {}
    for batch in batches:
        for name in ("fused", "compiled_optim"):
            if f"modes_{name}" in configs:
                config = modes._make(name, batch)
                steps[f"modes_{name}_b{batch}"] = (config.step, config.mode)
    if "transformer_compiled" in configs:
        steps["transformer_compiled_b8x32"] = (transformer._configs(8, 32)[1].step, "fused")
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
    """Exports each configuration's fused step program for ``platform`` into ``out``; returns the index."""
    import jax
    import numpy as np

    import tpurec

    # For "cpu" (to check the runner here) the programs use XLA's own dots, as a TPU program does:
    # tpurec's native XLA:CPU kernels are custom calls that only a process with tpurec serves.
    def settings():
        return tpurec.config.override(native_matmul=False) if platform == "cpu" else contextlib.nullcontext()

    os.makedirs(out, exist_ok=True)
    index: dict = {"jax_version": jax.__version__, "programs": {}}
    for name, (step, mode) in _steps(list(configs or CONFIGS), batches).items():
        with tpurec.mode(mode), settings():
            for _ in range(warmup):
                step()
            host = _host_ms(step, host_steps)
            program, args = _capture_step(step)
            arrays, tree = jax.tree_util.tree_flatten(args)  # numpy copies (see _capture_step)
            specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
            # Traced again here, under the same settings as the step.
            exported = jax.export.export(jax.jit(program.raw), platforms=(platform,))(
                *jax.tree_util.tree_unflatten(tree, specs)
            )
        with open(os.path.join(out, f"{name}.jaxexport"), "wb") as f:
            f.write(exported.serialize())
        saved: dict[str, Any] = {f"a{k}": a for k, a in enumerate(arrays) if a.nbytes <= max_saved_mb * 2**20}
        np.savez(os.path.join(out, f"{name}.npz"), allow_pickle=False, **saved)
        index["programs"][name] = {
            "host_ms_per_step": host,
            "inputs": [[list(a.shape), str(a.dtype)] for a in arrays],
            "input_bytes": int(sum(a.nbytes for a in arrays)),
        }
        print(f"exported {name}: {len(arrays)} inputs, host {host:.2f} ms per step", file=sys.stderr)
    with open(os.path.join(out, "index.json"), "w") as f:
        json.dump(index, f, indent=1)
    return index


# --- run (needs only JAX and numpy) ---------------------------------------------------


def run_exported(directory: str, iters: int) -> dict:
    """Times each exported program of ``directory`` on JAX's default device; returns the JSON."""
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
        "programs": {},
    }
    rng = np.random.default_rng(0)
    for name, entry in index["programs"].items():
        with open(os.path.join(directory, f"{name}.jaxexport"), "rb") as f:
            exported = jax.export.deserialize(bytearray(f.read()))
        saved = np.load(os.path.join(directory, f"{name}.npz"))
        flat = []
        for k, (shape, dtype) in enumerate(entry["inputs"]):
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
        single = []
        for _ in range(iters):
            start = time.perf_counter()
            jax.block_until_ready(call(*args))
            single.append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        outs = None
        for _ in range(iters):
            outs = call(*args)
        jax.block_until_ready(outs)
        pipelined = (time.perf_counter() - start) * 1e3 / iters
        host = entry["host_ms_per_step"]
        result["programs"][name] = {
            "device_ms_median": statistics.median(single),
            "device_ms_min": min(single),
            "device_ms_pipelined": pipelined,
            "host_ms_per_step_exported_from": host,
            "host_over_device": host / pipelined,
        }
    return result


def main(argv: list[str] | None = None, prog: str = "python -m tpurec.bench device_time") -> dict:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    export = sub.add_parser("export", help="export the step programs for TPU (here)")
    export.add_argument("--out", required=True, help="directory to write the programs and inputs to")
    export.add_argument("--batch", type=int, nargs="+", default=[512, 4096], help="bench modes batches")
    export.add_argument("--warmup", type=int, default=5)
    export.add_argument("--host-steps", type=int, default=20, help="steps timed for the host ms")
    export.add_argument("--max-saved-mb", type=float, default=1.0, help="larger inputs are made up on the TPU")
    export.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    export.add_argument("--platform", default="tpu", choices=("tpu", "cpu"), help="cpu: to check the runner here")
    run = sub.add_parser("run", help="time the exported programs (on the TPU machine)")
    run.add_argument("directory")
    run.add_argument("--iters", type=int, default=50)
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
