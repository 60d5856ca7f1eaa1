"""TorchRec's quantized EmbeddingBagCollection (INT8/INT4/INT2 rows) through from_torchrec looks up
as TorchRec/FBGEMM do on CPU.

Reference: a float TorchRec EBC quantized by TorchRec's own path
(``torchrec.inference.modules.quantize_embeddings``), run on CPU by FBGEMM.

Tolerances. float32 output: ``rtol=1e-6`` and ``atol=1e-6 * max|reference|``. tpurec dequantizes each
row exactly as FBGEMM (float16 scale and bias widened to float32, ``w * scale * q + w * bias``), but
its CSR input sums a bag's rows in id order (duplicates merged) where FBGEMM sums them in bag order,
and the rounding of a float32 sum is relative to its terms, not to a total that may cancel to ~0.
float16/bfloat16 output is compared in that dtype with torch's default tolerances for it (both
round the same float32 sums once).
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagCollection as TorchrecEBC
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.inference.modules import quantize_embeddings
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import DataType, PoolingType
from torchrec.quant.embedding_modules import EmbeddingBagCollection as TorchrecQuantEBC
from torchrec.quant.embedding_modules import quant_prep_enable_quant_state_dict_split_scale_bias

import tpurec
import tpurec.sparse as sp
from helpers import random_kjt

QUANT_DTYPES = {"int8": torch.qint8, "int4": torch.quint4x2, "int2": torch.quint2x4}


def _tables(weighted_dims=(16, 8, 16)):
    # Mixed pooling: TorchRec's quantized EBC orders its output by pooling group (t0, t2, then t1).
    d0, d1, d2 = weighted_dims
    return [
        EmbeddingBagConfig(name="t0", embedding_dim=d0, num_embeddings=40, feature_names=["f0", "f3"]),
        EmbeddingBagConfig(
            name="t1", embedding_dim=d1, num_embeddings=30, feature_names=["f1"], pooling=PoolingType.MEAN
        ),
        EmbeddingBagConfig(name="t2", embedding_dim=d2, num_embeddings=20, feature_names=["f2"]),
    ]


def _quantized(tables, dtype, *, weighted=False, output_dtype=torch.float32, split_scale_bias=False, seed=0):
    torch.manual_seed(seed)
    ebc = TorchrecEBC(tables=copy.deepcopy(tables), is_weighted=weighted)
    if split_scale_bias:
        quant_prep_enable_quant_state_dict_split_scale_bias(ebc)
    qebc = quantize_embeddings(torch.nn.Sequential(ebc), dtype=dtype, inplace=False, output_dtype=output_dtype)[0]
    assert type(qebc) is TorchrecQuantEBC
    return qebc


def _assert_float32_close(ours: torch.Tensor, reference: torch.Tensor) -> None:
    assert ours.dtype == reference.dtype == torch.float32
    scale = reference.abs().max().item()
    torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-6 * scale)


@pytest.mark.parametrize("mode", ["eager", "fused"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("kind", list(QUANT_DTYPES))
def test_lookup_matches_torchrec_quantized_cpu(kind, weighted, mode):
    tables = _tables()
    reference = _quantized(tables, QUANT_DTYPES[kind], weighted=weighted)
    ours = sp.from_torchrec(reference, device="tpu")
    assert isinstance(ours, sp.QuantEmbeddingBagCollection)
    assert ours.device.type == "tpu" and ours.stacked_weight(0).dtype == torch.uint8
    rng = np.random.default_rng(1)
    for _ in range(3):
        kjt = random_kjt(tables, 6, rng, max_len=12, weighted=weighted)
        expected = reference(kjt)
        with tpurec.mode(mode):
            got = ours(kjt)
            values = got.values().cpu()
        assert got.keys() == expected.keys() == ["f0", "f3", "f2", "f1"]
        assert got.length_per_key() == expected.length_per_key()
        _assert_float32_close(values, expected.values())


@pytest.mark.parametrize("output_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_half_precision_output_matches_in_that_dtype(kind, output_dtype):
    tables = _tables()
    reference = _quantized(tables, QUANT_DTYPES[kind], output_dtype=output_dtype)
    ours = sp.from_torchrec(reference, device="tpu")
    kjt = random_kjt(tables, 6, np.random.default_rng(2), max_len=12)
    expected = reference(kjt).values()
    got = ours(kjt).values().cpu()
    assert got.dtype == expected.dtype == output_dtype
    torch.testing.assert_close(got, expected)


def test_converted_rows_are_fbgemms_bytes_and_state_dict_has_torchrec_keys():
    tables = _tables()
    for kind in QUANT_DTYPES:
        reference = _quantized(tables, QUANT_DTYPES[kind])
        ours = sp.from_torchrec(reference, device="tpu")
        theirs, mine = reference.state_dict(), ours.state_dict()
        assert sorted(mine) == sorted(theirs) == [f"embedding_bags.t{i}.weight" for i in range(3)]
        for key, value in theirs.items():
            plain = getattr(value, "elem", value)  # TorchRec wraps INT4/INT2 rows in UInt4Tensor/UInt2Tensor
            assert torch.equal(mine[key].cpu(), plain), (kind, key)


@pytest.mark.parametrize("split_scale_bias", [False, True], ids=["whole_rows", "split_scale_bias"])
def test_state_dict_round_trip(split_scale_bias):
    tables = _tables()
    reference = _quantized(tables, torch.quint4x2, split_scale_bias=split_scale_bias)
    configs = reference.embedding_bag_configs()
    fresh = sp.QuantEmbeddingBagCollection(configs, device="tpu")
    kjt = random_kjt(tables, 5, np.random.default_rng(3), max_len=8)
    assert fresh(kjt).values().abs().max().item() == 0  # new tables are zero until loaded
    fresh.load_state_dict(reference.state_dict())  # TorchRec's keys (and split form) load as they are
    expected = reference(kjt).values()
    _assert_float32_close(fresh(kjt).values().cpu(), expected)
    # Our own state dict loads into another module (on another device) and looks up the same.
    again = sp.QuantEmbeddingBagCollection(configs)
    again.load_state_dict(fresh.state_dict())
    _assert_float32_close(again(kjt).values(), expected)
    # Another row alignment keeps the scale, bias and values; only the padding differs.
    packed = sp.QuantEmbeddingBagCollection(configs, row_alignment=4, device="tpu")
    packed.load_state_dict(reference.state_dict())
    assert packed.table_weight("t0").shape == (40, 12)
    _assert_float32_close(packed(kjt).values().cpu(), expected)


def test_partitions_and_static_capacities():
    tables = _tables()
    reference = _quantized(tables, torch.qint8)
    ours = sp.from_torchrec(reference, device="tpu", num_partitions=4, capacities=sp.Capacity(64))
    kjt = random_kjt(tables, 8, np.random.default_rng(6), max_len=10)
    _assert_float32_close(ours(kjt).values().cpu(), reference(kjt).values())
    tight = sp.from_torchrec(reference, device="tpu", num_partitions=4, capacities=sp.Capacity(1))
    with pytest.raises(sp.CapacityError, match="t0"):
        tight(kjt)


def test_bad_state_dict_changes_nothing():
    tables = _tables()
    reference = _quantized(tables, torch.qint8)
    ours = sp.from_torchrec(reference)
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    bad = dict(reference.state_dict())
    bad["embedding_bags.t2.weight"] = torch.zeros(20, 3, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="embedding_bags.t2.weight: rows of 3 bytes cannot hold scale, bias"):
        ours.load_state_dict({k: torch.ones_like(v) if "t0" in k else v for k, v in bad.items()})
    bad["embedding_bags.t2.weight"] = torch.zeros(20, 16)
    with pytest.raises(RuntimeError, match="expected uint8 quantized rows"):
        ours.load_state_dict(bad)
    for key, value in ours.state_dict().items():
        assert torch.equal(value, before[key])


@pytest.mark.parametrize("mode", ["eager", "fused"])
def test_dlrm_with_quantized_embeddings_matches_torchrec(mode):
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=r, feature_names=[f"f{i}"])
        for i, r in enumerate((30, 20, 10))
    ]
    model = DLRM(
        embedding_bag_collection=TorchrecEBC(tables),
        dense_in_features=5,
        dense_arch_layer_sizes=[16, 8],
        over_arch_layer_sizes=[16, 1],
    ).eval()
    reference = quantize_embeddings(model, dtype=torch.qint8, inplace=False)
    assert type(reference.sparse_arch.embedding_bag_collection) is TorchrecQuantEBC
    ours = sp.from_torchrec(copy.deepcopy(reference)).to("tpu")
    assert isinstance(ours.sparse_arch.embedding_bag_collection, sp.QuantEmbeddingBagCollection)
    rng = np.random.default_rng(4)
    for _ in range(2):
        kjt = random_kjt(tables, 8, rng, max_len=6)
        dense = torch.from_numpy(rng.standard_normal((8, 5)).astype(np.float32))
        with torch.no_grad():
            expected = reference(dense, kjt)
            with tpurec.mode(mode):
                got = ours(dense.to("tpu"), kjt).cpu()
        # The dense arch runs XLA's kernels on tpu, PyTorch's on CPU: 1e-5 relative, as the float DLRM tests.
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_bad_batches_raise_the_float_collections_errors():
    tables = _tables()
    reference = _quantized(tables, torch.qint8)
    ours = sp.from_torchrec(reference, device="tpu")
    floats = sp.EmbeddingBagCollection(
        [dataclasses.replace(t, data_type=DataType.FP32) for t in reference.embedding_bag_configs()]
    )
    keys = ["f0", "f3", "f1", "f2"]
    lengths = torch.tensor([1, 0, 1, 0, 1, 0, 1, 0])
    out_of_range = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.tensor([3, 40, 2, 1]), lengths=lengths)
    negative = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.tensor([3, 1, -1, 1]), lengths=lengths)
    unknown = KeyedJaggedTensor.from_lengths_sync(
        keys=keys[:3] + ["zz"], values=torch.tensor([3, 1, 2, 1]), lengths=lengths
    )
    for kjt, words in (
        (out_of_range, "feature 'f3' has id 40 outside [0, 40) of table 't0'"),
        (negative, "id -1"),
        (unknown, "zz"),
    ):
        with pytest.raises(ValueError) as theirs:
            floats(kjt)
        with pytest.raises(ValueError) as mine:
            ours(kjt)
        assert words in str(mine.value)
        assert str(mine.value) == str(theirs.value)


def test_quantized_tables_do_not_train():
    tables = _tables()
    reference = _quantized(tables, torch.qint8, weighted=True)
    with pytest.raises(ValueError, match=r"\['model\.0'\] hold quantized tables, which are for inference"):
        sp.from_torchrec(torch.nn.Sequential(reference), optimizer=sp.SGD(learning_rate=0.1))
    ours = sp.from_torchrec(reference, device="tpu")
    assert list(ours.parameters()) == []
    kjt = random_kjt(tables, 4, np.random.default_rng(5), weighted=True)
    assert not ours(kjt).values().requires_grad
    trainable = KeyedJaggedTensor.from_lengths_sync(
        keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(), weights=kjt.weights().clone().requires_grad_()
    )
    with pytest.raises(NotImplementedError, match="is for inference, but the KJT's per-id weights require grad"):
        ours(trainable)
    with torch.no_grad():
        _assert_float32_close(ours(trainable).values().cpu(), reference(kjt).values())


def test_unsupported_quantized_collections_are_refused_by_name():
    tables = _tables()
    torch.manual_seed(0)
    ebc = TorchrecEBC(tables=copy.deepcopy(tables))
    fp16_table = quantize_embeddings(
        torch.nn.Sequential(ebc), dtype=torch.qint8, inplace=False, per_table_weight_dtype={"t1": torch.float16}
    )
    with pytest.raises(NotImplementedError, match=r"model\.0 .*table 't1' is FP16"):
        sp.from_torchrec(fp16_table)
    assert type(fp16_table[0]) is TorchrecQuantEBC  # nothing was changed
    with pytest.raises(ValueError, match="data_type=FP32"):
        sp.QuantEmbeddingBagCollection(tables)
    odd = [
        EmbeddingBagConfig(name="t", embedding_dim=6, num_embeddings=4, feature_names=["f"], data_type=DataType.INT2)
    ]
    with pytest.raises(ValueError, match="multiple of 4"):
        sp.QuantEmbeddingBagCollection(odd)


def test_lookup_op_refuses_bad_arguments():
    rp = torch.tensor([2], dtype=torch.int32)
    ids = torch.tensor([0, 1], dtype=torch.int32)
    gains = torch.ones(2)
    table = torch.zeros(3, 16, dtype=torch.uint8)
    op = torch.ops.tpurec.quantized_sparse_dense_matmul
    kwargs = dict(batch_size=1, bits=8, embedding_dim=8, output_dtype="float32")
    assert op(rp, ids, ids, gains, table, **kwargs).shape == (1, 8)
    with pytest.raises(ValueError, match="embedding_ids must be 1-D int32"):
        op(rp, ids.long(), ids, gains, table, **kwargs)
    with pytest.raises(ValueError, match="table must be uint8"):
        op(rp, ids, ids, gains, table.float(), **kwargs)
    with pytest.raises(ValueError, match="cannot hold scale, bias and 16 8-bit values"):
        op(rp, ids, ids, gains, table, **{**kwargs, "embedding_dim": 16})
