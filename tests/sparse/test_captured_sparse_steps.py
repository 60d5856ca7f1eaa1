"""A DLRM step with SparseCore lookups captured by tpurec.graph: the batch's CSR input staged by
EmbeddingBagCollection.stage(), replays trained as torchrec with FBGEMM's fused optimizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagCollection as TorchrecEBC
from torchrec.datasets.utils import Batch
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from torchrec.optim import RowWiseAdagrad as TorchrecRowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import tpurec
import tpurec.sparse as sp
from helpers import make_tables, random_kjt

BATCH, STEPS, WARMUP = 8, 7, 2  # WARMUP plain steps, the capture, then replays
LAYERS = {"dense_in_features": 5, "dense_arch_layer_sizes": [16, 8], "over_arch_layer_sizes": [16, 1]}


def _tables():
    return make_tables(dims=(8, 8, 8), rows=(30, 20, 10))


def _batches(n: int = STEPS) -> list:
    rng = np.random.default_rng(0)
    return [
        (
            random_kjt(_tables(), BATCH, rng),
            torch.from_numpy(rng.standard_normal((BATCH, 5)).astype(np.float32)),
            torch.from_numpy(rng.integers(0, 2, BATCH).astype(np.float32)),
        )
        for _ in range(n)
    ]


def _reference() -> DLRM:
    torch.manual_seed(0)
    collection = FusedEmbeddingBagCollection(
        _tables(), optimizer_type=TorchrecRowWiseAdagrad, optimizer_kwargs={"lr": 0.1}
    )
    return DLRM(embedding_bag_collection=collection, **LAYERS)


def _ours(reference: DLRM, capacities: sp.Capacity | None = sp.Capacity(128)) -> DLRM:
    model = DLRM(embedding_bag_collection=TorchrecEBC(_tables()), **LAYERS)
    model.load_state_dict(reference.state_dict())
    apply_optimizer_in_backward(TorchrecRowWiseAdagrad, model.sparse_arch.parameters(), {"lr": 0.1})
    return sp.from_torchrec(model, capacities=capacities).to("tpu")


def _step(model, optimizer, dense, kjt, labels):
    optimizer.zero_grad()
    loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, kjt).squeeze(-1), labels)
    loss.backward()
    optimizer.step()
    return loss


def _train(model, batches, captured: bool) -> tuple[list[float], tpurec.TpuGraph]:
    """Fused-mode steps over static dense tensors and the collection's staged CSR input."""
    collection = model.sparse_arch.embedding_bag_collection
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05, fused=True)
    static_dense = torch.zeros(BATCH, 5, device="tpu")
    static_labels = torch.zeros(BATCH, device="tpu")
    graph = tpurec.TpuGraph()
    losses = []
    with tpurec.mode("fused"):
        for i, (kjt, dense, labels) in enumerate(batches):
            static_dense.copy_(dense)
            static_labels.copy_(labels)
            collection.stage(kjt)
            if not captured or i < WARMUP:
                losses.append(_step(model, optimizer, static_dense, kjt, static_labels).item())
            elif i == WARMUP:
                with tpurec.graph(graph):
                    static_loss = _step(model, optimizer, static_dense, kjt, static_labels)
                losses.append(static_loss.item())
            else:
                graph.replay()
                losses.append(static_loss.item())
    return losses, graph


def test_captured_dlrm_step_replays_as_torchrec_and_as_the_uncaptured_step():
    batches = _batches()
    reference = _reference()
    dense_reference = torch.optim.Adagrad(reference.parameters(), lr=0.05, fused=True)
    expected = [_step(reference, dense_reference, dense, kjt, labels).item() for kjt, dense, labels in batches]

    ours = _ours(_reference())
    losses, graph = _train(ours, batches, captured=True)
    assert graph.captured
    plain = _ours(_reference())
    assert losses == _train(plain, batches, captured=False)[0]  # bit for bit
    for key, value in plain.state_dict().items():
        assert torch.equal(ours.state_dict()[key].cpu(), value.cpu()), key
    # The replays counted their optimizer steps, as the uncaptured steps did (saved in checkpoints).
    collections = [m.sparse_arch.embedding_bag_collection for m in (ours, plain)]
    assert collections[0].optimizer_state_dict()["steps"] == collections[1].optimizer_state_dict()["steps"]
    assert collections[0].optimizer_state_dict()["steps"] == [STEPS]
    # torchrec on CPU with FBGEMM's fused row-wise Adagrad: test_dlrm.py's tolerances.
    assert losses == pytest.approx(expected, abs=1e-4, rel=0)
    state = ours.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key].cpu(), value, atol=1e-4, rtol=0)


