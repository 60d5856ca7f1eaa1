"""Measures how long a tiny decoder LM's fused training step takes to compile, cold and from the disk cache.

Run on a machine with a TPU (``python tests/core/compile_latency_on_device.py``); it runs on XLA:CPU
too. Writes ``$OUT/compile_latency.json`` (or ./compile_latency.json), rewritten after every
measurement so that a run cut short keeps what it measured.

For each family (transformers' Llama, Qwen2, Gemma2, ... at the model zoo's tiny sizes: hidden 32, 2
layers, batch 2 x sequence 8, AdamW, every step inside ``with tpurec.mode("fused"):``), two new
processes share one fresh persistent cache folder (``TPUREC_CACHE_DIR``):

* ``cold``: the first, on an empty cache: every program is compiled;
* ``warm``: the second, the same steps: every program should come from the disk cache.

Each reports, per step, its wall time (until its loss is on the host) and where its compile
seconds went (``tpurec.stats()``: ``tracing``, ``lowering``, ``xla_compile``, ``cache_load``, and
by kind of program: fused windows with their op counts, single ops, ...), the programs compiled and
read from disk, and the time to import tpurec and to build and move the model. The cold process
also dumps the StableHLO of every program it lowers (``JAX_DUMP_IR_TO``) and the JSON summarises
the largest ones: their size in lines, how many operations mention ``f64`` (float64, which a TPU
emulates), ``while`` loops, and custom calls: what makes a program slow to compile.

    python tests/core/compile_latency_on_device.py --families llama qwen2 gemma2 --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

FAMILIES = ("llama", "qwen2", "gemma2", "mistral", "phi3", "qwen3")
_LM = dict(  # the model zoo's decoder LM sizes (tests/models/zoo.py)
    vocab_size=99,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def _model(family: str):
    import transformers as T

    classes = {
        "llama": (T.LlamaForCausalLM, T.LlamaConfig, {}),
        "qwen2": (T.Qwen2ForCausalLM, T.Qwen2Config, {}),
        "qwen3": (T.Qwen3ForCausalLM, T.Qwen3Config, {"head_dim": 8}),
        "mistral": (T.MistralForCausalLM, T.MistralConfig, {"sliding_window": 4}),
        "phi3": (T.Phi3ForCausalLM, T.Phi3Config, {}),
        "gemma2": (T.Gemma2ForCausalLM, T.Gemma2Config, {"head_dim": 8, "sliding_window": 4}),
    }
    model_cls, config_cls, overrides = classes[family]
    return model_cls(config_cls(**{**_LM, **overrides}))


def child(family: str, steps: int) -> dict:
    """One process's measurement (``TPUREC_CACHE_DIR`` and ``JAX_DUMP_IR_TO`` set by the parent)."""
    started = time.perf_counter()
    import torch

    import tpurec
    from tpurec.bench.compile_report import compile_since

    imported = time.perf_counter()
    import jax

    torch.manual_seed(0)
    model = _model(family)
    model.train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 99, (2, 8), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    before_move = tpurec.stats()
    model = model.to("tpu")
    batch = {k: v.to("tpu") for k, v in batch.items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.tpu.synchronize()
    moved = time.perf_counter()
    result: dict = {
        "family": family,
        "platform": tpurec.platform(),
        "device_kind": str(jax.devices()[0].device_kind),
        "import_seconds": imported - started,
        "build_and_move_seconds": moved - imported,
        "move_compile": compile_since(before_move),
        "steps": [],
    }
    for step in range(1, steps + 1):
        before, start = tpurec.stats(), time.perf_counter()
        with tpurec.mode("fused"):
            optimizer.zero_grad()
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
        value = loss.item()
        after = tpurec.stats()
        result["steps"].append(
            {
                "step": step,
                "seconds": time.perf_counter() - start,
                "loss": value,
                "compile": compile_since(before, after),
                "compilations": after["compilations"] - before["compilations"],
                "disk_hits": after["disk_hits"] - before["disk_hits"],
                "fused_graphs": after["fused_graphs"] - before["fused_graphs"],
                "fused_ops": after["fused_ops"] - before["fused_ops"],
            }
        )
    result["seconds_to_first_step"] = moved - started + result["steps"][0]["seconds"]
    return result


_NAME = re.compile(r"(stablehlo|chlo|mhlo)\.[a-z_]+")
_OP = re.compile(r"^\s*(?:%\S+(?:, %\S+)* = )?\"?(stablehlo|chlo|mhlo|func|sdy)\.[a-z_]+")


def summarize_dumps(directory: str, top: int = 8) -> dict:
    """The dumped StableHLO modules: how many, their total size, and the largest ones' makeup."""
    modules = []
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        if not name.endswith(".mlir"):
            continue
        with open(os.path.join(directory, name), errors="replace") as f:
            lines = f.read().splitlines()
        ops = [line for line in lines if _OP.match(line)]
        f64_by_name: dict[str, int] = {}
        for line in ops:
            if "f64" in line:
                op = _NAME.search(line)
                key = op.group(0) if op else "?"
                f64_by_name[key] = f64_by_name.get(key, 0) + 1
        modules.append(
            {
                "file": name,
                "lines": len(lines),
                "operations": len(ops),
                "operations_with_f64": sum("f64" in line for line in ops),
                "while_loops": sum("stablehlo.while" in line for line in ops),
                "custom_calls": sum("custom_call" in line for line in ops),
                "f64_operations_by_name": dict(sorted(f64_by_name.items(), key=lambda kv: -kv[1])[:10]),
            }
        )
    modules.sort(key=lambda m: -m["operations"])
    return {
        "modules": len(modules),
        "operations": sum(m["operations"] for m in modules),
        "operations_with_f64": sum(m["operations_with_f64"] for m in modules),
        "largest": modules[:top],
    }


def _run_child(family: str, steps: int, cache: str, dump: str | None, timeout: float) -> dict:
    env = {**os.environ, "TPUREC_CACHE_DIR": cache}
    if dump:
        env["JAX_DUMP_IR_TO"] = dump
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--child", family, "--steps", str(steps)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return {"family": family, "error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - start
    if proc.returncode != 0 or "RESULT " not in proc.stdout:
        return {"family": family, "error": f"exit {proc.returncode}: {proc.stderr[-2000:]}"}
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    result["process_seconds"] = wall
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=["llama", "gemma2"], choices=FAMILIES)
    parser.add_argument("--steps", type=int, default=3, help="fused training steps per process")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per process at most")
    parser.add_argument("--child", choices=FAMILIES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.steps)))
        return {}
    out_dir = os.environ.get("OUT", ".")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "compile_latency.json")
    report: dict = {"steps": args.steps, "runs": []}
    for family in args.families:
        with tempfile.TemporaryDirectory(prefix="tpurec-compile-latency-") as scratch:
            cache, dump = os.path.join(scratch, "cache"), os.path.join(scratch, "dump")
            entry: dict = {"family": family}
            entry["cold"] = _run_child(family, args.steps, cache, dump, args.timeout)
            entry["cold_stablehlo"] = summarize_dumps(dump)
            entry["warm"] = _run_child(family, args.steps, cache, None, args.timeout)
            report["runs"].append(entry)
            with open(path, "w") as f:
                json.dump(report, f, indent=2)
            for kind in ("cold", "warm"):
                run = entry[kind]
                first = run.get("seconds_to_first_step")
                print(
                    f"{family} {kind}: "
                    + (f"{first:.1f} s to the first step" if first is not None else run.get("error", "")[:300]),
                    file=sys.stderr,
                )
    print(f"wrote {path}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
