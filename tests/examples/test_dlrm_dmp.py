"""examples/dlrm/train.py --dist dmp: TorchRec's DistributedModelParallel and TrainPipelineSparseDist
through the script's command line, under torchrun with 2 processes (one XLA:CPU device each): the
tables planned by tpurec's planner at start-up or read from a ``tpurec plan --json`` file."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
from forked_runs import run_forked
from launcher import environment, run
from ports import free_port_pair

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "dlrm", "train.py")

SMALL = [
    "--num_embeddings", "100", "--embedding_dim", "16", "--dense_arch_layer_sizes", "32,16",
    "--over_arch_layer_sizes", "32,1", "--batch_size", "16", "--limit_train_batches", "8",
    "--limit_val_batches", "2", "--limit_test_batches", "2", "--learning_rate", "0.05",
]  # fmt: skip
SECONDS = 420


def _env() -> dict[str, str]:
    return environment(OMP_NUM_THREADS="1")


def _torchrun(*args: str) -> str:
    """``torchrun --nproc-per-node 2 train.py --dist dmp ARGS``: its output, or a test failure (bounded)."""
    return run(SCRIPT, 2, "--dist", "dmp", *args, env=_env(), seconds=SECONDS).output


def _write_plan(tmp_path, devices: int) -> str:
    """A plan of SMALL's 26 tables for ``devices`` devices, written by ``tpurec plan --json``."""
    tables = tmp_path / "tables.json"
    tables.write_text(json.dumps({
        "embedding_dim": 16,
        "tables": [{"name": f"t_cat_{i}", "num_embeddings": 100, "feature_names": [f"cat_{i}"]} for i in range(26)],
    }))  # fmt: skip
    plan = tmp_path / "plan.json"
    topology = {1: "v5p-2", 2: "v5p-4"}[devices]
    out = subprocess.run(
        [sys.executable, "-m", "tpurec", "plan", "--topology", topology, "--tables", str(tables), "--batch-size",
         str(16 * devices), "--optimizer", "sgd", "--json", str(plan), "--no-torchrec-compare"],
        env=_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return str(plan)


def _summary(output: str) -> tuple[float, float, int, int]:
    """The summary line's held-out AUC, last loss, test samples and steps per process."""
    summary = re.search(
        r"held-out AUC ([0-9.]+), .* \((\d+) test samples\); (\d+) steps per process, last loss ([0-9.]+)", output
    )
    assert summary is not None, output[-3000:]
    return float(summary.group(1)), float(summary.group(4)), int(summary.group(2)), int(summary.group(3))


def _documented_flags() -> list[str]:
    """The flags of the ``--dist dmp`` command in docs/dlrm_training.md (after ``--dist dmp``)."""
    text = open(os.path.join(ROOT, "docs", "dlrm_training.md")).read()
    block = re.search(r"```bash\n(\.venv/bin/python -m torch\.distributed\.run [^`]*--dist dmp[^`]*)```", text)
    assert block is not None, "docs/dlrm_training.md has no --dist dmp command"
    words = block.group(1).replace("\\\n", " ").split()
    return words[words.index("dmp") + 1 :]


@pytest.mark.slow
def test_torchrun_two_processes_trains_the_dlrm_with_dmp_from_a_plan_file(tmp_path):
    """``--plan`` takes what ``tpurec plan --json`` wrote for 2 devices; 2 epochs of 4 steps, a
    validation pass each, the test set over both ranks."""
    plan = _write_plan(tmp_path, devices=2)
    output = _torchrun("--epochs", "2", "--plan", plan, "--print_sharding_plan", *SMALL)
    assert "sharded by TorchRec's DistributedModelParallel on 2 processes" in output, output[-3000:]
    assert f"the plan of {plan}:" in output and "model.sparse_arch.embedding_bag_collection" in output, output[-3000:]
    planned = json.loads(open(plan).read())["plan"]["<root>"]
    printed = dict((m[0], m[1:]) for m in re.findall(r"(t_cat_\d+) +\| (\w+) +\| (\w+)", output))
    assert printed == {name: (t["sharding_type"], t["compute_kernel"]) for name, t in planned.items()}, output[-6000:]
    assert "caching params will be ignored" not in output, output[-6000:]
    assert len(re.findall(r"AUROC over val set: [0-9.]+, NE [0-9.]+, calibration [0-9.]+ \(epoch \d\)", output)) == 2, (
        output[-3000:]
    )
    # 8 batches a epoch over 2 processes: 4 steps each, 2 epochs; the test set is both ranks' 2 x 16 samples.
    auc, loss, samples, steps = _summary(output)
    assert (samples, steps) == (32, 8) and 0.0 <= auc <= 1.0 and math.isfinite(loss) and loss > 0, output[-3000:]


@pytest.mark.slow
def test_the_documented_dmp_command_learns_without_torchrec_warnings():
    """The command of docs/dlrm_training.md, planned by tpurec's planner at start-up: held-out AUC
    above 0.75 on the synthetic data; no TorchRec warning that the job will fail, no FutureWarning."""
    output = _torchrun(*_documented_flags())
    auc, _loss, _samples, _steps = _summary(output)
    assert auc > 0.75, output[-3000:]
    assert "the job will fail" not in output and "FutureWarning" not in output, output[-6000:]


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """The command lines --dist dmp refuses, each through train.py's main() in a process of its own, forked from
    one that imported the script once (tests/forked_runs.py), with the environment torchrun would give it."""
    tmp_path = tmp_path_factory.mktemp("refusals")
    plan = _write_plan(tmp_path, devices=2)
    one_process = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    runs = {
        # A plan made for 2 devices, given to a run of 1 process.
        "plan_for_two": {"argv": ["--dist", "dmp", "--plan", plan, *SMALL],
                         "env": {**one_process, "MASTER_PORT": str(free_port_pair())}},
        "plan_without_dmp": {"argv": ["--plan", str(tmp_path / "plan.json"), *SMALL]},
        "without_torchrun": {"argv": ["--dist", "dmp", *SMALL], "env": {"RANK": None, "WORLD_SIZE": None}},
        # As torchrun sets them: the flag checks come first.
        "fused_mode": {"argv": ["--dist", "dmp", "--mode", "fused", *SMALL], "env": {"RANK": "0", "WORLD_SIZE": "1"}},
    }  # fmt: skip
    return dict(zip(runs, run_forked(SCRIPT, list(runs.values()), _env())))


def test_a_plan_for_another_process_count_is_refused(refusals):
    """A plan made for 2 devices, given to a run of 1 process: one line naming the file, status 2."""
    out = refusals["plan_for_two"]
    plan = out.args[out.args.index("--plan") + 1]
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("train.py: error:")]
    assert len(lines) == 1 and f"--plan {plan}:" in lines[0] and "1 devices" in lines[0], out.stderr[-3000:]


def test_plan_is_refused_without_dist_dmp(refusals):
    out = refusals["plan_without_dmp"]
    assert out.returncode == 2, out.stderr[-3000:]
    assert "train.py: error: --plan FILE shards the tables of --dist dmp" in out.stderr, out.stderr[-3000:]


def test_dist_dmp_without_torchrun_says_how_to_launch(refusals):
    out = refusals["without_torchrun"]
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("train.py: error:")]
    assert len(lines) == 1 and "torchrun --nproc-per-node N examples/dlrm/train.py --dist dmp" in lines[0], out.stderr


def test_dist_dmp_refuses_what_it_does_not_run(refusals):
    out = refusals["fused_mode"]
    assert out.returncode == 2, out.stderr[-3000:]
    assert "train.py: error: --dist dmp does not take --mode fused/compile" in out.stderr, out.stderr[-3000:]
