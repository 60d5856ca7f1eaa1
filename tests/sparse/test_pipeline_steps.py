"""TrainPipeline without per-step waits: several captured steps per launch (``steps_per_call``) and
losses read one call behind (``losses()``), against the plain pipeline's steps bit for bit; a nan
loss or an error names its step; a warm pipeline compiles nothing."""

from __future__ import annotations

from typing import cast

import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagCollection as TorchrecEBC
from torchrec.datasets.utils import Batch
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.optim import RowWiseAdagrad as TorchrecRowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import tpurec
import tpurec.sparse as sp
from helpers import make_tables, random_kjt

BATCH, K = 8, 3  # K steps per launch
WARMUP = 3  # calls of one step each: two plain steps, then the capture
LAYERS = {"dense_in_features": 5, "dense_arch_layer_sizes": [16, 8], "over_arch_layer_sizes": [16, 1]}


def _tables():
    return make_tables(dims=(8, 8), rows=(30, 20))


def _batches(n: int, seed: int = 0) -> list[Batch]:
    rng = np.random.default_rng(seed)
    return [
        Batch(
            torch.from_numpy(rng.standard_normal((BATCH, 5)).astype(np.float32)),
            random_kjt(_tables(), BATCH, rng),
            torch.from_numpy(rng.integers(0, 2, BATCH).astype(np.float32)),
        )
        for _ in range(n)
    ]


def _model(capacities: sp.Capacity | None = sp.Capacity(128)) -> DLRMTrain:
    torch.manual_seed(0)
    model = DLRM(embedding_bag_collection=TorchrecEBC(_tables()), **LAYERS)
    apply_optimizer_in_backward(TorchrecRowWiseAdagrad, model.sparse_arch.parameters(), {"lr": 0.1})
    return DLRMTrain(cast(DLRM, sp.from_torchrec(model, capacities=capacities).to("tpu")))


def _train(
    batches: list[Batch], capacities: sp.Capacity | None = sp.Capacity(128), **options
) -> tuple[list, int, DLRMTrain, list]:
    """Runs the pipeline over ``batches`` in fused mode; returns its (step, loss) pairs, its step
    count, the model and, per call, the programs it ran."""
    model = _model(capacities)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05, fused=True)
    pipeline = sp.TrainPipeline(model, optimizer, "tpu", **options)
    it = iter(batches)
    losses, programs = [], []
    with tpurec.mode("fused"):
        while True:
            before = tpurec.stats()["executions"]
            try:
                pipeline.progress(it)
            except StopIteration:
                break
            programs.append(tpurec.stats()["executions"] - before)
            losses.extend(pipeline.losses())
    losses.extend(pipeline.losses(wait=True))
    pipeline.close()
    return losses, pipeline.steps, model, programs


@pytest.mark.parametrize("batches", ["full", "short_batch", "capacities_grow"])
def test_steps_per_call_train_as_single_steps_bit_for_bit(batches):
    data = _batches(WARMUP + 3 * K + 1)  # the last call has one step: a single replay
    capacities: sp.Capacity | None = sp.Capacity(128)
    if batches == "short_batch":  # a batch of other shapes cuts a launch short and runs uncaptured
        b = data[WARMUP + 4]
        data[WARMUP + 4] = Batch(b.dense_features[:4], random_kjt(_tables(), 4, np.random.default_rng(3)), b.labels[:4])
    if batches == "capacities_grow":  # new CSR tensors in the middle of a launch: its steps run one by one
        capacities = None
        b = data[WARMUP + K + 1]
        data[WARMUP + K + 1] = Batch(
            b.dense_features, random_kjt(_tables(), BATCH, np.random.default_rng(4), 40), b.labels
        )
    expected, steps, plain, _ = _train(data, capacities)
    looped = _train(data, capacities, graphed=True, steps_per_call=K, compile_in_background=False)
    losses, looped_steps, model, programs = looped
    assert [s for s, _ in losses] == list(range(len(data))) and looped_steps == steps == len(data)
    assert losses == expected  # bit for bit, every step's loss
    for key, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[key].cpu(), value.cpu()), key
    # The collection's count of optimizer steps (Python state a replay's hook advances): once per step
    counts = [m.model.sparse_arch.embedding_bag_collection._steps for m in (model, plain)]
    assert counts[0] == counts[1] and counts[0][0] > 0, counts
    if batches == "full":
        assert len(programs) == WARMUP + 3 + 1  # one call per step before the capture, then K steps per call
        assert programs[WARMUP : WARMUP + 3] == [1, 1, 1]  # one launch for K steps


