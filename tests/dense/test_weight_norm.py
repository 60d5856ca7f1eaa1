"""Weight normalisation through the tpu device against PyTorch's CPU kernels, forward and backward."""

from __future__ import annotations

import warnings

import pytest
import torch

import tpurec

pytestmark = pytest.mark.usefixtures("no_host_fallback")

TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("dim", [0, 2])
def test_interface_and_its_backward_match_the_cpu_kernels(dtype, dim):
    torch.manual_seed(0)
    v = torch.randn(3, 4, 5, dtype=dtype)
    shape = [1, 1, 1]
    shape[dim] = v.shape[dim]
    g = torch.randn(shape, dtype=dtype)
    w, norms = torch._weight_norm_interface(v, g, dim)
    grad = torch.randn_like(w)
    grad_v, grad_g = torch.ops.aten._weight_norm_interface_backward(grad, v, g, norms, dim)

    on = lambda t: t.to("tpu")  # noqa: E731
    w_t, norms_t = torch._weight_norm_interface(on(v), on(g), dim)
    grad_v_t, grad_g_t = torch.ops.aten._weight_norm_interface_backward(on(grad), on(v), on(g), on(norms), dim)
    for got, want in ((w_t, w), (norms_t, norms), (grad_v_t, grad_v), (grad_g_t, grad_g)):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got.cpu(), want, **TOL[dtype])


class _Net(torch.nn.Module):
    """A weight-normed Linear (the old hook API) feeding a weight-normed Conv1d (the parametrization)."""

    def __init__(self, dim):
        super().__init__()
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch.nn.utils.weight_norm is deprecated, still used
            self.linear = torch.nn.utils.weight_norm(torch.nn.Linear(6, 5), dim=dim)
        self.conv = torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(5, 4, 3), dim=dim)

    def forward(self, x):
        return self.conv(torch.tanh(self.linear(x)).transpose(1, 2))


def _train_step(model, x, compiled=False):
    forward = torch.compile(model, backend="tpu") if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = forward(x).square().mean()
    loss.backward()
    grads = [p.grad.detach().cpu().clone() for p in model.parameters()]
    opt.step()
    return [loss.detach().cpu()] + grads + [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["eager", "fused", "compiled"])
@pytest.mark.parametrize("dim", [0, 1])
def test_weight_normed_layers_train_as_on_cpu(mode, dim):
    # PyTorch runs the fused op for dim 0 and the last dim (the Linear's 1), ordinary ops otherwise (the Conv's 1).
    torch.manual_seed(1)
    x = torch.randn(2, 7, 6)
    want = _train_step(_Net(dim), x)
    model = _Net(dim).to("tpu")
    if mode == "fused":
        with tpurec.mode("fused"):
            got = _train_step(model, x.to("tpu"))
    else:
        got = _train_step(model, x.to("tpu"), compiled=mode == "compiled")
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
