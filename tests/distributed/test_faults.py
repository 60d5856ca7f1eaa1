"""A multi-process job that cannot go on ends every process with a clear error, in bounded time.

Two processes x 4 XLA:CPU devices run tests/distributed/fault_worker.py (a tiny sharded DLRM):
processes that disagree (table rows, plan, local batch size, step count) all fail with the same
message; a SIGKILLed or SIGSTOPped process (process 0, which starts JAX's coordination service, too)
ends the other with an error naming it and its step; a taken coordinator port is an error naming the port; torchrun's elastic restart plus a resume from
the last committed checkpoint ends where an uninterrupted run does.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import launcher
from ports import free_port_pair

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORKER = HERE / "fault_worker.py"
LIMIT = 60  # seconds: every failure must end the job within this (issue 21)

pytestmark = pytest.mark.slow


def _env(**settings: str) -> dict[str, str]:
    return launcher.environment(devices=4, FAULT_HANG_SECONDS="240", TPUREC_PEER_TIMEOUT="20", **settings)


class Job:
    """Two worker processes started as torchrun would (its environment), each with a log file."""

    def __init__(self, tmp_path: Path, **settings: str) -> None:
        port = free_port_pair()
        self.logs = [tmp_path / f"rank{r}.log" for r in range(2)]
        self.procs = []
        for r in range(2):
            env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(r), LOCAL_RANK=str(r),
                       **settings)  # fmt: skip
            with open(self.logs[r], "w") as log:
                self.procs.append(
                    subprocess.Popen([sys.executable, str(WORKER)], env=env, stdout=log, stderr=subprocess.STDOUT)
                )

    def log(self, r: int) -> str:
        return self.logs[r].read_text()

    def wait_for(self, r: int, text: str, timeout: float = 240) -> float:
        """Waits until process ``r`` printed ``text``; the time it did."""
        deadline = time.monotonic() + timeout
        while text not in self.log(r):
            assert self.procs[r].poll() is None or text in self.log(r), self.log(r)[-3000:]
            assert time.monotonic() < deadline, f"process {r} did not print {text!r}:\n{self.log(r)[-3000:]}"
            time.sleep(0.2)
        return time.monotonic()

    def wait(self, r: int, timeout: float) -> int:
        try:
            return self.procs[r].wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"process {r} still runs after {timeout} s:\n{self.log(r)[-3000:]}") from None

    def kill(self) -> None:
        """Ends what the test started (a stopped process gets SIGKILL too)."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)


