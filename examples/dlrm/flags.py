"""Command line of the DLRM training script.

The flags carry the names and meanings of TorchRec's ``dlrm_main.py`` (so a
command line written for it runs here unchanged apart from the script name),
plus tpurec's own (``--mode``, ``--num_devices``, ``--checkpoint_dir``, ...).
Flags of ``dlrm_main.py`` that tune CUDA (``--pin_memory``, ``--allow_tf32``)
are accepted and have no effect here. The few that this script does not honour
(``--undersampling_rate``, which ``dlrm_main.py`` parses and never applies;
``--dataset_name criteo_kaggle`` with a data path) exit with status 2, saying why.

Bad input is reported by :class:`ConfigError`: ``train.py`` prints its one-line
message and exits with status 2, as argparse does for a bad flag.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Sequence

from torchrec.datasets.criteo import DEFAULT_CAT_NAMES, INT_FEATURE_COUNT

from dlrm import lr_schedule

INTERACTION_TYPES = ("original", "dcn", "projection")
EMBEDDING_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")
EXECUTION_MODES = ("eager", "fused", "compile", "graphed")
DISTRIBUTIONS = ("tpurec", "dmp")
DENSE_FEATURES = INT_FEATURE_COUNT


class ConfigError(ValueError):
    """Bad command line or data: one line saying what is wrong and what to do."""


@dataclasses.dataclass
class Config:
    """The parsed, checked command line.

    Attributes mirror the flags; list flags are lists of ints. The derived
    ``feature_names`` and ``table_rows`` give one table per sparse feature.
    """

    epochs: int
    batch_size: int
    test_batch_size: int
    limit_train_batches: int | None
    limit_val_batches: int | None
    limit_test_batches: int | None
    num_embeddings: int | None
    num_embeddings_per_feature: list[int] | None
    embedding_dim: int
    dense_arch_layer_sizes: list[int]
    over_arch_layer_sizes: list[int]
    interaction_type: str
    interaction_branch1_layer_sizes: list[int]
    interaction_branch2_layer_sizes: list[int]
    dcn_num_layers: int
    dcn_low_rank_dim: int
    learning_rate: float
    eps: float
    adagrad: bool
    shuffle_batches: bool
    mmap_mode: bool
    multi_hot_sizes: list[int] | None
    multi_hot_distribution_type: str
    collect_multi_hot_freqs_stats: bool
    drop_last_training_batch: bool
    shuffle_training_set: bool
    lr_warmup_steps: int
    lr_decay_start: int
    lr_decay_steps: int
    in_memory_binary_criteo_path: str | None
    synthetic_multi_hot_criteo_path: str | None
    tsv_criteo_path: str | None
    hash_ids: bool
    validation_freq_within_epoch: int | None
    print_sharding_plan: bool
    print_lr: bool
    seed: int
    mode: str
    num_devices: int
    topology: str | None
    plan: str | None
    embedding_optimizer: str
    checkpoint_dir: str | None
    resume: bool
    profile_dir: str | None
    plot: str | None
    tensorboard_dir: str | None
    metrics_file: str | None
    loss_every: int
    steps_per_call: int
    dist: str
    feature_names: list[str]
    table_rows: list[int]

    @property
    def lr_policy(self) -> lr_schedule.LRPolicy:
        """The learning rate of each step (``--lr_warmup_steps``, ``--lr_decay_start``, ``--lr_decay_steps``)."""
        return lr_schedule.LRPolicy(self.learning_rate, self.lr_warmup_steps, self.lr_decay_start, self.lr_decay_steps)

    @property
    def synthetic(self) -> bool:
        """True when no data path is given (the synthetic click data is used)."""
        return (
            self.in_memory_binary_criteo_path is None
            and self.synthetic_multi_hot_criteo_path is None
            and self.tsv_criteo_path is None
        )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (flag names and defaults as TorchRec's ``dlrm_main.py``)."""
    p = argparse.ArgumentParser(
        prog="train.py",
        description="Train TorchRec's DLRM (original, DCN or projection) on the tpu device.",
        allow_abbrev=False,
    )
    # --- dlrm_main.py's flags: same names, same meanings, same defaults -------------
    p.add_argument("--epochs", type=int, default=1, help="number of epochs to train")
    p.add_argument("--batch_size", type=int, default=32, help="batch size to use for training")
    p.add_argument("--drop_last_training_batch", action="store_true", help="drop the last non-full training batch")
    p.add_argument(
        "--test_batch_size",
        type=int,
        default=None,
        help="batch size for validation and testing (default: --batch_size)",
    )
    p.add_argument("--limit_train_batches", type=int, default=None, help="number of train batches per epoch")
    p.add_argument("--limit_val_batches", type=int, default=None, help="number of validation batches")
    p.add_argument("--limit_test_batches", type=int, default=None, help="number of test batches")
    p.add_argument(
        "--dataset_name",
        type=str,
        choices=["criteo_1t", "criteo_kaggle"],
        default="criteo_1t",
        help="the layout of the npy files: criteo_1t (day_N_*; the last day is split into val and test); "
        "criteo_kaggle is refused with a data path (see docs/dlrm_training.md)",
    )
    p.add_argument(
        "--num_embeddings",
        type=int,
        default=100_000,
        help="rows of each table when --num_embeddings_per_feature is not given",
    )
    p.add_argument(
        "--num_embeddings_per_feature",
        type=str,
        default=None,
        help="comma separated rows per sparse feature (one table each)",
    )
    p.add_argument(
        "--dense_arch_layer_sizes",
        type=str,
        default="512,256,64",
        help="comma separated dense arch layer sizes; the last equals --embedding_dim",
    )
    p.add_argument(
        "--over_arch_layer_sizes",
        type=str,
        default="512,512,256,1",
        help="comma separated over arch layer sizes; the last is 1",
    )
    p.add_argument("--embedding_dim", type=int, default=64, help="size of each embedding")
    p.add_argument(
        "--interaction_branch1_layer_sizes",
        type=str,
        default="2048,2048",
        help="projection interaction: branch 1 layer sizes",
    )
    p.add_argument(
        "--interaction_branch2_layer_sizes",
        type=str,
        default="2048,2048",
        help="projection interaction: branch 2 layer sizes",
    )
    p.add_argument("--dcn_num_layers", type=int, default=3, help="DCN interaction: number of cross layers")
    p.add_argument("--dcn_low_rank_dim", type=int, default=512, help="DCN interaction: low rank dimension")
    p.add_argument(
        "--undersampling_rate",
        type=float,
        default=None,
        help="not supported: dlrm_main.py parses it and never applies it (must be unset)",
    )
    p.add_argument("--seed", type=int, default=None, help="random seed (default 0)")
    p.add_argument("--pin_memory", action="store_true", help="accepted; no effect on tpu")
    p.add_argument(
        "--mmap_mode", action="store_true", help="keep the npy files on disk (memory-mapped) instead of loading them"
    )
    p.add_argument(
        "--in_memory_binary_criteo_path",
        type=str,
        default=None,
        help="directory of day_N_{dense,sparse,labels}.npy files",
    )
    p.add_argument(
        "--synthetic_multi_hot_criteo_path",
        type=str,
        default=None,
        help="directory of MLPerf v2 synthetic multi-hot files (day_N_sparse_multi_hot.npz)",
    )
    p.add_argument("--learning_rate", type=float, default=15.0, help="learning rate (dense and embedding optimizers)")
    p.add_argument("--eps", type=float, default=1e-8, help="epsilon of the Adagrad/Adam optimizers")
    p.add_argument("--shuffle_batches", action="store_true", help="shuffle the samples within each batch")
    p.add_argument(
        "--shuffle_training_set",
        action="store_true",
        help="shuffle the training rows once, in memory, with --seed (the data is loaded whole: overrides --mmap_mode)",
    )
    p.add_argument(
        "--validation_freq_within_epoch", type=int, default=None, help="validate every this many training steps"
    )
    p.add_argument("--adagrad", action="store_true", help="use Adagrad (dense and embeddings) instead of SGD")
    p.add_argument("--interaction_type", type=str, default="original", help="original, dcn or projection")
    p.add_argument(
        "--collect_multi_hot_freqs_stats",
        action="store_true",
        help="count how often each id is looked up in training, before and after --multi_hot_sizes's conversion; "
        "written at the end to stats_pre_hash_0_<dist>.npy and stats_post_hash_0_<dist>.npy in the working directory",
    )
    p.add_argument(
        "--multi_hot_sizes",
        type=str,
        default=None,
        help="comma separated multi-hot size per sparse feature (1-hot ids become bags)",
    )
    p.add_argument(
        "--multi_hot_distribution_type",
        type=str,
        choices=["uniform", "pareto"],
        default="uniform",
        help="distribution of the extra multi-hot ids",
    )
    p.add_argument("--lr_warmup_steps", type=int, default=0, help="linear learning-rate warm-up over this many steps")
    p.add_argument(
        "--lr_decay_start", type=int, default=0, help="step at which the quadratic learning-rate decay starts"
    )
    p.add_argument("--lr_decay_steps", type=int, default=0, help="steps of the learning-rate decay (0: no decay)")
    p.add_argument(
        "--print_lr",
        action="store_true",
        help="print the learning rate of each parameter group before every training step (group 0: the tables, "
        "1: the dense part)",
    )
    p.add_argument("--allow_tf32", action="store_true", help="accepted; no effect on tpu")
    p.add_argument(
        "--print_sharding_plan", action="store_true", help="print the TPU sharding plan of the tables (tpurec planner)"
    )
    # --- tpurec's own ------------------------------------------------------------------
    p.add_argument(
        "--mode",
        choices=EXECUTION_MODES,
        default=None,
        help="tpurec execution mode of the dense model (default: fused; eager, the only one, with --dist dmp; "
        "graphed: fused, the training step captured by tpurec.graph and replayed; not with --dist dmp)",
    )
    p.add_argument(
        "--dist",
        choices=DISTRIBUTIONS,
        default="tpurec",
        help="tpurec: one process, tables sharded by tpurec.shard over --num_devices; dmp: one process per device "
        "under torchrun, TorchRec's DistributedModelParallel (tables planned by tpurec's planner or --plan) and "
        "TrainPipelineSparseDist",
    )
    p.add_argument("--num_devices", type=int, default=1, help="tpu devices to train on")
    p.add_argument(
        "--topology",
        type=str,
        default=None,
        help="TPU topology for --print_sharding_plan, e.g. v5p-8 (default: the run's chip, v5p on a host "
        "without a TPU, with --num_devices of them; with --dist dmp, as many as torchrun's processes)",
    )
    p.add_argument(
        "--plan",
        type=str,
        default=None,
        help="with --dist dmp: shard the tables with this plan, the JSON file `tpurec plan --json` writes for the "
        "run's tables and process count (default: tpurec's planner plans them at start-up)",
    )
    p.add_argument(
        "--embedding_optimizer",
        choices=EMBEDDING_OPTIMIZERS,
        default=None,
        help="fused embedding optimizer (default: adagrad with --adagrad, else sgd)",
    )
    p.add_argument(
        "--tsv_criteo_path",
        type=str,
        default=None,
        help="raw Criteo TSV files: a directory of day_N / *.tsv / *.txt files or a comma separated list; the last file is split into val and test",
    )
    p.add_argument(
        "--hash_ids",
        action="store_true",
        help="take ids modulo the table size, as TorchRec's Criteo loaders do (default: ids beyond a table are an error)",
    )
    p.add_argument(
        "--checkpoint_dir", type=str, default=None, help="save checkpoints here (at each validation and at the end)"
    )
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --checkpoint_dir")
    p.add_argument("--profile_dir", type=str, default=None, help="write a trace of a few training steps here")
    p.add_argument("--plot", type=str, default=None, help="write a PNG of the loss and AUC curves to this path")
    p.add_argument(
        "--tensorboard_dir",
        type=str,
        default=None,
        help="write TensorBoard event files here (loss, learning rate, throughput, held-out metrics)",
    )
    p.add_argument(
        "--metrics_file",
        type=str,
        default=None,
        help="append the same records to this file, one JSON object per line",
    )
    p.add_argument(
        "--loss_every",
        type=int,
        default=10,
        help="show the mean loss of the last this many steps on the progress bar every this many steps (losses "
        "are read from the device one call behind the steps issued, never waited for at once)",
    )
    p.add_argument(
        "--steps_per_call",
        type=int,
        default=1,
        help="--mode graphed: run up to this many captured steps in one program (one launch); validation, "
        "checkpoints and the progress bar keep step granularity (one device only)",
    )
    return p


