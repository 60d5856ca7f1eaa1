"""tpurec.library.jax_op: JAX and Pallas functions as custom ops on tpu tensors."""

import itertools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
import torch
from jax.experimental import pallas as pl

import tpurec
from tpurec.library import jax_op


@pytest.fixture(autouse=True)
def _start_in_eager_mode():
    """These tests check eager-mode mechanics or enter the mode they test themselves, so each
    starts in eager mode even when the suite runs with TPUREC_MODE=fused."""
    with tpurec.mode("eager"):
        yield


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# A plain JAX op: differentiated by jax.vjp; a float (runtime) and an int (static) argument.
# Ops a test defines get a new name each time it runs (the fused-mode run of a test is in the same process).
_fresh = itertools.count()


@jax_op("tpurec_test::gated_tanh")
def gated_tanh(x: jax.Array, gate: jax.Array, *, scale: float = 1.0, power: int = 1) -> jax.Array:
    return jnp.tanh(x) ** power * jax.nn.sigmoid(gate) * scale


def torch_gated_tanh(x, gate, scale=1.0, power=1):
    return torch.tanh(x) ** power * torch.sigmoid(gate) * scale


# A Pallas kernel: JAX cannot differentiate it, so it has a backward written in JAX.
def _mul_relu_kernel(x_ref, y_ref, out_ref):
    out_ref[...] = jnp.maximum(x_ref[...] * y_ref[...], 0.0)


def _mul_relu_backward(grad, x, y):
    active = (x * y > 0).astype(grad.dtype)
    return grad * active * y, grad * active * x


@jax_op("tpurec_test::mul_relu", backward=_mul_relu_backward)
def mul_relu(x: jax.Array, y: jax.Array) -> jax.Array:
    return pl.pallas_call(
        _mul_relu_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=jax.default_backend() != "tpu"
    )(x, y)


# Two outputs.
@jax_op("tpurec_test::sum_and_max")
def sum_and_max(x: jax.Array, *, dim: int = 1) -> tuple[jax.Array, jax.Array]:
    return x.sum(dim), x.max(dim)


class Block(torch.nn.Module):
    """Linear -> Pallas mul_relu with a second linear -> JAX gated_tanh -> linear."""

    def __init__(self, custom: bool) -> None:
        super().__init__()
        self.custom = custom
        self.a = torch.nn.Linear(6, 16)
        self.b = torch.nn.Linear(6, 16)
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x):
        a, b = self.a(x), self.b(x)
        if self.custom:
            h = gated_tanh(mul_relu(a, b), b, scale=1.5, power=2)
        else:
            h = torch_gated_tanh(torch.relu(a * b), b, scale=1.5, power=2)
        return self.out(h)


def _train(model, device, steps, compiled=False):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    forward = torch.compile(model, backend="tpu") if compiled else model
    generator = torch.Generator().manual_seed(1)
    losses, grads = [], []
    for _ in range(steps):
        x = torch.randn(8, 6, generator=generator)
        y = torch.randn(8, 1, generator=generator)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(forward(x.to(device)), y.to(device))
        loss.backward()
        grads.append({n: p.grad.cpu().clone() for n, p in model.named_parameters()})
        optimizer.step()
        losses.append(loss.item())
    return losses, grads


@pytest.mark.parametrize("mode", ["eager", "fused", "compiled"])
def test_jax_and_pallas_ops_train_like_pytorch(mode):
    torch.manual_seed(0)
    reference = Block(custom=False)
    model = Block(custom=True)
    model.load_state_dict(reference.state_dict())
    ref_losses, ref_grads = _train(reference, "cpu", steps=4)
    with tpurec.mode("eager" if mode == "compiled" else mode):
        losses, grads = _train(model.to("tpu"), "tpu", steps=4, compiled=mode == "compiled")
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (losses, ref_losses)
    for step_grads, step_ref in zip(grads, ref_grads):
        for name in step_ref:
            torch.testing.assert_close(step_grads[name], step_ref[name], rtol=1e-5, atol=1e-5, msg=name)


