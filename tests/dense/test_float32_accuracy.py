"""Float32 functions that tpurec writes out instead of leaving them to XLA, against float64 on CPU.

XLA expands ``sinh``, ``cosh``, ``acosh``, ``erf_inv``, ``erfc`` and ``zeta`` itself, with float32
exponentials and logarithms that a TPU approximates (relative errors up to 2.6e-4 on a v5e, see
docs/lowerings.md; on XLA:CPU erf_inv erred 5.7e-6 and sinh/cosh 1.5e-6). tpurec computes them
around accurate exponentials and logarithms or in float64 (``tpurec/dense/transcendental.py``).
Here, through the tpu device on XLA:CPU: over wide ranges and at the edges, the largest relative
error against float64 is at most twice PyTorch CPU's own plus 2 ulp, and infinities and NaN fall
where CPU's do. (Results below float32's smallest normal number are left out: the device flushes
them to zero, docs/device-semantics.md.)
"""

from __future__ import annotations

import pytest
import torch

_TINY = torch.finfo(torch.float32).tiny
_EPS = torch.finfo(torch.float32).eps


def _spread(generator: torch.Generator, scales: tuple[float, ...], extra: list[float]) -> torch.Tensor:
    parts = [torch.randn(2048, generator=generator) * s for s in scales]
    return torch.cat(parts + [torch.tensor(extra, dtype=torch.float32)])


def _inputs(name: str) -> tuple:
    g = torch.Generator().manual_seed(0)
    inf, nan = float("inf"), float("nan")
    if name in ("sinh", "cosh"):
        edges = [0.0, -0.0, 1.0, -1.0, 88.0, 89.0, 89.4, 89.5, 90.0, -89.5, inf, -inf, nan, 1e-30]
        return (_spread(g, (1e-6, 1e-3, 0.1, 1.0, 5.0, 30.0), edges),)
    if name == "acosh":
        near_one = [1 + torch.rand(2048, generator=g) * s for s in (1e-6, 1e-3, 0.1, 1.0, 10.0, 1e4)]
        edges = torch.tensor([1.0, 0.999, 2.0, 2.0**26, 2.0**27, 3e38, inf, nan, 0.0, -5.0])
        return (torch.cat(near_one + [edges]),)
    if name == "erfinv":
        edges = torch.tensor([1.0, -1.0, 0.0, -0.0, 1.5, nan, 1 - 2**-24, -1 + 2**-24])
        return (torch.cat([torch.rand(8192, generator=g) * 2 - 1, 1 - torch.rand(1024, generator=g) * 1e-4, edges]),)
    if name == "erfc":
        return (_spread(g, (1.0, 4.0), [0.0, 9.0, 27.0, -30.0, inf, -inf, nan]),)
    if name == "zeta":
        return torch.rand(4096, generator=g) * 10 + 1.01, torch.rand(4096, generator=g) * 1000
    if name == "asinh":
        return (_spread(g, (1e-6, 1e-3, 1.0, 1e3, 1e30), [0.0, -0.0, 2.0**26, 2.0**27, 3e38, inf, -inf, nan]),)
    if name == "atanh":
        edges = torch.tensor([0.0, -0.0, 1.0, -1.0, 1 - 2**-24, 2.0, nan])
        return (torch.cat([torch.rand(8192, generator=g) * 2 - 1, edges]),)
    raise KeyError(name)


FUNCTIONS = {
    "sinh": torch.sinh,
    "cosh": torch.cosh,
    "acosh": torch.acosh,
    "erfinv": torch.erfinv,
    "erfc": torch.erfc,
    "zeta": torch.special.zeta,
    "asinh": torch.asinh,
    "atanh": torch.atanh,
}


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_float32_function_is_as_accurate_as_cpu(name: str) -> None:
    f = FUNCTIONS[name]
    inputs = _inputs(name)
    exact = f(*(x.double() for x in inputs))
    cpu = f(*inputs)
    ours = f(*(x.to("tpu") for x in inputs)).cpu()
    assert ours.dtype == torch.float32
    # Infinities and NaN where CPU has them.
    assert torch.equal(ours.isnan(), cpu.isnan()) and torch.equal(ours.isposinf(), cpu.isposinf())
    assert torch.equal(ours.isneginf(), cpu.isneginf())
    normal = exact.isfinite() & (exact.abs() >= _TINY) & (exact.abs() <= torch.finfo(torch.float32).max)

    def worst(x: torch.Tensor) -> float:
        error = (x.double() - exact).abs() / exact.abs()
        return error[normal].max().item()

    assert worst(ours) <= 2 * worst(cpu) + 2 * _EPS, (worst(ours), worst(cpu))


def test_float32_arithmetic_flushes_subnormals_as_cpu_with_flush_denormal() -> None:
    # XLA (on CPU as on a TPU) computes float32 with subnormal inputs and results flushed to zero:
    # the device's results are PyTorch CPU's under torch.set_flush_denormal(True), bit for bit.
    # Copies keep them (the device stores the bits it is given).
    x = torch.tensor([1e-40, -3e-39, 1e-39, 2e-38, 2.4e-38, 1.0])
    on_device = x.to("tpu")
    assert torch.equal(on_device.cpu(), x) and torch.equal(torch.cat([on_device, on_device.clone()]).cpu(), x.repeat(2))
    ops = {
        "mul": lambda v: v * 0.25,
        "add": lambda v: v + 0,
        "div": lambda v: v / 3,
        "sum": lambda v: v.sum(),
        "exp": lambda v: torch.exp(v - 100),
    }
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals (no SSE3)")
    try:
        for name, op in ops.items():
            assert torch.equal(op(on_device).cpu(), op(x)), name
    finally:
        torch.set_flush_denormal(False)
