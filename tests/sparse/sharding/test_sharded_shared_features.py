"""A pooled collection with a feature in two tables (TorchRec's outputs ``feature@table``) and a table on
several features, sharded by ``tpurec.shard`` over the 8 host devices, against TorchRec's
``EmbeddingBagCollection`` trained on CPU on the same batches (5 steps, in-backward Adagrad, plain and VBE
batches): the pooled outputs per step within 1e-5 relative and 1e-6 absolute (float32 sums of up to 4 rows),
the tables after the steps within 1e-5 relative and 1e-6 absolute (float32 Adagrad updates of the same
gradients)."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagCollection as TorchrecEBC
from torchrec import EmbeddingBagConfig
from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, data_parallel, row_wise
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import tpurec
import tpurec.sparse as sp
from helpers import random_kjt
from test_input_forms import vbe_kjt
from tpurec.sparse.sharding import ShardedEmbeddingBagCollection

STEPS = 5
BATCH = 16
TOLERANCE: dict[str, Any] = {"rtol": 1e-5, "atol": 1e-6}
# "clicked" is pooled from both tables; "item" serves two features.
TABLES = [
    EmbeddingBagConfig(name="item", embedding_dim=8, num_embeddings=30, feature_names=["history", "clicked"]),
    EmbeddingBagConfig(name="shop", embedding_dim=4, num_embeddings=11, feature_names=["shop", "clicked"]),
]
BATCH_SHAPE = [
    EmbeddingBagConfig(name="ids", embedding_dim=4, num_embeddings=11, feature_names=["history", "clicked", "shop"])
]


@pytest.mark.parametrize("form", ["uniform", "vbe"])
def test_a_feature_in_two_tables_trains_as_torchrec_when_sharded(form):
    torch.manual_seed(0)
    reference = TorchrecEBC(TABLES)
    ours = copy.deepcopy(reference)
    for model in (reference, ours):
        apply_optimizer_in_backward(torch.optim.Adagrad, model.parameters(), {"lr": 0.1})
    meta = TorchrecEBC(TABLES, device=torch.device("meta"))
    generators = {"item": row_wise(), "shop": column_wise(ranks=[2, 6])} if form == "uniform" else {
        "item": column_wise(ranks=[1, 4]), "shop": data_parallel()
    }  # fmt: skip
    plan = construct_module_sharding_plan(meta, generators, local_size=8, world_size=8, device_type="cpu")
    sharded = tpurec.shard(sp.from_torchrec(ours).to("tpu"), plan)
    assert isinstance(sharded, ShardedEmbeddingBagCollection)
    start = {k: v.clone() for k, v in reference.state_dict().items()}
    rng = np.random.default_rng(5)
    for step in range(STEPS):
        kjt = random_kjt(BATCH_SHAPE, BATCH, rng) if form == "uniform" else vbe_kjt(BATCH_SHAPE, BATCH, rng)
        want, got = reference(kjt), sharded(kjt)
        assert got.keys() == want.keys() == ["history", "clicked@item", "shop", "clicked@shop"]
        torch.testing.assert_close(got.values().detach().cpu(), want.values().detach(), **TOLERANCE, msg=str(step))
        mix = torch.linspace(-1, 1, want.values().shape[1])
        for out, device in ((want, "cpu"), (got, "tpu")):
            ((out.values() * mix.to(device)) ** 2).sum().backward()
    theirs = reference.state_dict()
    mine = sharded.state_dict()
    assert set(mine) == set(theirs)
    for key, value in theirs.items():
        torch.testing.assert_close(mine[key].cpu(), value, **TOLERANCE, msg=key)
        assert not torch.equal(value, start[key]), key
