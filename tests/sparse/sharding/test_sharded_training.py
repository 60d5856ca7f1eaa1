"""tpurec.shard on 8 CPU devices: torchrec's DLRM trains like the unsharded model."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagCollection as TorchrecEBC
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingPlan
from torchrec.models.dlrm import DLRM

import tpurec
import tpurec.sparse as sp
from helpers import make_tables, random_kjt
from tpurec.sparse.sharding import ShardedEmbeddingBagCollection

EBC_PATH = "sparse_arch.embedding_bag_collection"
LAYERS = {"dense_in_features": 5, "dense_arch_layer_sizes": [16, 8], "over_arch_layer_sizes": [16, 1]}
TABLES = make_tables(
    dims=(8, 8, 8, 8, 8), rows=(40, 23, 17, 30, 64), features=(("f0", "f1"), ("f2",), ("f3",), ("f4",), ("f5",))
)


def _plan(generators: dict, tables=TABLES) -> ShardingPlan:
    meta = TorchrecEBC(tables=tables, device=torch.device("meta"))
    # local_size 4: table_row_wise(host_index=h) spreads rows over ranks 4h..4h+3.
    module_plan = construct_module_sharding_plan(meta, generators, local_size=4, world_size=8, device_type="cpu")
    return ShardingPlan({EBC_PATH: module_plan})


def _table_wise(i: int):
    return table_wise(rank=(3 * i + 1) % 8)


def _column_wise(i: int):
    return column_wise(ranks=[i % 8, (i + 5) % 8])  # two 4-column shards on different devices


def _table_column_wise(i: int):
    # TWCW: column shards on the ranks of one host (torchrec's generator needs a real process group,
    # so the same layout is written with column_wise on host 1's ranks; the type is relabelled below).
    return column_wise(ranks=[4 + i % 4, 4 + (i + 1) % 4])


GENERATORS = {
    "table_wise": _table_wise,
    "row_wise": lambda i: row_wise(),
    "column_wise": _column_wise,
    "data_parallel": lambda i: data_parallel(),
    "table_row_wise": lambda i: table_row_wise(host_index=i % 2),
    "table_column_wise": _table_column_wise,
}


def _models(optimizer: sp.EmbeddingOptimizer, capacity: int | None = None):
    """(unsharded tpurec DLRM on tpu:0, identical copy to be sharded)."""
    torch.manual_seed(0)
    built = []
    for _ in range(2):
        model = DLRM(embedding_bag_collection=TorchrecEBC(TABLES), **LAYERS)
        built.append(model)
    built[1].load_state_dict(built[0].state_dict())
    return [sp.from_torchrec(m, optimizer=optimizer, capacities=sp.Capacity(512)).to("tpu") for m in built]


def _batches(steps: int, batch: int = 16, seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        kjt = random_kjt(TABLES, batch, rng)
        dense = torch.from_numpy(rng.standard_normal((batch, 5)).astype(np.float32))
        labels = torch.from_numpy(rng.integers(0, 2, batch).astype(np.float32))
        yield kjt, dense, labels


def _step(model, optimizer, kjt, dense, labels) -> float:
    optimizer.zero_grad()
    logits = model(dense.to("tpu"), kjt).squeeze(-1)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.to("tpu"))
    loss.backward()
    optimizer.step()
    return loss.item()


def _train_and_compare(
    plan: ShardingPlan,
    optimizer: sp.EmbeddingOptimizer,
    steps: int = 10,
    capacity: int | None = None,
    compiled: bool = False,
):
    reference, sharded = _models(optimizer)
    sharded = tpurec.shard(sharded, plan, capacity=capacity)
    ebc = sharded.sparse_arch.embedding_bag_collection
    assert isinstance(ebc, ShardedEmbeddingBagCollection)
    dense_ref = torch.optim.Adagrad(reference.parameters(), lr=0.05)
    dense_sharded = torch.optim.Adagrad(sharded.parameters(), lr=0.05)
    # Compiled: the dense arch is one graph; the sharded lookup runs outside it (host routing).
    forward = torch.compile(sharded, backend="tpu") if compiled else sharded
    for step, (kjt, dense, labels) in enumerate(_batches(steps)):
        want = _step(reference, dense_ref, kjt, dense, labels)
        got = _step(forward, dense_sharded, kjt, dense, labels)
        assert abs(want - got) < 1e-5, (step, want, got)
    tables, slots = ebc.full_tables()
    reference_ebc = reference.sparse_arch.embedding_bag_collection
    reference_slots = reference_ebc.optimizer_state_dict()["state"]
    for cfg in TABLES:
        np.testing.assert_allclose(
            tables[cfg.name], reference_ebc.table_weight(cfg.name).detach().cpu().numpy(), atol=1e-5, rtol=0
        )
        for name, value in slots[cfg.name].items():
            want = reference_slots[f"embedding_bags.{cfg.name}.weight"][name].cpu().numpy()
            np.testing.assert_allclose(value, want, atol=1e-5, rtol=0)
    state = sharded.state_dict()
    for key, value in reference.state_dict().items():
        if "embedding_bag_collection" not in key:
            torch.testing.assert_close(state[key].cpu(), value.cpu(), atol=1e-5, rtol=0)
    return sharded


def _relabel(plan: ShardingPlan, kind: str) -> ShardingPlan:
    for ps in plan.plan[EBC_PATH].values():
        ps.sharding_type = kind
    return plan


@pytest.mark.parametrize("kind", list(GENERATORS))
def test_each_sharding_type_trains_like_unsharded(kind):
    generators = {cfg.name: GENERATORS[kind](i) for i, cfg in enumerate(TABLES)}
    plan = _plan(generators)
    if kind == "table_column_wise":
        plan = _relabel(plan, kind)
    # Adagrad (per element) makes column shards exact; row-wise slots would be per column shard.
    _train_and_compare(plan, sp.Adagrad(learning_rate=0.1))


def test_mixed_plan_trains_like_unsharded_then_runs_without_compiling():
    plan = _plan(
        {
            "t0": table_wise(rank=2),
            "t1": row_wise(),
            "t2": column_wise(ranks=[1, 6]),
            "t3": data_parallel(),
            "t4": table_row_wise(host_index=1),
        }
    )
    sharded = _train_and_compare(plan, sp.Adam(learning_rate=0.05), capacity=64)
    dense_opt = torch.optim.SGD(sharded.parameters(), lr=0.01)
    batches = list(_batches(22, seed=1))
    for kjt, dense, labels in batches[:2]:
        _step(sharded, dense_opt, kjt, dense, labels)
    tpurec.reset_stats()
    for kjt, dense, labels in batches[2:]:
        _step(sharded, dense_opt, kjt, dense, labels)
    assert tpurec.stats()["compilations"] == 0


def test_mixed_plan_in_fused_mode_with_rowwise_adagrad():
    plan = _plan(
        {
            "t0": table_wise(rank=5),
            "t1": row_wise(),
            "t2": table_wise(rank=0),
            "t3": data_parallel(),
            "t4": row_wise(),
        }
    )
    with tpurec.mode("fused"):
        _train_and_compare(plan, sp.RowWiseAdagrad(learning_rate=0.1), steps=4)


def test_mixed_plan_compiled():
    plan = _plan(
        {
            "t0": table_wise(rank=2),
            "t1": row_wise(),
            "t2": column_wise(ranks=[1, 6]),
            "t3": data_parallel(),
            "t4": table_row_wise(host_index=1),
        }
    )
    _train_and_compare(plan, sp.Adagrad(learning_rate=0.1), steps=4, compiled=True)


def test_without_a_plan_the_tpu_planner_shards_a_collection():
    tables = make_tables(dims=(8, 16), rows=(1000, 50), features=(("f0",), ("f1",)))
    torch.manual_seed(0)
    reference = sp.EmbeddingBagCollection(tables, optimizer=sp.SGD(learning_rate=0.1), device="tpu")
    source = sp.EmbeddingBagCollection(tables, optimizer=sp.SGD(learning_rate=0.1), device="tpu")
    source.load_state_dict(reference.state_dict())
    sharded = tpurec.shard(source)  # the model is the collection: the sharded collection comes back
    assert isinstance(sharded, ShardedEmbeddingBagCollection)
    assert set(sharded.layout.shardings) == {"t0", "t1"}
    rng = np.random.default_rng(0)
    for _ in range(3):
        kjt = random_kjt(tables, 16, rng)
        want, got = reference(kjt).values(), sharded(kjt).values()
        torch.testing.assert_close(got.cpu(), want.cpu(), atol=1e-6, rtol=0)
        (want * want).sum().backward()
        (got * got).sum().backward()
    tables_now, _ = sharded.full_tables()
    for name, value in tables_now.items():
        np.testing.assert_allclose(value, reference.table_weight(name).detach().cpu().numpy(), atol=1e-6, rtol=0)


def test_state_dict_has_the_unsharded_keys_and_loads_back():
    reference, sharded = _models(sp.Adagrad(learning_rate=0.1))
    plan = _plan(
        {
            "t0": table_wise(rank=2),
            "t1": row_wise(),
            "t2": column_wise(ranks=[1, 6]),
            "t3": data_parallel(),
            "t4": table_row_wise(host_index=1),
        }
    )
    sharded = tpurec.shard(sharded, plan)
    want = reference.state_dict()
    got = sharded.state_dict()
    assert set(got) == set(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key].cpu(), value.cpu(), atol=0, rtol=0)
    torch.manual_seed(5)
    other = DLRM(embedding_bag_collection=TorchrecEBC(TABLES), **LAYERS).state_dict()
    sharded.load_state_dict(other)
    tables, _ = sharded.sparse_arch.embedding_bag_collection.full_tables()
    for cfg in TABLES:
        np.testing.assert_array_equal(
            tables[cfg.name], other[f"sparse_arch.embedding_bag_collection.embedding_bags.{cfg.name}.weight"].numpy()
        )


# --- FeatureProcessedEmbeddingBagCollection: position weights train under tpurec.shard ---------------

FP_TABLES = make_tables(dims=(8, 8, 8), rows=(13, 7, 5))
FP_GENERATORS = {
    "table_wise": {"t0": table_wise(rank=3), "t1": table_wise(rank=6), "t2": table_wise(rank=0)},
    "row_wise": {"t0": row_wise(), "t1": row_wise(), "t2": row_wise()},
    "column_wise": {"t0": column_wise(ranks=[1, 5]), "t1": column_wise(ranks=[2, 7]), "t2": table_wise(rank=4)},
    "data_parallel": {"t0": data_parallel(), "t1": row_wise(), "t2": table_wise(rank=1)},
}


class _PositionWeighted(torch.nn.Module):
    """TorchRec's FeatureProcessedEmbeddingBagCollection (PositionWeightedModuleCollection) and a linear head."""

    def __init__(self) -> None:
        from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
        from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

        super().__init__()
        features = [f for t in FP_TABLES for f in t.feature_names]
        self.fp = FeatureProcessedEmbeddingBagCollection(
            TorchrecEBC(FP_TABLES, is_weighted=True), PositionWeightedModuleCollection({f: 4 for f in features})
        )
        with torch.no_grad():  # TorchRec starts them at 1: random ones show every position's gradient
            for p in self.fp._feature_processors.parameters():
                p.uniform_(0.5, 1.5)
        self.head = torch.nn.Linear(sum(t.embedding_dim * len(t.feature_names) for t in FP_TABLES), 1)

    def forward(self, kjt):
        return self.head(self.fp(kjt).values()).squeeze(-1)