def test_a_warm_pipeline_with_steps_per_call_compiles_nothing():
    model = _model()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05, fused=True)
    pipeline = sp.TrainPipeline(model, optimizer, "tpu", graphed=True, steps_per_call=K)
    data = _batches(WARMUP + 4 * K)
    it = iter(data)
    with tpurec.mode("fused"):
        for _ in range(WARMUP + 1):  # the first launch: its steps one by one while its program compiles
            before = tpurec.stats()["executions"]
            pipeline.progress(it)
        assert tpurec.stats()["executions"] - before == K
        assert pipeline.wait_for_compiles(timeout=300)
        pipeline.losses(wait=True)
        before = tpurec.stats()
        for _ in range(3):
            pipeline.progress(it)
        pipeline.losses(wait=True)
    after = tpurec.stats()
    assert after["compilations"] == before["compilations"]
    assert after["executions"] - before["executions"] == 3  # one launch per call
    assert pipeline.steps == len(data)
    pipeline.close()


def test_losses_are_read_one_call_behind_the_step_issued():
    model = _model()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05, fused=True)
    pipeline = sp.TrainPipeline(model, optimizer, "tpu")
    it = iter(_batches(5))
    with tpurec.mode("fused"):
        pipeline.progress(it)
        assert pipeline.losses() == []  # step 0 issued, not read
        for step in range(1, 5):
            pipeline.progress(it)
            assert [s for s, _ in pipeline.losses()] == [step - 1]
        assert [s for s, _ in pipeline.losses(wait=True)] == [4]
        with pytest.raises(StopIteration):
            pipeline.progress(it)
    pipeline.close()


@pytest.mark.parametrize("options", [{}, {"graphed": True, "steps_per_call": K}], ids=["plain", "steps_per_call"])
def test_a_nan_loss_surfaces_with_its_step(options):
    data = _batches(WARMUP + 2 * K + 2)
    bad = WARMUP + K + 1
    data[bad].dense_features[0, 0] = float("nan")
    model = _model()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05, fused=True)
    pipeline = sp.TrainPipeline(model, optimizer, "tpu", **options)
    it = iter(data)
    read = []
    with tpurec.mode("fused"):
        with pytest.raises(FloatingPointError, match=f"the loss of step {bad} is nan"):
            for _ in data:
                pipeline.progress(it)
                read.extend(pipeline.losses())
            pipeline.losses(wait=True)
    read.extend(pipeline.losses())
    assert [s for s, _ in read] == list(range(bad))  # every step before it, read
    pipeline.close()


class _FailsAt(torch.nn.Module):
    """A model whose step ``at`` raises in its forward."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(5, 1)
        self.calls, self.at = 0, at

    def forward(self, batch: Batch):
        self.calls += 1
        if self.calls - 1 == self.at:
            raise RuntimeError("the device failed")
        logits = self.linear(batch.dense_features).squeeze(-1)
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels), logits


def test_an_error_of_a_step_names_the_step():
    model = _FailsAt(3).to("tpu")
    pipeline = sp.TrainPipeline(model, torch.optim.SGD(model.parameters(), lr=0.1), "tpu")
    it = iter(_batches(5))
    with tpurec.mode("fused"):
        for _ in range(3):
            pipeline.progress(it)
        with pytest.raises(RuntimeError, match="the device failed") as raised:
            pipeline.progress(it)
    assert "raised by step 3" in "".join(raised.value.__notes__)
    assert [s for s, _ in pipeline.losses(wait=True)] == [0, 1, 2]
    pipeline.close()


def test_an_error_surfacing_when_a_loss_is_read_names_its_step():
    # A loss whose buffer is gone by the time it is read stands in for a computation that failed
    # on the device after its launch: the error surfaces at the read, one call later.
    model = _FailsAt(-1).to("tpu")
    pipeline = sp.TrainPipeline(model, torch.optim.SGD(model.parameters(), lr=0.1), "tpu")
    it = iter(_batches(4))
    with tpurec.mode("fused"):
        pipeline.progress(it)
        pipeline.progress(it)
        _, values, _ = pipeline._unread[-1]  # step 1's loss, not read yet
        values.delete()
        with pytest.raises(RuntimeError) as raised:
            pipeline.progress(it)
    assert "the loss of step 1" in "".join(raised.value.__notes__)
    pipeline.close()


def test_steps_per_call_needs_a_captured_step():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(ValueError, match="needs graphed=True"):
        sp.TrainPipeline(model, optimizer, "tpu", steps_per_call=4)
    with pytest.raises(ValueError, match="steps_per_call must be >= 1"):
        sp.TrainPipeline(model, optimizer, "tpu", graphed=True, steps_per_call=0)
