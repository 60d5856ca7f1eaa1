"""Variable batch per feature (VBE) and inverse_indices under tpurec.shard: the sharded collection
pools, differentiates and trains as TorchRec's EmbeddingBagCollection does on the same batches."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagCollection as TorchrecEBC
from torchrec import KeyedJaggedTensor
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, data_parallel, row_wise, table_wise
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import tpurec
import tpurec.sparse as sp
from helpers import make_tables, with_weights
from test_input_forms import vbe_kjt

TABLES = make_tables(dims=(4, 4, 8))
BATCH = 16  # output samples: two per host device


def _plan():
    meta = TorchrecEBC(tables=TABLES, device=torch.device("meta"), is_weighted=True)
    return construct_module_sharding_plan(
        meta,
        {"t0": row_wise(), "t1": table_wise(rank=3), "t2": data_parallel()},
        local_size=8,
        world_size=8,
        device_type="cpu",
    )


def _tables(module) -> dict[str, torch.Tensor]:
    return {k.split(".")[-2]: v.detach().cpu() for k, v in module.state_dict().items()}


def test_vbe_batches_train_as_torchrec_under_shard():
    torch.manual_seed(0)
    reference = TorchrecEBC(TABLES, is_weighted=True)
    ours = copy.deepcopy(reference)
    apply_optimizer_in_backward(torch.optim.SGD, reference.parameters(), {"lr": 0.5})
    apply_optimizer_in_backward(torch.optim.SGD, ours.parameters(), {"lr": 0.5})
    sharded = tpurec.shard(sp.from_torchrec(ours).to("tpu"), _plan())
    rng = np.random.default_rng(0)
    for _ in range(3):
        kjt = vbe_kjt(TABLES, BATCH, rng, weighted=True)
        got = []
        for model in (reference, sharded):
            weights = kjt.weights().clone().requires_grad_(True)
            out = model(with_weights(kjt, weights)).values()
            out.pow(2).sum().backward()
            got.append((out.detach().cpu(), weights.grad))
        torch.testing.assert_close(got[1][0], got[0][0], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(got[1][1], got[0][1], atol=1e-5, rtol=1e-5)
    want = _tables(reference)
    full = sharded.full_tables()[0]
    for name, value in want.items():
        np.testing.assert_allclose(np.asarray(full[name]), value.numpy(), atol=1e-5, rtol=1e-5, err_msg=name)


def test_inverse_indices_on_one_stride_expand_and_bad_ones_are_named():
    torch.manual_seed(0)
    reference = TorchrecEBC(TABLES, is_weighted=True)
    sharded = tpurec.shard(sp.from_torchrec(copy.deepcopy(reference), optimizer=sp.SGD(0.1)).to("tpu"), _plan())
    rng = np.random.default_rng(1)
    kjt = vbe_kjt(TABLES, BATCH, rng, weighted=True, strides={f: 4 for f in ("f0", "f1", "f2", "f3")})
    torch.testing.assert_close(sharded(kjt).values().detach().cpu(), reference(kjt).values().detach())
    # Equal strides and no inverse_indices: one batch size already.
    plain = vbe_kjt(TABLES, BATCH, rng, inverse=False, weighted=True, strides={f: 8 for f in ("f0", "f1", "f2", "f3")})
    torch.testing.assert_close(sharded(plain).values().detach().cpu(), reference(plain).values().detach())
    names, index = kjt.inverse_indices()
    bad = KeyedJaggedTensor(
        keys=kjt.keys(),
        values=kjt.values(),
        lengths=kjt.lengths(),
        weights=kjt.weights(),
        stride_per_key_per_rank=kjt.stride_per_key_per_rank(),
        inverse_indices=(names, index + 10),
    )
    with pytest.raises(ValueError, match="inverse_indices of feature"):
        sharded(bad)
