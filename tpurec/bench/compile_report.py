"""Where compile seconds went, from two ``tpurec.stats()`` snapshots: in all, by phase, by kind of program.

The benchmarks and the model zoo report it so that a slow compilation is visible next to the step
times: ``python -m tpurec.bench <name>`` prints :func:`summary_line` of its whole run on stderr and
adds :func:`compile_since`'s dict to its JSON under ``compile``.

Example::

    before = tpurec.stats()
    train_step()
    report = compile_since(before)
    print(summary_line(report))  # 2.31 s compiling 14 programs (tracing 0.41 s, ...); slowest: ...
"""

from __future__ import annotations

from typing import Any

import tpurec

__all__ = ["compile_since", "summary_line"]


def compile_since(before: dict[str, Any], after: dict[str, Any] | None = None) -> dict[str, Any]:
    """The compile seconds between two ``tpurec.stats()`` snapshots (``after``: now).

    Returns:
        ``seconds`` (the wall time of new programs' first runs), ``phases`` (``tracing``,
        ``lowering``, ``xla_compile``, ``cache_load``), ``programs`` (new programs) and
        ``by_program``: per kind of program (``tpurec.stats()["compiles_by_program"]``'s labels),
        its programs, seconds and phases, the slowest first.
    """
    after = tpurec.stats() if after is None else after
    by_program = {}
    for label, entry in after["compiles_by_program"].items():
        was = before["compiles_by_program"].get(label, {})
        delta = {key: value - was.get(key, 0) for key, value in entry.items()}
        if delta["programs"]:
            by_program[label] = delta
    return {
        "seconds": after["compile_seconds"] - before["compile_seconds"],
        "phases": {k: v - before["compile_phases"][k] for k, v in after["compile_phases"].items()},
        "programs": sum(entry["programs"] for entry in by_program.values()),
        "by_program": dict(sorted(by_program.items(), key=lambda item: -item[1]["seconds"])),
    }


def summary_line(report: dict[str, Any], top: int = 5) -> str:
    """One line of :func:`compile_since`'s report: the total, its phases and the ``top`` slowest kinds of program."""
    phases = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in report["phases"].items())
    slowest = "; ".join(
        f"{label} {entry['seconds']:.2f} s" + (f" ({entry['programs']} programs)" if entry["programs"] > 1 else "")
        for label, entry in list(report["by_program"].items())[:top]
    )
    line = f"{report['seconds']:.2f} s compiling {report['programs']} programs ({phases})"
    return f"{line}; slowest: {slowest}" if slowest else line
