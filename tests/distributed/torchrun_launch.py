"""Runs a worker script under torchrun with one XLA:CPU device per process, every process bounded in time."""

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


def torchrun(script: str, processes: int, out: Path, *args: str, seconds: int = 240) -> list[list[str]]:
    """Runs ``script CHECKS... OUT ARGS`` in ``processes`` ranks; each rank's report lines.

    Fails the test with the launch's output unless every rank ended with status 0 within
    ``seconds`` (each rank's own watchdog, ``TPUREC_TEST_HANG_SECONDS``, fires 30 s earlier and
    prints every thread's stack).
    """
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
        "JAX_PLATFORMS": "cpu",
        "TPUREC_TEST_HANG_SECONDS": str(seconds - 30),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    checks, *rest = args
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port_pair()),
        str(HERE / script), checks, str(out), *rest,
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
    assert proc.returncode == 0, output[-8000:]
    return [Path(f"{out}.{rank}").read_text().split("\n") for rank in range(processes)]
