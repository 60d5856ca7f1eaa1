"""overflow="drop" counts what it drops: per feature on each collection and in tpurec.stats()."""

from __future__ import annotations

import numpy as np
import torch
from torchrec import EmbeddingBagCollection as TorchrecEBC
from torchrec import KeyedJaggedTensor
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise

import tpurec
import tpurec.sparse as sp
from helpers import make_tables

TABLES = make_tables(dims=(8, 8), rows=(20, 12), features=(("f0",), ("f1",)))


def _kjt() -> KeyedJaggedTensor:
    """16 samples: samples 4 and 5 have 10 distinct ids of f0 each (rows 0..19); f1 has ids 0, 1, 2."""
    f0 = np.zeros(16, np.int64)
    f0[[4, 5]] = 10
    f1 = np.zeros(16, np.int64)
    f1[[0, 1, 2]] = 1
    values = np.concatenate([np.arange(20), np.arange(3)])
    return KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1"], values=torch.from_numpy(values), lengths=torch.from_numpy(np.concatenate([f0, f1]))
    )


def test_unsharded_collection_counts_dropped_entries_per_feature():
    # One stack (t0 rows 0..19, then t1 rows 20..31), one partition of 8 ids: the first 8 distinct
    # rows (f0's ids 0..7) are kept; f0's 12 others and f1's 3 are dropped.
    ebc = sp.EmbeddingBagCollection(
        TABLES, optimizer=sp.SGD(learning_rate=0.1), capacities=sp.Capacity(8), overflow="drop", device="tpu"
    )
    assert len(ebc.stacks) == 1
    tpurec.reset_stats()
    assert ebc.dropped_entries() == {} and tpurec.stats()["dropped_entries"] == {}
    ebc(_kjt()).values().sum().backward()
    assert ebc.dropped_entries() == {"f0": 12, "f1": 3}
    ebc.prefetch(_kjt())  # prepared on a worker: counted when the step takes it, once
    ebc(_kjt())
    assert ebc.dropped_entries() == {"f0": 24, "f1": 6}
    assert tpurec.stats()["dropped_entries"] == {"f0": 24, "f1": 6}
    tpurec.reset_stats()
    assert tpurec.stats()["dropped_entries"] == {} and ebc.dropped_entries() == {"f0": 24, "f1": 6}


def test_unsharded_collection_without_drops_counts_nothing():
    ebc = sp.EmbeddingBagCollection(TABLES, optimizer=sp.SGD(learning_rate=0.1), device="tpu")
    tpurec.reset_stats()
    ebc(_kjt())
    assert ebc.dropped_entries() == {} and tpurec.stats()["dropped_entries"] == {}


def test_sharded_collection_counts_dropped_entries_per_feature():
    meta = TorchrecEBC(tables=TABLES, device=torch.device("meta"))
    plan = construct_module_sharding_plan(
        meta, {"t0": table_wise(rank=1), "t1": row_wise()}, local_size=8, world_size=8, device_type="cpu"
    )
    ebc = sp.EmbeddingBagCollection(TABLES, optimizer=sp.SGD(learning_rate=0.1), device="tpu")
    sharded = tpurec.shard(ebc, plan, capacity=8, overflow="drop")
    tpurec.reset_stats()
    # Device 2 (samples 4 and 5) sends 20 entries of f0 to t0's shard on device 1: 12 are dropped.
    sharded(_kjt()).values().sum().backward()
    assert sharded.dropped_entries() == {"f0": 12} and sharded.dropped == 12
    sharded.prefetch(_kjt())
    sharded(_kjt())
    assert sharded.dropped_entries() == {"f0": 24} and sharded.dropped == 24
    assert tpurec.stats()["dropped_entries"] == {"f0": 24}
