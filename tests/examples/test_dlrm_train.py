"""examples/dlrm/train.py: TorchRec parity, resume, data parsing, bad input, dlrm_main command lines."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from torchrec.optim import RowWiseAdagrad as TorchrecRowWiseAdagrad
from forked_runs import run_forked

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "dlrm", "train.py")

import tpurec  # noqa: E402,F401
from dlrm import checkpoint, data, flags, loop  # noqa: E402  (examples/ is on sys.path: pyproject.toml)
from dlrm import model as model_lib  # noqa: E402

SMALL = [
    "--num_embeddings_per_feature",
    "50,40,30,20",
    "--embedding_dim",
    "8",
    "--dense_arch_layer_sizes",
    "16,8",
    "--over_arch_layer_sizes",
    "16,1",
    "--batch_size",
    "32",
    "--dcn_num_layers",
    "2",
    "--dcn_low_rank_dim",
    "4",
    "--interaction_branch1_layer_sizes",
    "16,16",
    "--interaction_branch2_layer_sizes",
    "16,8",
    "--limit_val_batches",
    "2",
    "--limit_test_batches",
    "2",
]
# The MLPerf DLRM v2 (DCN) command line of TorchRec's dlrm_main README, scaled down:
# smaller tables, dims, batch and low-rank dim; every flag name and form as there.
MLPERF_DCN = (
    "--embedding_dim 16 --dense_arch_layer_sizes 32,16 --over_arch_layer_sizes 32,16,1 "
    "--in_memory_binary_criteo_path {path} "
    "--num_embeddings_per_feature 400,39,172,74,202,3,71,15,7,400,306,405,10,22,119,15,4,97,14,400,400,400,59,129,10,36 "
    "--validation_freq_within_epoch 3 --epochs 1 --pin_memory --mmap_mode --batch_size 32 "
    "--interaction_type=dcn --dcn_num_layers=3 --dcn_low_rank_dim=8 --adagrad --learning_rate 0.005 "
    "--multi_hot_distribution_type uniform --multi_hot_sizes=3,2,1,2,6,1,1,1,1,7,3,8,1,6,9,5,1,1,1,12,100,27,10,3,1,1"
)


def run_script(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, timeout=timeout, cwd=ROOT, env=env)
    # Decoded by hand: text mode would turn the progress bar's "\r" into new lines.
    return subprocess.CompletedProcess(out.args, out.returncode, out.stdout.decode(), out.stderr.decode())


def write_criteo_npy(
    directory: str, days: int = 2, rows: int = 100, table_rows: list[int] | None = None, seed: int = 0
) -> None:
    """day_N_{dense,sparse,labels}.npy as TorchRec's npy_preproc_criteo writes them."""
    rng = np.random.default_rng(seed)
    table_rows = table_rows or [50] * 26
    for day in range(days):
        np.save(os.path.join(directory, f"day_{day}_dense.npy"), rng.random((rows, 13), dtype=np.float32))
        ids = np.stack([rng.integers(0, n, rows) for n in table_rows], axis=1).astype(np.int64)
        np.save(os.path.join(directory, f"day_{day}_sparse.npy"), ids)
        np.save(os.path.join(directory, f"day_{day}_labels.npy"), rng.integers(0, 2, (rows, 1)).astype(np.int32))


# --- the first 20 steps match TorchRec on CPU with FBGEMM's fused optimizer --------------


FBGEMM_OPTIMIZERS = {  # --embedding_optimizer -> TorchRec's fused (FBGEMM) optimizer and its kwargs
    "sgd": (torch.optim.SGD, lambda cfg: {"lr": cfg.learning_rate}),
    "adagrad": (torch.optim.Adagrad, lambda cfg: {"lr": cfg.learning_rate, "eps": cfg.eps}),
    "rowwise_adagrad": (TorchrecRowWiseAdagrad, lambda cfg: {"lr": cfg.learning_rate, "eps": cfg.eps}),
}  # FBGEMM's CPU kernels have no Adam ("not supported in CPU mode"): --embedding_optimizer adam has no CPU peer


