"""The suite's pytest-xdist scheduling (tests/scheduling.py), run on a small suite of its own on two workers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# Two workers, a replacement and a dozen tiny tests: seconds on an idle machine.
RUN_SECONDS = 180
TWO_WORKERS = ("-n", "2", "--dist", "loadfile")

CONFTEST = """
import pytest
from scheduling import FileScheduling

@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    return FileScheduling(config, log)
"""


def _run_suite(folder: Path, files: dict[str, str], *options: str) -> subprocess.CompletedProcess[str]:
    (folder / "conftest.py").write_text(CONFTEST)
    for name, body in files.items():
        (folder / name).write_text(textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_XDIST_WORKER_COUNT", None)
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *TWO_WORKERS, "-v", "-rA", *options, "."]
    process = subprocess.Popen(
        command, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = process.communicate(timeout=RUN_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        output, _ = process.communicate()
        pytest.fail(f"the run did not end within {RUN_SECONDS} s:\n{output[-4000:]}")
    return subprocess.CompletedProcess(command, process.returncode, output, "")


def test_a_lost_worker_fails_its_test_and_the_run_goes_on_to_the_end(tmp_path: Path) -> None:
    """A worker that dies mid-file (os.abort, as XLA:CPU aborts a process): its test is reported as failed by name,
    the file's other tests and every later file still run, on the other worker and the one started in its place,
    and the run ends, with exit status 1.

    xdist's own loadscope scheduling handed the lost worker's finished files out again; a worker holding its last test
    got nothing to run, and the run waited forever."""
    quick = """
        def test_one():
            pass

        def test_two():
            pass
    """
    files = {f"test_{n}_before.py": quick for n in range(3)}
    files["test_3_crash.py"] = """
        import os

        def test_before_the_crash():
            pass

        def test_aborts():
            os.abort()

        def test_after_the_crash():
            pass
    """
    files |= {f"test_{n}_after.py": quick for n in range(4, 7)}
    run = _run_suite(tmp_path, files)
    assert run.returncode == 1, run.stdout[-4000:]
    assert "crashed while running 'test_3_crash.py::test_aborts'" in run.stdout, run.stdout[-4000:]
    assert "1 failed, 14 passed" in run.stdout, run.stdout[-4000:]
    summary = run.stdout.rpartition("short test summary info")[2]  # -rA: one line a test, after the workers' output
    for test in ["test_3_crash.py::test_before_the_crash", "test_3_crash.py::test_after_the_crash"]:
        assert f"\nPASSED {test}\n" in summary, run.stdout[-4000:]
    # Run once: the lost test does not take the next worker down too ("1 failed" above; the workers' stack dumps
    # interleave with the report's lines, so the controller's own line is counted).
    assert run.stdout.count("replacing crashed worker") == 1, run.stdout[-4000:]


def test_a_hung_test_ends_its_worker_with_every_thread_s_stack(tmp_path: Path) -> None:
    """A test that outlives faulthandler_timeout (pyproject.toml: the suite's bound on one test) ends its worker with
    every thread's stack (faulthandler_exit_on_timeout); the run reports it by name and goes on."""
    files = {
        "test_0_hangs.py": """
            import time

            def test_hangs():
                time.sleep(600)

            def test_after_the_hang():
                pass
        """,
        "test_1_quick.py": "def test_one():\n    pass\n",
    }
    run = _run_suite(tmp_path, files, "-o", "faulthandler_timeout=5", "-o", "faulthandler_exit_on_timeout=true")
    assert run.returncode == 1, run.stdout[-4000:]
    assert "crashed while running 'test_0_hangs.py::test_hangs'" in run.stdout, run.stdout[-4000:]
    assert "Timeout (0:00:05)!" in run.stdout and "in test_hangs" in run.stdout, run.stdout[-4000:]
    assert "1 failed, 2 passed" in run.stdout, run.stdout[-4000:]
