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


def random_kjt(tables, batch_size, rng: np.random.Generator, max_len=4, weighted=False, lengths=None) -> KeyedJaggedTensor:
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
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=v, lengths=torch.from_numpy(np.concatenate(lens)).long(), **kwargs)


def tpu_device_missing() -> str | None:
    """Why the "tpu" device cannot run the sparse modules yet (None when it can).

    The device core and its ATen lowerings land separately; the tpu tests skip
    (with the reason) until cat / full_like / views / autograd work there.
    """
    try:
        import tpurec.tensor  # noqa: F401

        x = torch.ones(2, 3, requires_grad=True)
        y = x.to("tpu")
        z = torch.cat([y.view(2, 3)[0:1], y[1:2]], dim=1) * torch.full_like(y[0:1].repeat(1, 2), 2.0)
        z.sum().backward()
        if not torch.equal(x.grad, torch.full((2, 3), 2.0)):
            return "tpu autograd gave a wrong gradient"
    except Exception as e:  # noqa: BLE001  (any failure means: not ready)
        return f"tpu device not ready: {type(e).__name__}: {str(e)[:200]}"
    return None
