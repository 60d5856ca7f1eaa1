"""A sharded sequence ``EmbeddingCollection`` (``tpurec.shard`` over the 8 host devices) on TorchRec's input
forms, against ``torchrec.EmbeddingCollection`` trained on CPU on the same batches: a variable batch per feature
(VBE: each feature its own number of sequences, ``inverse_indices`` not read, as TorchRec's collection reads
them), a feature in two tables (outputs ``feature@table``) and one table on several features.

Each test runs 5 steps with an in-backward Adagrad (TorchRec's one update on a step's summed gradient) and a
loss weighting each output differently; per step the outputs (values within 1e-6 absolute: single rows, no
sums; lengths exactly) and at the end the tables within 1e-5 relative and 1e-6 absolute (float32 Adagrad
updates of the same gradients).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection as TorchrecEC
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import tpurec
import tpurec.sparse as sp
from helpers import random_kjt
from test_input_forms import vbe_kjt
from tpurec.sparse.sharding import ShardedEmbeddingBagCollection

STEPS = 5
BATCH = 8
MAX_SEQ_LEN = 4
# "clicked" is looked up in both tables; "item" serves two features.
TABLES = [
    EmbeddingConfig(name="item", embedding_dim=8, num_embeddings=30, feature_names=["history", "clicked"]),
    EmbeddingConfig(name="shop", embedding_dim=8, num_embeddings=11, feature_names=["shop", "clicked"]),
]
# Ids every table holds, for the batches of the three features.
BATCH_SHAPE = [
    EmbeddingConfig(name="ids", embedding_dim=8, num_embeddings=11, feature_names=["history", "clicked", "shop"])
]
PLANS = {
    "row_wise": {"item": row_wise(), "shop": row_wise()},
    "mixed": {"item": column_wise(ranks=[1, 5]), "shop": data_parallel()},
    "table_wise": {"item": table_wise(rank=3), "shop": table_wise(rank=6)},
}


def _pair(plan: str):
    torch.manual_seed(0)
    reference = TorchrecEC(TABLES, need_indices=True)
    ours = copy.deepcopy(reference)
    for model in (reference, ours):
        apply_optimizer_in_backward(torch.optim.Adagrad, model.parameters(), {"lr": 0.1})
    ours = sp.from_torchrec(ours, max_seq_len=MAX_SEQ_LEN).to("tpu")
    meta = TorchrecEC(TABLES, device=torch.device("meta"))
    module_plan = construct_module_sharding_plan(meta, PLANS[plan], local_size=8, world_size=8, device_type="cpu")
    sharded = tpurec.shard(ours, module_plan)
    assert isinstance(sharded.bags, ShardedEmbeddingBagCollection)
    return reference, sharded


def _train_and_compare(reference, sharded, batches) -> None:
    start = {k: v.clone() for k, v in reference.state_dict().items()}
    for step, kjt in enumerate(batches):
        outs = [model(kjt) for model in (reference, sharded)]
        assert list(outs[1]) == list(outs[0]) == ["history", "clicked@item", "shop", "clicked@shop"]
        for key, want in outs[0].items():
            got = outs[1][key]
            msg = f"{key} at step {step}"
            torch.testing.assert_close(got.values().detach().cpu(), want.values().detach(), atol=1e-6, rtol=0, msg=msg)
            torch.testing.assert_close(got.lengths().cpu(), want.lengths(), atol=0, rtol=0, msg=msg)
            torch.testing.assert_close(got.weights().cpu(), want.weights(), atol=0, rtol=0, msg=msg)
        for out in outs:
            torch.stack([jt.values().pow(2).sum() * (i + 1) for i, jt in enumerate(out.values())]).sum().backward()
    theirs = reference.state_dict()
    ours = sharded.state_dict()
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key].cpu(), value, rtol=1e-5, atol=1e-6, msg=key)
        assert not torch.equal(value, start[key]), key  # the tables did train


@pytest.mark.parametrize("plan", list(PLANS))
def test_a_feature_in_two_tables_trains_as_torchrec_when_sharded(plan):
    reference, sharded = _pair(plan)
    rng = np.random.default_rng(1)
    _train_and_compare(
        reference, sharded, [random_kjt(BATCH_SHAPE, BATCH, rng, max_len=MAX_SEQ_LEN) for _ in range(STEPS)]
    )


@pytest.mark.parametrize(
    "plan, inverse", [("row_wise", False), ("mixed", True)], ids=["row_wise", "mixed_inverse_indices_ignored"]
)
def test_a_variable_batch_per_feature_trains_as_torchrec_when_sharded(plan, inverse):
    # Each feature has 1 to BATCH sequences (VBE over two ranks): rarely a multiple of the 8 devices.
    reference, sharded = _pair(plan)
    rng = np.random.default_rng(2)
    batches = [vbe_kjt(BATCH_SHAPE, BATCH, rng, max_len=MAX_SEQ_LEN, inverse=inverse) for _ in range(STEPS)]
    assert any(max(kjt.stride_per_key()) % 8 for kjt in batches)
    _train_and_compare(reference, sharded, batches)


def test_a_batch_that_is_no_multiple_of_the_devices_trains_as_torchrec_when_sharded():
    # TorchRec takes any number of sequences; the sharded lookup pads the bags with empty ones.
    reference, sharded = _pair("table_wise")
    rng = np.random.default_rng(3)
    _train_and_compare(reference, sharded, [random_kjt(BATCH_SHAPE, 5, rng, max_len=MAX_SEQ_LEN) for _ in range(STEPS)])
