"""Every flag of TorchRec's dlrm_main.py: train.py runs it with its meaning or exits 2 naming it.

The flags are those of ``torchrec_dlrm/dlrm_main.py`` (facebookresearch/dlrm, the DLRM example
TorchRec's documentation points to). The learning-rate schedule is checked against a copy of
its ``LRPolicyScheduler`` (dlrm_main_lr_scheduler.py), alone and driving TorchRec's FBGEMM
fused optimizer the way dlrm_main does.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from dlrm_main_lr_scheduler import LRPolicyScheduler
from forked_runs import run_forked
from test_dlrm_train import ROOT, SCRIPT, SMALL, write_criteo_npy
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

import tpurec
from dlrm import data, flags, loop, lr_schedule
from dlrm import model as model_lib

# dlrm_main.py's parse_args, in its order.
DLRM_MAIN_FLAGS = [
    "--epochs", "--batch_size", "--drop_last_training_batch", "--test_batch_size", "--limit_train_batches",
    "--limit_val_batches", "--limit_test_batches", "--dataset_name", "--num_embeddings",
    "--num_embeddings_per_feature", "--dense_arch_layer_sizes", "--over_arch_layer_sizes", "--embedding_dim",
    "--interaction_branch1_layer_sizes", "--interaction_branch2_layer_sizes", "--dcn_num_layers",
    "--dcn_low_rank_dim", "--undersampling_rate", "--seed", "--pin_memory", "--mmap_mode",
    "--in_memory_binary_criteo_path", "--synthetic_multi_hot_criteo_path", "--learning_rate", "--eps",
    "--shuffle_batches", "--shuffle_training_set", "--validation_freq_within_epoch", "--adagrad",
    "--interaction_type", "--collect_multi_hot_freqs_stats", "--multi_hot_sizes", "--multi_hot_distribution_type",
    "--lr_warmup_steps", "--lr_decay_start", "--lr_decay_steps", "--print_lr", "--allow_tf32",
    "--print_sharding_plan",
]  # fmt: skip
# The flags this script refuses (exit 2), with a command line that uses each and what the message says.
REFUSED = {
    "--undersampling_rate": (["--undersampling_rate", "0.3"], "never applies it"),
    "--dataset_name": (
        ["--dataset_name", "criteo_kaggle", "--in_memory_binary_criteo_path", "@npy"],
        "--dataset_name criteo_kaggle is not supported with a data path",
    ),
}


def _reference_lrs(base: float, w: int, d: int, n: int, steps: int) -> list[float] | str:
    """The learning rate TorchRec's scheduler gives each training step, or why it fails."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base)
    try:
        scheduler = LRPolicyScheduler(optimizer, w, d, n)
        lrs = []
        for _ in range(steps):
            lrs.append(optimizer.param_groups[0]["lr"])
            scheduler.step()
    except SystemExit as e:
        return f"exit: {e}"
    except AttributeError as e:
        return f"raises: {e}"
    return lrs


SCHEDULES = [(w, d, n) for w, d, n in itertools.product(range(5), range(6), range(5))] + [
    (10, 20, 30),
    (8, 8, 40),
    (0, 0, 100),
    (50, 60, 5),
]


@pytest.mark.parametrize("base", [15.0, 0.05])
def test_lr_policy_matches_torchrecs_scheduler_step_by_step(base):
    steps = 120
    for w, d, n in SCHEDULES:
        policy = lr_schedule.LRPolicy(base, w, d, n)
        reference = _reference_lrs(base, w, d, n, steps)
        problem = lr_schedule.check(policy)
        if isinstance(reference, str):  # TorchRec's refuses or fails: so does the script, at parse time
            assert problem is not None, (w, d, n, reference)
            continue
        assert problem is None, (w, d, n, problem)
        assert [policy.at_step(s) for s in range(steps)] == reference, (w, d, n)