def _int_list(name: str, text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        values = [int(v) for v in str(text).split(",") if v.strip() != ""]
    except ValueError:
        raise ConfigError(f"--{name} must be comma separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ConfigError(f"--{name} must be positive integers, got {text!r}")
    return values


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def parse_args(argv: Sequence[str] | None = None) -> Config:
    """Parses and checks the command line.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        The checked :class:`Config`.

    Raises:
        ConfigError: a flag value is inconsistent (one line, what to do).
        SystemExit: argparse's own errors (unknown flag, bad number), status 2.
    """
    a = build_parser().parse_args(argv)
    _check(
        a.interaction_type in INTERACTION_TYPES,
        f"unknown --interaction_type {a.interaction_type!r}; choose one of {', '.join(INTERACTION_TYPES)}",
    )
    for name in (
        "epochs",
        "batch_size",
        "embedding_dim",
        "dcn_num_layers",
        "dcn_low_rank_dim",
        "num_devices",
        "loss_every",
        "steps_per_call",
    ):
        _check(getattr(a, name) > 0, f"--{name} must be positive, got {getattr(a, name)}")
    for name in (
        "test_batch_size",
        "limit_train_batches",
        "limit_val_batches",
        "limit_test_batches",
        "validation_freq_within_epoch",
    ):
        value = getattr(a, name)
        _check(value is None or value > 0, f"--{name} must be positive, got {value}")
    _check(a.learning_rate > 0, f"--learning_rate must be positive, got {a.learning_rate}")
    _check(
        a.undersampling_rate is None,
        "--undersampling_rate is not supported: TorchRec's dlrm_main.py parses it but never applies it, and this "
        "script does not undersample either; drop it",
    )
    schedule = lr_schedule.LRPolicy(a.learning_rate, a.lr_warmup_steps, a.lr_decay_start, a.lr_decay_steps)
    problem = lr_schedule.check(schedule)
    _check(problem is None, str(problem))
    _check(
        a.mode != "graphed" or schedule.constant,
        "--mode graphed replays the captured step at the learning rate it was captured with, so a schedule "
        "(--lr_warmup_steps/--lr_decay_steps) cannot change it; use --mode fused or compile",
    )
    _check(
        a.steps_per_call == 1 or a.mode == "graphed",
        f"--steps_per_call {a.steps_per_call} runs several captured steps in one program: it needs --mode graphed",
    )
    _check(
        a.steps_per_call == 1 or a.num_devices == 1,
        f"--steps_per_call {a.steps_per_call} runs on one device: drop --num_devices or use --steps_per_call 1",
    )
    _check(
        a.mode != "graphed" or a.dist != "dmp",
        "--mode graphed captures the step of a model on one device or sharded by tpurec.shard (--dist tpurec); "
        "use it without --dist dmp",
    )
    _check(
        a.plan is None or a.dist == "dmp",
        "--plan FILE shards the tables of --dist dmp (TorchRec's DistributedModelParallel); the tpurec path "
        "plans with tpurec.shard at start-up, so drop --plan or add --dist dmp",
    )
    dense_sizes = _int_list("dense_arch_layer_sizes", a.dense_arch_layer_sizes)
    over_sizes = _int_list("over_arch_layer_sizes", a.over_arch_layer_sizes)
    branch1 = _int_list("interaction_branch1_layer_sizes", a.interaction_branch1_layer_sizes)
    branch2 = _int_list("interaction_branch2_layer_sizes", a.interaction_branch2_layer_sizes)
    per_feature = _int_list("num_embeddings_per_feature", a.num_embeddings_per_feature)
    multi_hot = _int_list("multi_hot_sizes", a.multi_hot_sizes)
    _check(
        dense_sizes[-1] == a.embedding_dim,
        f"the last --dense_arch_layer_sizes ({dense_sizes[-1]}) must equal --embedding_dim ({a.embedding_dim})",
    )
    _check(over_sizes[-1] == 1, f"the last --over_arch_layer_sizes must be 1 (one logit), got {over_sizes[-1]}")
    if a.interaction_type == "projection":
        _check(
            branch1[-1] % a.embedding_dim == 0 and branch2[-1] % a.embedding_dim == 0,
            f"the last --interaction_branch1/2_layer_sizes ({branch1[-1]}, {branch2[-1]}) must be multiples of --embedding_dim ({a.embedding_dim})",
        )
    if per_feature is not None:
        feature_names = [f"cat_{i}" for i in range(len(per_feature))]
        table_rows = per_feature
    else:
        _check(a.num_embeddings > 0, f"--num_embeddings must be positive, got {a.num_embeddings}")
        feature_names = list(DEFAULT_CAT_NAMES)
        table_rows = [a.num_embeddings] * len(feature_names)
    if multi_hot is not None:
        _check(
            len(multi_hot) == len(feature_names),
            f"--multi_hot_sizes has {len(multi_hot)} values but there are {len(feature_names)} sparse features; give one per feature",
        )
    data_paths = [
        x
        for x in (a.in_memory_binary_criteo_path, a.synthetic_multi_hot_criteo_path, a.tsv_criteo_path)
        if x is not None
    ]
    _check(
        len(data_paths) <= 1,
        "--in_memory_binary_criteo_path, --synthetic_multi_hot_criteo_path and --tsv_criteo_path are mutually exclusive; give one",
    )
    _check(
        multi_hot is None or a.synthetic_multi_hot_criteo_path is None,
        "--multi_hot_sizes converts 1-hot ids to multi-hot; it is inapplicable with --synthetic_multi_hot_criteo_path",
    )
    _check(not a.resume or a.checkpoint_dir is not None, "--resume needs --checkpoint_dir (where the checkpoint is)")
    _check(
        a.dataset_name == "criteo_1t" or not data_paths,
        "--dataset_name criteo_kaggle is not supported with a data path: dlrm_main.py reads train_*.npy and "
        "validates and tests on the second half of the rows it trains on; write the Kaggle set as day_N_*.npy files "
        "(the last one held out) and drop --dataset_name",
    )
    _check(
        not a.collect_multi_hot_freqs_stats or multi_hot is not None,
        "--collect_multi_hot_freqs_stats counts the ids of --multi_hot_sizes's 1-hot to multi-hot conversion; "
        "give --multi_hot_sizes",
    )
    embedding_optimizer = a.embedding_optimizer or ("adagrad" if a.adagrad else "sgd")
    synthetic = not data_paths
    # dlrm_main.py runs 10 batches per stage on its random data unless told otherwise.
    limits = {s: getattr(a, f"limit_{s}_batches") for s in ("train", "val", "test")}
    if synthetic:
        limits = {s: 10 if v is None else v for s, v in limits.items()}
    return Config(
        epochs=a.epochs,
        batch_size=a.batch_size,
        test_batch_size=a.test_batch_size or a.batch_size,
        limit_train_batches=limits["train"],
        limit_val_batches=limits["val"],
        limit_test_batches=limits["test"],
        num_embeddings=None if per_feature is not None else a.num_embeddings,
        num_embeddings_per_feature=per_feature,
        embedding_dim=a.embedding_dim,
        dense_arch_layer_sizes=dense_sizes,
        over_arch_layer_sizes=over_sizes,
        interaction_type=a.interaction_type,
        interaction_branch1_layer_sizes=branch1,
        interaction_branch2_layer_sizes=branch2,
        dcn_num_layers=a.dcn_num_layers,
        dcn_low_rank_dim=a.dcn_low_rank_dim,
        learning_rate=a.learning_rate,
        eps=a.eps,
        adagrad=a.adagrad,
        shuffle_batches=a.shuffle_batches,
        mmap_mode=a.mmap_mode,
        multi_hot_sizes=multi_hot,
        multi_hot_distribution_type=a.multi_hot_distribution_type,
        collect_multi_hot_freqs_stats=a.collect_multi_hot_freqs_stats,
        drop_last_training_batch=a.drop_last_training_batch,
        shuffle_training_set=a.shuffle_training_set,
        lr_warmup_steps=a.lr_warmup_steps,
        lr_decay_start=a.lr_decay_start,
        lr_decay_steps=a.lr_decay_steps,
        in_memory_binary_criteo_path=a.in_memory_binary_criteo_path,
        synthetic_multi_hot_criteo_path=a.synthetic_multi_hot_criteo_path,
        tsv_criteo_path=a.tsv_criteo_path,
        hash_ids=a.hash_ids,
        validation_freq_within_epoch=a.validation_freq_within_epoch,
        print_sharding_plan=a.print_sharding_plan,
        print_lr=a.print_lr,
        seed=0 if a.seed is None else a.seed,
        mode=a.mode or ("eager" if a.dist == "dmp" else "fused"),
        num_devices=a.num_devices,
        topology=a.topology,
        plan=a.plan,
        embedding_optimizer=embedding_optimizer,
        checkpoint_dir=a.checkpoint_dir,
        resume=a.resume,
        profile_dir=a.profile_dir,
        plot=a.plot,
        tensorboard_dir=a.tensorboard_dir,
        metrics_file=a.metrics_file,
        loss_every=a.loss_every,
        steps_per_call=a.steps_per_call,
        dist=a.dist,
        feature_names=feature_names,
        table_rows=table_rows,
    )