def test_compiled_graph_with_custom_ops_is_one_program():
    model = Block(custom=True).to("tpu")
    x = torch.randn(8, 6).to("tpu")
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0, explanation
    compiled = torch.compile(model, backend="tpu")
    with torch.no_grad():
        compiled(x)  # compiles
        tpurec.reset_stats()
        compiled(x).cpu()
    stats = tpurec.stats()
    # The whole forward, both custom ops included, ran as one program: no eager op programs.
    assert stats["executions"] == 1 and stats["ops_by_name"] == {"_to_copy.default": 1}, stats
    torch._dynamo.reset()


def test_custom_op_reuses_its_program_and_float_arguments_are_runtime_values():
    from tpurec.core import headroom

    headroom.release_programs()  # no program of power=3 left by an earlier test in this process
    x, gate = torch.randn(4, 5).to("tpu"), torch.randn(4, 5).to("tpu")
    gated_tanh(x, gate, scale=2.0, power=1).cpu()
    tpurec.reset_stats()
    out = gated_tanh(x, gate, scale=3.0, power=1)
    assert tpurec.stats()["programs_built"] == 0 and tpurec.stats()["compilations"] == 0
    torch.testing.assert_close(out.cpu(), torch_gated_tanh(x.cpu(), gate.cpu(), 3.0), rtol=1e-6, atol=1e-6)
    # An int argument is static: a new value is a new program.
    gated_tanh(x, gate, scale=2.0, power=3).cpu()
    assert tpurec.stats()["programs_built"] == 1


def test_two_outputs_on_tpu_cpu_and_fake_tensors():
    x = torch.randn(3, 4)
    total, largest = sum_and_max(x.to("tpu"), dim=0)
    torch.testing.assert_close(total.cpu(), x.sum(0))
    torch.testing.assert_close(largest.cpu(), x.max(0).values)
    host_total, _ = sum_and_max(x)  # CPU tensors run the same function on XLA:CPU
    torch.testing.assert_close(host_total, x.sum(1))
    half = x.bfloat16()
    for device in ("cpu", "tpu"):
        half_total, half_max = sum_and_max(half.to(device))
        assert half_total.dtype == torch.bfloat16 and half_total.device.type == device
        torch.testing.assert_close(half_max.cpu(), half.max(1).values)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake_total, fake_max = sum_and_max(torch.empty(7, 9, dtype=torch.float64), dim=1)
    assert fake_total.shape == (7,) and fake_max.dtype == torch.float64


def test_pallas_without_backward_fails_in_forward_with_advice():
    @jax_op(f"tpurec_test::mul_relu_no_backward_{next(_fresh)}")  # a new name each run in this process
    def no_backward(x: jax.Array, y: jax.Array) -> jax.Array:
        return pl.pallas_call(_mul_relu_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x, y)

    x = torch.randn(4, 4, device="tpu", requires_grad=True)
    no_backward(x.detach(), x.detach())  # without autograd it runs
    with pytest.raises(ValueError, match="backward="):
        no_backward(x, x)


def test_bad_definitions_are_rejected_clearly():
    with pytest.raises(ValueError, match="namespace::op_name"):
        jax_op("no_namespace")
    with pytest.raises(ValueError, match="already defined"):
        jax_op("tpurec_test::gated_tanh")(lambda x: x)
    with pytest.raises(TypeError, match="annotation"):

        @jax_op("tpurec_test::unannotated")
        def unannotated(x):
            return x

    with pytest.raises(TypeError, match="not supported"):

        @jax_op("tpurec_test::bad_type")
        def bad_type(x: jax.Array, names: list) -> jax.Array:
            return x


def test_user_backward_must_return_one_gradient_per_tensor():
    @jax_op(f"tpurec_test::bad_backward_{next(_fresh)}", backward=lambda g, x, y: g)
    def add(x: jax.Array, y: jax.Array) -> jax.Array:
        return x + y

    x = torch.randn(3, requires_grad=True)  # CPU: an error in backward aborts nothing there
    with pytest.raises(ValueError, match="one per tensor"):
        add(x, x).sum().backward()


@pytest.mark.slow
def test_pallas_example_trains_like_pytorch():
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples/pallas_kernel.py"), "--steps", "5", "--mode", "fused"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    worst = float(out.stdout.split("largest loss difference: ")[1].split(";")[0])
    assert worst <= 1e-5, out.stdout