def test_lr_schedule_trains_like_torchrec_fbgemm_under_dlrm_mains_scheduler():
    # dlrm_main: the fused tables' optimizer (FBGEMM) and the dense one combined, one scheduler over
    # both, stepped after each training step. The losses and tables of 20 steps match.
    w, d, n = 4, 8, 10
    cfg = flags.parse_args(
        [*SMALL, "--adagrad", "--learning_rate", "0.05", "--limit_train_batches", "20",
         "--lr_warmup_steps", str(w), "--lr_decay_start", str(d), "--lr_decay_steps", str(n)]
    )  # fmt: skip
    ours = model_lib.build_model(cfg, "tpu")
    reference = model_lib.build_torchrec_model(
        cfg,
        FusedEmbeddingBagCollection(
            model_lib.table_configs(cfg), optimizer_type=torch.optim.Adagrad,
            optimizer_kwargs={"lr": cfg.learning_rate, "eps": cfg.eps},
        ),
    )  # fmt: skip
    reference.load_state_dict({k: v.cpu() for k, v in ours.state_dict().items()})
    fused = reference.sparse_arch.embedding_bag_collection.fused_optimizer()
    dense = KeyedOptimizerWrapper(
        {k: p for k, p in reference.named_parameters() if "embedding_bags" not in k},
        lambda params: torch.optim.Adagrad(params, lr=cfg.learning_rate, eps=cfg.eps),
    )
    ref_optimizer = CombinedOptimizer([fused, dense])
    scheduler = LRPolicyScheduler(ref_optimizer, w, d, n)
    dense_optimizer = model_lib.dense_optimizer(cfg, ours)
    pipeline = loop.make_pipeline(ours, dense_optimizer, cfg, "tpu")
    tables = loop.embedding_optimizers(ours)
    batches = list(data.make_loaders(cfg)["train"].epoch_batches(0))
    ours_losses, ref_losses = [], []
    with tpurec.mode(cfg.mode):
        stream = iter(batches)
        for step in range(len(batches)):  # the script's step
            loop.set_learning_rate(tables, dense_optimizer, cfg.lr_policy.at_step(step))
            pipeline.progress(stream)
        ours_losses = [value for _, value in pipeline.losses(wait=True)]
        pipeline.close()
        for batch in batches:
            ref_optimizer.zero_grad()
            logits = reference(batch.dense_features, batch.sparse_features).squeeze(-1)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
            loss.backward()
            ref_optimizer.step()
            scheduler.step()
            ref_losses.append(loss.item())
    np.testing.assert_allclose(ours_losses, ref_losses, rtol=1e-4, atol=0)
    state = ours.state_dict()
    for key, value in reference.state_dict().items():
        if "embedding_bags" in key:
            torch.testing.assert_close(state[key].cpu(), value, rtol=0, atol=1e-4)


def _run(*args: str, cwd: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, timeout=600, cwd=cwd, env=env)
    return subprocess.CompletedProcess(out.args, out.returncode, out.stdout.decode(), out.stderr.decode())


def _used(args: list[str]) -> set[str]:
    return {a.split("=")[0] for a in args if a.startswith("--")}