def test_replay_refuses_an_embedding_learning_rate_changed_since_the_capture():
    model = _ours(_reference())
    losses, graph = _train(model, _batches(WARMUP + 1), captured=True)
    collection = model.sparse_arch.embedding_bag_collection
    collection.optimizer.learning_rate = 0.2  # captured with 0.1
    tables = collection.stacked_weight(0).detach().cpu().clone()
    with pytest.raises(RuntimeError, match=r"the embedding optimizer of tables \['t0', 't1', 't2'\] now has"):
        graph.replay()
    assert torch.equal(collection.stacked_weight(0).detach().cpu(), tables)
    assert collection.optimizer_state_dict()["steps"] == [WARMUP + 1]


def test_a_prefetched_batch_in_the_step_is_refused_after_the_step_ran():
    # prefetch() puts the CSR arrays on the device outside tpurec's ops: a replay would read the capture's batch.
    batches = _batches(WARMUP + 1)
    model = _ours(_reference())
    collection = model.sparse_arch.embedding_bag_collection
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    dense, labels = (t.to("tpu") for t in batches[0][1:])
    with tpurec.mode("fused"):
        for kjt, _, _ in batches[:WARMUP]:
            collection.prefetch(kjt)
            _step(model, optimizer, dense, kjt, labels).item()
        kjt = batches[WARMUP][0]
        collection.prefetch(kjt)
        before = collection.stacked_weight(0).detach().cpu().clone()
        graph = tpurec.TpuGraph()
        with pytest.raises(RuntimeError, match=r"that no tensor held when the step began.*its stage\(\) method"):
            with tpurec.graph(graph):
                _step(model, optimizer, dense, kjt, labels)
    assert not graph.captured
    assert not torch.equal(collection.stacked_weight(0).detach().cpu(), before)  # the step ran in full


def test_stage_refuses_while_the_staged_lookup_waits_for_its_backward():
    kjt, other = (b[0] for b in _batches(2))
    model = _ours(_reference())
    collection = model.sparse_arch.embedding_bag_collection
    collection.stage(kjt)
    pooled = collection(kjt).values()
    staged = [t.cpu().clone() for t in collection._static_csr[0]]
    with pytest.raises(RuntimeError, match="still waits for its backward"):
        collection.stage(other)
    assert collection._staged is not None and collection._staged[0] is kjt
    assert all(torch.equal(t.cpu(), s) for t, s in zip(collection._static_csr[0], staged))
    pooled.sum().backward()
    collection.stage(other)  # after the backward it may


def test_a_replay_after_staging_a_batch_of_another_size_runs_nothing():
    batches = _batches(WARMUP + 1)
    model = _ours(_reference())
    graph = tpurec.TpuGraph()
    collection = model.sparse_arch.embedding_bag_collection
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    dense, labels = torch.zeros(BATCH, 5, device="tpu"), torch.zeros(BATCH, device="tpu")
    with tpurec.mode("fused"):
        kjt = batches[0][0]
        for _ in range(WARMUP):
            collection.stage(kjt)
            _step(model, optimizer, dense, kjt, labels).item()
        with tpurec.graph(graph):
            _step(model, optimizer, dense, kjt, labels)
        # Half the batch: other CSR shapes, so new staged tensors; the captured step's are freed.
        collection.stage(random_kjt(_tables(), BATCH // 2, np.random.default_rng(1)))
        weights = collection.stacked_weight(0).detach().cpu().clone()
        with pytest.raises(RuntimeError, match="a tensor the captured step reads now holds"):
            graph.replay()
    assert torch.equal(collection.stacked_weight(0).detach().cpu(), weights)


def _pipeline_losses(
    graphed: bool, batches: list, capacities: sp.Capacity | None = sp.Capacity(128), workers: int = 2
) -> tuple[list[float], list, DLRMTrain]:
    model = DLRMTrain(_ours(_reference(), capacities))
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05, fused=True)
    pipeline = sp.TrainPipeline(model, optimizer, "tpu", graphed=graphed, workers=workers)
    it = iter([Batch(dense, kjt, labels) for kjt, dense, labels in batches])
    losses, outputs = [], []
    with tpurec.mode("fused"):
        while True:
            try:
                loss, logits, labels = pipeline.progress(it)
            except StopIteration:
                break
            losses.append(loss.item())
            outputs.append(logits)
    pipeline.close()
    return losses, outputs, model


def test_graphed_pipeline_trains_as_the_plain_pipeline():
    batches = _batches()
    losses, outputs, model = _pipeline_losses(True, batches)
    expected, _, plain = _pipeline_losses(False, batches)
    assert losses == expected  # bit for bit
    for key, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[key].cpu(), value.cpu()), key
    # From the capture (the third step) on, every step returns the captured step's output tensors.
    assert all(out is outputs[WARMUP] for out in outputs[WARMUP:])
    assert len({id(out) for out in outputs[:WARMUP]}) == WARMUP