@pytest.mark.parametrize(
    "interaction,optimizer_flags",
    [
        ("original", ["--adagrad"]),
        ("dcn", ["--adagrad"]),
        ("projection", ["--adagrad"]),
        ("original", []),  # dlrm_main's default: SGD for both
        ("original", ["--adagrad", "--embedding_optimizer", "rowwise_adagrad"]),
        # the step captured on its third call and replayed (dense Adagrad with fused=True: the same arithmetic)
        ("original", ["--adagrad", "--embedding_optimizer", "rowwise_adagrad", "--mode", "graphed"]),
    ],
    ids=["original", "dcn", "projection", "original-sgd", "original-rowwise_adagrad", "original-graphed"],
)
def test_first_20_steps_match_torchrec_fbgemm(interaction, optimizer_flags):
    cfg = flags.parse_args(
        [
            *SMALL,
            "--interaction_type",
            interaction,
            "--learning_rate",
            "0.05",
            *optimizer_flags,
            "--limit_train_batches",
            "20",
        ]
    )
    ours = model_lib.build_model(cfg, "tpu")
    fused_type, fused_kwargs = FBGEMM_OPTIMIZERS[cfg.embedding_optimizer]
    reference = model_lib.build_torchrec_model(
        cfg,
        FusedEmbeddingBagCollection(
            model_lib.table_configs(cfg), optimizer_type=fused_type, optimizer_kwargs=fused_kwargs(cfg)
        ),
    )
    reference.load_state_dict({k: v.cpu() for k, v in ours.state_dict().items()})  # same init
    if cfg.adagrad:
        ref_optimizer = torch.optim.Adagrad(reference.parameters(), lr=cfg.learning_rate, eps=cfg.eps)
    else:
        ref_optimizer = torch.optim.SGD(reference.parameters(), lr=cfg.learning_rate)
    pipeline = loop.make_pipeline(ours, model_lib.dense_optimizer(cfg, ours), cfg, "tpu")
    batches = list(data.make_loaders(cfg)["train"].epoch_batches(0))
    ours_losses, ref_losses = [], []
    with tpurec.mode("fused" if cfg.mode == "graphed" else cfg.mode):
        stream = iter(batches)
        for _ in batches:  # the script's step: TrainPipeline over one iterator
            pipeline.progress(stream)
        ours_losses = [value for _, value in pipeline.losses(wait=True)]
        pipeline.close()
        for batch in batches:
            ref_optimizer.zero_grad()
            logits = reference(batch.dense_features, batch.sparse_features).squeeze(-1)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
            loss.backward()
            ref_optimizer.step()
            ref_losses.append(loss.item())
    assert len(ours_losses) == 20
    if cfg.mode == "graphed":  # it did capture and replay (a refused capture raises; other shapes run plainly)
        graph = pipeline.pipeline._graph
        assert graph is not None and graph.captured
    assert ref_losses[-1] < ref_losses[0]  # it trains
    np.testing.assert_allclose(ours_losses, ref_losses, rtol=1e-4, atol=0)
    # The tables moved identically too (so the fused optimizers agree, not only the losses).
    state = ours.state_dict()
    for key, value in reference.state_dict().items():
        if "embedding_bags" in key:
            torch.testing.assert_close(state[key].cpu(), value, rtol=0, atol=1e-4)


@pytest.mark.parametrize("mode", ["fused", "graphed"])
def test_two_devices_train_like_one(tmp_path, mode):
    """--num_devices 2 (tpurec.shard, per-device batch 16) == one device with batch 32; with --mode
    graphed the sharded step is captured on its third call and replayed."""
    assert torch.tpu.device_count() >= 2  # tests/conftest.py makes 8 host devices
    runs = []
    for extra in (["--batch_size", "32"], ["--batch_size", "16", "--num_devices", "2", "--mode", mode]):
        cfg = flags.parse_args([*SMALL, *extra, "--adagrad", "--learning_rate", "0.05", "--limit_train_batches", "10"])
        model = loop.place_model(model_lib.build_model(cfg, "tpu"), cfg)
        pipeline = loop.make_pipeline(model, model_lib.dense_optimizer(cfg, model), cfg, "tpu")
        loaders = data.make_loaders(cfg)
        with tpurec.mode("fused" if cfg.mode == "graphed" else cfg.mode):
            stream = loaders["train"].epoch_batches(0)
            for _ in range(10):
                pipeline.progress(stream)
            losses = [value for _, value in pipeline.losses(wait=True)]
            pipeline.close()
            if cfg.mode == "graphed":  # it did capture (a refused capture raises)
                assert pipeline.pipeline._graph is not None and pipeline.pipeline._graph.captured
            auc = loop.evaluate(model, model, loaders["test"], "tpu", "test").auc
        runs.append((losses, auc))
    (one, auc_one), (two, auc_two) = runs
    assert one[-1] < one[0]
    np.testing.assert_allclose(two, one, rtol=1e-4, atol=0)
    assert abs(auc_two - auc_one) < 1e-4


# --- resume: 10 steps, stop, 10 more == 20 steps ------------------------------------------


def _history(directory: str) -> dict:
    return torch.load(os.path.join(directory, checkpoint.FILE_NAME), weights_only=True)["extra"]["progress"]["history"]


