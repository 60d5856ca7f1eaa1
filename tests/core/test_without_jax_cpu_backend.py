"""tpurec's work on CPU tensors where JAX has no CPU backend (``JAX_PLATFORMS=tpu``, as on a TPU machine).

tpurec asked JAX for its CPU device for constants lifted into compiled graphs and for custom ops
called on CPU tensors; with ``JAX_PLATFORMS=tpu`` JAX has none and raised. Here JAX's CPU backend is
made to look absent (``jax.devices("cpu")`` raises as JAX does) and both run on the default device.
"""

from __future__ import annotations

import itertools

import jax
import pytest
import torch

import tpurec.library

# Ops a test defines get a new name each run (the fused-mode run of a test is in the same process).
_fresh = itertools.count()


@pytest.fixture
def no_cpu_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    devices = jax.devices

    def without_cpu(backend=None):
        if backend == "cpu":
            raise RuntimeError(
                "Unknown backend: 'cpu' requested, but no platforms that are instances of cpu are present."
            )
        return devices() if backend is None else devices(backend)

    monkeypatch.setattr(jax, "devices", without_cpu)


class _WithCpuConstants(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.tensor(2.0) + x.new_tensor([1.0, 2.0])  # CPU tensors lifted into the graph


@pytest.mark.usefixtures("no_cpu_backend")
def test_compiled_graph_with_cpu_constants_runs() -> None:
    x = torch.tensor([1.0, 5.0])
    compiled = torch.compile(_WithCpuConstants(), backend="tpu")
    torch.testing.assert_close(compiled(x.to("tpu")).cpu(), _WithCpuConstants()(x), rtol=0, atol=0)


@pytest.mark.usefixtures("no_cpu_backend")
def test_custom_op_on_cpu_tensors_runs() -> None:
    @tpurec.library.jax_op(f"tpurec_test_no_cpu::twice_{next(_fresh)}")
    def twice(x: jax.Array) -> jax.Array:
        return x * 2

    x = torch.arange(3.0)
    out = twice(x)
    assert out.device.type == "cpu"
    torch.testing.assert_close(out, x * 2, rtol=0, atol=0)
