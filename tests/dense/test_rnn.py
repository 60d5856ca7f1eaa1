"""RNN cell and packed-sequence lowerings through the tpu device vs CPU."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import tpurec  # noqa: F401

# float32 through sigmoid/tanh (XLA's approximations are a few ulp from Sleef's).
TOL = dict(rtol=1e-5, atol=1e-5)


def _compare_module(module: nn.Module, inputs: tuple, reduce=lambda out: out[0]):
    """Forward and every gradient (inputs and parameters) of ``module`` on tpu vs CPU."""
    torch.manual_seed(0)
    tpu_module = copy.deepcopy(module).to("tpu")
    cpu_inputs = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    tpu_inputs = [x.detach().to("tpu").requires_grad_(x.is_floating_point()) for x in inputs]
    ref = reduce(module(*cpu_inputs))
    cotangent = torch.randn(ref.shape)
    (ref * cotangent).sum().backward()
    # Recorded, not raised: an exception inside the autograd engine aborts the process.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        out = reduce(tpu_module(*tpu_inputs))
        (out * cotangent.to("tpu")).sum().backward()
    assert not [w for w in caught if "ran on the host" in str(w.message)]
    torch.testing.assert_close(out.cpu(), ref.detach(), **TOL)
    for got, want in zip(tpu_inputs, cpu_inputs):
        if want.grad is not None:
            torch.testing.assert_close(got.grad.cpu(), want.grad, **TOL)
    for (name, p), q in zip(module.named_parameters(), tpu_module.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad, **TOL, msg=name)


class _LSTMWithState(nn.Module):
    def __init__(self, cell: nn.LSTMCell) -> None:
        super().__init__()
        self.cell = cell

    def forward(self, x, h, c):
        return self.cell(x, (h, c))


@pytest.mark.parametrize("bias", [True, False])
def test_lstm_cell(bias):
    torch.manual_seed(0)
    module = _LSTMWithState(nn.LSTMCell(5, 4, bias=bias))
    x, h, c = torch.randn(3, 5), torch.randn(3, 4), torch.randn(3, 4)
    # both outputs feed the loss, so grad_hy and grad_cy are both defined
    _compare_module(module, (x, h, c), reduce=lambda hc: hc[0] * 2 + hc[1])


@pytest.mark.parametrize("bias", [True, False])
def test_gru_cell(bias):
    torch.manual_seed(0)
    cell = nn.GRUCell(5, 4, bias=bias)
    _compare_module(cell, (torch.randn(3, 5), torch.randn(3, 4)), reduce=lambda h: h)


def test_lstm_cell_with_state_only_hidden_used():
    torch.manual_seed(0)
    module = _LSTMWithState(nn.LSTMCell(5, 4))
    # only hy reaches the loss: grad_cy arrives undefined
    _compare_module(module, (torch.randn(2, 5), torch.randn(2, 4), torch.randn(2, 4)), reduce=lambda hc: hc[0])


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_two_layer_bidirectional(kind):
    torch.manual_seed(0)
    module = (nn.LSTM if kind == "lstm" else nn.GRU)(4, 6, num_layers=2, bidirectional=True)
    _compare_module(module, (torch.randn(5, 3, 4),))


def test_lstm_on_packed_sequence_unsorted_lengths():
    torch.manual_seed(0)
    lstm = nn.LSTM(4, 5, batch_first=True)

    class Packed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = lstm

        def forward(self, x):
            packed = pack_padded_sequence(x, torch.tensor([3, 5, 1]), batch_first=True, enforce_sorted=False)
            out, _ = self.lstm(packed)
            return pad_packed_sequence(out, batch_first=True)[0]

    _compare_module(Packed(), (torch.randn(3, 5, 4),), reduce=lambda out: out)


@pytest.mark.parametrize("batch_first", [False, True])
def test_pack_padded_sequence_data_and_batch_sizes(batch_first):
    x = torch.randn(4, 3, 2) if not batch_first else torch.randn(3, 4, 2)
    lengths = torch.tensor([4, 2, 1])
    ref = pack_padded_sequence(x, lengths, batch_first=batch_first)
    got = pack_padded_sequence(x.to("tpu"), lengths, batch_first=batch_first)
    assert got.data.device.type == "tpu"
    torch.testing.assert_close(got.data.cpu(), ref.data)
    assert got.batch_sizes.tolist() == ref.batch_sizes.tolist() == [3, 2, 1, 1]


@pytest.mark.parametrize(
    "lengths, message",
    [([2, 3, 1], "decreasing"), ([5, 2, 1], "exceeds"), ([2, 0, 0], "positive")],
)
def test_pack_padded_sequence_bad_lengths(lengths, message):
    x = torch.randn(4, 3, 2, device="tpu")
    with pytest.raises(ValueError, match=message):
        torch.ops.aten._pack_padded_sequence(x, torch.tensor(lengths), False)