@pytest.mark.slow
def test_two_devices_compiled_trains_like_fused():
    """--num_devices 2 --mode compile: the sharded model's dense part compiled, through the pipeline."""
    runs = {}
    for mode in ("fused", "compile"):
        cfg = flags.parse_args(
            [
                *SMALL,
                "--batch_size",
                "16",
                "--num_devices",
                "2",
                "--adagrad",
                "--learning_rate",
                "0.05",
                "--limit_train_batches",
                "6",
                "--mode",
                mode,
            ]
        )
        model = loop.place_model(model_lib.build_model(cfg, "tpu"), cfg)
        ebc = next(m for m in model.modules() if hasattr(m, "distribute_input"))
        route, threads = ebc._route, []
        ebc._route = lambda kjt: threads.append(threading.current_thread().name) or route(kjt)
        pipeline = loop.make_pipeline(model, model_lib.dense_optimizer(cfg, model), cfg, "tpu")
        with tpurec.mode("fused" if mode == "compile" else mode):
            stream = data.make_loaders(cfg)["train"].epoch_batches(0)
            for _ in range(6):
                pipeline.progress(stream)
            runs[mode] = [value for _, value in pipeline.losses(wait=True)]
            pipeline.close()
        # The sharded ids were routed on the pipeline's workers, ahead of their steps.
        assert all(name.startswith("tpurec-train-pipeline") for name in threads[:6]), threads
    assert runs["fused"][-1] < runs["fused"][0]
    np.testing.assert_allclose(runs["compile"], runs["fused"], rtol=1e-5, atol=0)


@pytest.mark.parametrize("source", ["synthetic", "criteo_npy_shuffled", "criteo_npy_shuffled_graphed_k4"])
def test_resume_10_plus_10_equals_20(tmp_path, source):
    common = [
        *SMALL,
        "--adagrad",
        "--learning_rate",
        "0.05",
        "--embedding_optimizer",
        "rowwise_adagrad",
        "--loss_every",
        "3",
        "--validation_freq_within_epoch",
        "4",
    ]
    if source.startswith("criteo_npy_shuffled"):
        # TorchRec's reader shuffles each batch with numpy's global generator: the
        # checkpoint must carry that state from before the first unread batch (with
        # --steps_per_call 4 the pipeline reads further ahead, up to a launch's batches).
        write_criteo_npy(str(tmp_path), days=3, rows=400, table_rows=[20] * 26)
        common[1] = ",".join(["20"] * 26)  # --num_embeddings_per_feature: 26 Criteo features
        common += ["--in_memory_binary_criteo_path", str(tmp_path), "--shuffle_batches"]
    if source.endswith("graphed_k4"):
        common += ["--mode", "graphed", "--steps_per_call", "4"]
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    for args in (
        ["--limit_train_batches", "20", "--checkpoint_dir", straight],
        ["--limit_train_batches", "10", "--checkpoint_dir", split],
        ["--limit_train_batches", "20", "--checkpoint_dir", split, "--resume"],
    ):
        out = run_script(*common, *args)
        assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from" in out.stdout
    # The tables' optimizer state is loaded with them: no warning that it restarts from zero.
    assert "restarts from zero" not in out.stderr, out.stderr[-3000:]
    a, b = _history(straight)["losses"], _history(split)["losses"]
    assert len(a) == len(b) == 20
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)
    wa = torch.load(os.path.join(straight, checkpoint.FILE_NAME), weights_only=False)
    wb = torch.load(os.path.join(split, checkpoint.FILE_NAME), weights_only=False)
    for key, value in wa["model"].items():
        torch.testing.assert_close(wb["model"][key], value, rtol=0, atol=1e-6)
    assert [v["step"] for v in _history(split)["val"]] == [4, 8, 10, 12, 16, 20]
    slots_a = wa["embedding_optimizers"]["sparse_arch.embedding_bag_collection"]
    slots_b = wb["embedding_optimizers"]["sparse_arch.embedding_bag_collection"]
    assert slots_a["steps"] == slots_b["steps"] == [20]
    for table, slots in slots_a["state"].items():
        torch.testing.assert_close(slots_b["state"][table]["momentum1"], slots["momentum1"], rtol=0, atol=1e-6)


def _sharded_checkpoint(directory: str) -> tuple[dict, dict]:
    """(state.pt's contents, the Orbax tree of tables/slots/steps/dense parameters as numpy) of the newest sharded checkpoint."""
    import orbax.checkpoint as ocp

    path = checkpoint.sharded_path(directory)
    assert path is not None and os.path.isdir(path)
    state = torch.load(os.path.join(path, checkpoint.SHARDED_STATE), weights_only=False)
    with ocp.StandardCheckpointer() as reader:
        tree = reader.restore(os.path.join(path, checkpoint.SHARDED_TABLES))
    return state, tree


