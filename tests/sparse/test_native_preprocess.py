"""Native (C++) KJT preprocessing against the numpy reference: identical CSR, same errors.

The existing preprocessing tests (test_preprocess.py) run here once more with
every native result compared bit for bit to the numpy one; a hypothesis test
does the same over random tables and KJTs (stacking, MEAN pooling, weights,
duplicates, partitions, capacities with "error" and "drop", bad ids).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import PoolingType

import tpurec.sparse as sp
from tpurec.sparse import preprocess as preprocess_module
from tpurec.sparse.kernels.native.preprocess import preprocess_native

# The existing preprocessing tests, collected again in this module, where the
# autouse fixture below checks native == numpy on every preprocess_kjt call.
from test_preprocess import *  # noqa: F401,F403,E402

CSR_FIELDS = ("row_pointers", "embedding_ids", "sample_ids", "gains", "max_ids", "max_unique_ids")


def assert_identical(native: sp.SparseCoreInput, reference: sp.SparseCoreInput) -> None:
    """Same stacks, same arrays (dtype, shape and bytes), same drop counts."""
    assert native.batch_size == reference.batch_size and native.num_partitions == reference.num_partitions
    assert list(native.stacks) == list(reference.stacks)
    for name, ref in reference.stacks.items():
        got = native.stacks[name]
        for field in CSR_FIELDS:
            a, b = getattr(got, field), getattr(ref, field)
            assert a.dtype == b.dtype and a.shape == b.shape, (name, field, a.dtype, b.dtype, a.shape, b.shape)
            assert a.tobytes() == b.tobytes(), (name, field, a, b)
        assert got.dropped == ref.dropped


def numpy_reference(kjt, tables, num_partitions=1, capacities=None, **kwargs) -> sp.SparseCoreInput:
    old = os.environ.get("TPUREC_PREPROCESS")
    os.environ["TPUREC_PREPROCESS"] = "numpy"
    try:
        return sp.preprocess_kjt(kjt, tables, num_partitions, capacities, **kwargs)
    finally:
        if old is None:
            del os.environ["TPUREC_PREPROCESS"]
        else:
            os.environ["TPUREC_PREPROCESS"] = old


NATIVE_RESULTS: list[int] = []


@pytest.fixture(autouse=True)
def compare_every_native_result(monkeypatch):
    """Forces the native path and compares each of its results with numpy's."""
    monkeypatch.setenv("TPUREC_PREPROCESS", "native")
    original = preprocess_module._preprocess_native

    def checked(kjt, stacks, num_partitions, capacities, is_weighted, overflow):
        got = original(kjt, stacks, num_partitions, capacities, is_weighted, overflow)
        if got is not None:
            NATIVE_RESULTS.append(1)
            ref = numpy_reference(kjt, stacks, num_partitions, capacities, is_weighted=is_weighted, overflow=overflow)
            assert_identical(got, ref)
        return got

    monkeypatch.setattr(preprocess_module, "_preprocess_native", checked)


def test_native_path_is_taken_and_matches_layout():
    tables = [
        EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=10, feature_names=["f", "g"]),
        EmbeddingBagConfig(name="b", embedding_dim=4, num_embeddings=5, feature_names=["h"], pooling=PoolingType.MEAN),
    ]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f", "g", "h"], values=torch.tensor([3, 3, 4, 1, 3, 2, 2, 1, 0]), lengths=torch.tensor([3, 0, 1, 1, 3, 1])
    )
    before = len(NATIVE_RESULTS)
    batch = sp.preprocess_kjt(kjt, tables, 2, sp.Capacity(5))
    assert len(NATIVE_RESULTS) == before + 1  # the native path ran (and matched numpy)
    # f sample 0 holds id 3 twice: merged into one entry with gain 2 in partition 1.
    csr = batch.stacks["a__b"]
    assert (int(csr.embedding_ids[8]), int(csr.sample_ids[8]), float(csr.gains[8])) == (1, 2, 1.0)
    assert (int(csr.embedding_ids[9]), int(csr.sample_ids[9]), float(csr.gains[9])) == (3, 0, 2.0)