MULTI_HOT = ",".join(str(1 + k % 3) for k in range(26))
# Synthetic data: every flag that does not name a data file.
SYNTHETIC_RUN = [
    "--epochs", "1", "--batch_size", "32", "--test_batch_size", "16", "--limit_train_batches", "7",
    "--limit_val_batches", "2", "--limit_test_batches", "2", "--dataset_name", "criteo_1t", "--num_embeddings", "40",
    "--dense_arch_layer_sizes", "16,8", "--over_arch_layer_sizes", "16,1", "--embedding_dim", "8",
    "--interaction_type", "projection", "--interaction_branch1_layer_sizes", "16,16",
    "--interaction_branch2_layer_sizes", "16,8", "--dcn_num_layers", "2", "--dcn_low_rank_dim", "4", "--seed", "3",
    "--pin_memory", "--learning_rate", "0.05", "--eps", "1e-7", "--shuffle_batches", "--adagrad",
    "--validation_freq_within_epoch", "3", "--multi_hot_sizes", MULTI_HOT, "--multi_hot_distribution_type", "pareto",
    "--collect_multi_hot_freqs_stats", "--lr_warmup_steps", "3", "--lr_decay_start", "4", "--lr_decay_steps", "2",
    "--print_lr", "--allow_tf32", "--print_sharding_plan", "--topology", "v5p-8",
]  # fmt: skip
# Criteo npy files: the reader's flags (TorchRec's in-memory reader), DCN.
NPY_RUN = [
    "--in_memory_binary_criteo_path", "@npy", "--num_embeddings_per_feature", ",".join(["50"] * 26),
    "--mmap_mode", "--shuffle_training_set", "--drop_last_training_batch", "--batch_size", "16",
    "--embedding_dim", "8", "--dense_arch_layer_sizes", "16,8", "--over_arch_layer_sizes", "16,1",
    "--interaction_type", "dcn", "--dcn_num_layers", "2", "--dcn_low_rank_dim", "4", "--learning_rate", "0.05",
]  # fmt: skip
# MLPerf's multi-hot npz files.
NPZ_RUN = [
    "--synthetic_multi_hot_criteo_path", "@npz", "--num_embeddings", "30", "--batch_size", "16",
    "--embedding_dim", "8", "--dense_arch_layer_sizes", "16,8", "--over_arch_layer_sizes", "16,1",
    "--shuffle_training_set", "--drop_last_training_batch", "--learning_rate", "0.05",
]  # fmt: skip


def test_every_dlrm_main_flag_is_run_or_refused():
    parser_flags = {o for a in flags.build_parser()._actions for o in a.option_strings}
    covered = _used(SYNTHETIC_RUN) | _used(NPY_RUN) | _used(NPZ_RUN) | set(REFUSED)
    assert set(DLRM_MAIN_FLAGS) <= parser_flags
    assert set(DLRM_MAIN_FLAGS) <= covered, set(DLRM_MAIN_FLAGS) - covered


