"""Managed collisions (MCH) train on tpu as TorchRec trains them on CPU.

Reference: a TorchRec model with a ``ManagedCollisionEmbeddingBagCollection`` (MCH modules with
a small ``zch_size``, raw ids up to ``input_hash_size``, evictions every two steps) trained on
CPU by TorchRec itself (in-backward Adagrad on the tables, SGD on the dense layer); the same
model converted by ``from_torchrec`` and moved to tpu, fed the same batches. Compared after
every step: losses and tables (1e-5 relative), remapped ids and every MCH buffer (exactly).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection as TorchrecEBC
from torchrec import EmbeddingBagConfig, EmbeddingCollection as TorchrecEC, KeyedJaggedTensor
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection as TorchrecMCEBC
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection as TorchrecMCEC
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import tpurec
import tpurec.sparse as sp

INPUT_HASH_SIZE = 1000
EVICTION_INTERVAL = 2
BATCH = 4
MC_PREFIX = "_managed_collision_collection."

POLICIES = {
    "lfu": LFU_EvictionPolicy,
    "lru": LRU_EvictionPolicy,
    "distance-lfu": DistanceLFU_EvictionPolicy,
}


def _tables(config=EmbeddingBagConfig, dims=(4, 8)):
    return [
        config(name="t0", embedding_dim=dims[0], num_embeddings=16, feature_names=["f0", "f1"]),
        config(name="t1", embedding_dim=dims[1], num_embeddings=8, feature_names=["f2"]),
    ]


def _mcc(tables, policy: str) -> ManagedCollisionCollection:
    return ManagedCollisionCollection(
        {
            t.name: MCHManagedCollisionModule(
                zch_size=t.num_embeddings,
                device=torch.device("cpu"),
                eviction_policy=POLICIES[policy](),
                eviction_interval=EVICTION_INTERVAL,
                input_hash_size=INPUT_HASH_SIZE,
            )
            for t in tables
        },
        tables,
    )


class _Model(nn.Module):
    """A managed-collision EBC and a dense layer over its pooled embeddings."""

    def __init__(self, sparse: nn.Module, dim: int) -> None:
        super().__init__()
        self.sparse = sparse
        self.over = nn.Linear(dim, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> tuple[torch.Tensor, KeyedJaggedTensor | None]:
        pooled, remapped = self.sparse(kjt)
        return self.over(pooled.values()).squeeze(1), remapped


def _reference(policy: str = "distance-lfu", return_remapped: bool = True) -> _Model:
    torch.manual_seed(0)
    tables = _tables()
    mc_ebc = TorchrecMCEBC(TorchrecEBC(tables), _mcc(tables, policy), return_remapped_features=return_remapped)
    return _Model(mc_ebc, dim=4 + 4 + 8)


def _trainable(model: _Model, optimizer=torch.optim.Adagrad, kwargs=None) -> tuple[_Model, torch.optim.Optimizer]:
    apply_optimizer_in_backward(optimizer, model.sparse.parameters(), dict(kwargs or {"lr": 0.1}))
    return model, torch.optim.SGD(model.over.parameters(), lr=0.05)


def _converted(model: _Model) -> _Model:
    model = sp.from_torchrec(model, device="tpu")
    return model.to("tpu")  # the dense layer; the remapping state stays on the host


def _pair(policy: str = "distance-lfu", return_remapped: bool = True, optimizer=torch.optim.Adagrad, kwargs=None):
    reference = _reference(policy, return_remapped)
    ours = copy.deepcopy(reference)
    reference, dense_reference = _trainable(reference, optimizer, kwargs)
    ours, dense_ours = _trainable(ours, optimizer, kwargs)
    return (reference, dense_reference), (_converted(ours), dense_ours)


def _batch(rng: np.random.Generator, step: int) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    """Raw ids far beyond zch_size: a skewed pool that drifts with the step, so eviction
    policies both admit new ids and evict old ones within a few steps."""
    lengths = rng.integers(0, 5, 3 * BATCH)
    ids = (rng.geometric(0.2, int(lengths.sum())) + 3 * step) * 37 % INPUT_HASH_SIZE
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1", "f2"], values=torch.from_numpy(ids).long(), lengths=torch.from_numpy(lengths).long()
    )
    return kjt, torch.from_numpy(rng.normal(size=BATCH).astype(np.float32))


def _step(model: _Model, dense: torch.optim.Optimizer, kjt: KeyedJaggedTensor, labels: torch.Tensor):
    dense.zero_grad()
    prediction, remapped = model(kjt)
    loss = (prediction - labels.to(prediction.device)).pow(2).mean()
    loss.backward()
    dense.step()
    return loss.detach().cpu(), remapped


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    # A copy: the MCH buffers and CPU tables would otherwise be the live tensors.
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _assert_same_state(ours: nn.Module, theirs: nn.Module, when: str) -> None:
    mine, reference = _state(ours), _state(theirs)
    assert list(mine) == list(reference), when  # TorchRec's keys, in TorchRec's order
    for key, value in mine.items():
        if MC_PREFIX in key:  # ids, counts, iterations: exact
            assert torch.equal(value, reference[key]), f"{when}: {key}\n{value}\n{reference[key]}"
        else:
            torch.testing.assert_close(value, reference[key], atol=1e-5, rtol=1e-5, msg=f"{when}: {key}")


def _assert_same_remap(ours: KeyedJaggedTensor | None, theirs: KeyedJaggedTensor | None, when: str) -> None:
    if theirs is None:
        assert ours is None, when
        return
    assert ours.keys() == theirs.keys(), when
    assert ours.values().device.type == "cpu", when
    assert torch.equal(ours.values(), theirs.values()), f"{when}: {ours.values()} != {theirs.values()}"
    assert torch.equal(ours.lengths(), theirs.lengths()), when


def _mch(model: nn.Module, table: str) -> MCHManagedCollisionModule:
    return model.sparse._managed_collision_collection._managed_collision_modules[table]


def _resident_ids(model: nn.Module, table: str) -> set[int]:
    ids = _mch(model, table)._mch_sorted_raw_ids
    return set(ids[ids != torch.iinfo(torch.int64).max].tolist())


def _train_and_compare(reference, ours, steps: int, rng: np.random.Generator, first_step: int = 0) -> dict[str, int]:
    """Trains both pairs on the same batches, compares after every step; returns per table
    how many raw ids were evicted (resident after one step, gone after a later one)."""
    evicted = {"t0": 0, "t1": 0}
    resident = {t: _resident_ids(reference[0], t) for t in evicted}
    for step in range(first_step, first_step + steps):
        kjt, labels = _batch(rng, step)
        loss_reference, remapped_reference = _step(*reference, kjt, labels)
        loss_ours, remapped_ours = _step(*ours, kjt, labels)
        torch.testing.assert_close(loss_ours, loss_reference, atol=1e-5, rtol=1e-5, msg=f"loss of step {step}")
        _assert_same_remap(remapped_ours, remapped_reference, f"remapped ids of step {step}")
        _assert_same_state(ours[0], reference[0], f"after step {step}")
        for table in evicted:
            now = _resident_ids(reference[0], table)
            evicted[table] += len(resident[table] - now)
            resident[table] = now
    return evicted


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_mc_ebc_trains_as_torchrec_with_evictions(policy):
    reference, ours = _pair(policy)
    start = _state(reference[0])
    evicted = _train_and_compare(reference, ours, steps=6, rng=np.random.default_rng(0))
    for table in ("t0", "t1"):  # the tables trained
        key = f"sparse._embedding_module.embedding_bags.{table}.weight"
        assert not torch.equal(_state(reference[0])[key], start[key]), key
    # The test means something: ids were admitted and, for every table, some were evicted later.
    assert all(_resident_ids(reference[0], t) for t in evicted)
    assert all(n > 0 for n in evicted.values()), evicted
    assert int(_mch(reference[0], "t0")._current_iter_tensor) == 6


@pytest.mark.parametrize("mode", ["eager", "fused", "compiled"])
def test_mc_ebc_trains_as_torchrec_in_each_mode_without_remapped_output(mode):
    reference, (ours, dense_ours) = _pair("lfu", return_remapped=False)
    rng = np.random.default_rng(1)
    # Compiled: the dense layer compiles; the remap and the lookup (host code) run outside the graph.
    step_model = torch.compile(ours, backend="tpu") if mode == "compiled" else ours
    with tpurec.mode("fused" if mode == "compiled" else mode):
        for step in range(5):
            kjt, labels = _batch(rng, step)
            loss_reference, remapped_reference = _step(*reference, kjt, labels)
            loss_ours, remapped_ours = _step(step_model, dense_ours, kjt, labels)
            torch.testing.assert_close(loss_ours, loss_reference, atol=1e-5, rtol=1e-5, msg=f"loss of step {step}")
            assert remapped_ours is None and remapped_reference is None
            _assert_same_state(ours, reference[0], f"after step {step}")


def test_eval_mode_remaps_without_changing_the_mch_state():
    reference, ours = _pair("distance-lfu")
    rng = np.random.default_rng(2)
    _train_and_compare(reference, ours, steps=4, rng=rng)
    reference[0].eval()
    ours[0].eval()
    before = _state(ours[0])
    with torch.no_grad():
        for step in range(4, 7):
            kjt, _ = _batch(rng, step)
            (pred_reference, remap_reference), (pred_ours, remap_ours) = reference[0](kjt), ours[0](kjt)
            torch.testing.assert_close(pred_ours.cpu(), pred_reference, atol=1e-5, rtol=1e-5)
            _assert_same_remap(remap_ours, remap_reference, f"eval step {step}")
    _assert_same_state(ours[0], reference[0], "after eval")
    for key, value in _state(ours[0]).items():
        assert torch.equal(value, before[key]), key  # no profiling, no eviction, no update


def _fresh_converted() -> _Model:
    model, _ = _trainable(_reference(), torch.optim.SGD, {"lr": 0.1})
    return _converted(model)


def test_state_dict_round_trip_keeps_the_mch_state():
    sgd = {"lr": 0.1}  # no optimizer state: a loaded model continues exactly as the saved one would
    reference, ours = _pair("distance-lfu", optimizer=torch.optim.SGD, kwargs=sgd)
    _train_and_compare(reference, ours, steps=5, rng=np.random.default_rng(3))
    saved_ours, saved_reference = ours[0].state_dict(), reference[0].state_dict()
    assert any(MC_PREFIX in k and "_mch_sorted_raw_ids" in k for k in saved_ours)
    # TorchRec reads tpurec's state dict, tpurec reads TorchRec's and its own checkpoint.
    torchrec_loaded, _ = _trainable(_reference(), torch.optim.SGD, sgd)
    torchrec_loaded.load_state_dict(saved_ours)
    tpurec_loaded = _fresh_converted()
    tpurec_loaded.load_state_dict(saved_reference)
    checkpoint_loaded = _fresh_converted()
    sp.checkpoint.load_state_dict(checkpoint_loaded, sp.checkpoint.state_dict(ours[0]))
    for loaded in (torchrec_loaded, tpurec_loaded, checkpoint_loaded):
        _assert_same_state(loaded, reference[0], "loaded")
    # They go on (with evictions) as TorchRec does from the same loaded state.
    rng_state = np.random.default_rng(4).bit_generator.state
    for loaded in (tpurec_loaded, checkpoint_loaded):
        rng = np.random.default_rng()
        rng.bit_generator.state = rng_state
        twin, _ = _trainable(_reference(), torch.optim.SGD, sgd)
        twin.load_state_dict(saved_reference)
        pair_reference = (twin, torch.optim.SGD(twin.over.parameters(), lr=0.05))
        pair_ours = (loaded, torch.optim.SGD(loaded.over.parameters(), lr=0.05))
        evicted = _train_and_compare(pair_reference, pair_ours, steps=4, rng=rng, first_step=5)
        assert sum(evicted.values()) > 0


def test_moving_the_model_keeps_the_remapping_state_on_the_host():
    from tpurec.sparse.managed import HostManagedCollisionCollection, ManagedCollisionEmbeddingBagCollection

    model = _fresh_converted()
    assert isinstance(model.sparse, ManagedCollisionEmbeddingBagCollection)
    assert isinstance(model.sparse, TorchrecMCEBC)  # TorchRec's class for code that tests it
    assert isinstance(model.sparse._managed_collision_collection, HostManagedCollisionCollection)
    assert isinstance(model.sparse._embedding_module, sp.EmbeddingBagCollection)
    assert list(model.state_dict()) == list(_reference().state_dict())
    model.to("tpu")
    for table in ("t0", "t1"):
        mch = _mch(model, table)
        assert {b.device.type for b in mch.buffers()} == {"cpu"}
        # TorchRec's eviction policies update the buffers through this dict.
        assert all(mch._mch_metadata[name] is getattr(mch, f"_mch_{name}") for name in mch._mch_metadata)
    assert model.sparse._embedding_module.device.type == "tpu"
    assert model.over.weight.device.type == "tpu"
    model.cpu()
    assert model.over.weight.device.type == "cpu"


def test_a_kjt_on_tpu_raises_and_changes_nothing():
    model = _fresh_converted()
    kjt, _ = _batch(np.random.default_rng(5), 0)
    on_tpu = KeyedJaggedTensor.from_lengths_sync(kjt.keys(), kjt.values().to("tpu"), kjt.lengths().to("tpu"))
    before = _state(model)
    with pytest.raises(ValueError, match="runs on the host"):
        model(on_tpu)
    for key, value in _state(model).items():
        assert torch.equal(value, before[key]), key


class _BareModel(nn.Module):
    """TorchRec's collection used on its own in front of an EBC."""

    def __init__(self) -> None:
        super().__init__()
        tables = _tables()
        self.remap = _mcc(tables, "lru")
        self.ebc = TorchrecEBC(tables)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.ebc(self.remap(kjt)).values()


