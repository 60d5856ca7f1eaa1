"""torch.export / torchrec.fx of converted TorchRec models: the traced program equals the eager model.

Each model is built with TorchRec on CPU (the reference), converted with ``from_torchrec`` for
inference on ``tpu``, exported, and the exported program is run on tpu inputs: it must equal the
eager converted model exactly (same ops) and TorchRec's CPU model to 1e-5 relative.
"""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest
import torch
import torchrec.fx
from torchrec import EmbeddingBagCollection as TorchrecEBC
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import PoolingType
from torchrec.modules.mlp import MLP

import tpurec.sparse as sp
from helpers import make_tables, random_kjt

RTOL, ATOL = 1e-5, 1e-6  # against TorchRec CPU (float32 sums in another order)
DENSE_IN = 5


def _exact(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.detach().cpu(), expected.detach().cpu(), rtol=0, atol=0)


def _close_to_torchrec(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.detach().cpu(), expected.detach(), rtol=RTOL, atol=ATOL)


def _lookup_nodes(ep: torch.export.ExportedProgram) -> list[torch.fx.Node]:
    return [n for n in ep.graph.nodes if n.op == "call_function" and "embedding_bag_collection" in str(n.target)]


def _kjt_dynamic_shapes(kjt: KeyedJaggedTensor, batch):
    from tpurec.sparse.export import kjt_dynamic_shapes

    return kjt_dynamic_shapes(kjt, batch)


# --- models ---------------------------------------------------------------------------


DLRM_TABLES = make_tables(dims=(8, 8, 8), rows=(30, 20, 10))


