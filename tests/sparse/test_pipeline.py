"""TrainPipeline: same losses as the plain loop, real overlap, clean ends and errors."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from torchrec.models.dlrm import DLRM, DLRMTrain

import tpurec
import tpurec.sparse as sparse

TABLES, ROWS, DIM, BATCH = 3, 40, 8, 16


def make_batches(n: int, seed: int = 0) -> list[Batch]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        lengths = rng.integers(0, 4, TABLES * BATCH)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{i}" for i in range(TABLES)],
            values=torch.from_numpy(rng.integers(0, ROWS, int(lengths.sum()))),
            lengths=torch.from_numpy(lengths),
        )
        dense = torch.from_numpy(rng.standard_normal((BATCH, 5)).astype(np.float32))
        labels = torch.from_numpy(rng.integers(0, 2, BATCH).astype(np.float32))
        out.append(Batch(dense_features=dense, sparse_features=kjt, labels=labels))
    return out


def make_model(device: str = "tpu") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    configs = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{i}"])
        for i in range(TABLES)
    ]
    dlrm = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(configs),
        dense_in_features=5,
        dense_arch_layer_sizes=[16, DIM],
        over_arch_layer_sizes=[16, 1],
    )
    model = sparse.from_torchrec(
        DLRMTrain(dlrm),
        optimizer=sparse.RowWiseAdagrad(learning_rate=0.05),
        capacities=sparse.Capacity(4 * BATCH * TABLES),
    ).to(device)
    optimizer = torch.optim.Adagrad([p for p in model.parameters() if p.requires_grad], lr=0.05)
    return model, optimizer


def plain_losses(model, optimizer, batches, device: str) -> list[float]:
    losses = []
    for b in batches:
        optimizer.zero_grad()
        loss, _ = model(Batch(b.dense_features.to(device), b.sparse_features, b.labels.to(device)))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def pipeline_losses(pipeline, batches) -> list[float]:
    it = iter(batches)
    losses = []
    while True:
        try:
            loss, logits, labels = pipeline.progress(it)
        except StopIteration:
            break
        assert logits.device.type == labels.device.type
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("mode", ["eager", "fused", "compiled"])
def test_pipeline_losses_equal_the_plain_loop(mode):
    batches = make_batches(4)
    execution = "fused" if mode == "compiled" else mode
    model, optimizer = make_model()
    with tpurec.mode(execution):
        expected = plain_losses(model, optimizer, batches, "tpu")
    model, optimizer = make_model()
    step_model = torch.compile(model, backend="tpu") if mode == "compiled" else model
    pipeline = sparse.TrainPipeline(step_model, optimizer, torch.device("tpu"))
    with tpurec.mode(execution):
        got = pipeline_losses(pipeline, batches)
    pipeline.close()
    # Same programs on the same inputs: identical, not just close.
    assert got == expected


def test_cpu_device_matches_too():
    batches = make_batches(3, seed=1)
    model, optimizer = make_model("cpu")
    expected = plain_losses(model, optimizer, batches, "cpu")
    model, optimizer = make_model("cpu")
    assert pipeline_losses(sparse.TrainPipeline(model, optimizer, "cpu"), batches) == expected


def test_is_a_torchrec_train_pipeline_driven_by_a_torchrec_loop():
    from torchrec.distributed.train_pipeline import TrainPipeline as TorchRecTrainPipeline
    from torchrec.distributed.train_pipeline.types import PipelineState

    batches = make_batches(3, seed=2)
    model, optimizer = make_model()
    expected = plain_losses(model, optimizer, batches, "tpu")
    model, optimizer = make_model()
    pipeline = sparse.TrainPipeline(model, optimizer, torch.device("tpu"))
    assert isinstance(pipeline, TorchRecTrainPipeline)
    assert pipeline._state is PipelineState.IDLE
    # TorchRec's training loop, as written for its own pipelines.
    it = iter(batches)
    got = []
    while True:
        try:
            loss, _, _ = pipeline.progress(it)
        except StopIteration:
            break
        assert pipeline._state is PipelineState.CALL_BWD  # the last phase reached, as TorchRec reports it
        got.append(loss.item())
    assert got == expected  # same programs on the same inputs: identical
    assert pipeline._state is PipelineState.IDLE
    with pytest.raises(StopIteration):  # exhausted stays exhausted
        pipeline.progress(it)
    # reset() drops what was prepared; a new iterator trains on.
    pipeline.reset()
    loss, _, _ = pipeline.progress(iter(make_batches(1, seed=3)))
    assert np.isfinite(loss.item())
    pipeline.close()


def test_a_failing_forward_leaves_torchrec_state_at_the_forward():
    from torchrec.distributed.train_pipeline.types import PipelineState

    model, optimizer = make_model()

    def fail(*_):
        raise RuntimeError("forward failed")

    handle = model.register_forward_pre_hook(fail)
    pipeline = sparse.TrainPipeline(model, optimizer, "tpu")
    with pytest.raises(RuntimeError, match="forward failed"):
        pipeline.progress(iter(make_batches(1)))
    assert pipeline._state is PipelineState.CALL_FWD
    handle.remove()
    pipeline.close()


class _Gate:
    """An iterator whose batch i+1 must be read while step i is still running."""

    def __init__(self, batches):
        self.batches = list(batches)
        self.read = [threading.Event() for _ in self.batches]
        self.i = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.i == len(self.batches):
            raise StopIteration
        self.read[self.i].set()
        self.i += 1
        return self.batches[self.i - 1]


def test_next_batch_is_read_and_preprocessed_while_the_step_runs():
    batches = make_batches(3, seed=2)
    gate = _Gate(batches)
    model, optimizer = make_model()
    ebc = next(m for m in model.modules() if isinstance(m, sparse.EmbeddingBagCollection))
    overlapped = []
    inner_forward = model.forward

    def forward(batch):
        step = len(overlapped)
        if step + 1 < len(batches):
            # Inside step i: batch i+1 gets read and its KJT preprocessed meanwhile.
            read = gate.read[step + 1].wait(timeout=30)
            deadline = threading.Event()
            for _ in range(300):
                if id(batches[step + 1].sparse_features) in ebc._prefetched:
                    break
                deadline.wait(0.1)
            overlapped.append(read and id(batches[step + 1].sparse_features) in ebc._prefetched)
        else:
            overlapped.append(True)
        return inner_forward(batch)

    model.forward = forward
    pipeline = sparse.TrainPipeline(model, optimizer, "tpu")
    assert len(pipeline_losses(pipeline, gate)) == 3
    assert overlapped == [True, True, True]
    assert not ebc._prefetched  # every prepared batch was used


def test_errors_of_the_iterator_surface_in_progress_and_bad_prefetch():
    model, optimizer = make_model()

    def broken():
        yield make_batches(1)[0]
        raise RuntimeError("disk on fire")

    pipeline = sparse.TrainPipeline(model, optimizer, "tpu")
    it = broken()
    pipeline.progress(it)
    with pytest.raises(RuntimeError, match="disk on fire"):
        pipeline.progress(it)
    with pytest.raises(StopIteration):
        pipeline.progress(it)
    with pytest.raises(ValueError, match="prefetch must be >= 1"):
        sparse.TrainPipeline(model, optimizer, "tpu", prefetch=0)


def test_workers_prepare_batches_side_by_side_and_steps_take_them_in_order():
    batches = make_batches(5, seed=3)
    model, optimizer = make_model()
    expected = plain_losses(model, optimizer, batches, "tpu")
    model, optimizer = make_model()
    ebc = next(m for m in model.modules() if isinstance(m, sparse.EmbeddingBagCollection))
    # The first two batches wait for each other inside prefetch: only two workers preparing
    # them at the same time get past the barrier (one worker would time out on it).
    both_preparing = threading.Barrier(2, timeout=30)
    inner_prefetch = ebc.prefetch

    def prefetch(features, batch=None):
        if any(features is b.sparse_features for b in batches[:2]):
            both_preparing.wait()
        inner_prefetch(features, batch)

    ebc.prefetch = prefetch
    pipeline = sparse.TrainPipeline(model, optimizer, "tpu", workers=3)
    assert pipeline_losses(pipeline, batches) == expected
    assert not both_preparing.broken
    pipeline.close()


def test_a_batch_that_fails_to_prepare_fails_its_own_step():
    batches = make_batches(3, seed=4)
    bad = batches[1].sparse_features
    batches[1] = Batch(
        batches[1].dense_features,
        KeyedJaggedTensor.from_lengths_sync(keys=bad.keys(), values=bad.values() + ROWS, lengths=bad.lengths()),
        batches[1].labels,
    )
    model, optimizer = make_model()
    pipeline = sparse.TrainPipeline(model, optimizer, "tpu", workers=2)
    it = iter(batches)
    pipeline.progress(it)  # step 0 runs; batch 1's ids are past its tables
    with pytest.raises(ValueError, match="id") as raised:
        pipeline.progress(it)
    assert "step 1" in "\n".join(getattr(raised.value, "__notes__", []))
    with pytest.raises(StopIteration):
        pipeline.progress(it)
    with pytest.raises(ValueError, match="workers must be >= 1"):
        sparse.TrainPipeline(model, optimizer, "tpu", workers=0)


def _run_bench(args: list[str], tmp_path) -> dict:
    import json
    import os
    import subprocess
    import sys

    from fresh_cache import fresh_cache

    cache = os.environ.get("TPUREC_CACHE_DIR") or str(fresh_cache(tmp_path / "cache"))
    env = {**os.environ, "TPUREC_CACHE_DIR": cache}
    done = subprocess.run(
        [sys.executable, "-m", "tpurec.bench", *args], capture_output=True, text=True, timeout=900, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.slow
def test_bench_dlrm_cli_pipeline_breakdown_and_plots(tmp_path):
    out = _run_bench(
        # Two warm-up steps: a torch.compile'd model in fused mode traces on its first call, and the
        # fused window holding the compiled graph first compiles on the second.
        [
            "dlrm",
            "--batch",
            "64",
            "--tables",
            "3",
            "--rows",
            "200",
            "--dim",
            "8",
            "--steps",
            "2",
            "--warmup",
            "2",
            "--modes",
            "fused",
            "compiled",
            "eager",
            "graphed",
            "graphed_k8",
            "--breakdown",
            "--plot",
            str(tmp_path / "plots"),
        ],
        tmp_path,
    )
    for mode in ("fused", "compiled", "eager", "graphed", "graphed_k8"):
        run = out[f"tpurec_{mode}"]
        # graphed: the step captured on its third call (the first timed one), then replayed
        assert run["pipeline"] is True and run["compilations_after_warmup"] == 0
        assert run["max_loss_difference"] < 1e-3  # same model, weights and batches as torchrec
        assert 0 < run["host_ms_per_step_stubbed"] < 60_000
        assert run["speedup_vs_plain_jax"] > 0
    # graphed_k8: 8 captured steps per launch (one call per round of 2 timed steps), the same losses
    # as graphed's single steps bit for bit.
    k8 = out["tpurec_graphed_k8"]
    assert k8["steps_per_call"] == 8 and k8["timed_steps"] == 8
    assert k8["losses_match_single_steps"] == {
        "reference": "tpurec_graphed",
        "steps_compared": 4,
        "equal": True,
        "max_abs_difference": 0.0,
        "first_differing_step": None,
    }
    # The plain-JAX peer of the same step (tpurec/bench/jax_peer.py) ran in the same run.
    assert out["plain_jax"]["step_ms"] > 0
    lookups = 64 * 3 * 4
    assert out["embedding_bound"]["bytes_per_step"] == lookups * 8 * 4 + lookups * (2 * 8 * 4 + 8)
    for side in ("torchrec_cpu", "tpurec_eager_synchronized"):
        phases = out["breakdown"][side]
        assert set(phases) == {
            "read",
            "preprocess",
            "transfer",
            "sparse_forward",
            "dense_forward_backward",
            "sparse_update",
            "dense_optimizer",
            "total",
        }
        assert all(v >= 0 for v in phases.values()) and phases["total"] > 0
    assert out["breakdown"]["tpurec_eager_synchronized"]["preprocess"] > 0
    for path in out["plots"]:
        assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_bench_embeddings_cli_sweep(tmp_path):
    out = _run_bench(
        [
            "embeddings",
            "--dims",
            "8",
            "16",
            "--ids-per-bag",
            "1",
            "3",
            "--tables",
            "2",
            "--rows",
            "100",
            "--batch",
            "16",
            "--iters",
            "1",
            "--skip-reference",
            "--plot",
            str(tmp_path / "plots"),
        ],
        tmp_path,
    )
    assert out["bandwidth_gb_s"] > 0 and out["bandwidth_source"] == "host memory copy"
    assert out["kernel"] == "native"  # XLA:CPU's own kernel
    assert [(r["dim"], r["ids_per_bag"]) for r in out["runs"]] == [(8, 1), (8, 3), (16, 1), (16, 3)]
    for run in out["runs"]:
        assert run["entries"] <= 2 * 16 * run["ids_per_bag"]
        for impl in ("native", "plain_jax", "fbgemm_tbe", "torchrec_ebc"):
            assert run[impl]["forward_ms"] > 0 and run[impl]["train_bandwidth_fraction"] >= 0
            assert run[impl]["forward_rows_gb_s"] > 0
    assert len(out["plots"]) == 2


@pytest.mark.slow
def test_bench_embeddings_times_the_tensorcore_kernel_and_its_variants(tmp_path, monkeypatch):
    # On a TPU without SparseCores the kernel is the TensorCore one; here it is forced (Pallas in
    # interpret mode), on a stacked table of 2 x 1100 rows: whole 2048-row blocks to stream.
    monkeypatch.setenv("TPUREC_SPARSE_KERNEL", "tensorcore")
    out = _run_bench(
        ["embeddings", "--dims", "8", "--ids-per-bag", "1", "--tables", "2", "--rows", "1100", "--batch-size", "64"]
        + ["--iters", "1", "--skip-reference"],
        tmp_path,
    )
    assert out["kernel"] == "tensorcore"
    (run,) = out["runs"]
    for impl in (
        "tensorcore",
        "tensorcore_two_pass",
        "tensorcore_mxu_row_sum",
        "tensorcore_xlu_row_slots",
        "plain_jax",
    ):
        assert run[impl]["forward_ms"] > 0 and run[impl]["train_step_ms"] > 0


def test_prefetched_batches_a_model_never_uses_do_not_pile_up():
    model, _ = make_model()
    ebc = next(m for m in model.modules() if isinstance(m, sparse.EmbeddingBagCollection))
    from tpurec.sparse.modules import _MAX_PREFETCHED

    batches = make_batches(_MAX_PREFETCHED + 4, seed=3)
    for b in batches:
        ebc.prefetch(b.sparse_features)
    assert len(ebc._prefetched) == _MAX_PREFETCHED  # the newest ones
    # The newest is still used by forward, and gives what preprocessing inline gives.
    newest = batches[-1].sparse_features
    with_prefetch = ebc(newest).values().cpu()
    assert id(newest) not in ebc._prefetched
    assert torch.equal(with_prefetch, ebc(newest).values().cpu())


def test_fused_mode_dispatches_one_program_per_step_without_reading_values():
    batches = make_batches(6, seed=4)
    model, optimizer = make_model()
    pipeline = sparse.TrainPipeline(model, optimizer, "tpu")
    it = iter(batches)
    outputs = []
    with tpurec.mode("fused"):
        for step in range(6):
            if step == 2:
                tpurec.reset_stats()
            outputs.append(pipeline.progress(it)[0])  # no value read inside the loop
        stats = tpurec.stats()
    assert stats["executions"] == 4 and stats["sync_points"] == {"step": 4}
    assert stats["compilations"] == 0
    model, optimizer = make_model()
    with tpurec.mode("fused"):
        expected = plain_losses(model, optimizer, batches, "tpu")
    assert [o.item() for o in outputs] == expected
