"""Starting a worker script under torchrun, one XLA:CPU device per process, bounded in time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from ports import free_port_pair

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# Each launch's bound: the ranks' own watchdog (TPUREC_TEST_HANG_SECONDS) fires first.
LAUNCH_SECONDS = 240


def launch(script: Path, processes: int, *args: str, seconds: int = LAUNCH_SECONDS) -> str:
    """Runs ``script args...`` in ``processes`` ranks under torchrun; their output, or a test failure.

    Args:
        script: the worker, run by every rank.
        processes: ranks (one XLA:CPU device each, as one tpu device per process on a pod).
        args: the worker's arguments.
        seconds: the whole launch's bound; the ranks' watchdog fires 30 s before it.

    Returns:
        torchrun's and the ranks' output (stdout and stderr).
    """
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
        "JAX_PLATFORMS": "cpu",
        "TPUREC_TEST_HANG_SECONDS": str(seconds - 30),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port_pair()), str(script), *args,
    ]  # fmt: skip
    # Its own session: on a timeout the whole launch (torchrun and its ranks) is killed, nothing else.
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the {processes}-process launch did not end within {seconds} s:\n{output[-6000:]}")
    assert proc.returncode == 0, output[-6000:]
    return output


def torchrun(script: str, processes: int, out: Path, *args: str, seconds: int = LAUNCH_SECONDS) -> list[list[str]]:
    """Runs ``script CHECKS... OUT ARGS`` (a worker beside this file) in ``processes`` ranks; each rank's report lines.

    Every rank writes its report to ``OUT.<rank>``; fails the test as :func:`launch` does.
    """
    checks, *rest = args
    launch(HERE / script, processes, checks, str(out), *rest, seconds=seconds)
    return [Path(f"{out}.{rank}").read_text().split("\n") for rank in range(processes)]
