"""A quantized inference collection (``from_torchrec`` of TorchRec's quantized EBC) sharded by
``tpurec.shard`` over the 8 host devices looks up as TorchRec's ``ShardedQuantEmbeddingBagCollection``
on CPU (``shard_quant_model`` with the same plan, 8 ranks on CPU), over 5 batches each.

Plans: table-wise, row-wise (SUM and MEAN tables: TorchRec's sharded inference averages each row
shard's ids on their own and sums the shard means) and a mix with column-wise shards. Tables INT8,
INT4 and INT2; unweighted and weighted; float32 and float16 output.

Tolerances. float32 output: ``rtol=1e-6`` and ``atol=1e-6 * max|reference|`` (both dequantize the
same bytes alike; within a shard tpurec sums a bag's rows in id order where FBGEMM sums them in bag
order; the shards' partial sums are added in the same rank order, each rounded to the output dtype).
float16 output: compared in float16 with torch's default tolerances for it (``rtol=1e-3``,
``atol=1e-5``: the same partial sums rounded once each).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection as TorchrecEBC
from torchrec import EmbeddingBagConfig
from torchrec.distributed.fused_params import FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS
from torchrec.distributed.global_settings import get_propogate_device, set_propogate_device
from torchrec.distributed.quant_embeddingbag import QuantEmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingPlan
from torchrec.inference.modules import quantize_embeddings, shard_quant_model
from torchrec.modules.embedding_configs import PoolingType
from torchrec.quant.embedding_modules import quant_prep_enable_quant_state_dict_split_scale_bias

import tpurec
import tpurec.sparse as sp
from helpers import random_kjt
from test_input_forms import vbe_kjt
from tpurec.sparse.sharding.quant import ShardedQuantEmbeddingBagCollection

BATCHES = 5
BATCH = 16
QUANT_DTYPES = {"int8": torch.qint8, "int4": torch.quint4x2, "int2": torch.quint2x4}
TABLES = [
    EmbeddingBagConfig(name="t0", embedding_dim=16, num_embeddings=50, feature_names=["f0", "f3"]),
    EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=40, feature_names=["f1"], pooling=PoolingType.MEAN),
    EmbeddingBagConfig(name="t2", embedding_dim=16, num_embeddings=64, feature_names=["f2"]),
]
PLANS: dict[str, dict[str, Any]] = {
    "table_wise": {"t0": table_wise(rank=3), "t1": table_wise(rank=5), "t2": table_wise(rank=3)},
    "row_wise": {"t0": row_wise(), "t1": row_wise(), "t2": row_wise()},
    "mixed": {"t0": column_wise(ranks=[1, 6]), "t1": row_wise(), "t2": table_wise(rank=7)},
}


@pytest.fixture(autouse=True)
def _torchrec_inference_on_cpu() -> Iterator[None]:
    # TorchRec's inference sharding builds each rank's FBGEMM module on the sharding device only
    # with this global setting (else on CUDA).
    before = get_propogate_device()
    set_propogate_device(True)
    yield
    set_propogate_device(before)


def _quantized(dtype: torch.dtype, weighted: bool, output_dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    ebc = TorchrecEBC(tables=copy.deepcopy(TABLES), is_weighted=weighted)
    # TorchRec shards quantized tables row- and column-wise only in this state-dict form.
    quant_prep_enable_quant_state_dict_split_scale_bias(ebc)
    quantized: Any = quantize_embeddings(nn.Sequential(ebc), dtype=dtype, inplace=False, output_dtype=output_dtype)
    return quantized[0]


def _sharder() -> Any:  # (a ModuleSharder of TorchRec's quantized EBC)
    return QuantEmbeddingBagCollectionSharder(fused_params={FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS: True})


def _torchrec_sharded(quantized: nn.Module, plan: Any) -> nn.Module:
    """TorchRec's sharded quantized EBC on 8 CPU ranks, holding ``quantized``'s rows."""
    model, _ = shard_quant_model(
        copy.deepcopy(quantized),
        world_size=8,
        compute_device="cpu",
        sharding_device="cpu",
        sharders=[_sharder()],
        sharding_plan=ShardingPlan({"": plan}),
    )
    model.load_state_dict(quantized.state_dict())
    return model


def _assert_close(got: torch.Tensor, want: torch.Tensor, msg: str) -> None:
    assert got.dtype == want.dtype, msg
    if want.dtype == torch.float32:
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * scale, msg=msg)
    else:
        torch.testing.assert_close(got, want, msg=msg)


@pytest.mark.parametrize(
    ("plan_name", "kind", "weighted", "output_dtype"),
    [
        ("table_wise", "int8", False, torch.float32),
        ("row_wise", "int8", True, torch.float32),
        ("row_wise", "int4", False, torch.float16),
        ("mixed", "int4", True, torch.float32),
        ("mixed", "int2", False, torch.float16),
    ],
)
def test_sharded_quantized_lookups_match_torchrec_sharded_inference(plan_name, kind, weighted, output_dtype):
    quantized = _quantized(QUANT_DTYPES[kind], weighted, output_dtype)
    plan = construct_module_sharding_plan(
        quantized, PLANS[plan_name], sharder=_sharder(), local_size=8, world_size=8, device_type="cpu"
    )
    reference = _torchrec_sharded(quantized, plan)
    unsharded = sp.from_torchrec(quantized, device="tpu")
    assert isinstance(unsharded, sp.QuantEmbeddingBagCollection)
    expected_state = unsharded.state_dict()
    if plan_name == "table_wise":
        sharded = tpurec.shard(unsharded, plan)
    else:
        # t1 (MEAN) is split into row shards: TorchRec averages each shard's ids, and tpurec says so.
        with pytest.warns(UserWarning, match=r"row-wise MEAN tables \['t1'\]"):
            sharded = tpurec.shard(unsharded, plan)
    assert isinstance(sharded, ShardedQuantEmbeddingBagCollection)
    rng = np.random.default_rng(3)
    for batch in range(BATCHES):
        kjt = random_kjt(TABLES, BATCH, rng, max_len=6, weighted=weighted)
        want, got = reference(kjt), sharded(kjt)
        # Keys in the unsharded module's order (TorchRec's sharded module groups them by sharding type).
        assert got.keys() == unsharded(kjt).keys()
        assert sorted(got.keys()) == sorted(want.keys())
        got_by_key, want_by_key = got.to_dict(), want.to_dict()
        for key in want.keys():
            _assert_close(got_by_key[key].cpu(), want_by_key[key], f"batch {batch}, {key}")
    # Its state dict is the unsharded module's, byte for byte; it loads TorchRec's split form back.
    state = sharded.state_dict()
    assert set(state) == set(expected_state)
    for key, value in expected_state.items():
        assert torch.equal(state[key], value.cpu()), key
    blank = {key: torch.zeros_like(value) for key, value in state.items()}
    sharded.load_state_dict(blank)
    assert not torch.equal(sharded.state_dict()[key], state[key])
    sharded.load_state_dict(quantized.state_dict())
    for key, value in sharded.state_dict().items():
        assert torch.equal(value, state[key]), key


def test_a_row_wise_mean_table_averages_each_shard_as_torchrec_does():
    # The computation itself, by hand: one bag whose ids fall in two row shards of t1.
    quantized = _quantized(torch.qint8, False, torch.float32)
    plan = construct_module_sharding_plan(
        quantized, PLANS["row_wise"], sharder=_sharder(), local_size=8, world_size=8, device_type="cpu"
    )
    with pytest.warns(UserWarning, match="average the ids each row shard holds"):
        sharded: Any = tpurec.shard(sp.from_torchrec(quantized, device="tpu"), plan)
    state = quantized.state_dict()
    rows = state["embedding_bags.t1.weight"].float()
    table = rows * state["embedding_bags.t1.weight_qscale"].float() + state["embedding_bags.t1.weight_qbias"].float()
    # t1 has 40 rows over 8 ranks: rows 0-4 on rank 0, 5-9 on rank 1.
    ids = [0, 1, 3, 7]
    lengths = {"f0": [0] * 8, "f3": [0] * 8, "f1": [4] + [0] * 7, "f2": [0] * 8}
    from torchrec import KeyedJaggedTensor

    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f3", "f1", "f2"],
        values=torch.tensor(ids),
        lengths=torch.tensor([n for key in ["f0", "f3", "f1", "f2"] for n in lengths[key]]),
    )
    got = sharded(kjt)["f1"][0].cpu()
    expected = table[[0, 1, 3]].mean(0) + table[[7]].mean(0)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(got, table[ids].mean(0), rtol=1e-3, atol=1e-3)  # the whole bag's mean differs


def test_a_quantized_collection_shards_beside_a_float_one_with_the_planner():
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    class Pair(nn.Module):
        def __init__(self, quantized: nn.Module, other: nn.Module) -> None:
            super().__init__()
            self.quantized, self.other = quantized, other

        def forward(self, kjt, other_kjt):
            return self.quantized(kjt), self.other(other_kjt)

    quantized = _quantized(torch.qint8, False, torch.float32)
    torch.manual_seed(1)
    other_tables = [EmbeddingBagConfig(name="u0", embedding_dim=8, num_embeddings=20, feature_names=["f0"])]
    other = TorchrecEBC(tables=other_tables)
    apply_optimizer_in_backward(torch.optim.SGD, other.parameters(), {"lr": 0.1})
    model: Any = sp.from_torchrec(Pair(copy.deepcopy(quantized), other), device="tpu")
    model = tpurec.shard(model)  # plan=None: table-wise for the quantized collection
    assert isinstance(model.quantized, ShardedQuantEmbeddingBagCollection)
    assert {s.sharding_type for s in model.quantized.layout.shardings.values()} == {"table_wise"}
    rng = np.random.default_rng(4)
    for batch in range(BATCHES):
        kjt, other_kjt = random_kjt(TABLES, BATCH, rng, max_len=6), random_kjt(other_tables, BATCH, rng)
        with torch.no_grad():
            got_quant, got_other = model(kjt, other_kjt)
        want_quant = quantized(kjt)  # table-wise: each bag pooled whole, as unsharded
        for key, value in want_quant.to_dict().items():
            _assert_close(got_quant[key].cpu(), value, f"batch {batch}, {key}")
        torch.testing.assert_close(
            got_other.values().detach().cpu(), other(other_kjt).values().detach(), rtol=1e-6, atol=1e-6
        )


def _sharded_int8() -> tuple[nn.Module, Any]:
    quantized = _quantized(torch.qint8, False, torch.float32)
    return sp.from_torchrec(quantized, device="tpu"), quantized


@pytest.mark.parametrize(
    ("generators", "match"),
    [
        ({"t0": data_parallel(), "t1": table_wise(rank=0), "t2": table_wise(rank=1)}, "t0.*data_parallel"),
        (
            {"t0": table_row_wise(host_index=0), "t1": table_wise(rank=0), "t2": table_wise(rank=1)},
            "t0.*table_row_wise",
        ),
    ],
    ids=["data_parallel", "table_row_wise"],
)
def test_sharding_types_torchrec_does_not_offer_for_quantized_tables_are_refused(generators, match):
    ours, _ = _sharded_int8()
    meta = TorchrecEBC(tables=copy.deepcopy(TABLES), device=torch.device("meta"))
    plan = construct_module_sharding_plan(meta, generators, local_size=8, world_size=8, device_type="cpu")
    with pytest.raises(ValueError, match=rf"{match}.*quantized tables shard table_wise, row_wise, column_wise"):
        tpurec.shard(ours, plan)
    assert isinstance(ours, sp.QuantEmbeddingBagCollection)


def test_training_options_are_refused_for_a_quantized_model():
    ours, quantized = _sharded_int8()
    plan = construct_module_sharding_plan(
        quantized, PLANS["table_wise"], sharder=_sharder(), local_size=8, world_size=8, device_type="cpu"
    )
    with pytest.raises(ValueError, match="quantized inference collections, which nothing trains"):
        tpurec.shard(ours, plan, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1})
    sharded: Any = tpurec.shard(ours, plan)
    rng = np.random.default_rng(0)
    # Variable batch per feature: refused as by the unsharded module (TorchRec's does not expand it).
    with pytest.raises(NotImplementedError, match="variable batch size per feature"):
        sharded(vbe_kjt(TABLES, BATCH, rng))