@pytest.mark.slow
def test_dlrm_main_flags_on_synthetic_data(tmp_path):
    out = _run(*SYNTHETIC_RUN, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    # --print_lr: each step's two groups (tables, dense) at TorchRec's scheduler's rate.
    printed = re.findall(r"^lr: (\d+) (\d) (\S+)$", out.stdout, re.MULTILINE)
    expected = _reference_lrs(0.05, 3, 4, 2, 7)
    assert [(int(s), int(g)) for s, g, _ in printed] == [(s, g) for s in range(7) for g in (0, 1)]
    assert [float(v) for _, _, v in printed] == [round(expected[s], 6) for s in range(7) for _ in (0, 1)]
    assert len(re.findall(r"AUROC over val set", out.stdout)) == 3  # steps 3, 6 and the epoch's end
    assert "v5p-8" in out.stdout  # --print_sharding_plan
    # --collect_multi_hot_freqs_stats: dlrm_main's files, lookups of the training batches per id.
    pre = np.load(tmp_path / "stats_pre_hash_0_pareto.npy", allow_pickle=True).item()
    post = np.load(tmp_path / "stats_post_hash_0_pareto.npy", allow_pickle=True).item()
    assert sorted(pre, key=int) == [str(k) for k in range(26)]
    for k in range(26):
        assert pre[str(k)].sum() == 7 * 32 and post[str(k)].sum() == 7 * 32 * (1 + k % 3)


@pytest.mark.slow
def test_dlrm_main_flags_on_criteo_files(tmp_path):
    npy = tmp_path / "npy"
    npy.mkdir()
    write_criteo_npy(str(npy), days=2, rows=40, table_rows=[50] * 26)
    npz = tmp_path / "npz"
    npz.mkdir()
    rng = np.random.default_rng(1)
    for day in range(2):
        np.save(npz / f"day_{day}_dense.npy", rng.random((40, 13), dtype=np.float32))
        np.save(npz / f"day_{day}_labels.npy", rng.integers(0, 2, (40, 1)).astype(np.int32))
        np.savez(npz / f"day_{day}_sparse_multi_hot.npz",
                 **{f"{k}.npy": rng.integers(0, 30, (40, 2)).astype(np.int32) for k in range(26)})  # fmt: skip
    for args, path in ((NPY_RUN, npy), (NPZ_RUN, npz)):
        out = _run(*[str(path) if a.startswith("@") else a for a in args], cwd=str(tmp_path))
        assert out.returncode == 0, out.stderr[-3000:]
        # --drop_last_training_batch: 40 training rows in batches of 16 make 2 steps, not 3.
        assert re.search(r"\b2 steps, last loss", out.stdout), out.stdout


def test_drop_last_and_shuffle_training_set_reach_the_readers(tmp_path):
    write_criteo_npy(str(tmp_path), days=2, rows=40, table_rows=[50] * 26)
    base = ["--in_memory_binary_criteo_path", str(tmp_path), "--num_embeddings", "50", "--batch_size", "16"]
    plain = data.make_loaders(flags.parse_args(base))["train"]
    dropped = data.make_loaders(flags.parse_args([*base, "--drop_last_training_batch"]))["train"]
    assert (len(plain), len(dropped)) == (3, 2)
    assert [b.labels.numel() for b in dropped.epoch_batches(0)] == [16, 16]
    shuffled = data.make_loaders(flags.parse_args([*base, "--shuffle_training_set"]))["train"]
    rows = lambda loader: torch.cat([b.dense_features for b in loader.epoch_batches(0)])  # noqa: E731
    a, b = rows(plain), rows(shuffled)
    assert not torch.equal(a, b)  # another order of the same rows
    torch.testing.assert_close(a[a[:, 0].argsort()], b[b[:, 0].argsort()], rtol=0, atol=0)


# Command lines train.py refuses before training: dlrm_main's refused flags, and LR schedules and stats that
# TorchRec's own script cannot run either (what each exit-2 line says).
SCHEDULE_REFUSALS = {
    "warmup_after_decay": (["--lr_warmup_steps", "5", "--lr_decay_start", "2"],
                           "warmup must finish before the decay starts"),
    "decay_without_rate": (["--lr_decay_start", "5", "--lr_decay_steps", "3"], "without a learning rate"),
    "negative_warmup": (["--lr_warmup_steps", "-1"], "--lr_warmup_steps must be 0 or more"),
    "graphed_schedule": (["--lr_warmup_steps", "4", "--lr_decay_start", "4", "--mode", "graphed",
                          "--lr_decay_steps", "2"], "--mode graphed replays the captured step"),
    "stats_without_multi_hot": (["--collect_multi_hot_freqs_stats"], "give --multi_hot_sizes"),
}  # fmt: skip


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Each refused command line through train.py's main() in a process of its own, forked from one that
    imported the script once (tests/forked_runs.py): exit status and the stderr a terminal shows."""
    npy = tmp_path_factory.mktemp("npy")
    write_criteo_npy(str(npy), days=2, rows=8, table_rows=[50] * 26)
    runs = {flag: [str(npy) if a == "@npy" else a for a in args] for flag, (args, _) in REFUSED.items()}
    runs.update({case: args for case, (args, _) in SCHEDULE_REFUSALS.items()})
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return dict(zip(runs, run_forked(SCRIPT, list(runs.values()), env)))


def _one_error_line(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 2, (out.returncode, out.stderr[-3000:])
    (line,) = out.stderr.strip().splitlines()
    return line


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_refused_dlrm_main_flag_exits_2_naming_it(flag, refusals):
    line = _one_error_line(refusals[flag])
    assert line.startswith("train.py: error:") and flag in line and REFUSED[flag][1] in line, line


@pytest.mark.parametrize("case", sorted(SCHEDULE_REFUSALS))
def test_schedules_and_stats_torchrec_cannot_run_exit_2(case, refusals):
    line = _one_error_line(refusals[case])
    assert line.startswith("train.py: error:") and SCHEDULE_REFUSALS[case][1] in line, line
