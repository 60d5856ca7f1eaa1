"""Captured steps of a model sharded by tpurec.shard on 8 CPU devices.

``ShardedEmbeddingBagCollection.stage()`` routes a batch into static entry tensors; the staged
lookup and its fused optimizer then run as tpu work on tensors (recorded into the step's window
in fused mode), so ``tpurec.graph`` and ``TrainPipeline(graphed=True)`` capture the whole step.
Replays must train exactly as the plain loop over the same programs (the sharded collection's
unstaged lookups), which test_sharded_training.py checks against TorchRec.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchrec.datasets.utils import Batch

import tpurec
import tpurec.sparse as sp
from helpers import random_kjt
from tpurec.sparse.sharding import distribute_batch
from test_sharded_pipeline import TABLES, _assert_same_state, _batches, _model, _state

WARMUP = 2  # plain steps before the capture (the pipeline's too)


def _fused_model(capacity: int | None = None):
    """The sharded DLRMTrain of test_sharded_pipeline (every sharding type) with a fused dense Adagrad."""
    model, _, ebc = _model(capacity)
    return model, torch.optim.Adagrad(model.parameters(), lr=0.05, fused=True), ebc


def _step(model, optimizer, batch: Batch) -> torch.Tensor:
    optimizer.zero_grad()
    loss, _ = model(batch)
    loss.backward()
    optimizer.step()
    return loss


def _on_tpu(batch: Batch) -> Batch:
    return Batch(batch.dense_features.to("tpu"), batch.sparse_features, batch.labels.to("tpu"))


def _plain_losses(batches: list[Batch], capacity: int | None = None) -> tuple[list[float], tuple, int]:
    model, optimizer, ebc = _fused_model(capacity)
    with tpurec.mode("fused"):
        losses = [_step(model, optimizer, _on_tpu(b)).item() for b in batches]
    return losses, _state(ebc), ebc._step


def _graphed_pipeline(batches: list[Batch], capacity: int | None = None):
    model, optimizer, ebc = _fused_model(capacity)
    pipeline = sp.TrainPipeline(model, optimizer, "tpu", graphed=True)
    it = iter(batches)
    losses, outputs, executions = [], [], []
    while True:
        before = tpurec.stats()["executions"]
        try:
            loss, logits, _labels = pipeline.progress(it)
        except StopIteration:
            break
        losses.append(loss.item())
        outputs.append(logits)
        executions.append(tpurec.stats()["executions"] - before)
    pipeline.close()
    return losses, outputs, executions, ebc


def test_graphed_pipeline_on_a_sharded_dlrm_trains_as_the_plain_loop():
    batches = _batches(7)
    expected, state, steps = _plain_losses(batches)
    losses, outputs, executions, ebc = _graphed_pipeline(batches)
    assert losses == expected  # bit for bit: the same programs, captured
    _assert_same_state(_state(ebc), state)
    assert ebc._step == steps == len(batches)  # replays count their optimizer steps
    # From the capture (the third step) on, every step returns the captured step's output tensors
    # and runs one program (the replay); the steps before it run the window of the whole step.
    assert all(out is outputs[WARMUP] for out in outputs[WARMUP:])
    assert executions[WARMUP + 1 :] == [1] * (len(batches) - WARMUP - 1)


@pytest.mark.parametrize("mode", ["eager", "fused"])
def test_a_staged_sharded_lookup_trains_as_the_unstaged_one(mode):
    batches = _batches(3, seed=1)
    results = []
    for staged in (False, True):
        model, optimizer, ebc = _fused_model()
        losses = []
        with tpurec.mode(mode):
            for b in batches:
                if staged:
                    ebc.stage(b.sparse_features)
                losses.append(_step(model, optimizer, _on_tpu(b)).item())
        results.append((losses, _state(ebc), ebc._step))
    assert results[1][0] == results[0][0]
    _assert_same_state(results[1][1], results[0][1])
    assert results[1][2] == results[0][2] == len(batches)


def _captured(batches: list[Batch]):
    """A sharded model whose step is captured with tpurec.graph after WARMUP staged steps."""
    model, optimizer, ebc = _fused_model()
    graph = tpurec.TpuGraph()
    # Batch tensors on the mesh already: the model's hook would split single-device ones in the step.
    static = Batch(
        distribute_batch(batches[0].dense_features, model.mesh), None, distribute_batch(batches[0].labels, model.mesh)
    )
    with tpurec.mode("fused"):
        for b in batches[:WARMUP]:
            ebc.stage(b.sparse_features)
            _step(model, optimizer, Batch(static.dense_features, b.sparse_features, static.labels)).item()
        kjt = batches[WARMUP].sparse_features
        ebc.stage(kjt)
        with tpurec.graph(graph):
            loss = _step(model, optimizer, Batch(static.dense_features, kjt, static.labels))
    return model, ebc, graph, loss, static


def test_a_sharded_replay_refuses_an_embedding_learning_rate_changed_since_the_capture():
    batches = _batches(WARMUP + 2, seed=2)
    _, ebc, graph, loss, _ = _captured(batches)
    ebc.stage(batches[-1].sparse_features)
    ebc.optimizer.learning_rate = 0.3  # captured with 0.1
    tables = _state(ebc)
    with pytest.raises(RuntimeError, match=r"the embedding optimizer of the sharded tables \['t0', .* now has"):
        graph.replay()
    _assert_same_state(_state(ebc), tables)
    assert ebc._step == WARMUP + 1
    ebc.optimizer.learning_rate = 0.1
    graph.replay()
    assert np.isfinite(loss.item()) and ebc._step == WARMUP + 2


def test_stage_refuses_while_the_staged_sharded_lookup_waits_for_its_backward():
    first, second = (b.sparse_features for b in _batches(2, seed=3))
    _, _, ebc = _fused_model()
    ebc.stage(first)
    pooled = ebc(first).values()
    staged = [t.cpu().clone() for t in ebc._static_entries]
    with pytest.raises(RuntimeError, match="still waits for its backward"):
        ebc.stage(second)
    assert ebc._staged is not None and ebc._staged[0] is first
    assert all(torch.equal(t.cpu(), s) for t, s in zip(ebc._static_entries, staged))
    pooled.sum().backward()
    ebc.stage(second)  # after the backward it may


def test_graphed_pipeline_captures_again_when_the_sharded_capacity_grows():
    # Automatic capacity: a batch with many more ids per bag needs a larger one, so stage()
    # makes new entry tensors; that step runs uncaptured, the next is captured again.
    batches = _batches(7, seed=4)
    rng = np.random.default_rng(5)
    wide = random_kjt(TABLES, batches[0].sparse_features.stride(), rng, max_len=24)
    batches[WARMUP + 2] = Batch(batches[WARMUP + 2].dense_features, wide, batches[WARMUP + 2].labels)
    expected, state, _ = _plain_losses(batches)
    losses, outputs, executions, ebc = _graphed_pipeline(batches)
    assert ebc.staged_generation == 2  # the first batch's tensors, then the grown capacity's
    assert losses == expected  # bit for bit
    _assert_same_state(_state(ebc), state)
    assert outputs[WARMUP + 1] is outputs[WARMUP]  # a replay
    assert outputs[WARMUP + 2] is not outputs[WARMUP]  # the grown batch's own step, uncaptured
    assert outputs[WARMUP + 4] is outputs[WARMUP + 3]  # the new capture's replay
    assert executions[WARMUP + 4 :] == [1] * (len(batches) - WARMUP - 4)


def test_graphed_pipeline_on_a_sharded_model_in_eval_mode_runs_the_forward_only():
    batches = _batches(WARMUP + 3, seed=6)
    model, optimizer, ebc = _fused_model()
    pipeline = sp.TrainPipeline(model, optimizer, "tpu", graphed=True)
    it = iter(batches)
    for _ in range(WARMUP + 1):  # the capture is the last of them
        pipeline.progress(it)
    model.eval()
    tables = _state(ebc)
    loss, _, _ = pipeline.progress(it)
    _assert_same_state(_state(ebc), tables)
    with torch.no_grad():
        expected, _ = model(_on_tpu(batches[WARMUP + 1]))
    assert loss.item() == expected.item()
    model.train()
    pipeline.progress(it)  # training again: a replay, which updates the tables
    assert not np.array_equal(_state(ebc)[0]["t0"], tables[0]["t0"])
    pipeline.close()