@pytest.mark.slow
def test_two_devices_resume_10_plus_10_equals_20(tmp_path):
    """--num_devices 2: 10 steps, a sharded checkpoint, resume, 10 more == 20 steps straight."""
    common = [
        *SMALL,
        "--batch_size",
        "16",
        "--num_devices",
        "2",
        "--adagrad",
        "--learning_rate",
        "0.05",
        "--embedding_optimizer",
        "rowwise_adagrad",
        "--loss_every",
        "3",
        "--validation_freq_within_epoch",
        "4",
    ]
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    for args in (
        ["--limit_train_batches", "20", "--checkpoint_dir", straight],
        ["--limit_train_batches", "10", "--checkpoint_dir", split],
        ["--limit_train_batches", "20", "--checkpoint_dir", split, "--resume"],
    ):
        out = run_script(*common, *args)
        assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from" in out.stdout
    (state_a, tree_a), (state_b, tree_b) = _sharded_checkpoint(straight), _sharded_checkpoint(split)
    a, b = state_a["progress"]["history"]["losses"], state_b["progress"]["history"]["losses"]
    assert len(a) == len(b) == 20
    assert a[-1] < a[0]
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-6)
    assert [v["step"] for v in state_b["progress"]["history"]["val"]] == [4, 8, 10, 12, 16, 20]
    # Tables, row-wise Adagrad slots, step counts and dense parameters end equal.
    (collection,) = tree_a["embeddings"]
    assert int(tree_a["embeddings"][collection]["step"]) == int(tree_b["embeddings"][collection]["step"]) == 20
    for table, entries in tree_a["embeddings"][collection]["tables"].items():
        assert set(entries) == {"weight", "momentum1"}
        for key, value in entries.items():
            np.testing.assert_allclose(tree_b["embeddings"][collection]["tables"][table][key], value, rtol=0, atol=1e-6)
    for key, value in tree_a["dense"].items():
        np.testing.assert_allclose(tree_b["dense"][key], value, rtol=0, atol=1e-6)
    # The dense Adagrad state too, and only the newest checkpoint is kept.
    for param, slots in state_a["dense_optimizer"]["state"].items():
        torch.testing.assert_close(state_b["dense_optimizer"]["state"][param]["sum"], slots["sum"], rtol=0, atol=1e-6)
    assert len([n for n in os.listdir(split) if n.startswith(checkpoint.SHARDED_PREFIX)]) == 1


def test_checkpoint_is_written_atomically(tmp_path, monkeypatch):
    cfg = flags.parse_args([*SMALL, "--adagrad"])
    model = model_lib.build_model(cfg, "tpu")
    optimizer = model_lib.dense_optimizer(cfg, model)
    path = checkpoint.save(str(tmp_path), model, optimizer, {"epoch": 0})
    before = open(path, "rb").read()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.torch, "save", crash)
    with pytest.raises(OSError):
        checkpoint.save(str(tmp_path), model, optimizer, {"epoch": 1})
    assert open(path, "rb").read() == before  # the old checkpoint is intact
    restored = checkpoint.load(str(tmp_path), model, optimizer)
    assert restored["progress"] == {"epoch": 0}


def test_resume_into_another_model_names_the_first_difference(tmp_path):
    cfg = flags.parse_args([*SMALL, "--adagrad"])
    model = model_lib.build_model(cfg, "tpu")
    checkpoint.save(str(tmp_path), model, model_lib.dense_optimizer(cfg, model), {"epoch": 0})
    other_cfg = flags.parse_args([*SMALL, "--adagrad", "--num_embeddings_per_feature", "50,40,30,21"])
    other = model_lib.build_model(other_cfg, "tpu")
    with pytest.raises(flags.ConfigError) as error:
        checkpoint.load(str(tmp_path), other, model_lib.dense_optimizer(other_cfg, other))
    message = str(error.value)
    assert message.startswith(f"--resume: checkpoint {tmp_path / checkpoint.FILE_NAME} does not fit"), message
    assert "embedding_bags.t_cat_3.weight has shape (20, 8), the model's is (21, 8)" in message, message
    assert "\n" not in message
    # As a user meets it: train.py --resume with the other tables exits 2 with that one line.
    out = run_script(*[a if a != "50,40,30,20" else "50,40,30,21" for a in SMALL], "--adagrad",
                     "--checkpoint_dir", str(tmp_path), "--resume")  # fmt: skip
    shown = [line.rsplit("\r", 1)[-1].strip() for line in out.stderr.split("\n")]
    assert out.returncode == 2 and [line for line in shown if line] == [f"train.py: error: {message}"], out.stderr


def test_sharded_checkpoint_is_written_atomically(tmp_path, monkeypatch):
    """A save that crashes inside the sharded write leaves the previous checkpoint the one --resume reads."""
    from tpurec.sparse.checkpoint import sharded

    cfg = flags.parse_args([*SMALL, "--adagrad", "--num_devices", "2", "--batch_size", "16"])
    model = loop.place_model(model_lib.build_model(cfg, "tpu"), cfg)
    optimizer = model_lib.dense_optimizer(cfg, model)
    first = checkpoint.save(str(tmp_path), model, optimizer, {"epoch": 0})
    pointer = open(tmp_path / checkpoint.SHARDED_POINTER).read()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(sharded, "save", crash)
    with pytest.raises(OSError):
        checkpoint.save(str(tmp_path), model, optimizer, {"epoch": 1})
    assert open(tmp_path / checkpoint.SHARDED_POINTER).read() == pointer
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(first), checkpoint.SHARDED_POINTER])  # no leftovers
    restored = checkpoint.load(str(tmp_path), model, optimizer)
    assert restored["progress"] == {"epoch": 0}


