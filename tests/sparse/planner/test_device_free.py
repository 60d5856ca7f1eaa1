"""The planner and the leaf below it (tpurec.sparse.sharding_plan) run without the device runtime.

``tpurec.sparse.DEVICE_FREE_LAYERS`` says so and tests/core/test_layering.py
checks their imports as written; here a subprocess runs them: it sets the two
package ``__init__`` files aside (``import tpurec`` loads the device runtime
for users, and ``import tpurec.sparse`` the embedding modules), registers only
the ``tpu`` device name, plans, writes and reads the plan, validates it, counts
its traffic and asks the CLI for its help, then lists what was imported:
nothing of ``tpurec.core``, ``tpurec.dense``, the sparse ops or JAX.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import tpurec

PACKAGE_ROOT = pathlib.Path(tpurec.__file__).parent

SCRIPT = textwrap.dedent(
    """
    import contextlib, io, json, pathlib, runpy, sys, types

    import torch

    root = pathlib.Path(sys.argv[1])
    for name, path in (("tpurec", root), ("tpurec.sparse", root / "sparse")):
        package = types.ModuleType(name)
        package.__path__ = [str(path)]
        sys.modules[name] = package
    torch.utils.rename_privateuse1_backend("tpu")  # the device name plans place shards on

    from tpurec.sparse.planner import (
        TableSpec, distribution_bytes, executed_distribution_bytes, plan, plan_from_json, plan_to_json, validate_plan,
    )

    tables = [TableSpec("small", 1000, 16, pooling_factor=2.0), TableSpec("large", 100_000, 64)]
    result, report = plan(tables, "v5p-8", batch_size=64)
    again = plan_from_json(json.loads(json.dumps(plan_to_json(result))))
    validate_plan(again, tables, 4)
    payload = distribution_bytes(again, tables, 4, 64).total.max_per_device
    buffers = executed_distribution_bytes(again, tables, 4, 64)["total"]
    sys.argv = ["tpurec plan", "--help"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_module("tpurec.sparse.planner", run_name="__main__")
        except SystemExit as e:
            status = e.code
    print(json.dumps({
        "tables": sorted(t for m in again.plan.values() for t in m),
        "payload": payload, "buffers": buffers, "help_status": status, "help": out.getvalue(),
        "modules": sorted(m for m in sys.modules if m.startswith("tpurec")),
        "jax": "jax" in sys.modules,
    }))
    """
)


def test_the_planner_plans_and_counts_without_the_device_runtime():
    env = {**os.environ, "PYTHONPATH": str(PACKAGE_ROOT.parent)}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(PACKAGE_ROOT)], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["tables"] == ["large", "small"]
    assert got["payload"] > 0 and got["buffers"] >= got["payload"]
    assert got["help_status"] == 0 and "--topology" in got["help"]
    outside = [
        m
        for m in got["modules"]
        if m not in ("tpurec", "tpurec.sparse", "tpurec.cli")
        and not m.startswith(("tpurec.sparse.planner", "tpurec.sparse.sharding_plan"))
    ]
    assert outside == []
    assert not got["jax"]