def _last_error(text: str) -> str:
    """The last line naming a tpurec peer error (what a user reads last)."""
    lines = [line for line in text.splitlines() if "PeerMismatch" in line or "PeerLost" in line or "tpurec:" in line]
    assert lines, text[-3000:]
    return lines[-1]


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            {"FAULT_ROWS_1": "50"},
            "collection sparse_arch.embedding_bag_collection.tables.t0.rows is 40 on process 0 but 50 on process 1",
        ),
        ({"FAULT_PLAN_1": "row_wise"}, "tables.t0.sharding is table_wise on process 0 but row_wise on process 1"),
        ({"FAULT_BATCH_1": "4"}, "the batch of step 1: local batch size is 8 on process 0 but 4 on process 1"),
        ({"FAULT_STEPS_1": "2"}, "process 1 finished its program after step 2 while process 0 is at step 3"),
    ],
    ids=["rows", "plan", "batch", "steps"],
)
def test_processes_that_disagree_all_fail_with_the_same_error(tmp_path, settings, message):
    job = Job(tmp_path, FAULT_STEPS="3", **settings)
    try:
        # From the moment both processes joined the job.
        started = max(job.wait_for(r, "joined the job") for r in range(2))
        codes = [job.wait(r, LIMIT + 240) for r in range(2)]
        elapsed = time.monotonic() - started
    finally:
        job.kill()
    assert codes == [1, 1], [job.log(r)[-3000:] for r in range(2)]
    for r in range(2):
        assert message in _last_error(job.log(r)), job.log(r)[-3000:]
        assert "Aborted" not in job.log(r) and "SIGABRT" not in job.log(r)
    assert elapsed < LIMIT, elapsed


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux's /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize(
    "lost, sig, where, seen",
    [(1, "KILL", "before", 2), (1, "STOP", "before", 2), (1, "STOP", "mid", 3), (0, "KILL", "before", 2),
     (0, "STOP", "before", 2)],
    ids=["kill-between-steps", "stop-between-steps", "stop-inside-a-step", "kill-process-0", "stop-process-0"],
)  # fmt: skip
def test_a_lost_process_ends_the_other_with_an_error_naming_it(tmp_path, lost, sig, where, seen):
    """``mid``: process 1 stops after its forward; process 0 goes on into the backward's collectives,
    where no Python error reaches it (its watching thread ends it). Process 0 runs JAX's coordination
    service in a child process, which outlives it until the other process has ended, then ends too."""
    other = 1 - lost
    job = Job(tmp_path, FAULT_STEPS="5", **{f"FAULT_SIGNAL_AT_{lost}": f"3:{sig}:{where}"})
    try:
        job.wait_for(0, "joined the job")
        service = [c for c in _children(job.procs[0].pid) if "coordinator" in Path(f"/proc/{c}/cmdline").read_text()]
        assert len(service) == 1, service
        signalled = job.wait_for(lost, f"sending SIG{sig}")
        code = job.wait(other, LIMIT + 30)
        elapsed = time.monotonic() - signalled
    finally:
        job.kill()
    assert code == 1, job.log(other)[-3000:]
    error = _last_error(job.log(other))
    assert f"process {lost} is lost: no heartbeat for 20 s (it died, was stopped or hangs)" in error, error
    assert f"last seen at its step {seen}; this process {other} is at step 3" in error, error
    assert elapsed < LIMIT, elapsed
    assert "Aborted" not in job.log(other) and "SIGABRT" not in job.log(other)
    # Once process 0 is gone, its service lingers TPUREC_PEER_TIMEOUT + 15 s at most, then ends.
    deadline = time.monotonic() + 20 + 15 + 20
    while _running(service[0]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _running(service[0]), f"JAX's coordination service (pid {service[0]}) outlived the job"


def _torchrun(tmp_path: Path, port: int, *extra: str, timeout: float = 400, **settings: str) -> launcher.Launch:
    return launcher.run(WORKER, 2, torchrun_args=extra, env=_env(**settings), seconds=timeout, port=port, cwd=tmp_path,
               check=False, separate_streams=True)  # fmt: skip


def test_a_taken_coordinator_port_is_an_error_naming_it(tmp_path):
    port = free_port_pair()
    with socket.socket() as squatter:  # another program on JAX's coordinator port (MASTER_PORT + 1)
        squatter.bind(("127.0.0.1", port + 1))
        squatter.listen()
        start = time.monotonic()
        run = _torchrun(tmp_path, port, timeout=LIMIT + 120)
        elapsed = time.monotonic() - start
    assert run.returncode != 0
    assert (
        f"CoordinatorPortInUse: port {port + 1} for JAX's coordinator (process 0, 127.0.0.1:{port + 1}) is already in use "
        "by another program" in run.stderr
    ), run.stderr[-3000:]
    assert "SIGSEGV" not in run.stderr and "Segmentation" not in run.stderr
    assert elapsed < LIMIT, elapsed


def test_an_elastic_restart_from_the_last_checkpoint_equals_an_uninterrupted_run(tmp_path):
    whole = tmp_path / "whole.npz"
    run = _torchrun(tmp_path, free_port_pair(), FAULT_STEPS="6", FAULT_OUT=str(whole))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    # Process 1 dies (SIGKILL) before step 5 of the first attempt; torchrun starts both again and they
    # resume from step-4, the last committed checkpoint.
    resumed = tmp_path / "resumed.npz"
    run = _torchrun(
        tmp_path, free_port_pair(), "--max-restarts", "1", "--monitor-interval", "0.5", FAULT_STEPS="6",
        FAULT_OUT=str(resumed), FAULT_CKPT=str(tmp_path / "ckpt"), FAULT_SIGNAL_AT_1="5:KILL", timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "sending SIGKILL to myself before step 5" in run.stdout
    assert "resumed after step 4" in run.stdout
    a, b = np.load(whole), np.load(resumed)
    assert sorted(a.files) == sorted(b.files) and len(a["losses"]) == 6
    for key in a.files:
        np.testing.assert_array_equal(b[key], a[key], err_msg=key)
