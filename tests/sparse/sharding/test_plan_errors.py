"""Bad plans, meshes and batches raise clear errors before anything changes."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from jax.sharding import Mesh
from torchrec import EmbeddingBagCollection as TorchrecEBC
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import ShardingPlan

import tpurec
import tpurec.sparse as sp
from helpers import make_tables, random_kjt
from tpurec.sparse.sharding import ShardedEmbeddingBagCollection

TABLES = make_tables(dims=(8, 8), rows=(20, 12), features=(("f0",), ("f1",)))


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = sp.EmbeddingBagCollection(TABLES, optimizer=sp.SGD(learning_rate=0.1))
        self.linear = torch.nn.Linear(16, 1)

    def forward(self, kjt):
        return self.linear(self.ebc(kjt).values())


def _module_plan(world_size: int = 8, **generators):
    meta = TorchrecEBC(tables=TABLES, device=torch.device("meta"))
    generators = generators or {"t0": table_wise(rank=1), "t1": row_wise()}
    return construct_module_sharding_plan(
        meta, generators, local_size=world_size, world_size=world_size, device_type="cpu"
    )


def _unchanged(model: Model, before: dict) -> None:
    assert isinstance(model.ebc, sp.EmbeddingBagCollection)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value.cpu(), before[key])
    assert all(len(p._storage.array.sharding.device_set) == 1 for p in model.parameters())
    assert not model._forward_pre_hooks


def _model() -> tuple[Model, dict]:
    torch.manual_seed(0)
    model = Model().to("tpu")
    return model, {k: v.cpu().clone() for k, v in model.state_dict().items()}


def test_rank_outside_the_mesh():
    model, before = _model()
    plan = ShardingPlan({"ebc": _module_plan(world_size=16, t0=table_wise(rank=12), t1=row_wise())})
    with pytest.raises(
        ValueError, match=r"table 't0' \(table_wise\) is placed on ranks \[12\] outside the mesh of 8 devices"
    ):
        tpurec.shard(model, plan)
    _unchanged(model, before)


def test_rank_outside_a_smaller_mesh():
    model, before = _model()
    mesh = Mesh(np.array(jax.devices()[:4]), ("devices",))
    with pytest.raises(ValueError, match="outside the mesh of 4 devices"):
        tpurec.shard(model, ShardingPlan({"ebc": _module_plan()}), mesh)
    _unchanged(model, before)


def test_unknown_sharding_type():
    model, before = _model()
    module_plan = _module_plan()
    module_plan["t1"].sharding_type = "diagonal_wise"
    with pytest.raises(ValueError, match=r"table 't1': unknown sharding type 'diagonal_wise'"):
        tpurec.shard(model, ShardingPlan({"ebc": module_plan}))
    _unchanged(model, before)


def test_table_missing_from_the_model():
    model, before = _model()
    module_plan = _module_plan()
    module_plan["t9"] = module_plan["t0"]
    with pytest.raises(ValueError, match=r"tables \['t9'\] that the module does not have"):
        tpurec.shard(model, ShardingPlan({"ebc": module_plan}))
    _unchanged(model, before)


def test_model_table_missing_from_the_plan():
    model, before = _model()
    module_plan = _module_plan()
    del module_plan["t1"]
    with pytest.raises(ValueError, match=r"no entry for tables \['t1'\]"):
        tpurec.shard(model, ShardingPlan({"ebc": module_plan}))
    _unchanged(model, before)


def test_plan_for_a_module_the_model_lacks():
    model, before = _model()
    with pytest.raises(ValueError, match=r"names modules \['sparse'\] that are not tpurec EmbeddingBagCollections"):
        tpurec.shard(model, ShardingPlan({"sparse": _module_plan()}))
    _unchanged(model, before)


def test_shards_that_do_not_tile_the_table():
    model, before = _model()
    module_plan = _module_plan()
    module_plan["t1"].sharding_spec.shards[1].shard_offsets = [0, 0]
    with pytest.raises(ValueError, match=r"table 't1' \(row_wise\): its shards do not tile"):
        tpurec.shard(model, ShardingPlan({"ebc": module_plan}))
    _unchanged(model, before)


def test_model_not_on_tpu():
    torch.manual_seed(0)
    model = Model()
    with pytest.raises(ValueError, match="move the model to 'tpu' first"):
        tpurec.shard(model, ShardingPlan({"ebc": _module_plan()}))
    assert isinstance(model.ebc, sp.EmbeddingBagCollection)


def test_batch_that_does_not_split_over_the_devices_changes_nothing():
    model, _ = _model()
    sharded = tpurec.shard(model, ShardingPlan({"ebc": _module_plan()}))
    assert isinstance(sharded.ebc, ShardedEmbeddingBagCollection)
    before = sharded.ebc.full_tables()[0]
    kjt = random_kjt(TABLES, 12, np.random.default_rng(0))
    with pytest.raises(
        ValueError, match="local batch of 12 samples does not split evenly over this process's 8 devices"
    ):
        sharded(kjt)
    bad = random_kjt(TABLES, 8, np.random.default_rng(0))
    bad = type(bad).from_lengths_sync(keys=bad.keys(), values=bad.values() + 100, lengths=bad.lengths())
    with pytest.raises(ValueError, match="outside"):
        sharded(bad)
    after = sharded.ebc.full_tables()[0]
    for name in before:
        np.testing.assert_array_equal(before[name], after[name])


def test_fixed_capacity_overflow():
    model, _ = _model()
    sharded = tpurec.shard(model, ShardingPlan({"ebc": _module_plan()}), capacity=8)
    kjt = random_kjt(TABLES, 8, np.random.default_rng(0), max_len=30)
    with pytest.raises(sp.CapacityError, match="capacity=8"):
        sharded(kjt)


def _weighted_requiring_grad(tables, batch: int):
    kjt = random_kjt(tables, batch, np.random.default_rng(0), weighted=True)
    return type(kjt).from_lengths_sync(
        keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(), weights=kjt.weights().requires_grad_()
    )


@pytest.mark.parametrize("why", ["mean_pooling", "overflow_drop"])
def test_per_id_weights_that_need_gradients_raise_where_torchrec_gradient_is_out_of_reach(why):
    from torchrec.modules.embedding_configs import PoolingType

    pooling = PoolingType.MEAN if why == "mean_pooling" else PoolingType.SUM
    tables = make_tables(dims=(8, 8), rows=(20, 12), features=(("f0",), ("f1",)), pooling=pooling)
    torch.manual_seed(0)
    ebc = sp.EmbeddingBagCollection(tables, is_weighted=True, optimizer=sp.SGD(learning_rate=0.1), device="tpu")
    overflow = "drop" if why == "overflow_drop" else "error"
    sharded = tpurec.shard(ebc, _module_plan(), overflow=overflow, capacity=64 if overflow == "drop" else None)
    before = sharded.full_tables()[0]
    weighted = _weighted_requiring_grad(tables, 8)
    match = "do not use SUM pooling" if why == "mean_pooling" else "overflow='drop' may drop ids"
    with pytest.raises(NotImplementedError, match=f"per-id weights require grad, but .*{match}"):
        sharded(weighted)
    with torch.no_grad():
        sharded(weighted)  # without gradients the lookup is exact
    after = sharded.full_tables()[0]
    for name in before:
        np.testing.assert_array_equal(before[name], after[name])
