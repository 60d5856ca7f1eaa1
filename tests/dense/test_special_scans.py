"""Float32 special functions scanned over their whole float32 range, against float64 on CPU.

The functions whose float32 lowerings have tails far outside float32's range (``erfc``,
``erfcx``, ``log_ndtr``; tpurec/dense/error_functions.py) and the ones computed through
float64 (``ndtri``, ``erfinv``, ``lgamma``, ``digamma``; tpurec/dense/transcendental.py),
through the tpu device on XLA:CPU, at every 8192nd float32 bit pattern (1024 values in each
binade, both signs, about 330,000 inputs). Where float64's answer is a normal float32 number,
each value's relative error from it is at most twice PyTorch CPU's float32 error at that input
plus 8 float32 epsilons (2^-23, so about 1e-6: PyTorch's own float32 erfcx, the algorithm
tpurec follows, errs by up to 4.4 epsilons in this scan, where glibc's erfc, which CPU's
``erfc`` calls, is nearly exact); elsewhere NaN and infinities fall where CPU's do. Inputs and
results below float32's smallest normal number are left out: the device flushes them to zero
(docs/device-semantics.md).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import pytest
import torch

_TINY = float(np.finfo(np.float32).tiny)
_MAX = float(np.finfo(np.float32).max)
_EPS = 2.0**-23


def _every_float32(stride: int = 2**13) -> torch.Tensor:
    """Every ``stride``-th float32 bit pattern that is finite and normal (or zero), with both infinities and NaN."""
    values = np.arange(0, 2**32, stride, dtype=np.uint64).astype(np.uint32).view(np.float32)
    values = values[np.isfinite(values) & ((np.abs(values) >= _TINY) | (values == 0))]
    edges = np.array([np.inf, -np.inf, np.nan, -0.0], dtype=np.float32)
    return torch.from_numpy(np.concatenate([values, edges]))


def assert_as_accurate_as_cpu(function: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> None:
    """``function`` on the tpu device within twice CPU's float32 error plus 8 epsilons of float64, pointwise."""
    exact = function(*(x.double() for x in inputs))
    cpu = function(*inputs)
    ours = function(*(x.to("tpu") for x in inputs)).cpu()
    assert ours.dtype == torch.float32
    normal = exact.isfinite() & (exact.abs() >= _TINY) & (exact.abs() <= _MAX)
    with np.errstate(all="ignore"):
        ours_error = ((ours.double() - exact).abs() / exact.abs())[normal]
        cpu_error = ((cpu.double() - exact).abs() / exact.abs())[normal]
    bound = 2 * cpu_error + 8 * _EPS
    wrong = ~(ours_error <= bound)  # NaN errors count as wrong
    if wrong.any():
        at = torch.nonzero(normal).flatten()[wrong]
        worst = at[torch.argmax(torch.where(ours_error[wrong].isnan(), torch.inf, ours_error[wrong]))]
        raise AssertionError(
            f"{int(wrong.sum())} of {int(normal.sum())} values off; worst at input "
            f"{[x[worst].item() for x in inputs]}: tpu {ours[worst].item()!r}, cpu {cpu[worst].item()!r}, "
            f"float64 {exact[worst].item()!r}"
        )
    # Outside float32's normal range: NaN and infinities where CPU has them (results that
    # underflow may be 0 or CPU's subnormal).
    rest = ~normal
    for kind in (torch.isnan, torch.isposinf, torch.isneginf):
        mismatch = rest & (kind(ours) != kind(cpu))
        assert not mismatch.any(), (kind.__name__, [x[mismatch][:5].tolist() for x in inputs], ours[mismatch][:5])


UNARY = {
    "erfc": torch.erfc,
    "erfcx": torch.special.erfcx,
    "log_ndtr": torch.special.log_ndtr,
    "ndtri": torch.special.ndtri,
    "erfinv": torch.erfinv,
    "lgamma": torch.lgamma,
    "digamma": torch.digamma,
}


@pytest.mark.parametrize("name", list(UNARY))
def test_unary_special_function_over_the_whole_float32_range(name: str) -> None:
    assert_as_accurate_as_cpu(UNARY[name], _every_float32())


def test_erfcx_and_log_ndtr_where_float64_underflows_or_loses_digits() -> None:
    # erfcx read 0.0 for x in [26.543, 26.642] (exp(x^2) erfc(x) in float64, whose subnormal
    # erfc XLA flushes); log_ndtr erred 7.7e-2 for x in (6, 8] (log(ndtr(x)) of a float64 ndtr
    # near 1).
    x = torch.cat([torch.linspace(26.5, 26.7, 4001), torch.linspace(5.0, 9.0, 4001)])
    assert_as_accurate_as_cpu(torch.special.erfcx, x)
    assert_as_accurate_as_cpu(torch.special.log_ndtr, x)
