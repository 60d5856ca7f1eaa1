"""Errors that say what was wrong and what to do."""

from __future__ import annotations

import os
import traceback

__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "ArgumentValueError",
    "unsupported_op",
    "lowering_failed",
    "user_frame",
]


class ArgumentError(Exception):
    """Base of the errors a lowering raises for arguments it refuses (a user error,
    not a lowering bug): they reach the caller unchanged instead of being wrapped."""


class ArgumentValueError(ArgumentError, ValueError):
    """An argument of the wrong rank, size or value."""


class ArgumentTypeError(ArgumentError, TypeError):
    """An argument of the wrong dtype."""


REPORT = "report it as an issue on the tpurec project, naming the op and the input shapes"


def unsupported_op(func, why: str = "it has no lowering and no decomposition") -> NotImplementedError:
    """The error for an ATen op the tpu device cannot run."""
    name = func._schema.name + (f".{func._overloadname}" if func._overloadname != "default" else "")
    return NotImplementedError(
        f"tpurec: the ATen op '{name}' is not supported on the tpu device ({why}). "
        f"Work around it by running this step on CPU (move its inputs with .cpu() and the result back "
        f"with .to('tpu')), or {REPORT}."
    )


def _package_dirs(*names: str) -> tuple[str, ...]:
    """The folders of the installed packages ``names``, found without importing them."""
    import importlib.util

    dirs = []
    for name in names:
        spec = importlib.util.find_spec(name)
        for location in (spec.submodule_search_locations or []) if spec else []:
            dirs.append(os.path.abspath(location) + os.sep)
    return tuple(dirs)


# The folders of the libraries whose frames are never the user's. Found by package spec, not by a
# substring such as "/tpurec/", which would also match a user's checkout in a folder of that name.
LIBRARY_DIRS = _package_dirs("torch", "jax", "jaxlib", "tpurec", "torchrec", "fbgemm_gpu", "numpy")


def user_frame() -> str | None:
    """``file:line`` of the innermost caller outside torch, jax and tpurec, if any."""
    dirs = LIBRARY_DIRS
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if frame.filename.startswith("<") or path.startswith(dirs):
            continue
        return f'File "{frame.filename}", line {frame.lineno}, in {frame.name}: {frame.line}'
    return None


def lowering_failed(func, error: Exception) -> Exception:
    """The error for a lowering (or its XLA compilation) that failed on these inputs."""
    name = func._schema.name + (f".{func._overloadname}" if func._overloadname != "default" else "")
    where = user_frame()
    text = (
        f"tpurec: lowering the ATen op '{name}' for the tpu device failed: {type(error).__name__}: {error}"
        + (f"\n  called from {where}" if where else "")
        + f"\nIf the inputs are valid for PyTorch on CPU, this is a tpurec bug: {REPORT}."
    )
    kind = NotImplementedError if isinstance(error, NotImplementedError) else RuntimeError
    return kind(text)