def test_a_bare_managed_collision_collection_remaps_as_torchrec():
    torch.manual_seed(0)
    reference = _BareModel()
    ours = copy.deepcopy(reference)
    for model in (reference, ours):
        apply_optimizer_in_backward(torch.optim.SGD, model.ebc.parameters(), {"lr": 0.5})
    ours = sp.from_torchrec(ours, device="tpu").to("tpu")
    assert type(ours.remap).__name__ == "HostManagedCollisionCollection"
    rng = np.random.default_rng(6)
    for step in range(5):
        kjt, _ = _batch(rng, step)
        theirs, mine = reference(kjt), ours(kjt)
        torch.testing.assert_close(mine.cpu(), theirs.detach(), atol=1e-5, rtol=1e-5)
        theirs.pow(2).sum().backward()
        mine.pow(2).sum().backward()
        _assert_same_state(ours, reference, f"after step {step}")
        assert {b.device.type for b in ours.remap.buffers()} == {"cpu"}
    assert len(_resident_ids_of(reference.remap, "t0")) > 0


def _resident_ids_of(mcc: ManagedCollisionCollection, table: str) -> set[int]:
    ids = mcc._managed_collision_modules[table]._mch_sorted_raw_ids
    return set(ids[ids != torch.iinfo(torch.int64).max].tolist())


