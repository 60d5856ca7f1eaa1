"""Issue 13 acceptance: unmodified CNN / LSTM-LM / bidirectional-GRU models train
10 steps on the tpu device with losses within 1e-4 (relative) of the same
training on CPU, in eager, fused and compiled mode."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import tpurec

STEPS = 10
LOSS_RTOL = 1e-4
VOCAB = 40


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1, stride=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.AvgPool2d(2),
            nn.AdaptiveAvgPool2d(3),
        )
        self.head = nn.Linear(16 * 9, 5)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(images), 1))


class LSTMLanguageModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 12)
        self.lstm = nn.LSTM(12, 16, batch_first=True)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(self.embed(tokens), lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        padded, _ = pad_packed_sequence(out, batch_first=True, total_length=tokens.shape[1])
        return self.head(padded)


class BiGRUClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 12)
        self.gru = nn.GRU(12, 16, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(2 * 16, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _, h_n = self.gru(self.embed(tokens))
        return self.head(torch.cat([h_n[-2], h_n[-1]], dim=1))


def _cnn_batch(g: torch.Generator):
    return (torch.randn(6, 3, 12, 12, generator=g),), (), torch.randint(0, 5, (6,), generator=g)


def _lm_batch(g: torch.Generator):
    tokens = torch.randint(1, VOCAB, (4, 7), generator=g)
    lengths = torch.tensor([5, 7, 3, 6])
    targets = torch.randint(1, VOCAB, (4, 7), generator=g)
    targets[torch.arange(7)[None, :] >= lengths[:, None]] = -100  # padding: ignored by the loss
    return (tokens,), (lengths,), targets  # lengths stay on the host, as pack_padded_sequence wants


def _gru_batch(g: torch.Generator):
    return (torch.randint(0, VOCAB, (5, 6), generator=g),), (), torch.randint(0, 3, (5,), generator=g)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)


MODELS = {
    "cnn": (SmallCNN, _cnn_batch),
    "lstm_lm": (LSTMLanguageModel, _lm_batch),
    "bigru": (BiGRUClassifier, _gru_batch),
}


def _train(model: nn.Module, batches, device: str, mode: str) -> list[float]:
    model = model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    forward = torch.compile(model, backend="tpu") if mode == "compiled" else model
    losses = []
    with tpurec.mode("fused" if mode == "fused" else "eager"):
        for inputs, host_inputs, targets in batches:
            optimizer.zero_grad()
            loss = _loss(forward(*(x.to(device) for x in inputs), *host_inputs), targets.to(device))
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eager", "fused", "compiled"])
@pytest.mark.parametrize("name", list(MODELS))
def test_model_trains_like_cpu(name, mode):
    make_model, make_batch = MODELS[name]
    torch.manual_seed(0)
    model = make_model()
    g = torch.Generator().manual_seed(1)
    # Two batches in turn: the model can fit them, so the loss must fall.
    batches = [make_batch(g) for _ in range(2)] * (STEPS // 2)
    cpu_losses = _train(copy.deepcopy(model), batches, "cpu", "eager")
    tpu_losses = _train(copy.deepcopy(model), batches, "tpu", mode)
    assert cpu_losses[-1] < cpu_losses[0]  # it does train
    torch.testing.assert_close(torch.tensor(tpu_losses), torch.tensor(cpu_losses), rtol=LOSS_RTOL, atol=0)
