"""A crashed pytest-xdist worker leaves evidence in its test's report (loaded by tests/conftest.py).

xdist reports only "worker crashed while running <test>". Each worker writes Python's fault handler
output (the stacks of every thread on a fatal signal) to a file of its own; the controller adds that
file, the machine's free memory, the largest processes and the kernel log's end to the crashed test's
report, so that a crash in CI says whether it was a native fault or the kernel's OOM killer (no stack,
memory gone).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest


def _fault_file(controller_pid: int, worker: str) -> Path:
    return Path(tempfile.gettempdir()) / f"tpurec-pytest-{controller_pid}-{worker}.faults"


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    worker = getattr(config, "workerinput", {}).get("workerid")
    if worker is not None:
        import faulthandler

        config._tpurec_faults = open(_fault_file(os.getppid(), worker), "w")  # type: ignore[attr-defined]  # noqa: SIM115
        faulthandler.enable(file=config._tpurec_faults, all_threads=True)  # type: ignore[attr-defined]


def _crash_evidence(worker: str) -> str:
    parts = []
    fault = _fault_file(os.getpid(), worker)
    text = fault.read_text(errors="replace").strip() if fault.exists() else ""
    parts.append(f"fault handler output of {worker}:\n{text}" if text else f"{worker} left no fault handler output")
    try:
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        parts.append("; ".join(line for line in meminfo if line.startswith(("MemTotal", "MemAvailable"))))
    except OSError:
        pass
    for command in (["ps", "-eo", "rss,etime,args", "--sort=-rss"], ["dmesg", "--ctime"]):
        try:
            out = subprocess.run(command, capture_output=True, text=True, timeout=10).stdout.splitlines()
        except (OSError, subprocess.TimeoutExpired):
            continue
        lines = out[:8] if command[0] == "ps" else out[-15:]
        parts.append(f"{' '.join(command)}:\n" + "\n".join(line[:200] for line in lines))
    return "\n".join(parts)


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem: str, report: pytest.TestReport, sched: object) -> None:
    worker = getattr(getattr(report, "node", None), "gateway", None)
    if worker is not None:
        report.longrepr = f"{report.longrepr}\n{_crash_evidence(worker.id)}"


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist): its workers' files go
        for fault in _fault_file(os.getpid(), "*").parent.glob(_fault_file(os.getpid(), "*").name):
            fault.unlink(missing_ok=True)