def test_int32_ids_bfloat16_weights_and_large_threaded_batch():
    tables = [EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=1000, feature_names=["f", "g"])]
    rng = np.random.default_rng(1)
    n = 2 * 20_000 * 2
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f", "g"],
        values=torch.from_numpy(rng.integers(0, 1000, n).astype(np.int32)),
        lengths=torch.full((2 * 20_000,), 2, dtype=torch.int32),
        weights=torch.from_numpy(rng.uniform(-2, 2, n).astype(np.float32)).to(torch.bfloat16),
    )
    # 80k entries over 4 partitions: the per-partition work runs on worker threads.
    got = preprocess_native(kjt, sp.stack_tables(tables), 4, {"a": sp.Capacity(n)}, None, "error")
    assert got is not None
    kjt_f32 = KeyedJaggedTensor.from_lengths_sync(
        keys=["f", "g"], values=kjt.values().long(), lengths=kjt.lengths().long(), weights=kjt.weights().float()
    )
    assert_identical(got, numpy_reference(kjt_f32, tables, 4, sp.Capacity(n)))


def test_rejected_batches_fall_back_to_the_reference_messages():
    tables = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f0", "f1"])]
    stacks = sp.stack_tables(tables)
    caps = {"t": sp.Capacity(8)}
    cases = [
        (torch.tensor([1, 2, 10]), [1, 1, 0, 1]),  # id outside the table
        (torch.tensor([1, 2, 3]), [1, 1, 1, 1]),  # lengths do not add up
        (torch.tensor([1, 2, 3]), [4, -1, 0, 0]),  # a negative length balanced by a longer one
        (torch.tensor([1, 2, 3]), [2**62, 2**62, 2**62, 2**62]),  # would wrap an int64 sum
    ]
    kjts = [KeyedJaggedTensor(keys=["f0", "f1"], values=v, lengths=torch.tensor(n)) for v, n in cases]
    kjts += [
        # duplicate key, offsets not starting at 0, weights of a dtype torchrec does not take
        KeyedJaggedTensor(keys=["f0", "f0"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 0, 1, 0])),
        KeyedJaggedTensor(keys=["f0", "f1"], values=torch.tensor([1, 2, 3]), offsets=torch.tensor([1, 2, 2, 3, 3])),
        KeyedJaggedTensor(
            keys=["f0", "f1"],
            values=torch.tensor([1, 2]),
            lengths=torch.tensor([1, 0, 1, 0]),
            weights=torch.ones(2).to(torch.float8_e4m3fn),
        ),
    ]
    for kjt in kjts:
        assert preprocess_native(kjt, stacks, 2, caps, None, "error") is None
        with pytest.raises(ValueError):
            sp.preprocess_kjt(kjt, tables, 2, sp.Capacity(8))
    over = KeyedJaggedTensor(keys=["f0", "f1"], values=torch.arange(10) % 10, lengths=torch.tensor([5, 5, 0, 0]))
    assert preprocess_native(over, stacks, 1, {"t": sp.Capacity(4)}, None, "error") is None
    with pytest.raises(sp.CapacityError, match="the batch needs 10 ids"):
        sp.preprocess_kjt(over, tables, 1, sp.Capacity(4))


def test_bad_backend_choice_is_a_value_error(monkeypatch):
    monkeypatch.setenv("TPUREC_PREPROCESS", "fortran")
    tables = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])]
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([1]), lengths=torch.tensor([1]))
    with pytest.raises(ValueError, match="TPUREC_PREPROCESS must be 'auto', 'native' or 'numpy', got 'fortran'"):
        sp.preprocess_kjt(kjt, tables, 1, sp.Capacity(8))


