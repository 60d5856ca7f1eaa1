"""Sharded checkpoints: 8 devices table-wise -> 4 devices row-wise, bit-identical."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from jax.sharding import Mesh
from torchrec import EmbeddingBagCollection as TorchrecEBC
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingPlan
from torchrec.models.dlrm import DLRM

import tpurec
import tpurec.sparse as sp
from helpers import make_tables, random_kjt
from tpurec.sparse.checkpoint import sharded as checkpoint

EBC_PATH = "sparse_arch.embedding_bag_collection"
TABLES = make_tables(dims=(8, 8, 8), rows=(40, 23, 17), features=(("f0", "f1"), ("f2",), ("f3",)))


def _model(seed: int, plan: dict, devices: int, optimizer=None):
    torch.manual_seed(seed)
    model = DLRM(
        embedding_bag_collection=TorchrecEBC(TABLES),
        dense_in_features=5,
        dense_arch_layer_sizes=[16, 8],
        over_arch_layer_sizes=[16, 1],
    )
    model = sp.from_torchrec(model, optimizer=optimizer or sp.Adam(learning_rate=0.05)).to("tpu")
    meta = TorchrecEBC(tables=TABLES, device=torch.device("meta"))
    module_plan = construct_module_sharding_plan(meta, plan, local_size=devices, world_size=devices, device_type="cpu")
    mesh = Mesh(np.array(jax.devices()[:devices]), ("devices",))
    return tpurec.shard(model, ShardingPlan({EBC_PATH: module_plan}), mesh)


def _train(model, steps: int) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    rng = np.random.default_rng(3)
    losses = []
    for _ in range(steps):
        kjt = random_kjt(TABLES, 8, rng)
        dense = torch.from_numpy(rng.standard_normal((8, 5)).astype(np.float32))
        labels = torch.from_numpy(rng.integers(0, 2, 8).astype(np.float32))
        optimizer.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, kjt).squeeze(-1), labels.to("tpu"))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _dense_state(model) -> dict[str, np.ndarray]:
    return {k: v.cpu().numpy() for k, v in model.state_dict().items() if "embedding_bag_collection" not in k}


def test_table_wise_on_8_devices_loads_row_wise_on_4_bit_identical(tmp_path):
    saved = _model(0, {"t0": table_wise(rank=5), "t1": table_wise(rank=7), "t2": table_wise(rank=2)}, 8)
    _train(saved, 3)
    checkpoint.save(saved, tmp_path / "ckpt")
    want_tables, want_slots = saved.sparse_arch.embedding_bag_collection.full_tables()
    assert any(np.abs(s).max() > 0 for d in want_slots.values() for s in d.values())  # Adam's moments are non-zero

    loaded = _model(1, {"t0": row_wise(), "t1": row_wise(), "t2": column_wise(ranks=[0, 3])}, 4)
    before = loaded.sparse_arch.embedding_bag_collection.full_tables()[0]
    assert not np.array_equal(before["t0"], want_tables["t0"])
    checkpoint.load(loaded, tmp_path / "ckpt")
    ebc = loaded.sparse_arch.embedding_bag_collection
    got_tables, got_slots = ebc.full_tables()
    for name in want_tables:
        np.testing.assert_array_equal(got_tables[name], want_tables[name])
        for slot in want_slots[name]:
            np.testing.assert_array_equal(got_slots[name][slot], want_slots[name][slot])
    assert ebc._step == saved.sparse_arch.embedding_bag_collection._step == 3
    for key, value in _dense_state(saved).items():
        np.testing.assert_array_equal(_dense_state(loaded)[key], value)

    # Both continue identically (the optimizer step count came along too).
    np.testing.assert_allclose(_train(loaded, 2), _train(saved, 2), atol=1e-5, rtol=0)


def test_data_parallel_tables_round_trip(tmp_path):
    plan = {"t0": data_parallel(), "t1": row_wise(), "t2": data_parallel()}
    saved = _model(0, plan, 8, sp.RowWiseAdagrad(learning_rate=0.1))
    _train(saved, 2)
    checkpoint.save(saved, tmp_path / "ckpt")
    loaded = _model(
        1,
        {"t0": table_wise(rank=1), "t1": data_parallel(), "t2": table_wise(rank=0)},
        2,
        sp.RowWiseAdagrad(learning_rate=0.1),
    )
    checkpoint.load(loaded, tmp_path / "ckpt")
    want, want_slots = saved.sparse_arch.embedding_bag_collection.full_tables()
    got, got_slots = loaded.sparse_arch.embedding_bag_collection.full_tables()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
        np.testing.assert_array_equal(got_slots[name]["momentum1"], want_slots[name]["momentum1"])


def test_checkpoint_of_other_tables_is_refused(tmp_path):
    saved = _model(0, {"t0": table_wise(rank=0), "t1": table_wise(rank=1), "t2": table_wise(rank=2)}, 8)
    checkpoint.save(saved, tmp_path / "ckpt")
    torch.manual_seed(0)
    other_tables = make_tables(dims=(8,), rows=(40,), features=(("f0",),))
    ebc = sp.EmbeddingBagCollection(other_tables, optimizer=sp.Adam(learning_rate=0.05), device="tpu")
    meta = TorchrecEBC(tables=other_tables, device=torch.device("meta"))
    plan = construct_module_sharding_plan(
        meta, {"t0": table_wise(rank=0)}, local_size=8, world_size=8, device_type="cpu"
    )
    model = torch.nn.Module()
    model.sparse_arch = torch.nn.Module()
    model.sparse_arch.embedding_bag_collection = ebc
    model = tpurec.shard(model, ShardingPlan({EBC_PATH: plan}))
    with pytest.raises(ValueError, match=r"the checkpoint has tables \['t0', 't1', 't2'\], the model \['t0'\]"):
        checkpoint.load(model, tmp_path / "ckpt")
