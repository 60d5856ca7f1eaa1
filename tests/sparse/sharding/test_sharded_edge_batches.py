"""Sharded collections on edge batches: a fixed capacity too small names where, empty batches train."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagCollection as TorchrecEBC
from torchrec import KeyedJaggedTensor
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, data_parallel, row_wise, table_wise

import tpurec
import tpurec.sparse as sp
from helpers import make_tables, random_kjt

TABLES = make_tables(dims=(8, 8), rows=(20, 12), features=(("f0",), ("f1",)))


def _plan(t0):
    meta = TorchrecEBC(tables=TABLES, device=torch.device("meta"))
    return construct_module_sharding_plan(
        meta, {"t0": t0, "t1": row_wise()}, local_size=8, world_size=8, device_type="cpu"
    )


def _crowded_kjt() -> KeyedJaggedTensor:
    """16 samples (2 per device): samples 4 and 5 (device 2) have 10 ids of f0 each, others none."""
    f0 = np.zeros(16, np.int64)
    f0[[4, 5]] = 10
    f1 = np.ones(16, np.int64)
    values = np.concatenate([np.arange(20) % 20, np.arange(16) % 12])
    return KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1"], values=torch.from_numpy(values), lengths=torch.from_numpy(np.concatenate([f0, f1]))
    )


@pytest.mark.parametrize(
    "t0, where",
    [
        (table_wise(rank=1), "device 2 sends 20 entries to the shard on device 1"),
        (data_parallel(), "device 2 looks up 20 entries in its data-parallel replica"),
    ],
    ids=["table_wise", "data_parallel"],
)
def test_capacity_error_names_table_feature_devices_and_the_capacity_to_set(t0, where):
    torch.manual_seed(0)
    ebc = sp.EmbeddingBagCollection(TABLES, optimizer=sp.SGD(learning_rate=0.1), device="tpu")
    sharded = tpurec.shard(ebc, _plan(t0), capacity=8)
    before = sharded.full_tables()[0]
    message = rf"{where} this step but capacity=8: table 't0' feature 'f0' \(20\); pass capacity=24 \(or more\)"
    with pytest.raises(sp.CapacityError, match=message):
        sharded(_crowded_kjt())
    after = sharded.full_tables()[0]
    for name in before:
        np.testing.assert_array_equal(before[name], after[name])
    # The capacity it suggests fits.
    bigger = tpurec.shard(
        sp.EmbeddingBagCollection(TABLES, optimizer=sp.SGD(learning_rate=0.1), device="tpu"), _plan(t0), capacity=24
    )
    assert bigger(_crowded_kjt()).values().shape == (16, 16)


def _empty_kjt() -> KeyedJaggedTensor:
    none = torch.zeros(0, dtype=torch.int64)
    return KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1"], values=none, lengths=none)


@pytest.mark.parametrize("mode", ["eager", "fused"])
def test_an_empty_batch_gives_0_by_dims_and_training_goes_on_as_unsharded(mode):
    torch.manual_seed(0)
    # Adam: its bias correction counts steps, so an empty step must count as on the unsharded twin.
    twin = sp.EmbeddingBagCollection(TABLES, optimizer=sp.Adam(learning_rate=0.1), device="tpu")
    source = sp.EmbeddingBagCollection(TABLES, optimizer=sp.Adam(learning_rate=0.1), device="tpu")
    source.load_state_dict(twin.state_dict())
    sharded = tpurec.shard(source, _plan(table_wise(rank=3)))
    batches = [_empty_kjt(), random_kjt(TABLES, 16, np.random.default_rng(0)), _empty_kjt()]
    with tpurec.mode(mode):
        for kjt in batches:
            want, got = twin(kjt).values(), sharded(kjt).values()
            assert tuple(got.shape) == tuple(want.shape)
            torch.testing.assert_close(got.cpu(), want.cpu(), atol=1e-6, rtol=0)
            (want * want).sum().backward()
            (got * got).sum().backward()
    assert tuple(sharded(_empty_kjt()).values().shape) == (0, 16)
    assert sharded._step == max(twin._steps) == 3
    for name, value in sharded.full_tables()[0].items():
        np.testing.assert_allclose(value, twin.table_weight(name).detach().cpu().numpy(), atol=1e-6, rtol=0)