# --- data parsing on generated files -------------------------------------------------------


def test_in_memory_npy_batches_hold_the_file_rows(tmp_path):
    write_criteo_npy(str(tmp_path), days=3, rows=10)
    cfg = flags.parse_args(
        ["--in_memory_binary_criteo_path", str(tmp_path), "--batch_size", "4", "--num_embeddings", "50"]
    )
    loaders = data.make_loaders(cfg)
    train = list(loaders["train"].epoch_batches(0))
    assert [b.labels.shape[0] for b in train] == [4, 4, 4, 4, 4]  # days 0-1: 20 rows
    dense = np.concatenate([np.load(tmp_path / f"day_{d}_dense.npy") for d in (0, 1)])
    sparse = np.concatenate([np.load(tmp_path / f"day_{d}_sparse.npy") for d in (0, 1)])
    labels = np.concatenate([np.load(tmp_path / f"day_{d}_labels.npy") for d in (0, 1)]).reshape(-1)
    np.testing.assert_array_equal(torch.cat([b.dense_features for b in train]).numpy(), dense)
    np.testing.assert_array_equal(torch.cat([b.labels for b in train]).numpy(), labels.astype(np.float32))
    first = train[0].sparse_features
    for k in range(26):
        np.testing.assert_array_equal(first[f"cat_{k}"].values().numpy(), sparse[:4, k])
    # The last day: first half validation, second half test.
    last = np.load(tmp_path / "day_2_dense.npy")
    val = torch.cat([b.dense_features for b in loaders["val"].epoch_batches(0)]).numpy()
    test = torch.cat([b.dense_features for b in loaders["test"].epoch_batches(0)]).numpy()
    np.testing.assert_array_equal(val, last[:5])
    np.testing.assert_array_equal(test, last[5:])


def _tsv_line(label: int, dense: list[int | str], cats: list[str]) -> str:
    return "\t".join([str(label), *map(str, dense), *cats]) + "\n"


def test_criteo_tsv_is_parsed_like_torchrec(tmp_path):
    rng = np.random.default_rng(0)
    files = []
    for day in range(2):
        rows = []
        for i in range(6):
            dense = [int(x) for x in rng.integers(-1, 50, 13)]
            dense[3] = ""  # missing values read as 0
            cats = [format(int(x), "08x") for x in rng.integers(0, 2**32, 26)]
            cats[5] = ""
            rows.append((i % 2, dense, cats))
        path = tmp_path / f"day_{day}"
        path.write_text("".join(_tsv_line(*r) for r in rows))
        files.append(rows)
    cfg = flags.parse_args(["--tsv_criteo_path", str(tmp_path), "--batch_size", "6", "--num_embeddings", "97"])
    batch = next(data.make_loaders(cfg)["train"].epoch_batches(0))
    rows = files[0]
    raw_dense = np.array([[0 if v == "" else v for v in r[1]] for r in rows], dtype=np.int64)
    # TorchRec's tsv_to_npys: shift so the minimum is 2, then log.
    expected_dense = np.log((raw_dense - raw_dense.min() + 2).astype(np.float32))
    np.testing.assert_allclose(batch.dense_features.numpy(), expected_dense, rtol=1e-6)
    np.testing.assert_array_equal(batch.labels.numpy(), [r[0] for r in rows])
    for k in range(26):
        ids = [int(r[2][k] or "0", 16) % 97 for r in rows]  # raw hashes modulo the table size
        np.testing.assert_array_equal(batch.sparse_features[f"cat_{k}"].values().numpy(), ids)


def test_mlperf_multi_hot_npz_is_read(tmp_path):
    rng = np.random.default_rng(1)
    sizes = [1 + k % 3 for k in range(26)]
    for day in range(2):
        np.save(tmp_path / f"day_{day}_dense.npy", rng.random((8, 13), dtype=np.float32))
        np.save(tmp_path / f"day_{day}_labels.npy", rng.integers(0, 2, (8, 1)).astype(np.int32))
        columns = {f"{k}.npy": rng.integers(0, 30, (8, s)).astype(np.int32) for k, s in enumerate(sizes)}
        np.savez(tmp_path / f"day_{day}_sparse_multi_hot.npz", **columns)
        if day == 0:
            day0 = columns
    cfg = flags.parse_args(
        ["--synthetic_multi_hot_criteo_path", str(tmp_path), "--batch_size", "8", "--num_embeddings", "30"]
    )
    batch = next(data.make_loaders(cfg)["train"].epoch_batches(0))
    for k, s in enumerate(sizes):
        jt = batch.sparse_features[f"cat_{k}"]
        assert jt.lengths().tolist() == [s] * 8
        np.testing.assert_array_equal(jt.values().numpy(), day0[f"{k}.npy"].reshape(-1))


