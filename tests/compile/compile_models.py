"""Small models for the compile tests: an MLP, a DLRM-like dense arch, a transformer block."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, d_in: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1)
        )

    def forward(self, x, y):
        return nn.functional.binary_cross_entropy_with_logits(self.net(x), y)


class DenseArch(nn.Module):
    """DLRM's dense side: bottom MLP, embedding lookups, dot interaction, top MLP.

    The embeddings are plain ``nn.Embedding`` tables (the sparse side has its own
    SparseCore ops); the interaction is DLRM's: pairwise dots of the bottom
    output and the pooled embeddings, upper triangle, concatenated.
    """

    def __init__(self, dense_in: int = 13, dim: int = 16, tables: int = 4, rows: int = 50, top: int = 32) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(dense_in, 32), nn.ReLU(), nn.Linear(32, dim), nn.ReLU())
        self.embeddings = nn.ModuleList(nn.Embedding(rows, dim) for _ in range(tables))
        n = tables + 1
        self.register_buffer("pairs", torch.triu_indices(n, n, offset=1), persistent=False)
        self.top = nn.Sequential(nn.Linear(dim + n * (n - 1) // 2, top), nn.ReLU(), nn.Linear(top, 1))

    def forward(self, dense, ids, labels):
        x = self.bottom(dense)
        pooled = [table(ids[:, i, :]).sum(dim=1) for i, table in enumerate(self.embeddings)]
        features = torch.stack([x] + pooled, dim=1)  # (B, n, dim)
        dots = torch.bmm(features, features.transpose(1, 2))
        inter = dots[:, self.pairs[0], self.pairs[1]]
        logits = self.top(torch.cat([x, inter], dim=1))
        return nn.functional.binary_cross_entropy_with_logits(logits, labels)


class TransformerBlock(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, p: float = 0.1) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(dim, 1)

    def forward(self, x, y):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        att = torch.softmax(q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5, dim=-1)
        h = (self.drop(att) @ v).transpose(1, 2).reshape(b, s, d)
        x = x + self.drop(self.proj(h))
        x = x + self.drop(self.ff(self.ln2(x)))
        return nn.functional.mse_loss(self.head(x).squeeze(-1), y)


def mlp_batch(batch: int = 64, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 16, generator=g)
    return x, (x[:, :1] + 0.5 * x[:, 1:2] > 0).float()


def dlrm_batch(batch: int = 32, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(batch, 13, generator=g)
    ids = torch.randint(0, 50, (batch, 4, 3), generator=g)
    labels = (torch.rand(batch, 1, generator=g) > 0.5).float()
    return dense, ids, labels


def transformer_batch(batch: int = 4, seq: int = 8, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, 32, generator=g)
    return x, x.mean(-1)


MODELS = {
    "mlp": (MLP, mlp_batch),
    "dlrm": (DenseArch, dlrm_batch),
    "transformer": (TransformerBlock, transformer_batch),
}


def train(name: str, device: str, steps: int, compiled: bool, eval_mode: bool = True, on_step=None, batch=None):
    """Trains model ``name`` with SGD+momentum for ``steps``; returns the losses."""
    make_model, make_batch = MODELS[name]
    torch.manual_seed(0)
    model = make_model().to(device)
    if eval_mode:
        model.eval()  # dropout off; layer norm and everything else train as usual
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    inputs = [t.to(device) for t in (batch or make_batch())]
    step_fn = torch.compile(model, backend="tpu") if compiled else model
    losses = []
    for step in range(steps):
        if on_step:
            on_step(step)
        optimizer.zero_grad()
        loss = step_fn(*inputs)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses
