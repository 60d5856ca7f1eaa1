"""Data for the DLRM script: synthetic clicks, Criteo (TSV or npy) and MLPerf multi-hot.

Every source yields ``torchrec.datasets.utils.Batch`` (dense features, a
``KeyedJaggedTensor`` of ids, labels) through ``epoch_batches(epoch)``:

* :class:`SyntheticClicks`: dense features and skewed one-hot ids drawn per
  batch index (so batch ``k`` is the same in every run and a resumed run
  needs no generator state); labels follow a hidden logistic model of the
  dense features and per-id scores, so a model can learn them (AUC well above 0.5).
* :class:`InMemoryCriteo`: the ``day_N_{dense,sparse,labels}.npy`` layout of
  TorchRec's preprocessed Criteo, read by ``torchrec.datasets.criteo.
  InMemoryBinaryCriteoIterDataPipe`` (the last day is split into val and test
  halves, the other days are training data, as in ``dlrm_main.py``).
* Criteo raw TSV files are converted to that layout with TorchRec's
  ``BinaryCriteoUtils.tsv_to_npys`` after a check of every line.
* :class:`MultiHotCriteo`: MLPerf DLRM v2's synthetic multi-hot layout
  (``day_N_sparse_multi_hot.npz`` holding ``0.npy`` .. ``25.npy``).

``--multi_hot_sizes`` turns one-hot ids into bags as ``dlrm_main.py``'s
``Multihot`` does: the first id is the original one, the others are fixed
functions of it, drawn uniform or pareto. They are computed by hashing rather
than from a lookup table, so a 40M-row table needs no 40M x size array.
"""

from __future__ import annotations

import atexit
import glob
import os
import re
import shutil
import tempfile
import zipfile
from typing import Iterable, Iterator

import numpy as np
import torch
from torchrec.datasets.criteo import (
    CAT_FEATURE_COUNT,
    DEFAULT_CAT_NAMES,
    INT_FEATURE_COUNT,
    BinaryCriteoUtils,
    InMemoryBinaryCriteoIterDataPipe,
)
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dlrm.flags import Config, ConfigError

STAGES = ("train", "val", "test")
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """A 64-bit integer hash (splitmix64's finaliser), elementwise on uint64."""
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def _unit(ids: np.ndarray, salt: int) -> np.ndarray:
    """A fixed pseudo-random number in [0, 1) per (id, salt)."""
    with np.errstate(over="ignore"):
        h = _mix(ids.astype(np.uint64) * _GOLDEN + np.uint64(salt) * np.uint64(0xD1B54A32D192ED03))
    return (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)


class SyntheticClicks:
    """Click data with a learnable rule, one batch per (stage, index).

    Args:
        feature_names: the sparse features (one table each).
        table_rows: rows of each feature's table.
        batch_size: samples per batch.
        num_batches: batches per epoch.
        stage: "train", "val" or "test" (each draws from its own stream).
        seed: base seed.
    """

    def __init__(
        self, feature_names: list[str], table_rows: list[int], batch_size: int, num_batches: int, stage: str, seed: int
    ) -> None:
        self.feature_names, self.table_rows = feature_names, table_rows
        self.batch_size, self.num_batches = batch_size, num_batches
        self.stage_id, self.seed = STAGES.index(stage), seed
        rule = np.random.default_rng([seed, 99])
        self.dense_weight = rule.normal(size=INT_FEATURE_COUNT) / np.sqrt(INT_FEATURE_COUNT)

    def __len__(self) -> int:
        return self.num_batches

    def batch(self, index: int) -> Batch:
        """Batch number ``index`` of this stage (the same in every run)."""
        rng = np.random.default_rng([self.seed, self.stage_id, index])
        size = self.batch_size
        dense = rng.normal(size=(size, INT_FEATURE_COUNT)).astype(np.float32)
        logit = dense @ self.dense_weight
        values = []
        scale = 2.0 / np.sqrt(len(self.feature_names))
        for t, rows in enumerate(self.table_rows):
            # Skewed towards small ids, as real categorical data is.
            ids = np.minimum(rng.zipf(1.2, size=size) - 1, rows - 1)
            logit += scale * (2.0 * _unit(ids, t + 1) - 1.0) * np.sqrt(3.0)
            values.append(ids)
        labels = (rng.random(size) < 1.0 / (1.0 + np.exp(-2.0 * logit))).astype(np.float32)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=self.feature_names,
            values=torch.from_numpy(np.concatenate(values)),
            lengths=torch.ones(len(self.feature_names) * size, dtype=torch.int32),
        )
        return Batch(dense_features=torch.from_numpy(dense), sparse_features=kjt, labels=torch.from_numpy(labels))

    def epoch_batches(self, epoch: int) -> Iterator[Batch]:
        """The batches of ``epoch`` (training data differs per epoch; val and test do not)."""
        first = epoch * self.num_batches if self.stage_id == 0 else 0
        for i in range(self.num_batches):
            yield self.batch(first + i)


