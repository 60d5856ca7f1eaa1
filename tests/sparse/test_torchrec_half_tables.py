"""TorchRec's float modules with FP16/BF16 tables through ``from_torchrec``, against TorchRec on CPU.

TorchRec's unsharded EmbeddingBagCollection / EmbeddingCollection keep FP16 *and* BF16
tables as float16 ``nn.EmbeddingBag`` / ``nn.Embedding``: the lookup rounds to float16 and
comes out float32, the tables train by float16 dense gradients through a torch optimizer
(in-backward or dense). ``from_torchrec`` moves that module to the device as it is, so the
device runs the same ops.

Tolerance: float16 values (weights, and outputs of FP16/BF16 tables rounded to float16 as
TorchRec rounds them) within 1e-3 relative (one float16 ulp) or 2.5e-4 absolute (one float16
ulp at 0.5, the scale of these tables, which stay within [-0.5, 0.5]), NaN exactly where
TorchRec has NaN. The device's float16 ops sum in float32 and round once, where PyTorch's CPU
kernels add a row's float16 gradients in float16 and round a MEAN bag's sum before dividing:
a weight may differ by a float16 ulp, and so may a bag summing such weights (measured: at most
1.8e-4 over the 5 steps; 6.2e-5 absolute fails). FP32 tables (and the float32 tables of a
FusedEmbeddingBagCollection) keep the float32 tolerance, 1e-5 relative.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagCollection as TorchrecEBC
from torchrec import EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import DataType, PoolingType
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedTensor

import tpurec
import tpurec.sparse as sp
from helpers import random_kjt

STEPS = 5
BATCH = 4
LR = 0.05
HALF = (1e-3, 2.5e-4)  # (rtol, atol)
FLOAT = (1e-5, 1e-6)


def _bag_tables(data_type: DataType) -> list[EmbeddingBagConfig]:
    # A table with two features, a MEAN table and an FP32 table next to the low-precision ones.
    return [
        EmbeddingBagConfig(
            name="t0", embedding_dim=4, num_embeddings=13, feature_names=["f0", "f1"], data_type=data_type
        ),
        EmbeddingBagConfig(
            name="t1",
            embedding_dim=8,
            num_embeddings=7,
            feature_names=["f2"],
            data_type=data_type,
            pooling=PoolingType.MEAN,
        ),
        EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=5, feature_names=["f3"]),
    ]


def _close(ours: torch.Tensor, theirs: torch.Tensor, msg: str) -> None:
    assert ours.dtype == theirs.dtype, msg
    rtol, atol = FLOAT if theirs.dtype == torch.float32 else HALF
    torch.testing.assert_close(
        ours.detach().cpu(), theirs.detach(), rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{msg}: {m}"
    )


def _close_outputs(mine: KeyedTensor, theirs: KeyedTensor, tables: list[EmbeddingBagConfig], step: int) -> None:
    """Each feature's pooled rows: float32 values, rounded to float16 where its table is FP16/BF16."""
    mine_values, theirs_values = mine.to_dict(), theirs.to_dict()
    for table in tables:
        for feature in table.feature_names:
            ours, reference = mine_values[feature], theirs_values[feature]
            assert ours.dtype == reference.dtype == torch.float32
            if table.data_type != DataType.FP32:
                ours, reference = ours.half(), reference.half()
            _close(ours, reference, f"{feature} at step {step}")


@pytest.mark.parametrize(
    "data_type, optimizer_class, training, mode",
    [
        (DataType.FP16, torch.optim.SGD, "in-backward", "eager"),
        (DataType.FP16, torch.optim.Adagrad, "in-backward", "fused"),
        (DataType.BF16, torch.optim.Adagrad, "dense", "eager"),
    ],
    ids=["fp16-sgd-in-backward-eager", "fp16-adagrad-in-backward-fused", "bf16-adagrad-dense-eager"],
)
def test_embedding_bag_collection_trains_as_torchrec(data_type, optimizer_class, training, mode):
    tables = _bag_tables(data_type)
    torch.manual_seed(0)
    reference = TorchrecEBC(tables)
    ours = copy.deepcopy(reference)
    assert reference.embedding_bags["t1"].weight.dtype == torch.float16  # BF16 too
    if training == "in-backward":
        apply_optimizer_in_backward(optimizer_class, reference.parameters(), {"lr": LR})
        apply_optimizer_in_backward(optimizer_class, ours.parameters(), {"lr": LR})
    ours = sp.from_torchrec(ours, device="tpu")
    assert isinstance(ours, TorchrecEBC) and ours.embedding_bags["t0"].weight.device.type == "tpu"
    dense = [optimizer_class(m.parameters(), lr=LR) for m in (reference, ours)] if training == "dense" else []
    rng = np.random.default_rng(7)
    for step in range(STEPS):
        kjt = random_kjt(tables, BATCH, rng, max_len=3)
        with tpurec.mode(mode):
            theirs, mine = reference(kjt), ours(kjt)  # the host KJT, as tpurec's collections take it
        assert mine.keys() == theirs.keys() and mine.values().device.type == "tpu"
        _close_outputs(mine, theirs, tables, step)
        with tpurec.mode(mode):
            theirs.values().pow(2).sum().backward()
            mine.values().pow(2).sum().backward()
            for optimizer in dense:
                optimizer.step()
                optimizer.zero_grad()
    theirs_state = reference.state_dict()
    assert list(ours.state_dict()) == list(theirs_state)
    for key, value in ours.state_dict().items():
        _close(value, theirs_state[key], key)
    if optimizer_class is torch.optim.Adagrad:
        # eps=1e-10 is 0 in float16: TorchRec's Adagrad turns rows without gradient into NaN, and so does the device.
        assert theirs_state["embedding_bags.t0.weight"].isnan().any()