@pytest.mark.parametrize("distribution", ["uniform", "pareto"])
def test_multi_hot_bags_start_with_the_id_and_stay_in_the_table(distribution):
    multi_hot = data.MultiHot([4, 1], [1000, 7], distribution)
    ids = np.array([0, 5, 999, 5])
    bags = multi_hot.expand(0, ids)
    assert bags.shape == (4, 4)
    np.testing.assert_array_equal(bags[:, 0], ids)
    np.testing.assert_array_equal(bags[1], bags[3])  # a fixed function of the id
    assert bags.min() >= 0 and bags.max() < 1000
    assert multi_hot.expand(1, np.array([3])).tolist() == [[3]]
    many = multi_hot.expand(0, np.arange(20000) % 1000)[:, 1:].reshape(-1)
    # The extra ids follow TorchRec's draws: numpy's pareto(0.25) as int32 modulo the table, or uniform.
    rng = np.random.default_rng(0)
    if distribution == "pareto":
        reference = np.minimum(rng.pareto(0.25, many.size), 2**31 - 1).astype(np.int64) % 1000
    else:
        reference = rng.integers(0, 1000, many.size)
    for bound in (1, 10, 100, 500):
        assert abs(np.mean(many < bound) - np.mean(reference < bound)) < 0.02, bound


# --- bad input: one line, exit status 2 ----------------------------------------------------


def _bad_npy_dir(tmp_path, kind: str) -> str:
    d = tmp_path / kind
    d.mkdir()
    write_criteo_npy(str(d), rows=20, table_rows=[50] * 26)
    if kind == "malformed":
        (d / "day_1_sparse.npy").write_bytes(b"this is not an npy file")
    if kind == "big_ids":
        sparse = np.load(d / "day_0_sparse.npy")
        sparse[7, 3] = 50  # the table of cat_3 has 50 rows
        np.save(d / "day_0_sparse.npy", sparse)
    return str(d)


BAD_INPUTS = {
    "missing_data": (
        lambda tmp: ["--in_memory_binary_criteo_path", os.path.join(tmp, "nowhere")],
        "is not a directory",
    ),
    "missing_file": (
        lambda tmp: ["--tsv_criteo_path", os.path.join(tmp, "day_0") + "," + os.path.join(tmp, "day_1")],
        "missing data file",
    ),
    "malformed_npy": (lambda tmp: ["--in_memory_binary_criteo_path", "@malformed"], "cannot read"),
    "malformed_tsv": (lambda tmp: ["--tsv_criteo_path", "@tsv"], "line 2: 3 tab separated fields"),
    "ids_beyond_table": (
        lambda tmp: ["--in_memory_binary_criteo_path", "@big_ids"],
        "feature cat_3 has id 50, outside its table of 50 rows",
    ),
    "dense_arch_not_embedding_dim": (
        lambda tmp: ["--dense_arch_layer_sizes", "16,12"],
        "must equal --embedding_dim (8)",
    ),
    "unknown_interaction": (
        lambda tmp: ["--interaction_type", "transformer"],
        "unknown --interaction_type 'transformer'",
    ),
    "more_devices_than_visible": (lambda tmp: ["--num_devices", "64"], "--num_devices 64 but only"),
    "graphed_with_dmp": (
        lambda tmp: ["--dist", "dmp", "--mode", "graphed"],
        "--mode graphed captures the step of a model on one device or sharded by tpurec.shard",
    ),
    "steps_per_call_without_graphed": (
        lambda tmp: ["--steps_per_call", "4"],
        "--steps_per_call 4 runs several captured steps in one program: it needs --mode graphed",
    ),
    "steps_per_call_on_two_devices": (
        lambda tmp: ["--steps_per_call", "4", "--mode", "graphed", "--num_devices", "2"],
        "--steps_per_call 4 runs on one device",
    ),
    "resume_without_sharded_checkpoint": (
        lambda tmp: ["--num_devices", "2", "--checkpoint_dir", tmp, "--resume"],
        "no sharded checkpoint (sharded.json)",
    ),
}


BAD_INPUT_BASE = [
    "--embedding_dim",
    "8",
    "--dense_arch_layer_sizes",
    "16,8",
    "--over_arch_layer_sizes",
    "8,1",
    "--batch_size",
    "8",
    "--num_embeddings",
    "50",
    "--limit_train_batches",
    "2",
    "--limit_val_batches",
    "1",
    "--limit_test_batches",
    "1",
]


