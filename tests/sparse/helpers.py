"""Shared helpers of the tpurec.sparse tests: random KJTs and torchrec references."""

from __future__ import annotations

import numpy as np
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import PoolingType


def make_tables(dims=(4, 4, 8), rows=(13, 7, 5), features=(("f0", "f1"), ("f2",), ("f3",)), pooling=PoolingType.SUM):
    return [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=d, num_embeddings=r, feature_names=list(fs), pooling=pooling)
        for i, (d, r, fs) in enumerate(zip(dims, rows, features))
    ]


def random_kjt(
    tables, batch_size, rng: np.random.Generator, max_len=4, weighted=False, lengths=None
) -> KeyedJaggedTensor:
    keys, values, lens = [], [], []
    for t in tables:
        for f in t.feature_names:
            keys.append(f)
            ls = rng.integers(0, max_len + 1, batch_size) if lengths is None else np.full(batch_size, lengths)
            lens.append(ls)
            values.append(rng.integers(0, t.num_embeddings, int(ls.sum())))
    v = torch.from_numpy(np.concatenate(values)).long()
    kwargs = {}
    if weighted:
        kwargs["weights"] = torch.from_numpy(rng.uniform(0.5, 2.0, v.numel()).astype(np.float32))
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=v, lengths=torch.from_numpy(np.concatenate(lens)).long(), **kwargs
    )


def with_weights(kjt: KeyedJaggedTensor, weights: torch.Tensor) -> KeyedJaggedTensor:
    """``kjt`` (VBE and inverse_indices kept) with ``weights`` as its per-id weights."""
    return KeyedJaggedTensor(
        keys=kjt.keys(),
        values=kjt.values(),
        lengths=kjt.lengths(),
        weights=weights,
        stride_per_key_per_rank=kjt.stride_per_key_per_rank(),
        inverse_indices=kjt.inverse_indices(),
    )
