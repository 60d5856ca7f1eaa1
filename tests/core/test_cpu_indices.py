"""Index tensors on the CPU: the tpu device accepts what CUDA accepts, and refuses the rest.

ATen's advanced indexing moves index tensors to the indexed tensor's device, so on CUDA
``t[cpu_idx]``, ``t[cpu_idx] = v``, ``index_put_`` and their backward work, and so does
``cpu_t[cuda_idx]``; a 0-dim CPU tensor is a scalar operand anywhere. A CPU tensor with
dimensions mixed into any other op (``t + cpu_vector``, ``index_select``) is an error, as
are non-scalar CPU values written through an index. Results are compared with the same
ops on CPU (exact: indexing moves values without arithmetic).
"""

from __future__ import annotations

import pytest
import torch

import tpurec
from tpurec.core import accounting

X = torch.arange(20.0).reshape(5, 4) / 7
ROWS = torch.tensor([3, 0, 3])
COLS = torch.tensor([1, 2, 0])
MASK = torch.tensor([True, False, True, False, True])

READS = {
    "rows": lambda t: t[ROWS],
    "columns": lambda t: t[:, COLS],
    "pairs": lambda t: t[ROWS, COLS],
    "mask": lambda t: t[MASK],
    "0-dim index": lambda t: t[torch.tensor(2)],
    "cpu and tpu indices": lambda t: t[ROWS.to(t.device), COLS],
}


@pytest.mark.parametrize("name", list(READS))
def test_reading_through_cpu_indices_and_its_backward_match_cpu(name):
    read = READS[name]
    host = X.clone().requires_grad_()
    dev = X.to("tpu").requires_grad_()
    want, got = read(host), read(dev)
    assert got.device.type == "tpu"
    grad = torch.linspace(-1, 1, want.numel()).reshape(want.shape)
    want.backward(grad)
    got.backward(grad.to("tpu"))
    torch.testing.assert_close(got.cpu(), want.detach(), rtol=0, atol=0)
    torch.testing.assert_close(dev.grad.cpu(), host.grad, rtol=0, atol=0)


VALUES = torch.arange(12.0).reshape(3, 4) - 5

WRITES = {
    "tpu values": lambda t: t.__setitem__(ROWS, VALUES.to(t.device)),
    "python scalar": lambda t: t.__setitem__(ROWS, 1.5),
    "0-dim cpu value": lambda t: t.__setitem__(ROWS, torch.tensor(2.5)),
    "mask": lambda t: t.__setitem__(MASK, 7.0),
    "index_put_ accumulate": lambda t: t.index_put_((ROWS,), VALUES.to(t.device), accumulate=True),
    "index_put": lambda t: t.copy_(t.index_put((ROWS, COLS), torch.tensor([1.0, 2.0, 3.0]).to(t.device), True)),
}


@pytest.mark.parametrize("name", list(WRITES))
def test_writing_through_cpu_indices_matches_cpu(name):
    host, dev = X.clone(), X.to("tpu")
    WRITES[name](host)
    WRITES[name](dev)
    torch.testing.assert_close(dev.cpu(), host, rtol=0, atol=0)


def test_gradient_through_a_write_with_cpu_indices():
    def f(t, v):
        out = t * 1
        out[ROWS] = v * 2
        return (out * out).sum()

    host_t, host_v = X.clone().requires_grad_(), VALUES.clone().requires_grad_()
    dev_t, dev_v = X.to("tpu").requires_grad_(), VALUES.to("tpu").requires_grad_()
    f(host_t, host_v).backward()
    f(dev_t, dev_v).backward()
    torch.testing.assert_close(dev_t.grad.cpu(), host_t.grad, rtol=0, atol=0)
    torch.testing.assert_close(dev_v.grad.cpu(), host_v.grad, rtol=0, atol=0)


def test_a_cpu_tensor_indexed_by_tpu_indices_stays_on_cpu():
    got = X[ROWS.to("tpu")]
    assert got.device.type == "cpu"
    torch.testing.assert_close(got, X[ROWS], rtol=0, atol=0)
    host, mixed = X.clone(), X.clone()
    host[ROWS] = 3.0
    mixed[ROWS.to("tpu")] = torch.tensor(3.0).to("tpu")
    torch.testing.assert_close(mixed, host, rtol=0, atol=0)


def test_0_dim_cpu_operands_are_scalars_and_get_their_gradient_on_cpu():
    torch.testing.assert_close((X.to("tpu") + torch.tensor(2.0)).cpu(), X + 2, rtol=0, atol=0)
    scale = torch.tensor(2.0, requires_grad=True)
    (X.to("tpu").requires_grad_() * scale).sum().backward()
    assert scale.grad.device.type == "cpu"
    torch.testing.assert_close(scale.grad, X.sum(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "call",
    [
        lambda t: t + torch.ones(4),
        lambda t: torch.index_select(t, 0, ROWS),
        lambda t: t.__setitem__(ROWS, VALUES),
        lambda t: torch.gather(t, 0, ROWS.reshape(3, 1)),
    ],
    ids=["1-D cpu operand", "index_select", "cpu values", "gather"],
)
def test_what_cuda_refuses_is_refused(call):
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        call(X.to("tpu"))


@pytest.mark.parametrize("mode", ["fused", "compiled"])
def test_cpu_indices_in_fused_and_compiled_mode(mode):
    def f(t, idx, v):
        out = t.clone()
        out[idx] = v
        return (t[idx] * 2).sum() + (out * out).sum()

    host_t, host_v = X.clone().requires_grad_(), VALUES.clone().requires_grad_()
    f(host_t, ROWS, host_v).backward()
    dev_t, dev_v = X.to("tpu").requires_grad_(), VALUES.to("tpu").requires_grad_()
    before = sum(accounting.counters().host_fallbacks.values())
    if mode == "fused":
        with tpurec.mode("fused"):
            loss = f(dev_t, ROWS, dev_v)
            loss.backward()
    else:
        loss = torch.compile(f, backend="tpu")(dev_t, ROWS, dev_v)
        loss.backward()
    assert sum(accounting.counters().host_fallbacks.values()) == before
    torch.testing.assert_close(dev_t.grad.cpu(), host_t.grad, rtol=0, atol=0)
    torch.testing.assert_close(dev_v.grad.cpu(), host_v.grad, rtol=0, atol=0)
