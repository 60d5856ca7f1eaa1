"""Time to the first finished training step of zoo families, from a cold and from a warm persistent cache.

For each family and mode, two fresh processes train the zoo's tiny model (tests/models/zoo.py:
AdamW, batch 2) for three steps on the tpu device, both with one new persistent cache folder
(``TPUREC_CACHE_DIR``): the first finds it empty (cold), the second finds what the first wrote
(warm). Each reports, per step, the wall time to its loss on the host and what compiled, from
``tpurec.stats()``: programs compiled and read from disk, compile seconds by phase (tracing, lowering,
XLA, cache load) and by program (largest first); then, outside the timed steps, each compiled
program's StableHLO size and its float64 lines (a TPU emulates float64). One JSON per family and
mode goes to stdout and, when ``OUT`` is set, to ``$OUT/compile_latency_<family>_<mode>.json``.

Run on the chip (the defaults: llama, gpt2 and resnet in fused mode, at most 7 minutes by ``--budget``)::

    OUT=/tmp/out python tests/models/compile_latency_on_device.py

and on CPU (``--families mlp``: a two-layer MLP, seconds)::

    python tests/models/compile_latency_on_device.py --families mlp --modes fused
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

STEPS = 3
_OPERATION = re.compile(r"^\s*(?:%\S+(?:, %\S+)* = )?\"?((?:stablehlo|chlo)\.[a-z_]+)", re.M)


def _mlp():
    import torch

    class Mlp(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 3))

        def forward(self, x, labels):
            return type("Out", (), {"loss": torch.nn.functional.cross_entropy(self.net(x), labels)})()

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return Mlp(), {"x": torch.randn(4, 16, generator=g), "labels": torch.randint(0, 3, (4,), generator=g)}


def _model_and_batch(family: str):
    if family == "mlp":
        return _mlp()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import zoo

    model, batch, _ = zoo.initial(zoo.FAMILIES[family])
    return model, batch


def _sizes(lowered: list) -> list[dict[str, Any]]:
    """StableHLO operations and float64 lines of each program compiled, from its lowering (after the steps).

    The lowering is the one this process's platform compiles (on the chip, the TPU's)."""
    sizes = []
    for label, jitted, specs in lowered:
        try:
            text = jitted.lower(*specs).as_text()
        except Exception as error:  # noqa: BLE001 (a size that cannot be had is reported, not fatal)
            sizes.append({"program": label, "error": f"{type(error).__name__}: {error}"[:200]})
            continue
        body = [line for line in text.splitlines() if "func.func" not in line]
        sizes.append(
            {
                "program": label,
                "stablehlo_ops": len(_OPERATION.findall(text)),
                "f64_lines": sum("f64" in line for line in body),
                # Which operations touch float64 (the packed runtime scalars' slices and converts, or arithmetic).
                "f64_ops": dict(Counter(op for line in body if "f64" in line for op in _OPERATION.findall(line))),
            }
        )
    return sorted(sizes, key=lambda s: -s.get("stablehlo_ops", 0))


def child(family: str, mode: str) -> dict[str, Any]:
    """Trains ``family`` for ``STEPS`` steps in ``mode`` in this process; what each step took and compiled."""
    started = time.perf_counter()
    import jax
    import torch

    import tpurec
    from tpurec.bench.compile_report import compile_since
    from tpurec.core import accounting, runtime

    imported = time.perf_counter() - started
    lowered: list = []
    execute = runtime.Program._execute

    def observed(self, jitted, args):  # keeps each new program's argument shapes for _sizes
        if not self.ran:
            specs = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x, args
            )
            lowered.append((accounting._compile_label(self.origin), jitted, specs))
        return execute(self, jitted, args)

    runtime.Program._execute = observed
    from tpurec.compile import backend

    run_graph = backend.CompiledGraph._execute

    def observed_graph(self, variant, inputs, seeds):  # the same for torch.compile's graphs
        if not variant.ran:
            arrays = [v for v in inputs if not isinstance(v, (int, float, bool))]
            specs = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x,
                (arrays, self.program.constants, seeds),
            )
            lowered.append((accounting._compile_label(variant.origin), variant.jitted, specs))
        return run_graph(self, variant, inputs, seeds)

    backend.CompiledGraph._execute = observed_graph
    model, batch = _model_and_batch(family)
    model.train()
    model = model.to("tpu")
    batch = {k: v.to("tpu") if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    forward = torch.compile(model, backend="tpu") if mode == "compiled" else model
    context = (lambda: tpurec.mode("fused")) if mode == "fused" else contextlib.nullcontext
    steps = []
    first = time.perf_counter()
    for step in range(1, STEPS + 1):
        before, t = tpurec.stats(), time.perf_counter()
        with context():
            optimizer.zero_grad()
            loss = forward(**batch).loss
            loss.backward()
            optimizer.step()
        value = float(loss.detach().cpu())
        seconds = time.perf_counter() - t
        report = compile_since(before)
        after = tpurec.stats()
        steps.append(
            {
                "step": step,
                "seconds": round(seconds, 3),
                "loss": value,
                "compile_requests": after["compile_requests"] - before["compile_requests"],
                "disk_hits": after["disk_hits"] - before["disk_hits"],
                "compile_seconds": round(report["seconds"], 3),
                "phases": {k: round(v, 3) for k, v in report["phases"].items()},
                "by_program": {
                    label: {k: round(v, 3) if isinstance(v, float) else v for k, v in entry.items()}
                    for label, entry in report["by_program"].items()
                },
            }
        )
    return {
        "platform": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "import_seconds": round(imported, 2),
        "first_step_seconds": steps[0]["seconds"],
        "to_first_steady_step_seconds": round(sum(s["seconds"] for s in steps[:2]), 3),
        "steps": steps,
        "programs": _sizes(lowered),
        "seconds_since_start": round(time.perf_counter() - first, 2),
    }


def _run_child(family: str, mode: str, cache: str, timeout: float) -> dict[str, Any]:
    env = {**os.environ, "TPUREC_CACHE_DIR": cache}
    command = [sys.executable, __file__, "--child", family, mode]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    wall = round(time.perf_counter() - started, 2)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return {"error": f"exit {done.returncode}: {done.stderr.strip()[-1500:]}", "process_seconds": wall}
    return {**json.loads(lines[-1]), "process_seconds": wall}


def measure(family: str, mode: str, timeout: float) -> dict[str, Any]:
    """The cold and the warm run of ``family`` in ``mode``, each in a new process, sharing a new cache folder."""
    # (This process never starts JAX: a TPU is opened by one process at a time, and the children need it.)
    with tempfile.TemporaryDirectory(prefix="tpurec-cache-") as cache:
        cold = _run_child(family, mode, cache, timeout)
        warm = _run_child(family, mode, cache, timeout)
    platform = cold.get("platform") or warm.get("platform")
    return {"family": family, "mode": mode, "platform": platform, "cold": cold, "warm": warm}


def _summary(result: dict[str, Any]) -> str:
    parts = [f"{result['family']} {result['mode']}:"]
    for run in ("cold", "warm"):
        r = result[run]
        if "error" in r:
            parts.append(f"{run} ERROR {r['error'][:200]}")
            continue
        s1 = r["steps"][0]
        top = max(r["programs"], key=lambda p: p.get("stablehlo_ops", 0), default={})
        parts.append(
            f"{run} first step {r['first_step_seconds']:.2f} s (compiled {s1['compile_requests'] - s1['disk_hits']}, "
            f"from disk {s1['disk_hits']}; {', '.join(f'{k} {v:.2f}' for k, v in s1['phases'].items())}), "
            f"to step 2 {r['to_first_steady_step_seconds']:.2f} s; largest program {top.get('stablehlo_ops')} ops, "
            f"{top.get('f64_lines')} f64 lines;"
        )
    return " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--families", default="llama,gpt2,resnet", help="zoo families (or mlp), comma-separated")
    parser.add_argument("--modes", default="fused", help="fused, compiled, eager; comma-separated")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per process")
    parser.add_argument(
        "--budget",
        type=float,
        default=420.0,
        help="seconds for the whole run: the pairs left when it is spent are skipped",
    )
    parser.add_argument("--child", nargs=2, metavar=("FAMILY", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    out = os.environ.get("OUT")
    started = time.perf_counter()
    for family in args.families.split(","):
        for mode in args.modes.split(","):
            left = args.budget - (time.perf_counter() - started)
            if left < 30:
                print(f"{family} {mode}: skipped, the --budget of {args.budget:.0f} s is spent", file=sys.stderr)
                continue
            result = measure(family, mode, min(args.timeout, left / 2))
            print(_summary(result), file=sys.stderr, flush=True)
            print(json.dumps(result), flush=True)
            if out:
                Path(out, f"compile_latency_{family}_{mode}.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