def test_without_a_compiler_auto_falls_back_and_native_raises(tmp_path):
    script = textwrap.dedent(
        """
        import os, warnings, torch
        from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
        import tpurec.sparse as sp
        from tpurec.sparse.kernels.native import NativeBuildError
        tables = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])]
        kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([1, 1]), lengths=torch.tensor([2]))
        os.environ["TPUREC_PREPROCESS"] = "native"
        try:
            sp.preprocess_kjt(kjt, tables, 1, sp.Capacity(8))
            raise SystemExit("native did not raise")
        except NativeBuildError as e:
            assert "is not usable" in str(e), e
        os.environ["TPUREC_PREPROCESS"] = "auto"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            batch = sp.preprocess_kjt(kjt, tables, 1, sp.Capacity(8))
        assert any("native preprocessing unavailable" in str(w.message) for w in caught), caught
        assert float(batch.stacks["t"].gains[0]) == 2.0
        print("ok")
        """
    )
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "TPUREC_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


# --- hypothesis: random tables and KJTs --------------------------------------------------


@st.composite
def random_case(draw):
    num_tables = draw(st.integers(1, 3))
    tables, keys = [], []
    for t in range(num_tables):
        features = [f"t{t}f{i}" for i in range(draw(st.integers(1, 2)))]
        keys += features
        tables.append(
            EmbeddingBagConfig(
                name=f"t{t}",
                embedding_dim=draw(st.sampled_from([4, 8])),
                num_embeddings=draw(st.integers(1, 40)),
                feature_names=features,
                pooling=draw(st.sampled_from([PoolingType.SUM, PoolingType.MEAN])),
            )
        )
    rows = {f: t.num_embeddings for t in tables for f in t.feature_names}
    batch_size = draw(st.integers(1, 6))
    order = draw(st.permutations(keys))  # KJT key order need not follow the tables
    lengths, values = [], []
    for key in order:
        for _ in range(batch_size):
            n = draw(st.integers(0, 12))
            lengths.append(n)
            # Few distinct ids so that bags repeat ids (merging) and partitions fill up.
            values += draw(st.lists(st.integers(0, min(rows[key], 6) - 1), min_size=n, max_size=n))
    if values and draw(st.booleans()):  # sometimes an id outside its table
        i = draw(st.integers(0, len(values) - 1))
        values[i] = draw(st.sampled_from([-1, 10_000]))
    weights = None
    if draw(st.booleans()):
        weights = draw(
            st.lists(
                st.floats(-4, 4, width=32, allow_subnormal=False) | st.sampled_from([0.1, 1 / 3, -0.0, 3e38, -2e38]),
                min_size=len(values),
                max_size=len(values),
            )
        )
    kjt = KeyedJaggedTensor(
        keys=list(order),
        values=torch.tensor(values, dtype=torch.int64),
        lengths=torch.tensor(lengths, dtype=torch.int64),
        weights=None if weights is None else torch.tensor(weights, dtype=torch.float32),
    )
    num_partitions = draw(st.integers(1, 4))
    capacity = sp.Capacity(draw(st.integers(1, 40)), None)
    unique = draw(st.integers(1, capacity.max_ids_per_partition))
    capacity = sp.Capacity(capacity.max_ids_per_partition, unique)
    overflow = draw(st.sampled_from(["error", "drop"]))
    is_weighted = draw(st.sampled_from([None, True, False]))
    return tables, kjt, num_partitions, capacity, overflow, is_weighted


def _outcome(fn):
    try:
        return fn(), None
    except ValueError as e:  # includes CapacityError
        return None, (type(e), str(e))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_case())
def test_random_kjts_native_equals_numpy(case):
    tables, kjt, num_partitions, capacity, overflow, is_weighted = case
    stacks = sp.stack_tables(tables)
    caps = {s.name: capacity for s in stacks}
    native = preprocess_native(kjt, stacks, num_partitions, caps, is_weighted, overflow)
    reference, error = _outcome(
        lambda: numpy_reference(kjt, tables, num_partitions, capacity, is_weighted=is_weighted, overflow=overflow)
    )
    if error is not None:
        assert native is None, f"numpy raised {error} but native accepted the batch"
        # Through preprocess_kjt the native path falls back and raises the same error.
        assert (
            _outcome(
                lambda: sp.preprocess_kjt(
                    kjt, tables, num_partitions, capacity, is_weighted=is_weighted, overflow=overflow
                )
            )[1]
            == error
        )
        return
    assert native is not None, "native declined a batch the reference accepts"
    assert_identical(native, reference)
