"""A sequence recommender trained on tpu against the same model trained by TorchRec on CPU.

A ``torchrec.EmbeddingCollection`` (user history: item ids and their categories,
unpooled) whose ``JaggedTensor`` outputs go through ``to_padded_dense`` into a one-layer
``nn.TransformerEncoderLayer``, a masked mean over the positions and a linear head, BCE
loss. The reference trains on CPU with TorchRec (``apply_optimizer_in_backward`` on the
tables, ``torch.optim.SGD`` with momentum for the rest); a deep copy is converted with
``tpurec.sparse.from_torchrec``, moved with ``.to("tpu")`` and trained on the same
batches. Losses, dense parameters and tables are compared after every step at
rtol 1e-5, atol 1e-6 (float32; the transformer's matmuls and softmax reorder sums).

This is the path that needs FBGEMM's jagged operators on tpu (``offsets()``,
``jagged_to_padded_dense`` and its backward): tpurec/dense/jagged.py.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn
from torchrec import KeyedJaggedTensor
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection as TorchrecEC
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import tpurec
import tpurec.sparse as sp

STEPS = 5
BATCH = 4
MAX_LEN = 6
TOTAL = 14  # ids per feature and batch
DIM = 8
TOLERANCE = dict(rtol=1e-5, atol=1e-6)
FEATURES = ("history", "history_category")


def _tables() -> list[EmbeddingConfig]:
    return [
        EmbeddingConfig(name="item_ids", embedding_dim=DIM, num_embeddings=40, feature_names=["history"]),
        EmbeddingConfig(name="categories", embedding_dim=DIM, num_embeddings=9, feature_names=["history_category"]),
    ]


class SequenceRecommender(nn.Module):
    """Embeds each history feature, encodes it with a transformer layer, pools, and scores."""

    def __init__(self) -> None:
        super().__init__()
        self.ec = TorchrecEC(tables=_tables(), device=torch.device("cpu"))
        self.encoder = nn.TransformerEncoderLayer(
            d_model=DIM, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True
        )
        self.head = nn.Linear(DIM * len(FEATURES), 1)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        sequences = self.ec(features)
        pooled = []
        for name in FEATURES:
            jagged = sequences[name]
            lengths = jagged.lengths()
            padded = jagged.to_padded_dense(desired_length=MAX_LEN)  # [B, MAX_LEN, DIM]
            positions = torch.arange(MAX_LEN, device=lengths.device)
            padding = positions[None, :] >= lengths[:, None]
            encoded = self.encoder(padded, src_key_padding_mask=padding)
            kept = (~padding).unsqueeze(-1).to(encoded.dtype)
            pooled.append((encoded * kept).sum(1) / lengths.clamp(min=1).unsqueeze(-1).to(encoded.dtype))
        return self.head(torch.cat(pooled, dim=1)).squeeze(-1)


def _lengths(rng: np.random.Generator) -> np.ndarray:
    """History lengths per feature, 1 to MAX_LEN each (an all-masked row would be NaN on CPU too),
    summing to TOTAL: the lengths change every batch, the jagged values' shape does not, so
    fused mode compiles the step once (a new total is a new program, docs/torchrec_semantics.md)."""
    out = np.empty((len(FEATURES), BATCH), dtype=np.int64)
    for i in range(len(FEATURES)):
        while True:
            lengths = rng.integers(1, MAX_LEN + 1, size=BATCH)
            if lengths.sum() == TOTAL:
                out[i] = lengths
                break
    return out


def _batches(seed: int = 0) -> list[tuple[KeyedJaggedTensor, torch.Tensor]]:
    """STEPS batches of BATCH user histories and click labels."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(STEPS):
        lengths = _lengths(rng)
        values = [rng.integers(0, t.num_embeddings, int(lengths[i].sum())) for i, t in enumerate(_tables())]
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=list(FEATURES),
            values=torch.from_numpy(np.concatenate(values)).long(),
            lengths=torch.from_numpy(lengths.reshape(-1)).long(),
        )
        labels = torch.from_numpy(rng.integers(0, 2, BATCH)).float()
        batches.append((kjt, labels))
    return batches


def _dense_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for name, p in model.named_parameters() if not name.startswith("ec.")]


def _train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, kjt: KeyedJaggedTensor, labels: torch.Tensor
) -> float:
    optimizer.zero_grad()
    logits = model(kjt)
    loss = nn.functional.binary_cross_entropy_with_logits(logits, labels.to(logits.device))
    loss.backward()  # the tables' optimizer runs inside backward (TorchRec) / the fused lookup (tpurec)
    optimizer.step()
    return loss.item()


@pytest.mark.parametrize("mode", ["eager", "fused"])
@pytest.mark.parametrize(
    "table_optimizer,table_kwargs",
    [(torch.optim.SGD, {"lr": 0.5}), (torch.optim.Adagrad, {"lr": 0.3, "eps": 1e-8})],
    ids=["sgd", "adagrad"],
)
def test_sequence_model_trains_on_tpu_as_torchrec_on_cpu(mode, table_optimizer, table_kwargs):
    torch.manual_seed(0)
    reference = SequenceRecommender()
    ours = copy.deepcopy(reference)
    for model in (reference, ours):
        apply_optimizer_in_backward(table_optimizer, model.ec.parameters(), dict(table_kwargs))
    ours = sp.from_torchrec(ours, max_seq_len=MAX_LEN).to("tpu")
    assert isinstance(ours.ec, sp.EmbeddingCollection)
    assert all(p.device.type == "tpu" for p in ours.parameters())

    dense = dict(lr=0.05, momentum=0.9)
    reference_optimizer = torch.optim.SGD(_dense_parameters(reference), **dense)
    our_optimizer = torch.optim.SGD(_dense_parameters(ours), **dense)
    with tpurec.mode(mode):
        for step, (kjt, labels) in enumerate(_batches()):
            expected = _train_step(reference, reference_optimizer, kjt, labels)
            got = _train_step(ours, our_optimizer, kjt, labels)
            assert got == pytest.approx(expected, rel=TOLERANCE["rtol"], abs=TOLERANCE["atol"]), f"loss of step {step}"
            theirs = reference.state_dict()
            mine = ours.state_dict()
            assert set(mine) == set(theirs)  # TorchRec's keys, tables included (ec.embeddings.<table>.weight)
            for key, value in mine.items():
                torch.testing.assert_close(value.cpu(), theirs[key], **TOLERANCE, msg=f"{key} after step {step}")
    # The tables did train (a test that compared two frozen tables would pass for nothing).
    torch.manual_seed(0)
    initial = SequenceRecommender()  # the same initial weights as the reference
    for table in ("item_ids", "categories"):
        before = initial.ec.embeddings[table].weight
        after = reference.ec.embeddings[table].weight
        assert not torch.allclose(before, after), table
