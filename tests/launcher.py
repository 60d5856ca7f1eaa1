"""Starting a script under torchrun from a test: the one launcher of the multi-process tests, bounded in time.

Every rank gets ``devices`` XLA:CPU devices (one, as one tpu device per process on a pod), the repository
on its ``PYTHONPATH`` and, through ``TPUREC_TEST_HANG_SECONDS``, a watchdog that ends a hung rank with every
thread's stack 30 s before the launch's own bound kills what is left.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from ports import free_port_pair

ROOT = Path(__file__).resolve().parents[1]
# A launch's default bound: the ranks' own watchdog (TPUREC_TEST_HANG_SECONDS) fires 30 s before it.
LAUNCH_SECONDS = 240


@dataclasses.dataclass
class Launch:
    """How a launch ended: torchrun's exit status and what it and the ranks printed."""

    returncode: int
    stdout: str  # stdout and stderr together, in order, unless the launch kept them apart
    stderr: str = ""

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def environment(devices: int = 1, hang_seconds: float | None = None, **settings: str) -> dict[str, str]:
    """This process's environment for the ranks: ``devices`` XLA:CPU devices each, the repository importable,
    the watchdog at ``hang_seconds`` (unset: not set here), then ``settings``."""
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    if hang_seconds is not None:
        env["TPUREC_TEST_HANG_SECONDS"] = str(hang_seconds)
    env.update(settings)
    return env


def run(
    script: Path | str,
    processes: int,
    *args: str,
    nodes: int = 1,
    torchrun_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    seconds: float = LAUNCH_SECONDS,
    port: int | None = None,
    cwd: Path | None = None,
    check: bool = True,
    separate_streams: bool = False,
) -> Launch:
    """Runs ``script args...`` in ``processes`` ranks under torchrun: ``nodes`` torchrun agents (nodes) of
    equal size on this machine, each in its own session, so that on a timeout every agent and its ranks are
    killed, and nothing else.

    Args:
        script: the worker, run by every rank.
        processes: ranks in all.
        args: the worker's arguments.
        nodes: torchrun nodes (agents), ``processes // nodes`` ranks each.
        torchrun_args: more torchrun flags (``--max-restarts``...).
        env: the ranks' environment (default: :func:`environment` with one device per rank, the watchdog 30 s
            before ``seconds`` and one OpenMP thread).
        seconds: the whole launch's bound.
        port: torchrun's store port (JAX's coordinator takes the next one); default: a free pair.
        cwd: the agents' working folder.
        check: fail the test unless every agent exits 0 (a timeout always fails it).
        separate_streams: keep stdout and stderr apart (:attr:`Launch.stderr`).

    Returns:
        How the launch ended (the first agent's exit status that is not 0, else 0), and its output.
    """
    if env is None:
        env = environment(hang_seconds=seconds - 30, OMP_NUM_THREADS="1")
    port = free_port_pair() if port is None else port
    agents = []
    for node in range(nodes):
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node-rank", str(node),
            "--nproc-per-node", str(processes // nodes), "--master-addr", "127.0.0.1", "--master-port", str(port),
            *torchrun_args, str(script), *args,
        ]  # fmt: skip
        agents.append(
            subprocess.Popen(
                command,
                env=env,
                cwd=cwd,
                stdout=subprocess.PIPE,
                text=True,
                start_new_session=True,
                stderr=subprocess.PIPE if separate_streams else subprocess.STDOUT,
            )  # fmt: skip
        )
    ended = []
    for agent in agents:
        try:
            stdout, stderr = agent.communicate(timeout=seconds)
        except subprocess.TimeoutExpired:
            for other in agents:
                if other.poll() is None:
                    os.killpg(other.pid, signal.SIGKILL)
            stdout, stderr = agent.communicate()
            output = stdout + (stderr or "")
            pytest.fail(f"the {processes}-process launch did not end within {seconds} s:\n{output[-6000:]}")
        ended.append(Launch(agent.returncode, stdout, stderr or ""))
    for launch in ended:
        if check:
            assert launch.returncode == 0, launch.output[-6000:]
    failed = [launch for launch in ended if launch.returncode != 0]
    first = failed[0] if failed else ended[0]
    return Launch(
        first.returncode, "".join(launch.stdout for launch in ended), "".join(launch.stderr for launch in ended)
    )


def reports(
    script: Path, processes: int, out: Path, checks: str, *args: str, seconds: float = LAUNCH_SECONDS
) -> list[list[str]]:
    """Runs ``script CHECKS OUT ARGS...`` in ``processes`` ranks (as :func:`run`); each rank's report lines.

    Every rank writes its report to ``OUT.<rank>``.
    """
    run(script, processes, checks, str(out), *args, seconds=seconds)
    return [Path(f"{out}.{rank}").read_text().split("\n") for rank in range(processes)]