def test_per_id_weights_need_the_tables_dtype_as_in_torchrec():
    tables = _bag_tables(DataType.FP16)[:1]
    torch.manual_seed(0)
    reference = TorchrecEBC(tables, is_weighted=True)
    ours = sp.from_torchrec(copy.deepcopy(reference), device="tpu")
    kjt = random_kjt(tables, BATCH, np.random.default_rng(2), max_len=3, weighted=True)
    with pytest.raises(RuntimeError, match="same type"):  # float32 weights, float16 table
        reference(kjt)
    with pytest.raises(RuntimeError, match=r"per-id weights are torch\.float32 and tables \{'t0': torch\.float16\}"):
        ours(kjt)
    half = KeyedJaggedTensor.from_lengths_sync(
        keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(), weights=kjt.weights().half()
    )
    _close_outputs(ours(half), reference(half), tables, 0)


def test_embedding_collection_trains_as_torchrec():
    tables = [
        EmbeddingConfig(name="t0", embedding_dim=4, num_embeddings=11, feature_names=["f0", "f1"], data_type=dt)
        for dt in [DataType.FP16]
    ] + [EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=6, feature_names=["f2"])]
    torch.manual_seed(0)
    reference = EmbeddingCollection(tables)
    ours = copy.deepcopy(reference)
    apply_optimizer_in_backward(torch.optim.SGD, reference.parameters(), {"lr": LR})
    apply_optimizer_in_backward(torch.optim.SGD, ours.parameters(), {"lr": LR})
    model = sp.from_torchrec(torch.nn.ModuleDict({"ec": ours}), device="tpu")
    assert model.get_submodule("ec") is ours and isinstance(ours, EmbeddingCollection)
    rng = np.random.default_rng(3)
    for step in range(STEPS):
        kjt = random_kjt(tables, BATCH, rng, max_len=3)
        theirs, mine = reference(kjt), ours(kjt)
        assert list(mine) == list(theirs)
        for name, jagged in mine.items():
            assert jagged.values().dtype == theirs[name].values().dtype == torch.float32
            assert jagged.values().device.type == "tpu"
            ours_values, theirs_values = jagged.values(), theirs[name].values()
            if name != "f2":  # (f2 is t1's, the FP32 table)
                ours_values, theirs_values = ours_values.half(), theirs_values.half()
            _close(ours_values, theirs_values, f"{name} at step {step}")
            assert torch.equal(jagged.lengths().cpu(), theirs[name].lengths())
        torch.stack([j.values().pow(2).sum() for j in theirs.values()]).sum().backward()
        torch.stack([j.values().pow(2).sum() for j in mine.values()]).sum().backward()
    for key, value in ours.state_dict().items():
        _close(value, reference.state_dict()[key], key)


def test_fused_collection_trains_its_float32_tables_as_torchrec():
    # TorchRec builds the FBGEMM module of a FusedEmbeddingBagCollection without weights_precision:
    # whatever data_type says, it trains float32 tables, and so does the converted module.
    tables = _bag_tables(DataType.FP16)
    torch.manual_seed(0)
    reference = FusedEmbeddingBagCollection(tables, optimizer_type=torch.optim.SGD, optimizer_kwargs={"lr": LR})
    assert reference.embedding_bags["t0"].weight.dtype == torch.float32
    ours = sp.from_torchrec(reference, device="tpu")
    rng = np.random.default_rng(5)
    for step in range(STEPS):
        kjt = random_kjt(tables, BATCH, rng, max_len=3)
        theirs, mine = reference(kjt), ours(kjt)
        _close(mine.values(), theirs.values(), f"output of step {step}")
        theirs.values().pow(2).sum().backward()
        mine.values().pow(2).sum().backward()
    mine_state = ours.state_dict()
    for key, value in reference.state_dict().items():
        _close(mine_state[key], value, key)


def test_what_cannot_run_as_torchrec_is_refused_before_anything_changes():
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import LFU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule

    tables = _bag_tables(DataType.FP16)
    torch.manual_seed(0)
    model = TorchrecEBC(tables)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"FP16/BF16 tables \['t0', 't1'\].*optimizer=SGD"):
        sp.from_torchrec(model, optimizer=sp.SGD(0.1), device="tpu")
    with pytest.raises(ValueError, match=r"cannot be converted to 'meta' for tpurec\.shard"):
        sp.from_torchrec(model, device="meta")
    with pytest.raises(ValueError, match=r"tables are on 'meta'"):
        sp.from_torchrec(TorchrecEBC(tables, device=torch.device("meta")), device="tpu")
    assert type(model) is TorchrecEBC
    for key, value in model.state_dict().items():
        assert value.device.type == "cpu" and torch.equal(value, before[key]), key

    managed = ManagedCollisionEmbeddingBagCollection(
        TorchrecEBC(tables[:1]),
        ManagedCollisionCollection(
            {
                "t0": MCHManagedCollisionModule(
                    zch_size=13, device=torch.device("cpu"), eviction_policy=LFU_EvictionPolicy(), eviction_interval=1
                )
            },
            tables[:1],
        ),
        return_remapped_features=False,
    )
    with pytest.raises(NotImplementedError, match=r"inside the managed-collision module model\.mc"):
        sp.from_torchrec(torch.nn.ModuleDict({"mc": managed}), device="tpu")