@pytest.fixture(scope="module")
def bad_input_runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Every BAD_INPUTS command line run through train.py's main() in a process of its own, forked from one
    that imported the script once (tests/forked_runs.py)."""
    command_lines = {}
    for case, (make_args, _) in BAD_INPUTS.items():
        tmp_path = tmp_path_factory.mktemp(case)
        args = make_args(str(tmp_path))
        if args[-1] == "@tsv":
            for day in range(2):
                (tmp_path / f"day_{day}").write_text(_tsv_line(1, [1] * 13, ["ab"] * 26) + "1\t2\t3\n")
            args[-1] = str(tmp_path)
        elif args[-1].startswith("@"):
            args[-1] = _bad_npy_dir(tmp_path, args[-1][1:])
        command_lines[case] = [*BAD_INPUT_BASE, *args]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return dict(zip(command_lines, run_forked(SCRIPT, list(command_lines.values()), env)))


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_exits_2_with_one_line(case, bad_input_runs):
    _, expected = BAD_INPUTS[case]
    out = bad_input_runs[case]
    # What a terminal shows: a progress bar rewrites its line with "\r" and is cleared on error.
    shown = [line.rsplit("\r", 1)[-1].strip() for line in out.stderr.split("\n")]
    lines = [line for line in shown if line]
    assert out.returncode == 2, out.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("train.py: error:"), out.stderr[-3000:]
    assert expected in lines[0], lines[0]


def _train_losses(path) -> list[float]:
    """The per-step training losses of a --metrics_file, in step order (steps 1, 2, ... checked)."""
    records = [json.loads(line) for line in open(path)]
    train = [r for r in records if r["stage"] == "train"]
    assert [r["step"] for r in train] == list(range(1, len(train) + 1))
    return [r["loss"] for r in train]


def test_graphed_mode_and_steps_per_call_train_as_fused_mode_through_the_command_line(tmp_path):
    # The captured step replayed from the third step on, with validation and checkpoints around it:
    # the same losses, AUC and entropy as fused mode (dense Adagrad with fused=True: the same arithmetic).
    # With --steps_per_call 4, steps 6-9 run in one launch (between the validation after step 5 and
    # the one after step 10): every step's loss equal bit for bit, validations at the same steps.
    args = [
        *SMALL,
        "--adagrad",
        "--learning_rate",
        "0.05",
        "--limit_train_batches",
        "12",
        "--validation_freq_within_epoch",
        "5",
    ]
    summaries, losses = {}, {}
    for name, extra in (
        ("fused", ["--mode", "fused"]),
        ("graphed", ["--mode", "graphed"]),
        ("graphed_k4", ["--mode", "graphed", "--steps_per_call", "4", "--checkpoint_dir", str(tmp_path / "k4")]),
    ):
        metrics = tmp_path / f"{name}.jsonl"
        out = run_script(*args, *extra, "--metrics_file", str(metrics))
        assert out.returncode == 0, out.stderr[-3000:]
        summary = out.stdout.strip().splitlines()[-1]
        if name == "graphed_k4":
            assert summary.endswith("; 4 of 12 steps in 1 launches of up to 4 steps"), summary
            summary = summary.rsplit("; 4 of 12", 1)[0]
        summaries[name] = (re.sub(r"[\d,]+ samples/s", "", summary), re.findall(r"AUROC over val set: .+", out.stdout))
        losses[name] = _train_losses(metrics)
    assert summaries["graphed"] == summaries["fused"]
    assert summaries["graphed_k4"] == summaries["graphed"]
    assert "12 steps" in summaries["fused"][0] and len(summaries["fused"][1]) == 3  # at steps 5, 10 and the end
    assert "(epoch 0, step 5)" in summaries["graphed_k4"][1][0] and "step 10" in summaries["graphed_k4"][1][1]
    assert len(losses["fused"]) == 12
    assert losses["graphed"] == losses["fused"]
    assert losses["graphed_k4"] == losses["graphed"]
    assert _history(str(tmp_path / "k4"))["losses"] == losses["graphed_k4"]  # the checkpoint's history


def _reference_losses(args: list[str]) -> list[float]:
    """The script's model and data, trained here by a plain loop that reads every loss at once (eager mode)."""
    cfg = flags.parse_args(args)
    model = model_lib.build_model(cfg, "tpu")
    optimizer = model_lib.dense_optimizer(cfg, model)
    step = loop.TrainStep(model, model)
    losses = []
    for batch in data.make_loaders(cfg)["train"].epoch_batches(0):
        optimizer.zero_grad()
        loss, _ = step(type(batch)(batch.dense_features.to("tpu"), batch.sparse_features, batch.labels.to("tpu")))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "mode", [["--mode", "fused"], ["--mode", "graphed", "--steps_per_call", "3"]], ids=["fused", "graphed_k3"]
)
def test_a_nan_loss_stops_the_run_naming_its_step(tmp_path, mode):
    """SGD at learning rate 30 diverges: the script stops at the first loss that is not finite, names
    its step (read one call behind; with --steps_per_call 3 inside a launch of steps 7-9), keeps the
    losses before it, and exits with status 1 and one line."""
    args = [*SMALL, "--learning_rate", "30", "--limit_train_batches", "12"]
    reference = _reference_losses(args)
    bad = next(i for i, value in enumerate(reference) if not np.isfinite(value))
    assert 4 <= bad < 11, reference  # past the plain steps and the capture, before the end
    metrics = tmp_path / "metrics.jsonl"
    out = run_script(*args, *mode, "--metrics_file", str(metrics))
    shown = [line.rsplit("\r", 1)[-1].strip() for line in out.stderr.split("\n")]
    lines = [line for line in shown if line]
    assert out.returncode == 1, out.stderr[-3000:]
    assert len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith(f"train.py: error: the training loss of step {bad + 1} is nan"), lines[0]
    got = _train_losses(metrics)
    assert len(got) == bad
    np.testing.assert_allclose(got, reference[:bad], rtol=1e-3)  # diverging: float32 rounding grows with the loss


