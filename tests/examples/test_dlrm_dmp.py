"""examples/dlrm/train.py --dist dmp: TorchRec's DistributedModelParallel and TrainPipelineSparseDist
through the script's command line, under torchrun with 2 processes (one XLA:CPU device each)."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "dlrm", "train.py")
sys.path.insert(0, os.path.join(ROOT, "tests"))
try:
    from ports import free_port_pair
finally:
    sys.path.remove(os.path.join(ROOT, "tests"))

SMALL = [
    "--num_embeddings", "100", "--embedding_dim", "16", "--dense_arch_layer_sizes", "32,16",
    "--over_arch_layer_sizes", "32,1", "--batch_size", "16", "--limit_train_batches", "8",
    "--limit_val_batches", "2", "--limit_test_batches", "2", "--learning_rate", "0.05",
]  # fmt: skip
SECONDS = 420


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
        "JAX_PLATFORMS": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }


@pytest.mark.slow
def test_torchrun_two_processes_trains_the_dlrm_with_dmp():
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
        "--master-port", str(free_port_pair()), SCRIPT, "--dist", "dmp", "--epochs", "2", *SMALL,
    ]  # fmt: skip
    proc = subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"torchrun did not end within {SECONDS} s:\n{output[-6000:]}")
    assert proc.returncode == 0, output[-6000:]
    assert "sharded by TorchRec's DistributedModelParallel on 2 processes" in output, output[-3000:]
    assert len(re.findall(r"AUROC over val set: [0-9.]+, NE [0-9.]+, calibration [0-9.]+ \(epoch \d\)", output)) == 2, (
        output[-3000:]
    )
    # 8 batches a epoch over 2 processes: 4 steps each, 2 epochs; the test set is both ranks' 2 x 16 samples.
    summary = re.search(
        r"held-out AUC ([0-9.]+), .* \(32 test samples\); 8 steps per process, last loss ([0-9.]+)", output
    )
    assert summary is not None, output[-3000:]
    auc, loss = float(summary.group(1)), float(summary.group(2))
    assert 0.0 <= auc <= 1.0 and math.isfinite(loss) and loss > 0, summary.group(0)


def test_dist_dmp_without_torchrun_says_how_to_launch():
    env = {k: v for k, v in _env().items() if k not in ("RANK", "WORLD_SIZE")}
    out = subprocess.run(
        [sys.executable, SCRIPT, "--dist", "dmp", *SMALL], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("train.py: error:")]
    assert len(lines) == 1 and "torchrun --nproc-per-node N examples/dlrm/train.py --dist dmp" in lines[0], out.stderr


def test_dist_dmp_refuses_what_it_does_not_run():
    env = {**_env(), "RANK": "0", "WORLD_SIZE": "1"}  # as torchrun sets them: the flag checks come first
    out = subprocess.run(
        [sys.executable, SCRIPT, "--dist", "dmp", "--mode", "fused", *SMALL],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-3000:]
    assert "train.py: error: --dist dmp does not take --mode fused/compile" in out.stderr, out.stderr[-3000:]
