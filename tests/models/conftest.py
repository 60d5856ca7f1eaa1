"""Each zoo test starts from fresh Dynamo caches (graphs are per model instance anyway); the run's
summary lists each pair's first-step time and compile seconds (``ZOO_COMPILE_JSON=path``: as JSON too)."""

import dataclasses
import json
import os
import sys

import pytest
import torch

import tpurec  # noqa: F401


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def pytest_terminal_summary(terminalreporter) -> None:
    zoo = sys.modules.get("zoo")
    reports = getattr(zoo, "reports", None)
    if not reports:
        return
    terminalreporter.section("zoo: time to the first step and compile seconds of the warm-up steps")
    for report in reports:
        terminalreporter.write_line(report.compile_line())
    path = os.environ.get("ZOO_COMPILE_JSON")
    if path:
        fields = ("family", "mode", "first_step_seconds", "compile", "seconds")
        rows = [{k: v for k, v in dataclasses.asdict(r).items() if k in fields} for r in reports]
        with open(path, "w") as out:
            json.dump({"platform": tpurec.platform(), "runs": rows}, out, indent=2)
        terminalreporter.write_line(f"wrote {path}")