def _day_files(directory: str, suffix: str, flag: str) -> list[str]:
    """``day_N<suffix>`` files of ``directory`` in day order."""
    if not os.path.isdir(directory):
        raise ConfigError(f"{flag} {directory!r} is not a directory")
    found = {}
    for path in glob.glob(os.path.join(directory, f"day_*{suffix}")):
        m = re.fullmatch(rf"day_(\d+){re.escape(suffix)}", os.path.basename(path))
        if m:
            found[int(m.group(1))] = path
    if len(found) < 2:
        raise ConfigError(
            f"{flag} {directory!r} needs day_N{suffix} files for at least two days "
            f"(training days, then the last day for val/test); found {len(found)}"
        )
    return [found[d] for d in sorted(found)]


def _npy_shape(path: str) -> tuple[int, ...]:
    if not os.path.isfile(path):
        raise ConfigError(f"missing data file {path}")
    try:
        return tuple(np.load(path, mmap_mode="r").shape)
    except Exception as e:  # numpy raises ValueError/OSError/EOFError on broken headers
        raise ConfigError(f"cannot read {path} as an .npy array ({type(e).__name__}: {e})") from None


def _check_day(dense: str, labels: str, sparse_columns: dict[str, tuple[int, ...]]) -> None:
    d, lab = _npy_shape(dense), _npy_shape(labels)
    if len(d) != 2 or d[1] != INT_FEATURE_COUNT:
        raise ConfigError(f"{dense} has shape {d}; expected [rows, {INT_FEATURE_COUNT}] dense features")
    if len(lab) != 2 or lab[0] != d[0] or lab[1] != 1:
        raise ConfigError(f"{labels} has shape {lab}; expected [{d[0]}, 1] to match {os.path.basename(dense)}")
    for path, shape in sparse_columns.items():
        if len(shape) != 2 or shape[0] != d[0]:
            raise ConfigError(f"{path} has shape {shape}; expected {d[0]} rows to match {os.path.basename(dense)}")


