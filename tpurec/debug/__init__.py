"""CPU shadow: every ATen op on tpu tensors run again by PyTorch on CPU, and compared.

``with tpurec.debug.shadow():`` (or ``TPUREC_MODE=debug TPUREC_SHADOW=cpu``) runs
each op as usual, then runs the same ATen overload on CPU copies of the values its
tpu inputs had, and raises :class:`ShadowMismatch` at the first op whose outputs, or
whose writes into its arguments, differ from PyTorch's. The error names the op, the
``nn.Module`` being run, the user's line and the difference.

Each op is judged on its own: its CPU inputs are copied from the tpu values just
before it runs, so a divergence never cascades into later ops, and random ops (whose
values cannot be compared) leave nothing behind that later ops would see differently.
A CPU copy is made per storage, with each tensor rebuilt as the same
(size, stride, offset) view of it, so views and in-place ops through views behave on
CPU as on tpu, and an in-place op is compared on the whole storage it wrote (the base
and every other view of it included).

Example::

    with tpurec.debug.shadow() as report:
        loss = model(x).sum()
        loss.backward()
        optimizer.step()
    print(report.checked, report.unchecked)
"""

from __future__ import annotations

import atexit
import contextlib
import sys
from typing import Iterator

from tpurec import config
from tpurec.core import get_mode, mode
from tpurec.debug import hook
from tpurec.debug.compare import DEFAULT_TOLERANCES, FLOAT64_FACTOR, ShadowReport
from tpurec.debug.hook import ShadowMismatch

__all__ = ["shadow", "ShadowMismatch", "ShadowReport", "DEFAULT_TOLERANCES", "FLOAT64_FACTOR"]

# Named as users reach them (tracebacks print ``tpurec.debug.ShadowMismatch``), not by the module
# that defines them.
ShadowMismatch.__module__ = ShadowReport.__module__ = __name__


@contextlib.contextmanager
def shadow(rtol: float | None = None, atol: float | None = None) -> Iterator[ShadowReport]:
    """Checks every ATen op on tpu tensors in the block against PyTorch CPU.

    The block runs in debug mode (each op synchronously). Each op also runs on CPU
    copies of its inputs; the first whose outputs or in-place writes differ raises
    :class:`ShadowMismatch` (during backward: at the next tpu op after it, or at the
    end of the block).

    Args:
        rtol, atol: tolerance for floating results, ``|tpu - cpu| <= atol + rtol * |cpu|``;
            default per dtype (:data:`DEFAULT_TOLERANCES`, float32: 1e-4, 1e-5). A miss is
            still accepted when tpu is no farther from the op run in float64 than
            :data:`FLOAT64_FACTOR` times CPU is. Integers, bools and NaN positions must match.

    Yields:
        A :class:`ShadowReport` counting the ops compared.
    """
    report = ShadowReport(rtol=rtol, atol=atol)
    with mode("debug"):
        hook.start(report)
        try:
            yield report
        finally:
            hook.stop(report)
    if hook.pending() is not None:
        hook.raise_pending()


def _from_environment() -> None:
    if config.get("TPUREC_SHADOW") == "off":
        return
    if get_mode() != "debug":
        raise ValueError(
            f"TPUREC_SHADOW=cpu compares each op as it runs, which needs TPUREC_MODE=debug (it is {get_mode()!r})"
        )
    hook.start(ShadowReport())
    atexit.register(_finish_environment)


def _finish_environment() -> None:
    # A divergence found in the last backward of a script, with no tpu op after it to raise it.
    if hook.pending() is not None:
        print(str(hook.pending()), file=sys.stderr)


_from_environment()
