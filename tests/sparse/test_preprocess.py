"""preprocess_kjt: layout, merging, pooling, stacking, capacities, validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import PoolingType

import tpurec.sparse as sp
from helpers import make_tables, random_kjt


def entries(csr: sp.StackedCsr, num_partitions: int) -> list[tuple[int, int, int, float]]:
    """Valid (partition, id, sample, gain) entries, in buffer order."""
    size = csr.embedding_ids.shape[0] // num_partitions
    out = []
    for p in range(num_partitions):
        for i in range(p * size, int(csr.row_pointers[p])):
            out.append((p, int(csr.embedding_ids[i]), int(csr.sample_ids[i]), float(csr.gains[i])))
    return out


def test_layout_partitions_merge_and_stacking():
    tables = [
        EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=10, feature_names=["f", "g"]),
        EmbeddingBagConfig(name="b", embedding_dim=4, num_embeddings=5, feature_names=["h"], pooling=PoolingType.MEAN),
        EmbeddingBagConfig(name="c", embedding_dim=2, num_embeddings=3, feature_names=["k"]),
    ]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f", "g", "h", "k"],
        # f: [3, 3, 4], [] | g: [1], [3] | h: [2, 2, 1], [0] | k: [], [2]
        values=torch.tensor([3, 3, 4, 1, 3, 2, 2, 1, 0, 2]),
        lengths=torch.tensor([3, 0, 1, 1, 3, 1, 0, 1]),
    )
    batch = sp.preprocess_kjt(kjt, tables, num_partitions=2, capacities=sp.Capacity(5))
    assert list(batch.stacks) == ["a__b", "c"]
    csr = batch.stacks["a__b"]
    assert csr.embedding_ids.dtype == np.int32 and csr.gains.dtype == np.float32
    assert csr.embedding_ids.shape == (2 * 8,)  # capacity 5 rounded up to the alignment 8
    got = entries(csr, 2)
    # Stack rows: a = 0..9, b = 10..14. Slots: f=0, g=1, h=2 (sample = slot * 2 + b).
    expected = sorted(
        [
            (1, 3, 0, 2.0),  # f sample 0: id 3 twice, merged
            (0, 4, 0, 1.0),
            (1, 1, 2, 1.0),  # g
            (1, 3, 3, 1.0),
            (0, 12, 4, 2 / 3),  # h (MEAN, length 3): id 2 twice -> 2/3
            (1, 11, 4, 1 / 3),
            (0, 10, 5, 1.0),
        ]
    )
    assert got == sorted(got)  # partition-major, then (id, sample)
    assert [(p, i, s, round(g, 6)) for p, i, s, g in got] == [(p, i, s, round(g, 6)) for p, i, s, g in sorted(expected)]
    assert list(csr.row_pointers) == [3, 8 + 4]
    assert (csr.embedding_ids[3:8] == sp.PAD_ID).all() and (csr.gains[3:8] == 0).all()
    assert list(csr.max_ids) == [3, 4] and list(csr.max_unique_ids) == [3, 3]
    assert entries(batch.stacks["c"], 2) == [(0, 2, 1, 1.0)]


def test_weighted_gains_and_empty_batch():
    tables = [EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=10, feature_names=["f"])]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f"], values=torch.tensor([5, 5, 6]), lengths=torch.tensor([2, 1]), weights=torch.tensor([0.5, 0.25, 2.0])
    )
    csr = sp.preprocess_kjt(kjt, tables, 1, sp.Capacity(8)).stacks["a"]
    assert entries(csr, 1) == [(0, 5, 0, 0.75), (0, 6, 1, 2.0)]
    csr = sp.preprocess_kjt(kjt, tables, 1, sp.Capacity(8), is_weighted=False).stacks["a"]
    assert entries(csr, 1) == [(0, 5, 0, 2.0), (0, 6, 1, 1.0)]
    empty = KeyedJaggedTensor.from_lengths_sync(
        keys=["f"], values=torch.tensor([], dtype=torch.long), lengths=torch.tensor([0, 0])
    )
    csr = sp.preprocess_kjt(empty, tables, 2, sp.Capacity(8)).stacks["a"]
    assert list(csr.row_pointers) == [0, 8] and (csr.embedding_ids == sp.PAD_ID).all()


def test_overflow_error_and_drop():
    tables = [EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=100, feature_names=["f"])]
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=torch.arange(0, 20, 2), lengths=torch.tensor([6, 4]))
    with pytest.raises(
        sp.CapacityError, match=r"partition 0 of 2: the batch needs 10 ids \(10 unique\).*max_ids_per_partition=4"
    ):
        sp.preprocess_kjt(kjt, tables, 2, sp.Capacity(4))
    batch = sp.preprocess_kjt(kjt, tables, 2, sp.Capacity(4), overflow="drop")
    assert batch.dropped == {"a": 6}
    assert len(entries(batch.stacks["a"], 2)) == 4
    batch = sp.preprocess_kjt(kjt, tables, 2, sp.Capacity(8, 3), overflow="drop")
    assert batch.dropped == {"a": 7} and len({e[1] for e in entries(batch.stacks["a"], 2)}) == 3


def test_suggest_capacities_fit_every_batch():
    tables = make_tables()
    rng = np.random.default_rng(0)
    batches = [random_kjt(tables, 5, rng, max_len=int(rng.integers(1, 6))) for _ in range(8)]
    caps = sp.suggest_capacities(batches, tables, num_partitions=3)
    assert set(caps) == {"t0__t1", "t2"}
    observed = max(int(sp.preprocess_kjt(b, tables, 3).stacks["t0__t1"].max_ids.max()) for b in batches)
    assert caps["t0__t1"].max_ids_per_partition == observed
    for b in batches:
        sp.preprocess_kjt(b, tables, 3, caps)  # no CapacityError
    bigger = sp.suggest_capacities(batches, tables, num_partitions=3, headroom=2.0)
    assert bigger["t0__t1"].max_ids_per_partition == 2 * observed


def _kjt(values, lengths, weights=None, keys=("f0", "f1")):
    return KeyedJaggedTensor(
        keys=list(keys),
        values=values,
        lengths=torch.tensor(lengths),
        weights=weights,
    )


TABLES = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f0", "f1"])]


@pytest.mark.parametrize(
    "kjt,match",
    [
        (_kjt(torch.tensor([1, 2, 10]), [1, 1, 0, 1]), r"feature 'f1' has id 10 outside \[0, 10\)"),
        (_kjt(torch.tensor([1, -3, 2]), [1, 1, 0, 1]), r"feature 'f0' has id -3"),
        (_kjt(torch.tensor([1, 2, 3]), [1, 1, 1, 1]), r"lengths sum to 4 but values has 3 ids \(feature 'f1'"),
        (_kjt(torch.tensor([1, 2, 3]), [1, -1, 2, 1]), r"feature 'f0' has a negative bag length -1"),
        (
            _kjt(torch.tensor([1, 2, 3]), [1, 1, 0, 1], weights=torch.tensor([1.0, 2.0])),
            r"weights has 2 entries but values has 3 ids \(first feature without matching weights: 'f1'\)",
        ),
        (_kjt(torch.tensor([1.0, 2.5, 3.0]), [1, 1, 0, 1]), r"must be integers, got dtype torch.float32.*'f0'.*1.0"),
        (_kjt(torch.tensor([1, 2, 3]), [1, 1, 0, 1], keys=("f0", "zz")), r"features \['zz'\].*not in any table"),
    ],
    ids=["too_large", "negative", "lengths_sum", "negative_length", "weights_length", "float_ids", "unknown_key"],
)
def test_bad_inputs_raise_value_error(kjt, match):
    with pytest.raises(ValueError, match=match):
        sp.preprocess_kjt(kjt, TABLES, 2, sp.Capacity(8))


@pytest.mark.parametrize("case", range(7))
def test_bad_inputs_leave_module_unchanged(case):
    kjt, _ = test_bad_inputs_raise_value_error.pytestmark[0].args[1][case]
    weighted = kjt.weights_or_none() is not None
    ebc = sp.EmbeddingBagCollection(TABLES, is_weighted=weighted, optimizer=sp.Adam(0.1))
    good = _kjt(torch.tensor([1, 2, 3]), [1, 1, 0, 1], weights=torch.ones(3) if weighted else None)
    ebc(good).values().sum().backward()
    before = [t.clone() for t in [*ebc.parameters(), *ebc.buffers()]]
    steps = ebc.optimizer_state_dict()["steps"]
    with pytest.raises(ValueError):
        ebc(kjt)
    after = [*ebc.parameters(), *ebc.buffers()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert ebc.optimizer_state_dict()["steps"] == steps


def test_missing_feature_and_missing_weights():
    kjt = KeyedJaggedTensor(keys=["f0"], values=torch.tensor([1]), lengths=torch.tensor([1, 0]))
    with pytest.raises(ValueError, match=r"features \['f1'\] used by the tables are missing"):
        sp.preprocess_kjt(kjt, TABLES)
    with pytest.raises(ValueError, match="tables are weighted but"):
        sp.preprocess_kjt(_kjt(torch.tensor([1, 2, 3]), [1, 1, 0, 1]), TABLES, is_weighted=True)