class InMemoryCriteo:
    """TorchRec's in-memory binary Criteo reader over ``day_N_*.npy`` files.

    Args:
        directory: where the files are.
        stage: "train", "val" or "test".
        batch_size: samples per batch.
        cfg: the run's config (table sizes, shuffling, id hashing).
        flag: the flag that named ``directory`` (for messages).
    """

    def __init__(
        self, directory: str, stage: str, batch_size: int, cfg: Config, flag: str = "--in_memory_binary_criteo_path"
    ) -> None:
        if len(cfg.feature_names) != CAT_FEATURE_COUNT:
            raise ConfigError(
                f"Criteo data has {CAT_FEATURE_COUNT} sparse features but --num_embeddings_per_feature "
                f"gives {len(cfg.feature_names)}; give {CAT_FEATURE_COUNT} values"
            )
        dense = _day_files(directory, "_dense.npy", flag)
        days = [os.path.basename(p)[: -len("_dense.npy")] for p in dense]
        sparse = [os.path.join(directory, f"{d}_sparse.npy") for d in days]
        labels = [os.path.join(directory, f"{d}_labels.npy") for d in days]
        for dp, sp, lp in zip(dense, sparse, labels):
            s = _npy_shape(sp)
            _check_day(dp, lp, {sp: s})
            if s[1] != CAT_FEATURE_COUNT:
                raise ConfigError(f"{sp} has shape {s}; expected [rows, {CAT_FEATURE_COUNT}] sparse ids")
        pick = slice(0, -1) if stage == "train" else slice(-1, None)
        self.source = directory
        try:
            self.pipe = InMemoryBinaryCriteoIterDataPipe(
                stage,
                dense[pick],
                sparse[pick],
                labels[pick],
                batch_size=batch_size,
                rank=0,
                world_size=1,
                # Only training batches shuffle: held-out metrics do not depend on the order,
                # and numpy's global generator then serves the training data alone.
                drop_last=cfg.drop_last_training_batch and stage == "train",
                shuffle_batches=cfg.shuffle_batches and stage == "train",
                shuffle_training_set=cfg.shuffle_training_set and stage == "train",
                shuffle_training_set_random_seed=cfg.seed,
                mmap_mode=cfg.mmap_mode,
                hashes=cfg.table_rows if cfg.hash_ids else None,
            )
        except (ValueError, OSError, EOFError) as e:
            raise ConfigError(f"cannot load the Criteo npy files in {directory} ({type(e).__name__}: {e})") from None

    def __len__(self) -> int:
        return len(self.pipe)

    def epoch_batches(self, epoch: int) -> Iterator[Batch]:
        del epoch  # the file order is the same each epoch (batches shuffle inside with --shuffle_batches)
        for batch in self.pipe:
            # TorchRec's reader hands over int32 labels of shape [B]; the loss wants floats.
            yield Batch(batch.dense_features, batch.sparse_features, batch.labels.float())