def _dlrm(capacities: sp.Capacity | None = sp.Capacity(256)) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(TorchRec DLRM on CPU, the same model converted for inference on tpu)."""
    torch.manual_seed(0)
    reference = DLRM(
        embedding_bag_collection=TorchrecEBC(DLRM_TABLES),
        dense_in_features=DENSE_IN,
        dense_arch_layer_sizes=[16, 8],
        over_arch_layer_sizes=[16, 1],
    ).eval()
    converted = sp.from_torchrec(copy.deepcopy(reference), capacities=capacities).eval().to("tpu")
    return reference, converted


def _dlrm_batch(batch_size: int, rng: np.random.Generator, max_len: int = 4) -> tuple[torch.Tensor, KeyedJaggedTensor]:
    dense = torch.from_numpy(rng.standard_normal((batch_size, DENSE_IN)).astype(np.float32))
    return dense, random_kjt(DLRM_TABLES, batch_size, rng, max_len=max_len)


class TwoTower(torch.nn.Module):
    """A retrieval two-tower model in TorchRec's style: query and candidate towers over their own
    EmbeddingBagCollections, scored by a dot product."""

    def __init__(self, query: TorchrecEBC, candidate: TorchrecEBC, hidden: int = 16, out: int = 8) -> None:
        super().__init__()
        self.query_ebc, self.candidate_ebc = query, candidate

        def tower(ebc: TorchrecEBC) -> torch.nn.Module:
            width = sum(t.embedding_dim * len(t.feature_names) for t in ebc.embedding_bag_configs())
            return torch.nn.Sequential(MLP(width, [hidden]), torch.nn.Linear(hidden, out))

        self.query_tower, self.candidate_tower = tower(query), tower(candidate)

    def forward(self, query: KeyedJaggedTensor, candidate: KeyedJaggedTensor) -> torch.Tensor:
        q = self.query_tower(self.query_ebc(query).values())
        c = self.candidate_tower(self.candidate_ebc(candidate).values())
        return (q * c).sum(dim=1)


QUERY_TABLES = [
    EmbeddingBagConfig(name="user", embedding_dim=8, num_embeddings=40, feature_names=["user_id"]),
    EmbeddingBagConfig(
        name="history",
        embedding_dim=8,
        num_embeddings=25,
        feature_names=["clicked", "bought"],
        pooling=PoolingType.MEAN,
    ),
]
# Weighted features, two embedding dims (two stacked tables).
CANDIDATE_TABLES = [
    EmbeddingBagConfig(name="item", embedding_dim=8, num_embeddings=30, feature_names=["item_id"]),
    EmbeddingBagConfig(name="category", embedding_dim=4, num_embeddings=12, feature_names=["item_category"]),
]


def _two_tower() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    reference = TwoTower(TorchrecEBC(QUERY_TABLES), TorchrecEBC(CANDIDATE_TABLES, is_weighted=True)).eval()
    # Capacities per stacked table (the query tables share one stack; the candidate's dims differ).
    capacities = {"user__history": sp.Capacity(64), "item": sp.Capacity(32), "category": sp.Capacity(32, 16)}
    converted = sp.from_torchrec(copy.deepcopy(reference), capacities=capacities).eval().to("tpu")
    return reference, converted


def _two_tower_batch(batch_size: int, rng: np.random.Generator) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor]:
    return random_kjt(QUERY_TABLES, batch_size, rng), random_kjt(CANDIDATE_TABLES, batch_size, rng, weighted=True)


# --- torch.export ------------------------------------------------------------------------


def test_dlrm_export_any_batch_equals_eager_and_torchrec():
    reference, converted = _dlrm()
    rng = np.random.default_rng(0)
    dense, kjt = _dlrm_batch(4, rng)
    batch = torch.export.Dim("batch")
    ep = torch.export.export(
        converted, (dense.to("tpu"), kjt), dynamic_shapes=({0: batch}, _kjt_dynamic_shapes(kjt, batch))
    )
    assert len(_lookup_nodes(ep)) == 1  # the whole lookup is one node
    program = ep.module()
    for batch_size in (4, 7, 2, 16):
        dense, kjt = _dlrm_batch(batch_size, rng)
        with torch.no_grad():
            out = program(dense.to("tpu"), kjt)
            eager = converted(dense.to("tpu"), kjt)
            expected = reference(dense, kjt)
        assert out.device.type == "tpu" and out.shape == (batch_size, 1)
        _exact(out, eager)
        _close_to_torchrec(out, expected)


def test_two_tower_export_any_batch_equals_eager_and_torchrec():
    reference, converted = _two_tower()
    rng = np.random.default_rng(1)
    query, candidate = _two_tower_batch(4, rng)
    batch = torch.export.Dim("batch")
    ep = torch.export.export(
        converted,
        (query, candidate),
        dynamic_shapes=(_kjt_dynamic_shapes(query, batch), _kjt_dynamic_shapes(candidate, batch)),
    )
    assert len(_lookup_nodes(ep)) == 2
    program = ep.module()
    for batch_size in (4, 9, 2):
        query, candidate = _two_tower_batch(batch_size, rng)
        with torch.inference_mode():  # a server's way of running it
            out = program(query, candidate)
            eager = converted(query, candidate)
            expected = reference(query, candidate)
        assert out.device.type == "tpu" and out.shape == (batch_size,)
        _exact(out, eager)
        _close_to_torchrec(out, expected)


@pytest.mark.parametrize("device", ["tpu", "cpu"])
def test_export_without_dynamic_shapes_is_for_one_input_shape(device):
    reference, converted = _dlrm()
    converted.to(device)
    rng = np.random.default_rng(2)
    dense, kjt = _dlrm_batch(4, rng, max_len=2)
    ep = torch.export.export(converted, (dense.to(device), kjt))
    program = ep.module()
    with torch.no_grad():
        out = program(dense.to(device), kjt)
        assert out.device.type == device
        _exact(out, converted(dense.to(device), kjt))
        _close_to_torchrec(out, reference(dense, kjt))
    # Another batch size, or the same batch size with another number of ids: torch's input guards refuse it.
    other_dense, other_kjt = _dlrm_batch(6, rng)
    with pytest.raises(AssertionError, match=r"Guard failed: dense_features.size\(\)\[0\] == 4"):
        program(other_dense.to(device), other_kjt)
    other_kjt = random_kjt(DLRM_TABLES, 4, rng, lengths=3)
    with pytest.raises(AssertionError, match=r"Guard failed: sparse_features._values.size\(\)\[0\] =="):
        program(dense.to(device), other_kjt)


def test_export_of_a_variable_batch_kjt_raises():
    _, converted = _dlrm()
    dense = torch.zeros(2, DENSE_IN, device="tpu")
    vbe = KeyedJaggedTensor(
        keys=["f0", "f1", "f2", "f3"],
        values=torch.arange(9) % 5,
        lengths=torch.ones(9, dtype=torch.long),
        stride_per_key_per_rank=[[2], [3], [2], [2]],
    )
    with pytest.raises(NotImplementedError, match="variable-batch"):
        torch.export.export(converted, (dense, vbe))


def test_exported_program_grows_automatic_capacities_like_the_module():
    reference, converted = _dlrm(capacities=None)
    rng = np.random.default_rng(3)
    dense, kjt = _dlrm_batch(4, rng, max_len=1)
    batch = torch.export.Dim("batch")
    ep = torch.export.export(
        converted, (dense.to("tpu"), kjt), dynamic_shapes=({0: batch}, _kjt_dynamic_shapes(kjt, batch))
    )
    dense, kjt = _dlrm_batch(8, rng, max_len=12)  # more ids per partition than the export example had
    with torch.no_grad():
        out = ep.module()(dense.to("tpu"), kjt)
        _exact(out, converted(dense.to("tpu"), kjt))
        _close_to_torchrec(out, reference(dense, kjt))


@pytest.mark.parametrize("exported_on", ["cpu", "tpu"])
def test_saved_program_loads_and_serves_on_tpu(exported_on):
    # The serving path: export (tables on CPU or tpu), torch.export.save, load, move the loaded
    # module to tpu, run any batch there.
    reference, converted = _dlrm()
    rng = np.random.default_rng(10)
    dense, kjt = _dlrm_batch(4, rng)
    batch = torch.export.Dim("batch")
    exported = copy.deepcopy(converted).to(exported_on)
    ep = torch.export.export(
        exported, (dense.to(exported_on), kjt), dynamic_shapes=({0: batch}, _kjt_dynamic_shapes(kjt, batch))
    )
    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    buffer.seek(0)
    with torch.serialization.safe_globals([KeyedJaggedTensor]):  # the example inputs hold a KJT
        program = torch.export.load(buffer).module().to("tpu")
    dense, kjt = _dlrm_batch(6, rng)
    with torch.no_grad():
        out = program(dense.to("tpu"), kjt)
        assert out.device.type == "tpu"
        _exact(out, converted(dense.to("tpu"), kjt))
        _close_to_torchrec(out, reference(dense, kjt))


def test_exported_program_validates_batches_like_the_module():
    _, converted = _dlrm()
    rng = np.random.default_rng(4)
    dense, kjt = _dlrm_batch(4, rng)
    batch = torch.export.Dim("batch")
    program = torch.export.export(
        converted, (dense.to("tpu"), kjt), dynamic_shapes=({0: batch}, _kjt_dynamic_shapes(kjt, batch))
    ).module()
    values = kjt.values().clone()
    values[0] = 10_000  # beyond every table
    bad = KeyedJaggedTensor.from_lengths_sync(keys=kjt.keys(), values=values, lengths=kjt.lengths())
    with torch.no_grad(), pytest.raises(ValueError) as eager_error:
        converted(dense.to("tpu"), bad)
    with torch.no_grad(), pytest.raises(ValueError) as exported_error:
        program(dense.to("tpu"), bad)
    assert str(exported_error.value) == str(eager_error.value)


def test_exported_program_survives_run_decompositions():
    _, converted = _dlrm()
    rng = np.random.default_rng(5)
    dense, kjt = _dlrm_batch(4, rng)
    ep = torch.export.export(converted, (dense.to("tpu"), kjt)).run_decompositions()
    assert len(_lookup_nodes(ep)) == 1
    with torch.no_grad():
        _exact(ep.module()(dense.to("tpu"), kjt), converted(dense.to("tpu"), kjt))


def test_export_in_training_mode_raises():
    _, converted = _dlrm()
    rng = np.random.default_rng(6)
    dense, kjt = _dlrm_batch(4, rng)
    converted.train()
    with pytest.raises(NotImplementedError, match=r"training mode.*model\.eval\(\)"):
        torch.export.export(converted, (dense.to("tpu"), kjt))


def test_backward_through_exported_lookup_raises():
    _, converted = _dlrm()
    rng = np.random.default_rng(7)
    dense, kjt = _dlrm_batch(4, rng)
    program = torch.export.export(converted, (dense.to("tpu"), kjt)).module()
    weight = converted.sparse_arch.embedding_bag_collection.stacked_weight(0)
    before = weight.detach().cpu().clone()
    out = program(dense.to("tpu"), kjt)
    with pytest.raises(RuntimeError, match="no backward"):
        out.sum().backward()
    _exact(weight, before)


def test_torchscript_raises_clearly():
    _, converted = _dlrm()
    with pytest.raises(NotImplementedError, match="cannot be TorchScripted.*torch.export"):
        torch.jit.script(converted)


# --- torchrec.fx ---------------------------------------------------------------------------


def test_fx_symbolic_trace_of_dlrm_and_two_tower_equals_eager():
    rng = np.random.default_rng(8)
    reference, converted = _dlrm()
    traced = torchrec.fx.symbolic_trace(converted)
    dense, kjt = _dlrm_batch(5, rng)
    with torch.no_grad():
        out = traced(dense.to("tpu"), kjt)
        _exact(out, converted(dense.to("tpu"), kjt))
        _close_to_torchrec(out, reference(dense, kjt))

    reference, converted = _two_tower()
    traced = torchrec.fx.symbolic_trace(converted)
    query, candidate = _two_tower_batch(6, rng)
    with torch.no_grad():
        out = traced(query, candidate)
        _exact(out, converted(query, candidate))
        _close_to_torchrec(out, reference(query, candidate))


def test_fx_trace_for_training_keeps_the_collection_a_leaf():
    _, converted = _dlrm()
    converted.train()
    with pytest.raises(NotImplementedError, match="leaf_modules"):
        torchrec.fx.symbolic_trace(converted)
    traced = torchrec.fx.symbolic_trace(converted, leaf_modules=["EmbeddingBagCollection"])
    assert any(n.op == "call_module" and n.target.endswith("embedding_bag_collection") for n in traced.graph.nodes)
    rng = np.random.default_rng(9)
    dense, kjt = _dlrm_batch(4, rng)
    with torch.no_grad():
        _exact(traced(dense.to("tpu"), kjt), converted(dense.to("tpu"), kjt))