@pytest.mark.parametrize("kind, mode", [(kind, "eager") for kind in FP_GENERATORS] + [("row_wise", "fused")])
def test_position_weighted_collection_trains_as_torchrec_when_sharded(kind, mode):
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    torch.manual_seed(0)
    reference = _PositionWeighted()
    start = copy.deepcopy(reference.state_dict())
    ours = copy.deepcopy(reference)
    for model in (reference, ours):
        apply_optimizer_in_backward(torch.optim.Adagrad, model.fp._embedding_bag_collection.parameters(), {"lr": 0.1})
    ours = sp.from_torchrec(ours).to("tpu")
    # TorchRec's plan names the feature-processed collection's own path.
    module_plan = construct_module_sharding_plan(
        reference.fp, FP_GENERATORS[kind], local_size=8, world_size=8, device_type="cpu"
    )
    ours = tpurec.shard(ours, ShardingPlan({"fp": module_plan}))
    assert isinstance(ours.fp._embedding_bag_collection, ShardedEmbeddingBagCollection)

    def dense(model):  # the position weights and the head
        return [p for n, p in model.named_parameters() if not n.startswith("fp._embedding_bag_collection.")]

    dense_reference = torch.optim.SGD(dense(reference), lr=0.1)
    dense_ours = torch.optim.SGD(dense(ours), lr=0.1)
    assert len(dense_ours.param_groups[0]["params"]) == len(dense_reference.param_groups[0]["params"]) == 6
    rng = np.random.default_rng(4)
    for step in range(5):
        with tpurec.mode(mode):
            kjt = random_kjt(FP_TABLES, 8, rng, max_len=4)
            labels = torch.from_numpy(rng.integers(0, 2, 8).astype(np.float32))
            losses = []
            for model, optimizer, device in ((reference, dense_reference, "cpu"), (ours, dense_ours, "tpu")):
                optimizer.zero_grad()
                loss = torch.nn.functional.binary_cross_entropy_with_logits(model(kjt), labels.to(device))
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
        np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5, atol=1e-6, err_msg=f"loss of step {step}")
    theirs, mine = reference.state_dict(), ours.state_dict()
    assert set(mine) == set(theirs)
    changed = 0
    for key, value in theirs.items():
        torch.testing.assert_close(mine[key].cpu(), value, rtol=1e-5, atol=1e-6, msg=key)
        changed += "position_weight" in key and not torch.equal(value, start[key])
    assert changed == 4  # every feature's position weights trained