def test_mc_embedding_collection_trains_as_torchrec():
    torch.manual_seed(0)
    tables = _tables(EmbeddingConfig, dims=(4, 4))  # TorchRec's EmbeddingCollection: one dim
    reference = TorchrecMCEC(TorchrecEC(tables), _mcc(tables, "lfu"), return_remapped_features=True)
    ours = copy.deepcopy(reference)
    for model in (reference, ours):
        apply_optimizer_in_backward(torch.optim.Adagrad, model.parameters(), {"lr": 0.1})
    ours = sp.from_torchrec(ours, device="tpu", max_seq_len=4)
    assert isinstance(ours._embedding_module, sp.EmbeddingCollection)
    rng = np.random.default_rng(7)
    for step in range(5):
        kjt, _ = _batch(rng, step)
        (theirs, remap_theirs), (mine, remap_mine) = reference(kjt), ours(kjt)
        _assert_same_remap(remap_mine, remap_theirs, f"step {step}")
        assert list(mine) == list(theirs)
        for key in theirs:
            torch.testing.assert_close(mine[key].values().cpu(), theirs[key].values().detach(), atol=1e-5, rtol=1e-5)
        sum(jt.values().pow(2).sum() for jt in theirs.values()).backward()
        sum(jt.values().pow(2).sum() for jt in mine.values()).backward()
        mine_state, theirs_state = _state(ours), _state(reference)
        assert list(mine_state) == list(theirs_state)
        for key, value in mine_state.items():
            torch.testing.assert_close(
                value,
                theirs_state[key],
                atol=1e-5 if MC_PREFIX not in key else 0,
                rtol=1e-5 if MC_PREFIX not in key else 0,
                msg=key,
            )


