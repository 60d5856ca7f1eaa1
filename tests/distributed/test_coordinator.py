"""JAX's coordination service in a child process (tpurec/distributed/coordinator.py): its lifetime.

The child is what process 0 of a job starts; here it is started alone (no JAX client connects),
which is enough to see it hold the port, end when told, outlive its parent's end by ``linger``
seconds and no more, and be ended by the next process 0 of an elastic restart.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ports import free_port_pair

from tpurec.distributed import coordinator
from tpurec.distributed.startup import CoordinatorPortInUse, check_coordinator_port


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def _gone_within(process: subprocess.Popen[str], seconds: float) -> float:
    """Seconds until the child ended (a test failure after ``seconds``)."""
    start = time.monotonic()
    try:
        process.wait(seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"the coordinator child still runs after {seconds} s")
    return time.monotonic() - start


@pytest.fixture
def address():
    return f"127.0.0.1:{free_port_pair() + 1}"


def test_the_child_holds_the_port_until_released(address):
    service = coordinator.start(address, 2, heartbeat_timeout=100, linger=60)
    try:
        with pytest.raises(CoordinatorPortInUse):
            check_coordinator_port(address)
        assert service.pid_file.read_text().split() == [str(service.pid), str(os.getpid())]  # the child, its parent
    finally:
        service.release()
    assert service.process.returncode == 0, service.log.read_text()
    assert not service.pid_file.exists()
    check_coordinator_port(address)  # free again


def test_the_child_outlives_a_lost_parent_by_linger_seconds_then_ends(address):
    service = coordinator.start(address, 2, heartbeat_timeout=100, linger=3)
    try:
        assert service.process.stdin is not None
        service.process.stdin.close()  # what the parent's death does to the pipe
        time.sleep(1.5)
        assert service.process.poll() is None, "the child ended before the others could read the store"
        waited = _gone_within(service.process, 30)
    finally:
        service.release()
    assert 0.5 < waited < 15, waited
    assert "process 0 is gone; serving 3 s more" in service.log.read_text()


# A process 0 that starts the child and is then killed (coordinator.py loaded by path: no torch, no jax).
_PARENT = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("coordinator", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
service = module.start(sys.argv[2], 2, heartbeat_timeout=100, linger=600)
print(service.pid, flush=True)
time.sleep(600)
"""


def test_a_stale_child_is_ended_by_the_next_process_0(address):
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, coordinator.__file__, address], stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
    finally:
        parent.kill()  # process 0 dies; its child lingers on the port
        parent.wait()
    assert _running(child)
    with pytest.raises(CoordinatorPortInUse):
        check_coordinator_port(address)
    start = time.monotonic()
    coordinator.end_stale(address)  # what initialize() does on a restarted process 0
    assert time.monotonic() - start < 10
    assert not _running(child)
    check_coordinator_port(address)  # the new process 0 can take the port


def test_the_coordinator_of_a_live_process_0_is_left_alone(address):
    service = coordinator.start(address, 2, heartbeat_timeout=100, linger=60)
    try:
        coordinator.end_stale(address)  # a second job started on the same port by mistake
        assert service.process.poll() is None
        with pytest.raises(CoordinatorPortInUse):
            check_coordinator_port(address)
    finally:
        service.release()


def test_a_pid_file_naming_another_program_ends_nothing(address):
    port = int(address.rpartition(":")[2])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        pid_file = coordinator._state_dir() / f"{port}.pid"
        pid_file.write_text(f"{other.pid} 1")  # a pid reused by another program since
        coordinator.end_stale(address)
        assert other.poll() is None
        assert not pid_file.exists()
    finally:
        other.kill()
        other.wait()
