"""A crashed xdist worker's report names the native fault (tests/crash_evidence.py), through pytest's command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

CRASHING = """
import faulthandler


def test_a_native_fault():
    faulthandler._sigsegv()


def test_a_passing_one():
    pass
"""


def test_a_crashed_worker_reports_its_fault_handler_output_and_the_memory(tmp_path: Path) -> None:
    (tmp_path / "test_crashing.py").write_text(CRASHING)
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-n",
            "2",
            "-p",
            "crash_evidence",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            str(tmp_path),
        ],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(HERE), "TMPDIR": str(temporary)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "crashed while running" in run.stdout, run.stdout
    assert "Fatal Python error: Segmentation fault" in run.stdout, run.stdout
    assert "test_a_native_fault" in run.stdout.split("Fatal Python error")[1], run.stdout
    assert "MemAvailable" in run.stdout, run.stdout
    assert "1 failed, 1 passed" in run.stdout, run.stdout
    assert not list(temporary.glob("*.faults")), "the workers' fault files outlived the run"
