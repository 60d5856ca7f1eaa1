"""tpurec.shard of sequence embeddings: a TorchRec EmbeddingCollection model trains as TorchRec trains it on CPU.

Reference: the TorchRec model (``torchrec.EmbeddingCollection`` with an in-backward
Adagrad, a dense projection) trained 5 steps by TorchRec on CPU. The same model goes
through ``from_torchrec(..., max_seq_len=...)``, ``.to("tpu")`` and ``tpurec.shard`` over
8 host devices with TorchRec's own plan for the collection's path; both see the same
batches, and losses, dense parameters and tables must agree.
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
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection as TorchrecEC
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import tpurec
import tpurec.sparse as sp
from helpers import random_kjt
from tpurec.sparse.planner import TpuPlannerConfig
from tpurec.sparse.planner import plan as tpu_plan
from tpurec.sparse.sharding import ShardedEmbeddingBagCollection

STEPS = 5
BATCH = 8
MAX_SEQ_LEN = 4
TABLES = [
    EmbeddingConfig(name="item", embedding_dim=8, num_embeddings=30, feature_names=["history", "clicked"]),
    EmbeddingConfig(name="shop", embedding_dim=8, num_embeddings=11, feature_names=["shop"]),
]
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


class SequenceModel(torch.nn.Module):
    """Each id's embedding scored against its sample's projected dense features, summed per sample."""

    def __init__(self) -> None:
        super().__init__()
        self.ec = TorchrecEC(TABLES)
        self.proj = torch.nn.Linear(5, 8)

    def forward(self, dense: torch.Tensor, kjt) -> torch.Tensor:
        query = self.proj(dense)
        batch = dense.shape[0]
        logits = torch.zeros(batch, device=query.device)
        for jt in self.ec(kjt).values():
            sample = torch.repeat_interleave(torch.arange(batch), jt.lengths().cpu()).to(query.device)
            per_id = (jt.values() * query.index_select(0, sample)).sum(1)
            logits = logits.index_add(0, sample, per_id)
        return logits


def _models(optimizer_class=torch.optim.Adagrad):
    """(TorchRec reference on CPU, converted copy on tpu, not yet sharded)."""
    torch.manual_seed(0)
    reference = SequenceModel()
    ours = copy.deepcopy(reference)
    for model in (reference, ours):
        apply_optimizer_in_backward(optimizer_class, model.ec.parameters(), {"lr": 0.1})
    return reference, sp.from_torchrec(ours, max_seq_len=MAX_SEQ_LEN).to("tpu")


def _plan(generators: dict) -> ShardingPlan:
    meta = TorchrecEC(TABLES, device=torch.device("meta"))
    module_plan = construct_module_sharding_plan(meta, generators, local_size=8, world_size=8, device_type="cpu")
    return ShardingPlan({"ec": module_plan})  # TorchRec's plan names the EmbeddingCollection's path


GENERATORS = {
    "table_wise": {"item": table_wise(rank=3), "shop": table_wise(rank=6)},
    "row_wise": {"item": row_wise(), "shop": row_wise()},
    "column_wise": {"item": column_wise(ranks=[1, 5]), "shop": column_wise(ranks=[2, 7])},
    "data_parallel": {"item": data_parallel(), "shop": table_wise(rank=4)},
}


def _batches(steps: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        kjt = random_kjt(TABLES, BATCH, rng, max_len=MAX_SEQ_LEN)
        dense = torch.from_numpy(rng.standard_normal((BATCH, 5)).astype(np.float32))
        labels = torch.from_numpy(rng.integers(0, 2, BATCH).astype(np.float32))
        yield kjt, dense, labels


def _train_and_compare(
    reference: SequenceModel, sharded: torch.nn.Module, steps: int = STEPS, mode: str = "eager"
) -> None:
    dense_reference = torch.optim.SGD(reference.proj.parameters(), lr=0.1)
    dense_sharded = torch.optim.SGD(sharded.proj.parameters(), lr=0.1)
    for step, (kjt, dense, labels) in enumerate(_batches(steps)):
        losses = []
        for model, optimizer, device in ((reference, dense_reference, "cpu"), (sharded, dense_sharded, "tpu")):
            with tpurec.mode(mode if device == "tpu" else "eager"):
                optimizer.zero_grad()
                loss = torch.nn.functional.binary_cross_entropy_with_logits(
                    model(dense.to(device), kjt), labels.to(device)
                )
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
        np.testing.assert_allclose(losses[1], losses[0], **TOLERANCE, err_msg=f"loss of step {step}")
    theirs = reference.state_dict()
    ours = sharded.state_dict()
    assert set(ours) == set(theirs)  # TorchRec's keys: ec.embeddings.<table>.weight, proj.*
    start = SequenceModel().state_dict()
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key].cpu(), value, **TOLERANCE, msg=key)
        assert not torch.equal(value, start[key]) or "embeddings" not in key  # the tables did train


@pytest.mark.parametrize("kind, mode", [(kind, "eager") for kind in GENERATORS] + [("row_wise", "fused")])
def test_each_sharding_type_trains_like_torchrec(kind, mode):
    reference, ours = _models()
    sharded = tpurec.shard(ours, _plan(GENERATORS[kind]))
    # The EmbeddingCollection stays (it unstacks the positions); its bags are the sharded lookup.
    assert isinstance(sharded.ec, sp.EmbeddingCollection)
    assert isinstance(sharded.ec.bags, ShardedEmbeddingBagCollection)
    placed = {name: s.sharding_type for name, s in sharded.ec.bags.layout.shardings.items()}
    assert placed == {name: generator.sharding_type for name, generator in _plan(GENERATORS[kind]).plan["ec"].items()}
    assert placed["item"] == kind
    _train_and_compare(reference, sharded, mode=mode)


def test_plan_of_the_tpu_planner_with_the_embedding_collection_sharder():
    reference, ours = _models()
    holder = torch.nn.Module()
    holder.ec = TorchrecEC(TABLES, device=torch.device("meta"))
    # Row-wise only: the plan then must come from TpuEmbeddingCollectionSharder's offer.
    plan, _report = tpu_plan(holder, "v5p-16", batch_size=BATCH, config=TpuPlannerConfig(sharding_types=["row_wise"]))
    assert set(plan.plan) == {"ec"}
    assert {ps.sharding_type for ps in plan.plan["ec"].values()} == {"row_wise"}
    sharded = tpurec.shard(ours, plan)
    assert {s.sharding_type for s in sharded.ec.bags.layout.shardings.values()} == {"row_wise"}
    _train_and_compare(reference, sharded, steps=3)


def test_without_a_plan_the_tpu_planner_shards_the_collection():
    reference, ours = _models()
    sharded = tpurec.shard(ours)
    assert isinstance(sharded.ec.bags, ShardedEmbeddingBagCollection)
    assert set(sharded.ec.bags.layout.shardings) == {"item", "shop"}
    _train_and_compare(reference, sharded, steps=3)


def test_collection_sharded_on_its_own_returns_torchrec_outputs():
    torch.manual_seed(0)
    reference = TorchrecEC(TABLES, need_indices=True)
    ours = sp.from_torchrec(copy.deepcopy(reference), max_seq_len=MAX_SEQ_LEN, optimizer=sp.SGD(0.1)).to("tpu")
    sharded = tpurec.shard(ours, _plan(GENERATORS["row_wise"]).plan["ec"])  # one module's table plan
    assert sharded is ours and isinstance(sharded.bags, ShardedEmbeddingBagCollection)
    kjt = next(_batches(1, seed=3))[0]
    with torch.no_grad():
        got, want = sharded(kjt), reference(kjt)
    assert list(got) == list(want)
    for key, jt in want.items():
        torch.testing.assert_close(got[key].values().cpu(), jt.values(), atol=1e-6, rtol=0, msg=key)
        torch.testing.assert_close(got[key].lengths().cpu(), jt.lengths(), msg=key)
        torch.testing.assert_close(got[key].weights().cpu(), jt.weights(), msg=key)


def test_state_dict_has_torchrec_keys_and_loads_back():
    reference, ours = _models()
    sharded = tpurec.shard(ours, _plan(GENERATORS["column_wise"]))
    assert set(sharded.state_dict()) == set(reference.state_dict())
    torch.manual_seed(5)
    other = SequenceModel().state_dict()
    sharded.load_state_dict(other)
    tables, _ = sharded.ec.bags.full_tables()
    for cfg in TABLES:
        np.testing.assert_array_equal(tables[cfg.name], other[f"ec.embeddings.{cfg.name}.weight"].numpy())


def test_plan_naming_the_collection_twice_or_not_at_all_changes_nothing():
    _, ours = _models()
    module_plan = _plan(GENERATORS["table_wise"]).plan["ec"]
    with pytest.raises(ValueError, match=r"names the collections \['ec._bags'\] twice"):
        tpurec.shard(ours, ShardingPlan({"ec": module_plan, "ec._bags": module_plan}))
    with pytest.raises(ValueError, match=r"no entry for the embedding collections \['ec'\]"):
        tpurec.shard(ours, ShardingPlan({}))
    assert isinstance(ours.ec.bags, sp.EmbeddingBagCollection) and not ours._forward_pre_hooks


def test_sharded_checkpoint_reshards_and_training_continues(tmp_path):
    from tpurec.sparse.checkpoint import sharded as checkpoint

    reference, ours = _models()
    saved = tpurec.shard(ours, _plan(GENERATORS["table_wise"]))
    _train_and_compare(reference, saved, steps=2)
    checkpoint.save(saved, tmp_path / "ckpt")
    torch.manual_seed(7)
    _, other = _models()
    loaded = tpurec.shard(other, _plan(GENERATORS["column_wise"]))
    checkpoint.load(loaded, tmp_path / "ckpt")
    want_tables, want_slots = saved.ec.bags.full_tables()
    got_tables, got_slots = loaded.ec.bags.full_tables()
    for name in want_tables:
        np.testing.assert_array_equal(got_tables[name], want_tables[name])
        np.testing.assert_array_equal(got_slots[name]["momentum1"], want_slots[name]["momentum1"])
    # Both go on as the reference (the step count and the dense part came along).
    for model in (saved, loaded):
        state = {k: v.cpu() for k, v in model.state_dict().items()}
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(state[key], value, **TOLERANCE, msg=key)


def test_optimizer_state_dict_has_torchrec_keys_and_loads_into_another_plan():
    reference, ours = _models()
    unsharded = copy.deepcopy(ours)  # the same model, trained unsharded on tpu
    sharded = tpurec.shard(ours, _plan(GENERATORS["row_wise"]))
    _train_and_compare(reference, sharded, steps=2)
    dense = torch.optim.SGD(unsharded.proj.parameters(), lr=0.1)
    for kjt, x, labels in _batches(2):
        dense.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(unsharded(x.to("tpu"), kjt), labels.to("tpu")).backward()
        dense.step()
    got, want = sharded.ec.optimizer_state_dict(), unsharded.ec.optimizer_state_dict()
    assert set(got["state"]) == set(want["state"]) == {"embeddings.item.weight", "embeddings.shop.weight"}
    for key, slots in want["state"].items():
        for name, value in slots.items():
            torch.testing.assert_close(got["state"][key][name], value.cpu(), **TOLERANCE, msg=f"{key} {name}")
    _, other = _models()
    loaded = tpurec.shard(other, _plan(GENERATORS["table_wise"]))
    with pytest.raises(ValueError, match="slot momentum1 of embedding_bags.item.weight"):
        bad = copy.deepcopy(got)
        bad["state"]["embeddings.item.weight"]["momentum1"] = torch.zeros(3, 8)
        loaded.ec.load_optimizer_state_dict(bad)
    assert all(not v.any() for slots in loaded.ec.optimizer_state_dict()["state"].values() for v in slots.values())
    loaded.ec.load_optimizer_state_dict(got)
    for key, slots in got["state"].items():
        for name, value in slots.items():
            torch.testing.assert_close(loaded.ec.optimizer_state_dict()["state"][key][name], value, atol=0, rtol=0)
    assert loaded.ec.bags._step == sharded.ec.bags._step == 2