def test_graphed_pipeline_in_eval_mode_runs_the_forward_only():
    # After the training step's capture, eval steps must not replay it (no backward, no update).
    batches = _batches(WARMUP + 3)
    model = DLRMTrain(_ours(_reference()))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    pipeline = sp.TrainPipeline(model, optimizer, "tpu", graphed=True)
    it = iter([Batch(dense, kjt, labels) for kjt, dense, labels in batches])
    with tpurec.mode("fused"):
        for _ in range(WARMUP + 1):
            pipeline.progress(it)
        model.eval()
        before = {k: v.cpu().clone() for k, v in model.state_dict().items()}
        loss, _, _ = pipeline.progress(it)
        assert all(torch.equal(model.state_dict()[k].cpu(), v) for k, v in before.items())
        kjt, dense, labels = batches[WARMUP + 1]
        with torch.no_grad():
            expected, _ = model(Batch(dense.to("tpu"), kjt, labels.to("tpu")))
        assert loss.item() == expected.item()
        model.train()
        pipeline.progress(it)  # training again: a replay, which updates the tables
    table = "model.sparse_arch.embedding_bag_collection.embedding_bags.t0.weight"
    assert not torch.equal(model.state_dict()[table].cpu(), before[table])
    pipeline.close()


def test_graphed_pipeline_refuses_a_device_it_cannot_capture_on():
    model = DLRMTrain(_ours(_reference()))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(ValueError, match="graphed=True.*the device is cpu"):
        sp.TrainPipeline(model, optimizer, "cpu", graphed=True)


def test_graphed_pipeline_runs_a_batch_of_other_shapes_uncaptured_and_replays_after_it():
    # A short batch (the last of an epoch) between replays, then full batches again: as the plain pipeline.
    batches = _batches(WARMUP + 4)
    short = random_kjt(_tables(), BATCH // 2, np.random.default_rng(3))
    batches[WARMUP + 2] = (short, batches[WARMUP + 2][1][: BATCH // 2], batches[WARMUP + 2][2][: BATCH // 2])
    losses, outputs, model = _pipeline_losses(True, batches)
    expected, _, plain = _pipeline_losses(False, batches)
    assert losses == expected  # bit for bit
    for key, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[key].cpu(), value.cpu()), key
    assert outputs[WARMUP + 1] is outputs[WARMUP] and outputs[WARMUP + 3] is outputs[WARMUP]  # replays
    assert outputs[WARMUP + 2] is not outputs[WARMUP]  # the short batch's own step


def test_graphed_pipeline_captures_again_when_automatic_capacities_grow():
    # Automatic capacities (none given) grow on a batch with more ids: stage() makes new CSR tensors,
    # which the captured step never read. That step runs uncaptured, the next is captured again.
    batches = _batches(WARMUP + 5)
    long = random_kjt(_tables(), BATCH, np.random.default_rng(4), max_len=40)
    batches[WARMUP + 2] = (long, *batches[WARMUP + 2][1:])
    # One worker prepares the batches in order. With two side by side, the long batch's growth can reach
    # the batch before it while that one is still being preprocessed, and the uncaptured step is then
    # that one (the losses are the same either way; which step recaptures depends on the threads' timing).
    losses, outputs, model = _pipeline_losses(True, batches, capacities=None, workers=1)
    expected, _, plain = _pipeline_losses(False, batches, capacities=None, workers=1)
    assert losses == expected  # bit for bit
    for key, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[key].cpu(), value.cpu()), key
    assert outputs[WARMUP + 1] is outputs[WARMUP]  # a replay of the first capture
    recaptured = outputs[WARMUP + 3]
    assert len({id(out) for out in (outputs[WARMUP], outputs[WARMUP + 2], recaptured)}) == 3
    assert outputs[WARMUP + 4] is recaptured  # a replay of the second capture
