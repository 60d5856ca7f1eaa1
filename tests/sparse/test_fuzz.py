"""Property-based fuzz test of the whole sparse input path, run in a subprocess.

The examples run in ``fuzz_kjt.py`` (see its docstring for what one example
checks) in a child process: a crash there (a segfault in numpy or in the native
kernels) fails this test with the reproducing case instead of killing pytest.

The number of examples is hypothesis' ``max_examples`` of the active profile
(100 by default). Long runs::

    pytest tests/sparse/test_fuzz.py --hypothesis-profile=fuzz-long          # 10,000 examples
    TPUREC_FUZZ_SEED=random pytest tests/sparse/test_fuzz.py --hypothesis-profile=fuzz-long

``TPUREC_FUZZ_SEED`` is the hypothesis seed (default 0, so CI is repeatable;
``random`` draws a new one). A reported case replays with
``python tests/sparse/fuzz_kjt.py --replay '<json>'``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

FUZZ_SCRIPT = Path(__file__).with_name("fuzz_kjt.py")


def run_fuzz(examples: int, tmp_path: Path, seed: str = "0", env: dict[str, str] | None = None) -> tuple[bool, str]:
    """Runs ``examples`` fuzz examples in a child; returns (passed, report with the reproducer)."""
    last = tmp_path / "last_case.json"
    command = [sys.executable, str(FUZZ_SCRIPT), "--examples", str(examples), "--last", str(last)]
    if seed != "random":
        command += ["--seed", seed]
    # Cold examples compile kernels (~1 s each on a busy 2-core machine); warm ones take ~0.1 s.
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=120 + 3 * examples, env={**os.environ, **(env or {})}
    )
    if result.returncode == 0:
        return True, result.stdout
    case = last.read_text().strip() if last.exists() else "(none written)"
    if result.returncode < 0:
        what = f"the fuzz process crashed with signal {signal.Signals(-result.returncode).name}"
    else:
        what = f"the fuzz process failed (exit {result.returncode})"
    report = (
        f"{what}. Reproducer (replay with: python {FUZZ_SCRIPT} --replay '<case>'):\n{case}\n"
        f"--- stdout (tail) ---\n{result.stdout[-6000:]}\n--- stderr (tail) ---\n{result.stderr[-6000:]}"
    )
    return False, report


@pytest.mark.slow
def test_fuzz_sparse_input_path(tmp_path):
    examples = settings.default.max_examples
    passed, report = run_fuzz(examples, tmp_path, seed=os.environ.get("TPUREC_FUZZ_SEED", "0"))
    assert passed, report
    assert f"fuzz: {examples} examples" in report and "0 failures" in report


def test_a_crash_in_the_fuzz_process_fails_with_the_reproducer(tmp_path):
    # The harness itself: a child killed by SIGSEGV mid-example must be reported with that case.
    passed, report = run_fuzz(5, tmp_path, env={"TPUREC_FUZZ_CRASH_AT": "2"})
    assert not passed
    assert "crashed with signal SIGSEGV" in report
    assert report.split("Reproducer", 1)[1].count('"seed"') == 1  # the case that was running