def _hash_zch_model() -> nn.Module:
    from torchrec.modules.hash_mc_modules import HashZchManagedCollisionModule

    tables = [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=8, feature_names=["f0"])]
    mcc = ManagedCollisionCollection(
        {
            "t0": HashZchManagedCollisionModule(
                zch_size=8, device=torch.device("cpu"), total_num_buckets=1, input_hash_size=100
            )
        },
        tables,
    )
    return nn.ModuleDict({"mc": TorchrecMCEBC(TorchrecEBC(tables), mcc)})


def _meta_mch_model() -> nn.Module:
    tables = [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=8, feature_names=["f0"])]
    mcc = ManagedCollisionCollection(
        {
            "t0": MCHManagedCollisionModule(
                zch_size=8, device=torch.device("meta"), eviction_policy=LFU_EvictionPolicy(), eviction_interval=1
            )
        },
        tables,
    )
    return nn.ModuleDict({"mc": TorchrecMCEBC(TorchrecEBC(tables), mcc)})


@pytest.mark.parametrize(
    "build, error, match",
    [
        (_hash_zch_model, NotImplementedError, r"table 't0' in model\.mc \(.*HashZchManagedCollisionModule\)"),
        (_meta_mch_model, ValueError, r"table 't0' in model\.mc has its buffers on \['meta'\]"),
    ],
    ids=["hash-zch", "meta-buffers"],
)
def test_managed_collisions_tpurec_cannot_run_exactly_are_refused(build, error, match):
    model = build()
    before = {k: v.clone() for k, v in model.state_dict().items() if v.device.type != "meta"}
    with pytest.raises(error, match=match):
        sp.from_torchrec(model, optimizer=sp.SGD(0.1), device="tpu")
    for key, value in before.items():  # nothing converted halfway
        assert torch.equal(model.state_dict()[key], value), key
    assert not any(type(m).__module__.startswith("tpurec") for m in model.modules())


class _TrainModel(nn.Module):
    """TorchRec's training-module convention for TrainPipeline: ``(loss, output)``."""

    def __init__(self, model: _Model) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: tuple[KeyedJaggedTensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        kjt, labels = batch
        prediction, _ = self.model(kjt)
        loss = (prediction - labels.to(prediction.device)).pow(2).mean()
        return loss, loss.detach()


def test_train_pipeline_trains_as_torchrec():
    (reference, dense_reference), (ours, dense_ours) = _pair("lru")
    rng = np.random.default_rng(8)
    batches = [_batch(rng, step) for step in range(5)]
    expected = [_step(reference, dense_reference, *b)[0] for b in batches]
    # Batch i+1 is prepared while step i runs, but its ids are remapped in step i+1 itself
    # (step i may evict): the collection behind the remap gets no batch ahead of time.
    pipeline = sp.TrainPipeline(_TrainModel(ours), dense_ours, "tpu")
    it = iter(batches)
    got = [pipeline.progress(it).cpu() for _ in batches]
    pipeline.close()
    for step, (mine, theirs) in enumerate(zip(got, expected)):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5, msg=f"loss of step {step}")
    _assert_same_state(ours, reference, "after the pipeline")
    assert not ours.sparse._embedding_module._prefetched
