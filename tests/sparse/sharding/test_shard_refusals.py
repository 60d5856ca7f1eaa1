"""What ``tpurec.shard`` refuses, before it changes anything, where it cannot do what TorchRec does.

* TorchRec's FP16/BF16 modules that ``from_torchrec`` keeps as TorchRec's own module on the device:
  TorchRec's DMP trains those tables with FBGEMM's fused kernels, the unsharded module with dense
  gradients (tpurec's own collections of FP16/BF16 tables shard: test_sharded_half_tables.py).
(What stays refused for managed-collision collections: test_sharded_managed_collisions.py.)

Each alone and next to a collection ``tpurec.shard`` does shard: the error names the module and the
model's state stays as it was.
"""

from __future__ import annotations


import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection as TorchrecEBC
from torchrec import EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from torchrec.modules.embedding_configs import DataType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import tpurec
import tpurec.sparse as sp


def _bag_tables(data_type: DataType = DataType.FP32, prefix: str = "t") -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"{prefix}{i}", embedding_dim=8, num_embeddings=20, feature_names=[f"f{i}"], data_type=data_type
        )
        for i in range(2)
    ]


class _Pair(nn.Module):
    """Two collections over one batch, outputs added (``other`` is a plain FP32 one or None)."""

    def __init__(self, first: nn.Module, other: nn.Module | None) -> None:
        super().__init__()
        self.first = first
        self.other = other

    def forward(self, kjt):
        out = self.first(kjt).values()
        return out if self.other is None else out + self.other(kjt).values()


def _trainable_ebc(tables: list[EmbeddingBagConfig]) -> TorchrecEBC:
    ebc = TorchrecEBC(tables=tables)
    apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.1})
    return ebc


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def _assert_refused(model: nn.Module, error: type[Exception], match: str) -> None:
    before = _state(model)
    modules = [type(m) for m in model.modules()]
    with pytest.raises(error, match=match):
        tpurec.shard(model)
    assert [type(m) for m in model.modules()] == modules  # nothing sharded
    after = _state(model)
    assert list(after) == list(before)
    for key, value in after.items():
        assert torch.equal(value, before[key]), key


@pytest.mark.parametrize("data_type", [DataType.FP16, DataType.BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("beside", [False, True], ids=["alone", "beside_a_float_collection"])
def test_torchrec_half_precision_tables_kept_as_torchrec_modules_are_refused(data_type, beside):
    torch.manual_seed(1)
    other = _trainable_ebc(_bag_tables(prefix="u")) if beside else None
    model = sp.from_torchrec(_Pair(_trainable_ebc(_bag_tables(data_type)), other), device="tpu")
    assert type(model.first).__name__ == "TorchrecEmbeddingBagCollectionOnDevice"
    _assert_refused(
        model, NotImplementedError, rf"TorchrecEmbeddingBagCollectionOnDevice at 'first'.*t0 \({data_type.name}\)"
    )


def test_torchrec_half_precision_sequence_tables_are_refused():
    torch.manual_seed(1)
    tables = [
        EmbeddingConfig(name="s0", embedding_dim=8, num_embeddings=20, feature_names=["f0"], data_type=DataType.FP16)
    ]
    ec = EmbeddingCollection(tables=tables)
    apply_optimizer_in_backward(torch.optim.SGD, ec.parameters(), {"lr": 0.1})
    model = sp.from_torchrec(nn.ModuleDict({"ec": ec}), device="tpu")
    assert type(model.ec).__name__ == "TorchrecEmbeddingCollectionOnDevice"
    _assert_refused(model, NotImplementedError, r"TorchrecEmbeddingCollectionOnDevice at 'ec'.*s0 \(FP16\)")