# --- optimizer_semantics: the unsharded collection's rule for a second lookup before backward --------


def test_lookups_waiting_for_backward_update_per_backward_pass_as_an_in_backward_optimizer():
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    plan = _plan({cfg.name: row_wise() for cfg in TABLES})
    for optimizer_class in (torch.optim.Adagrad, torch.optim.SGD):
        torch.manual_seed(0)
        reference = DLRM(embedding_bag_collection=TorchrecEBC(TABLES), **LAYERS)
        model = copy.deepcopy(reference)
        for m in (reference, model):
            apply_optimizer_in_backward(
                optimizer_class, m.sparse_arch.embedding_bag_collection.parameters(), {"lr": 0.1}
            )
        sharded = tpurec.shard(sp.from_torchrec(model).to("tpu"), plan)
        ebc = sharded.sparse_arch.embedding_bag_collection
        assert ebc.optimizer_semantics == "torch"
        (kjt, dense, _), (kjt2, _, _) = _batches(2)
        for m, device in ((reference, "cpu"), (sharded, "tpu")):
            first = m(dense.to(device), kjt)
            m(dense.to(device), kjt2).sum().backward()  # its own backward pass: its own update
            first.sum().backward()
            # Two lookups in one backward pass: one update on their summed gradient.
            (m(dense.to(device), kjt) * m(dense.to(device), kjt2)).sum().backward()
        assert ebc.optimizer_state_dict()["steps"] == [3]
        tables, theirs = ebc.full_tables()[0], reference.sparse_arch.embedding_bag_collection.state_dict()
        for cfg in TABLES:
            torch.testing.assert_close(
                torch.from_numpy(tables[cfg.name]), theirs[f"embedding_bags.{cfg.name}.weight"], rtol=1e-5, atol=1e-6
            )
        # Opting into FBGEMM's one update per lookup.
        ebc.optimizer_semantics = "fbgemm"
        pending = sharded(dense.to("tpu"), kjt)
        sharded(dense.to("tpu"), kjt2).sum().backward()
        pending.sum().backward()
        assert ebc.optimizer_state_dict()["steps"] == [5]
    # An explicit fused optimizer given to tpurec.shard has FBGEMM's semantics.
    torch.manual_seed(0)
    model = DLRM(embedding_bag_collection=TorchrecEBC(TABLES), **LAYERS)
    apply_optimizer_in_backward(
        torch.optim.Adagrad, model.sparse_arch.embedding_bag_collection.parameters(), {"lr": 0.1}
    )
    sharded = tpurec.shard(sp.from_torchrec(model).to("tpu"), plan, optimizer=sp.Adagrad(learning_rate=0.1))
    assert sharded.sparse_arch.embedding_bag_collection.optimizer_semantics == "fbgemm"
