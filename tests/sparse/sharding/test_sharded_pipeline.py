"""TrainPipeline with a model sharded by tpurec.shard on 8 CPU devices.

The pipeline's worker validates, routes and packs batch i+1 for the sharded
collection and sends it to the mesh while step i runs; the losses and tables
must equal those of the plain loop exactly, and bad batches must fail at the
step that would have used them, with the tables untouched.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagCollection as TorchrecEBC
from torchrec.datasets.utils import Batch
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingPlan
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import tpurec
import tpurec.sparse as sp
from helpers import make_tables, random_kjt
from tpurec.sparse.sharding import ShardedEmbeddingBagCollection
from tpurec.sparse.types import CapacityError

EBC_PATH = "model.sparse_arch.embedding_bag_collection"
LAYERS = {"dense_in_features": 5, "dense_arch_layer_sizes": [16, 8], "over_arch_layer_sizes": [16, 1]}
TABLES = make_tables(dims=(8, 8, 8, 8), rows=(40, 23, 30, 17), features=(("f0", "f1"), ("f2",), ("f3",), ("f4",)))
BATCH = 16
WORKER = "tpurec-train-pipeline"  # the reader thread, and the prefix of the preparing workers' names


def _plan() -> ShardingPlan:
    """Table-wise, row-wise, column-wise and data-parallel tables in one plan."""
    meta = TorchrecEBC(tables=TABLES, device=torch.device("meta"))
    generators = {"t0": table_wise(rank=3), "t1": row_wise(), "t2": column_wise(ranks=[1, 6]), "t3": data_parallel()}
    return ShardingPlan(
        {EBC_PATH: construct_module_sharding_plan(meta, generators, local_size=8, world_size=8, device_type="cpu")}
    )


def _model(capacity: int | None = None) -> tuple[torch.nn.Module, torch.optim.Optimizer, ShardedEmbeddingBagCollection]:
    """A sharded torchrec DLRMTrain (same weights every call), its dense optimizer and its sharded collection."""
    torch.manual_seed(0)
    model = DLRMTrain(DLRM(embedding_bag_collection=TorchrecEBC(TABLES), **LAYERS))
    model = sp.from_torchrec(model, optimizer=sp.Adagrad(learning_rate=0.1), capacities=sp.Capacity(512)).to("tpu")
    model = tpurec.shard(model, _plan(), capacity=capacity)
    ebc = model.model.sparse_arch.embedding_bag_collection
    assert isinstance(ebc, ShardedEmbeddingBagCollection)
    assert {s.sharding_type for s in ebc.layout.shardings.values()} == {
        "table_wise",
        "row_wise",
        "column_wise",
        "data_parallel",
    }
    return model, torch.optim.Adagrad(model.parameters(), lr=0.05), ebc


def _batches(n: int, seed: int = 0) -> list[Batch]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        kjt = random_kjt(TABLES, BATCH, rng)
        dense = torch.from_numpy(rng.standard_normal((BATCH, 5)).astype(np.float32))
        labels = torch.from_numpy(rng.integers(0, 2, BATCH).astype(np.float32))
        out.append(Batch(dense_features=dense, sparse_features=kjt, labels=labels))
    return out


def _plain_losses(model, optimizer, batches) -> list[float]:
    losses = []
    for b in batches:
        optimizer.zero_grad()
        loss, _ = model(Batch(b.dense_features.to("tpu"), b.sparse_features, b.labels.to("tpu")))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _pipeline_losses(pipeline, it) -> list[float]:
    losses = []
    while True:
        try:
            loss, _logits, _labels = pipeline.progress(it)
        except StopIteration:
            break
        losses.append(loss.item())
    return losses


def _state(ebc: ShardedEmbeddingBagCollection) -> tuple[dict, dict]:
    return ebc.full_tables()


def _assert_same_state(got: tuple[dict, dict], want: tuple[dict, dict]) -> None:
    for name in want[0]:
        np.testing.assert_array_equal(got[0][name], want[0][name], err_msg=name)
        for slot in want[1][name]:
            np.testing.assert_array_equal(got[1][name][slot], want[1][name][slot], err_msg=f"{name}.{slot}")


def _record_routing_threads(ebc: ShardedEmbeddingBagCollection) -> list[str]:
    """Wraps ``ebc._route`` to record which thread routed each batch."""
    threads: list[str] = []
    route = ebc._route

    def recording(features):
        threads.append(threading.current_thread().name)
        return route(features)

    ebc._route = recording
    return threads


@pytest.mark.parametrize("mode", ["eager", "fused", "compiled"])
def test_pipeline_equals_the_plain_loop_on_a_sharded_dlrm(mode):
    batches = _batches(5)
    execution = "fused" if mode == "compiled" else mode
    model, optimizer, ebc = _model()
    # The plain loop runs the same step: compiled too in compiled mode.
    step_model = torch.compile(model, backend="tpu") if mode == "compiled" else model
    with tpurec.mode(execution):
        expected = _plain_losses(step_model, optimizer, batches)
    expected_state = _state(ebc)

    model, optimizer, ebc = _model()
    threads = _record_routing_threads(ebc)
    step_model = torch.compile(model, backend="tpu") if mode == "compiled" else model
    pipeline = sp.TrainPipeline(step_model, optimizer, torch.device("tpu"))
    assert ebc in pipeline._collections
    with tpurec.mode(execution):
        got = _pipeline_losses(pipeline, iter(batches))
    pipeline.close()
    # Same programs on the same inputs: identical, not just close.
    assert got == expected
    _assert_same_state(_state(ebc), expected_state)
    # Every batch was validated and routed on the pipeline's workers, none again in the step.
    assert len(threads) == len(batches) and all(name.startswith(WORKER) for name in threads), threads
    assert not ebc._prefetched


def test_batch_tensors_go_to_the_mesh_from_the_worker():
    model, optimizer, _ebc = _model()
    pipeline = sp.TrainPipeline(model, optimizer, "tpu")
    seen = []
    inner = model.forward

    def forward(batch):
        seen.append((batch.dense_features, batch.labels))
        return inner(batch)

    model.forward = forward
    _pipeline_losses(pipeline, iter(_batches(2, seed=4)))
    for dense, labels in seen:
        for t in (dense, labels):
            sharding = t._storage.array.sharding
            assert len(sharding.device_set) == 8 and not sharding.is_fully_replicated


def test_the_pipeline_asks_the_sharded_collections_for_their_mesh_not_the_model():
    import jax
    from jax.sharding import Mesh

    from tpurec.sparse.mesh_batches import mesh_of

    model, optimizer, ebc = _model()
    assert model.mesh is ebc.mesh  # kept for users (distribute_batch(labels, model.mesh))
    # An attribute of the user's model is not where batches go: here another mesh under that name.
    model.mesh = Mesh(np.array(jax.devices()[:2]), ("other",))
    assert mesh_of(model) is ebc.mesh
    pipeline = sp.TrainPipeline(model, optimizer, "tpu")
    moved = pipeline._to_device(torch.ones(BATCH, 5))
    assert moved.array.sharding.mesh == ebc.mesh
    assert len(moved.array.sharding.device_set) == 8
    del model.mesh
    assert mesh_of(model) is ebc.mesh


def _bad_id(batch: Batch) -> Batch:
    kjt = batch.sparse_features
    values = kjt.values().clone()
    values[-1] = 10_000  # feature f4's table t3 has 17 rows
    bad = KeyedJaggedTensor.from_lengths_sync(keys=kjt.keys(), values=values, lengths=kjt.lengths())
    return Batch(batch.dense_features, bad, batch.labels)


def test_a_bad_batch_raises_at_its_step_with_the_tables_unchanged():
    batches = _batches(4, seed=1)
    batches[2] = _bad_id(batches[2])
    model, optimizer, ebc = _model()
    pipeline = sp.TrainPipeline(model, optimizer, "tpu")
    it = iter(batches)
    pipeline.progress(it)
    pipeline.progress(it)
    before = _state(ebc)
    dropped = ebc.dropped
    with pytest.raises(ValueError, match=r"feature 'f4' has id 10000 outside \[0, 17\) of table 't3'"):
        pipeline.progress(it)
    _assert_same_state(_state(ebc), before)
    assert ebc.dropped == dropped and not ebc._prefetched
    with pytest.raises(StopIteration):
        pipeline.progress(it)
    pipeline.close()
    # The plain loop raises the same error for the same batch.
    with pytest.raises(ValueError, match="feature 'f4' has id 10000"):
        _plain_losses(model, optimizer, [batches[2]])
    _assert_same_state(_state(ebc), before)


def test_capacity_overflow_through_the_pipeline_and_counted_drops():
    batches = _batches(3, seed=2)
    model, optimizer, ebc = _model(capacity=1)  # rounded up to 8 entries per source and shard
    needs = [max(ebc._route(b.sparse_features).needs) for b in batches]
    assert max(needs) > 8, needs  # the batches overflow the capacity
    pipeline = sp.TrainPipeline(model, optimizer, "tpu")
    before = _state(ebc)
    with pytest.raises(CapacityError, match="capacity=8"):
        pipeline.progress(iter(batches))
    _assert_same_state(_state(ebc), before)
    pipeline.close()

    # With overflow="drop" the drops are counted when a step uses the batch, not when it is prepared.
    model, optimizer, ebc = _model(capacity=1)
    ebc.overflow = "drop"
    expected_drops = []
    for b in batches:
        ebc.prefetch(b.sparse_features)
        expected_drops.append(ebc._prefetched[id(b.sparse_features)].dropped)
    ebc.clear_prefetched()
    assert ebc.dropped == 0 and sum(expected_drops) > 0
    pipeline = sp.TrainPipeline(model, optimizer, "tpu")
    assert len(_pipeline_losses(pipeline, iter(batches))) == 3
    assert ebc.dropped == sum(expected_drops)


def test_prefetch_gives_what_the_inline_path_gives_and_does_not_pile_up():
    _model_, _opt, ebc = _model()
    batches = _batches(10, seed=3)
    for b in batches:
        ebc.prefetch(b.sparse_features)
    assert len(ebc._prefetched) == 8  # the newest ones
    newest = batches[-1].sparse_features
    with torch.no_grad():
        prefetched = ebc(newest).values().cpu()
        assert id(newest) not in ebc._prefetched
        inline = ebc(newest).values().cpu()
    assert torch.equal(prefetched, inline)
    # A different KJT object with the same keys is not mistaken for a prefetched one.
    copy = KeyedJaggedTensor.from_lengths_sync(keys=newest.keys(), values=newest.values(), lengths=newest.lengths())
    ebc.prefetch(newest)
    with torch.no_grad():
        assert torch.equal(ebc(copy).values().cpu(), inline)
    assert id(newest) in ebc._prefetched
    ebc.clear_prefetched()
    assert not ebc._prefetched
    assert ebc.feature_names == ["f0", "f1", "f2", "f3", "f4"]


@pytest.mark.slow
def test_bench_sharded_cli_times_both_loops_on_identical_losses():
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [
            sys.executable,
            str(root / "examples" / "dlrm" / "bench_sharded.py"),
            "--devices",
            "4",
            "--batch",
            "64",
            "--tables",
            "4",
            "--rows",
            "100",
            "--dim",
            "8",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--rounds",
            "1",
            "--modes",
            "fused",
            "graphed",
            "--dense-only",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    run = out["fused"]
    assert run["max_loss_difference"] == 0.0  # the same steps, whichever loop runs them
    assert run["plain_step_ms"] > 0 and run["pipeline_step_ms"] > 0 and run["pipeline_dense_only_step_ms"] > 0
    assert run["speedup"] == pytest.approx(run["plain_step_ms"] / run["pipeline_step_ms"], rel=1e-2)
    assert run["plain_host_ms"] > 0 and run["pipeline_host_ms"] > 0
    # The captured pipeline (TrainPipeline(graphed=True), fused dense Adagrad in both loops): the same steps.
    graphed = out["graphed"]
    assert graphed["max_loss_difference"] == 0.0 and graphed["pipeline_host_ms"] > 0
    assert "pipeline_dense_only_step_ms" not in graphed
    assert out["sparse_host_prepare_ms"] > 0 and len(out["load_average_before"]) == 3
    bad = subprocess.run(
        [sys.executable, str(root / "examples" / "dlrm" / "bench_sharded.py"), "--batch", "10"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert bad.returncode == 2 and "must be a multiple of --devices 8" in bad.stderr
