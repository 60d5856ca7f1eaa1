"""torch.profiler traces show tpurec's events; tpurec.profile(logdir) adds XLA's device trace."""

import glob
import json
import os

import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.models.dlrm import DLRM
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import tpurec
import tpurec.sparse as sparse


@pytest.fixture(autouse=True)
def _start_in_eager_mode():
    """These tests check eager-mode mechanics or enter the mode they test themselves, so each
    starts in eager mode even when the suite runs with TPUREC_MODE=fused."""
    with tpurec.mode("eager"):
        yield


def _dlrm():
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=rows, feature_names=[f"f{i}"])
        for i, rows in enumerate((30, 20))
    ]
    model = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables),
        dense_in_features=5,
        dense_arch_layer_sizes=[16, 8],
        over_arch_layer_sizes=[16, 1],
    )
    apply_optimizer_in_backward(torch.optim.SGD, model.sparse_arch.parameters(), {"lr": 0.1})
    model = sparse.from_torchrec(model, capacities=sparse.Capacity(64)).to("tpu")
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _batch(rng, batch_size=8):
    lengths = rng.integers(1, 4, 2 * batch_size)
    values = np.concatenate([rng.integers(0, 20, int(lengths.sum()))])
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1"], values=torch.from_numpy(values).long(), lengths=torch.from_numpy(lengths).long()
    )
    dense = torch.from_numpy(rng.standard_normal((batch_size, 5)).astype(np.float32))
    labels = torch.from_numpy(rng.integers(0, 2, batch_size).astype(np.float32))
    return dense, kjt, labels


def _step(model, optimizer, batch):
    dense, kjt, labels = batch
    optimizer.zero_grad()
    logits = model(dense.to("tpu"), kjt).squeeze(-1)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.to("tpu"))
    loss.backward()
    optimizer.step()
    return loss.item()


@pytest.mark.parametrize("mode", ["eager", "fused"])
def test_dlrm_step_trace_has_compile_execute_and_sync_ranges(mode, tmp_path):
    model, optimizer = _dlrm()
    rng = np.random.default_rng(0)
    with tpurec.mode(mode):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(2):  # the first step compiles, the second runs cached programs
                _step(model, optimizer, _batch(rng))
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]  # the Chrome trace parses
    names = {e["name"] for e in events if e.get("ph") == "X"}
    program = "fused window" if mode == "fused" else "op"
    assert f"tpurec::compile {program}" in names and f"tpurec::execute {program}" in names, sorted(names)
    assert "tpurec::sync (item)" in names if mode == "fused" else "tpurec::sync (to host)" in names
    assert "tpurec::dispatch" in names and any(n.startswith("aten::") for n in names)
    compiles = [e for e in events if e.get("name", "").startswith("tpurec::compile")]
    assert all(e["dur"] > 0 for e in compiles)
    averages = {e.key: e for e in prof.key_averages()}
    assert averages[f"tpurec::compile {program}"].count >= 1 and averages[f"tpurec::execute {program}"].count >= 1
    assert f"tpurec::compile {program}" in prof.key_averages().table(row_limit=-1)


def test_host_fallback_and_synchronize_are_ranges():
    x = torch.tensor([0.0, 1.0, 0.0, 2.0]).to("tpu")
    with torch.profiler.profile() as prof:
        nonzero = torch.nonzero(x)  # data-dependent shape: runs on the host
        torch.tpu.synchronize()
    names = {e.key for e in prof.key_averages()}
    assert "tpurec::host_fallback aten.nonzero.default" in names and "tpurec::sync (synchronize)" in names
    assert nonzero.cpu().flatten().tolist() == [1, 3]


def test_no_ranges_without_a_profiler():
    from tpurec import profiler

    assert not profiler.enabled()
    assert type(profiler.record("tpurec::x")).__name__ == "nullcontext"


def test_profile_writes_the_torch_trace_and_xlas_device_trace(tmp_path):
    model, optimizer = _dlrm()
    rng = np.random.default_rng(1)
    with tpurec.profile(str(tmp_path)) as prof:
        _step(model, optimizer, _batch(rng))
    events = json.loads((tmp_path / "torch_trace.json").read_text())["traceEvents"]
    assert any(e.get("name", "").startswith("tpurec::") for e in events)
    assert glob.glob(os.path.join(tmp_path, "plugins", "profile", "*", "*.xplane.pb")), os.listdir(tmp_path)
    assert prof.key_averages()
    with pytest.raises(ValueError, match="not a folder"):
        with tpurec.profile(str(tmp_path / "torch_trace.json")):
            pass


def test_compiled_graphs_have_compile_and_execute_ranges():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).to("tpu")
    compiled = torch.compile(model, backend="tpu")
    x = torch.randn(3, 4).to("tpu")
    with torch.profiler.profile() as prof:
        for _ in range(2):
            compiled(x).sum().backward()
    counts = {e.key: e.count for e in prof.key_averages()}
    for kind in ("forward", "backward"):
        assert counts.get(f"tpurec::compile {kind} graph") == 1, counts
        assert counts.get(f"tpurec::execute {kind} graph") == 1, counts
    torch._dynamo.reset()