def test_unknown_flag_is_argparse_error():
    out = run_script("--no_such_flag")
    assert out.returncode == 2 and "unrecognized arguments: --no_such_flag" in out.stderr


# --- TorchRec command lines run unchanged ----------------------------------------------------


@pytest.mark.slow
def test_dlrm_main_readme_dcn_command_line_runs_and_prints_auc(tmp_path):
    rows = [int(x) for x in re.search(r"--num_embeddings_per_feature (\S+)", MLPERF_DCN).group(1).split(",")]
    write_criteo_npy(str(tmp_path), days=3, rows=64, table_rows=rows)
    out = run_script(*MLPERF_DCN.format(path=tmp_path).split())
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"AUROC over val set: \d\.\d+", out.stdout), out.stdout
    assert re.search(r"AUROC over test set: \d\.\d+", out.stdout), out.stdout


@pytest.mark.slow
def test_profile_dir_writes_torch_and_xla_traces(tmp_path):
    import json

    out = run_script(*SMALL, "--adagrad", "--learning_rate", "0.05", "--profile_dir", str(tmp_path / "trace"))
    assert out.returncode == 0, out.stderr[-3000:]
    events = json.loads((tmp_path / "trace" / "torch_trace.json").read_text())["traceEvents"]
    assert events
    assert list((tmp_path / "trace" / "plugins" / "profile").rglob("*.xplane.pb"))


def _make_train_command() -> list[str]:
    """The command `make train` runs (from `make -n`), with this interpreter."""
    text = subprocess.run(["make", "-s", "-n", "train"], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    line = [ln for ln in text.replace("\\\n", " ").splitlines() if "examples/dlrm/train.py" in ln][-1]
    return line.split()[1:]


@pytest.mark.slow
def test_make_train_reaches_auc_075_within_3_minutes(tmp_path):
    command = _make_train_command()
    start = time.perf_counter()
    out = run_script(*command[1:], "--plot", str(tmp_path / "curves.png"))
    elapsed = time.perf_counter() - start
    assert out.returncode == 0, out.stderr[-3000:]
    auc = float(re.search(r"held-out AUC (\d\.\d+)", out.stdout).group(1))
    assert auc > 0.75, out.stdout
    assert elapsed < 180, elapsed
    assert re.search(r"\b0 compilations after warm-up", out.stdout), out.stdout
    assert "Epoch 0: 100%" in out.stderr  # the tqdm bar
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_print_sharding_plan_lists_every_table(capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("dlrm_train_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    cfg = flags.parse_args([*SMALL, "--print_sharding_plan", "--topology", "v5p-8"])
    script.print_sharding_plan(cfg)
    text = capsys.readouterr().out
    assert "v5p-8" in text
    assert "optimizer sgd" in text  # the run's embedding optimizer (SGD without --adagrad), not the planner's default
    for name, rows in zip(cfg.feature_names, cfg.table_rows):
        assert re.search(rf"t_{name}\s+{rows}\s+8\b", text), text
    with pytest.raises(flags.ConfigError, match="--print_sharding_plan"):
        script.print_sharding_plan(flags.parse_args([*SMALL, "--topology", "not-a-tpu"]))
    # Without --topology: the run's chip with --num_devices of them (a v5e here, as if on one).
    import tpurec.sparse.sharding.model as model_module

    v5e = type("Device", (), {"device_kind": "TPU v5 lite", "platform": "tpu"})()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_module.jax, "devices", lambda *a: [v5e])
        script.print_sharding_plan(flags.parse_args([*SMALL, "--print_sharding_plan"]))
    text = capsys.readouterr().out
    assert "v5e-1" in text and "v5p" not in text
