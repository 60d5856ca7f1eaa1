"""Errors that say what was wrong and what to do."""

from __future__ import annotations

__all__ = ["unsupported_op"]

REPORT = "report it as an issue on the tpurec project, naming the op and the input shapes"


def unsupported_op(func, why: str = "it has no lowering and no decomposition") -> NotImplementedError:
    """The error for an ATen op the tpu device cannot run."""
    name = func._schema.name + (f".{func._overloadname}" if func._overloadname != "default" else "")
    return NotImplementedError(
        f"tpurec: the ATen op '{name}' is not supported on the tpu device ({why}). "
        f"Work around it by running this step on CPU (move its inputs with .cpu() and the result back "
        f"with .to('tpu')), or {REPORT}."
    )