class MultiHotCriteo:
    """MLPerf DLRM v2's synthetic multi-hot Criteo: ``day_N_dense.npy``,
    ``day_N_labels.npy`` and ``day_N_sparse_multi_hot.npz`` (members ``0.npy`` ..
    ``25.npy``, int32 ``[rows, multi_hot_size]``). Files are read whole.
    """

    def __init__(self, directory: str, stage: str, batch_size: int, cfg: Config) -> None:
        flag = "--synthetic_multi_hot_criteo_path"
        if len(cfg.feature_names) != CAT_FEATURE_COUNT:
            raise ConfigError(
                f"MLPerf multi-hot Criteo has {CAT_FEATURE_COUNT} sparse features but "
                f"--num_embeddings_per_feature gives {len(cfg.feature_names)}; give {CAT_FEATURE_COUNT} values"
            )
        sparse_files = _day_files(directory, "_sparse_multi_hot.npz", flag)
        days = [os.path.basename(p)[: -len("_sparse_multi_hot.npz")] for p in sparse_files]
        chosen = days[:-1] if stage == "train" else days[-1:]
        dense, sparse, labels = [], [[] for _ in range(CAT_FEATURE_COUNT)], []
        for day in chosen:
            dp, lp = os.path.join(directory, f"{day}_dense.npy"), os.path.join(directory, f"{day}_labels.npy")
            npz = os.path.join(directory, f"{day}_sparse_multi_hot.npz")
            try:
                with np.load(npz) as members:
                    columns = [np.asarray(members[f"{k}.npy"]) for k in range(CAT_FEATURE_COUNT)]
            except (KeyError, ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
                raise ConfigError(
                    f"cannot read {npz} as MLPerf multi-hot ids 0.npy..{CAT_FEATURE_COUNT - 1}.npy ({type(e).__name__}: {e})"
                ) from None
            _check_day(dp, lp, {f"{npz}:{k}.npy": c.shape for k, c in enumerate(columns)})
            dense.append(np.load(dp))
            labels.append(np.load(lp))
            for k, c in enumerate(columns):
                sparse[k].append(c)
        self.dense = np.concatenate(dense).astype(np.float32)
        self.labels = np.concatenate(labels).reshape(-1).astype(np.float32)
        self.sparse = [np.concatenate(c).astype(np.int64) for c in sparse]
        if cfg.hash_ids:
            self.sparse = [c % rows for c, rows in zip(self.sparse, cfg.table_rows)]
        if stage != "train":  # the last day: first half validation, second half test
            half = (len(self.dense) + 1) // 2
            part = slice(0, half) if stage == "val" else slice(half, None)
            self.dense, self.labels = self.dense[part], self.labels[part]
            self.sparse = [c[part] for c in self.sparse]
        if cfg.shuffle_training_set and stage == "train":  # once, with --seed, as TorchRec's in-memory reader
            order = np.random.RandomState(cfg.seed).permutation(len(self.dense))
            self.dense, self.labels = self.dense[order], self.labels[order]
            self.sparse = [c[order] for c in self.sparse]
        self.batch_size, self.shuffle, self.source = batch_size, cfg.shuffle_batches and stage == "train", directory
        self.drop_last = cfg.drop_last_training_batch and stage == "train"

    def __len__(self) -> int:
        if self.drop_last:
            return len(self.dense) // self.batch_size
        return -(-len(self.dense) // self.batch_size)

    def epoch_batches(self, epoch: int) -> Iterator[Batch]:
        del epoch
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            part = slice(start, start + self.batch_size)
            dense, labels, cols = self.dense[part], self.labels[part], [c[part] for c in self.sparse]
            if self.shuffle:  # the global numpy generator, as TorchRec's readers (and checkpoints) use it
                order = np.random.permutation(len(dense))
                dense, labels, cols = dense[order], labels[order], [c[order] for c in cols]
            size = len(dense)
            lengths = np.concatenate([np.full(size, c.shape[1], dtype=np.int32) for c in cols])
            kjt = KeyedJaggedTensor.from_lengths_sync(
                keys=list(DEFAULT_CAT_NAMES),
                values=torch.from_numpy(np.concatenate([c.reshape(-1) for c in cols])),
                lengths=torch.from_numpy(lengths),
            )
            yield Batch(
                torch.from_numpy(np.ascontiguousarray(dense)), kjt, torch.from_numpy(np.ascontiguousarray(labels))
            )


def _tsv_files(spec: str) -> list[str]:
    if "," in spec:
        files = [s for s in spec.split(",") if s]
    elif os.path.isdir(spec):
        files = sorted(
            (
                p
                for p in glob.glob(os.path.join(spec, "*"))
                if os.path.isfile(p) and re.search(r"(day_\d+|\.tsv|\.txt)$", p)
            ),
            key=lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", os.path.basename(p))],
        )
    else:
        files = [spec]
    for f in files:
        if not os.path.isfile(f):
            raise ConfigError(f"missing data file {f} (--tsv_criteo_path)")
    if len(files) < 2:
        raise ConfigError(
            f"--tsv_criteo_path {spec!r} needs at least two files (training files, then the last one for val/test); found {len(files)}"
        )
    return files


def check_tsv(path: str) -> int:
    """Checks that every line of a Criteo TSV file has a 0/1 label, 13 integer
    and 26 hexadecimal fields (empty fields are allowed: they read as 0).

    Returns:
        The number of rows.

    Raises:
        ConfigError: naming the file, the line and what is wrong with it.
    """
    columns = 1 + INT_FEATURE_COUNT + CAT_FEATURE_COUNT
    rows = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            fields = line.rstrip("\n").rstrip("\r").split("\t")
            where = f"{path} line {number}"
            if len(fields) != columns:
                raise ConfigError(
                    f"{where}: {len(fields)} tab separated fields, expected {columns} (label, 13 integers, 26 hex ids)"
                )
            if fields[0] not in ("0", "1"):
                raise ConfigError(f"{where}: label {fields[0]!r} is not 0 or 1")
            for i, v in enumerate(fields[1 : 1 + INT_FEATURE_COUNT]):
                if v and not re.fullmatch(r"-?\d+", v):
                    raise ConfigError(f"{where}: dense feature {i} is {v!r}, not an integer")
            for i, v in enumerate(fields[1 + INT_FEATURE_COUNT :]):
                if v and not re.fullmatch(r"[0-9a-fA-F]+", v):
                    raise ConfigError(f"{where}: categorical feature {i} is {v!r}, not hexadecimal")
            rows += 1
    if rows == 0:
        raise ConfigError(f"{path} is empty")
    return rows


def tsv_to_npy_dir(spec: str) -> str:
    """Converts raw Criteo TSV files to the ``day_N_*.npy`` layout in a new
    temporary directory (TorchRec's ``tsv_to_npys``) and returns it."""
    files = _tsv_files(spec)
    for f in files:
        check_tsv(f)
    out = tempfile.mkdtemp(prefix="tpurec_criteo_")
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    for day, f in enumerate(files):
        stem = os.path.join(out, f"day_{day}")
        BinaryCriteoUtils.tsv_to_npys(f, f"{stem}_dense.npy", f"{stem}_sparse.npy", f"{stem}_labels.npy")
    return out


class MultiHot:
    """One-hot ids -> fixed bags of ``sizes[k]`` ids (``dlrm_main.py``'s ``Multihot``).

    Bag of id ``i`` in table ``k``: ``i`` itself, then ``sizes[k] - 1`` ids that
    are a fixed function of ``i``: uniform over the table, or pareto
    (shape 0.25, as TorchRec) modulo the table size.
    """

    def __init__(self, sizes: list[int], table_rows: list[int], distribution: str, collect_stats: bool = False) -> None:
        self.sizes, self.table_rows, self.distribution = sizes, table_rows, distribution
        # --collect_multi_hot_freqs_stats: lookups per id of each table, before and after the conversion.
        self.collect_stats = collect_stats
        self.freqs_pre_hash = [np.zeros(rows) for rows in table_rows] if collect_stats else []
        self.freqs_post_hash = [np.zeros(rows) for rows in table_rows] if collect_stats else []

    def save_freqs_stats(self, directory: str = ".", rank: int = 0) -> list[str]:
        """Writes the counts as ``dlrm_main.py`` does: ``stats_{pre,post}_hash_<rank>_<distribution>.npy``, each
        a dict ``{"<table index>": counts}`` (``np.load(path, allow_pickle=True).item()`` reads it back).

        Returns:
            The two paths.
        """
        paths = []
        for kind, freqs in (("pre", self.freqs_pre_hash), ("post", self.freqs_post_hash)):
            path = os.path.join(directory, f"stats_{kind}_hash_{rank}_{self.distribution}.npy")
            np.save(path, {str(k): f for k, f in enumerate(freqs)})
            paths.append(path)
        return paths

    def expand(self, k: int, ids: np.ndarray) -> np.ndarray:
        """``[n]`` one-hot ids of table ``k`` -> ``[n, sizes[k]]`` bags."""
        size, rows = self.sizes[k], self.table_rows[k]
        extra = np.arange(1, size, dtype=np.uint64)
        u = _unit(ids.astype(np.uint64)[:, None] * np.uint64(1 << 8) + extra[None, :], 1000 + k)
        if self.distribution == "uniform":
            more = np.floor(u * rows).astype(np.int64)
        else:  # numpy's pareto(a) is (1 - u) ** (-1 / a) - 1 (Lomax); int32 and modulo as TorchRec
            more = np.minimum((1.0 - u) ** (-1.0 / 0.25) - 1.0, 2**31 - 1).astype(np.int64) % rows
        return np.concatenate([ids.astype(np.int64)[:, None], np.minimum(more, rows - 1)], axis=1)

    def __call__(self, batch: Batch) -> Batch:
        kjt = batch.sparse_features
        size = batch.dense_features.shape[0]
        values, lengths = [], []
        for k, key in enumerate(kjt.keys()):
            ids = kjt[key].values().numpy()
            if ids.shape[0] != size:
                raise ConfigError(
                    f"--multi_hot_sizes needs one-hot input, but feature {key} has {ids.shape[0]} ids for {size} samples"
                )
            bags = self.expand(k, ids).reshape(-1)
            if self.collect_stats:
                np.add.at(self.freqs_pre_hash[k], ids, 1)
                np.add.at(self.freqs_post_hash[k], bags, 1)
            values.append(bags)
            lengths.append(np.full(size, self.sizes[k], dtype=np.int32))
        new = KeyedJaggedTensor.from_lengths_sync(
            keys=kjt.keys(),
            values=torch.from_numpy(np.concatenate(values)),
            lengths=torch.from_numpy(np.concatenate(lengths)),
        )
        return Batch(batch.dense_features, new, batch.labels)


def check_ids(batch: Batch, feature_names: list[str], table_rows: list[int], source: str) -> None:
    """Raises ConfigError when an id of ``batch`` is outside its table."""
    kjt = batch.sparse_features
    if list(kjt.keys()) != list(feature_names):
        raise ConfigError(f"{source} has sparse features {list(kjt.keys())[:4]}..., expected {feature_names[:4]}...")
    for key, rows in zip(feature_names, table_rows):
        ids = kjt[key].values()
        if ids.numel() == 0:
            continue
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= rows:
            bad = low if low < 0 else high
            raise ConfigError(
                f"{source}: feature {key} has id {bad}, outside its table of {rows} rows (--num_embeddings_per_feature / "
                f"--num_embeddings); give larger tables, or --hash_ids to take ids modulo the table size as TorchRec's loaders do"
            )


class Loader:
    """One stage's batches: the source, then multi-hot expansion, then the id check.

    Args:
        source: an object with ``epoch_batches(epoch)`` and ``__len__``.
        cfg: the run's config.
        limit: at most this many batches per epoch (``--limit_*_batches``).
        name: where the data comes from (for messages).
    """

    def __init__(self, source, cfg: Config, limit: int | None, name: str, stage: str = "train") -> None:
        self.source, self.limit, self.name = source, limit, name
        self.feature_names, self.table_rows = cfg.feature_names, cfg.table_rows
        self.multi_hot = (
            MultiHot(
                cfg.multi_hot_sizes,
                cfg.table_rows,
                cfg.multi_hot_distribution_type,
                collect_stats=cfg.collect_multi_hot_freqs_stats and stage == "train",
            )
            if cfg.multi_hot_sizes
            else None
        )

    def __len__(self) -> int:
        n = len(self.source)
        return n if self.limit is None else min(n, self.limit)

    def epoch_batches(self, epoch: int) -> Iterator[Batch]:
        """The epoch's batches, expanded and checked."""
        for i, batch in enumerate(self.source.epoch_batches(epoch)):
            if self.limit is not None and i >= self.limit:
                return
            if self.multi_hot is not None:
                batch = self.multi_hot(batch)
            check_ids(batch, self.feature_names, self.table_rows, self.name)
            yield batch


def make_loaders(cfg: Config) -> dict[str, Loader]:
    """The train, val and test loaders the flags ask for."""
    limits = {"train": cfg.limit_train_batches, "val": cfg.limit_val_batches, "test": cfg.limit_test_batches}
    # --batch_size is per device (dlrm_main.py's per-rank batch): one process feeds all of them.
    sizes = {
        "train": cfg.batch_size * cfg.num_devices,
        "val": cfg.test_batch_size * cfg.num_devices,
        "test": cfg.test_batch_size * cfg.num_devices,
    }
    loaders = {}
    tsv_dir = tsv_to_npy_dir(cfg.tsv_criteo_path) if cfg.tsv_criteo_path else None
    for stage in STAGES:
        if cfg.synthetic:
            source: Iterable = SyntheticClicks(
                cfg.feature_names, cfg.table_rows, sizes[stage], limits[stage], stage, cfg.seed
            )
            name = f"synthetic {stage} data"
        elif cfg.synthetic_multi_hot_criteo_path:
            source = MultiHotCriteo(cfg.synthetic_multi_hot_criteo_path, stage, sizes[stage], cfg)
            name = cfg.synthetic_multi_hot_criteo_path
        elif tsv_dir is not None:
            # Raw Criteo ids are 32-bit hashes (no contiguous numbering): they are
            # always taken modulo the table size, as TorchRec's pipeline does.
            hashed = Config(**{**cfg.__dict__, "hash_ids": True})
            source = InMemoryCriteo(tsv_dir, stage, sizes[stage], hashed, flag="--tsv_criteo_path")
            name = cfg.tsv_criteo_path
        else:
            source = InMemoryCriteo(cfg.in_memory_binary_criteo_path, stage, sizes[stage], cfg)
            name = cfg.in_memory_binary_criteo_path
        loaders[stage] = Loader(source, cfg, limits[stage], name, stage)
    return loaders
