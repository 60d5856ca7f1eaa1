"""The native XLA:CPU kernels (FFI) equal the JAX reference kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from torchrec import EmbeddingBagConfig
from torchrec.modules.embedding_configs import PoolingType

import tpurec.sparse as sp
from helpers import random_kjt
from tpurec.sparse.kernels import native, reference

TOL = dict(rtol=1e-6, atol=1e-6)

OPTIMIZERS = {
    "sgd": (0, dict(learning_rate=0.1)),
    "adagrad": (1, dict(learning_rate=0.1, eps=1e-8)),
    "rowwise_adagrad": (1, dict(learning_rate=0.1, eps=1e-8, weight_decay=0.01)),
    "adam": (2, dict(learning_rate=0.05, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=3)),
}


def _tables(pooling: PoolingType, rows: int = 23, dim: int = 8) -> list[EmbeddingBagConfig]:
    # Two tables stacked into one (row offsets), few rows so bags repeat ids.
    return [
        EmbeddingBagConfig(
            name="a", embedding_dim=dim, num_embeddings=rows, feature_names=["f0", "f1"], pooling=pooling
        ),
        EmbeddingBagConfig(
            name="b", embedding_dim=dim, num_embeddings=rows // 2, feature_names=["f2"], pooling=pooling
        ),
    ]


def _csr(seed: int, partitions: int, pooling=PoolingType.SUM, weighted=True, batch=16, rows=23, dim=8, capacity=256):
    tables = _tables(pooling, rows, dim)
    kjt = random_kjt(
        tables, batch, np.random.default_rng(seed), max_len=6, weighted=weighted
    )  # max_len>0: empty bags too
    batch_in = sp.preprocess_kjt(kjt, tables, partitions, sp.Capacity(capacity))
    (stack,) = batch_in.stacks.values()
    return stack.arrays(), 3 * batch, rows + rows // 2, dim


def _state(seed, rows, dim, num_slots, name):
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((rows, dim)).astype(np.float32)
    if name == "rowwise_adagrad":
        slots = [rng.random(rows).astype(np.float32)]
    else:
        slots = [rng.random((rows, dim)).astype(np.float32) for _ in range(num_slots)]
    return table, slots


def _as_tuple(x):
    return tuple(np.asarray(a) for a in (x if isinstance(x, tuple) else (x,)))


def _jit(fn):
    return jax.jit(fn, static_argnames=("batch_size",))


@pytest.mark.parametrize("partitions", [1, 3, 8])
@pytest.mark.parametrize(
    "pooling,weighted", [(PoolingType.SUM, True), (PoolingType.MEAN, False), (PoolingType.SUM, False)]
)
def test_forward_matches_reference(partitions, pooling, weighted):
    csr, batch, rows, dim = _csr(partitions, partitions, pooling, weighted)
    table = np.random.default_rng(7).standard_normal((rows, dim)).astype(np.float32)
    got = _jit(native.sparse_dense_matmul)(*csr, table, batch_size=batch)
    want = _jit(reference.sparse_dense_matmul)(*csr, table, batch_size=batch)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("partitions,pooling", [(1, PoolingType.SUM), (4, PoolingType.MEAN), (5, PoolingType.SUM)])
def test_grad_matches_reference(name, partitions, pooling):
    num_slots, hp = OPTIMIZERS[name]
    op = f"sparse_dense_matmul_grad_with_{name}"
    csr, batch, rows, dim = _csr(10 + partitions, partitions, pooling)
    table, slots = _state(1, rows, dim, num_slots, name)
    grad = np.random.default_rng(2).standard_normal((batch, dim)).astype(np.float32)
    got = _as_tuple(jax.jit(getattr(native, op))(*csr, grad, table, *slots, **hp))
    want = _as_tuple(jax.jit(getattr(reference, op))(*csr, grad, table, *slots, **hp))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, **TOL)
    assert not np.array_equal(got[0], table)  # something was updated
    # Untouched rows are bit-identical (only touched rows are written).
    touched = np.zeros(rows, bool)
    rp, ids, _, _ = csr
    size = ids.shape[0] // rp.shape[0]
    for p in range(rp.shape[0]):
        touched[ids[p * size : rp[p]]] = True
    np.testing.assert_array_equal(got[0][~touched], table[~touched])


def test_multithreaded_size_matches_reference():
    # Large enough to take the multi-threaded path (the C++ side skips threads for tiny inputs).
    csr, batch, rows, dim = _csr(3, 6, batch=256, rows=400, dim=32, capacity=1024)
    table, (acc,) = _state(4, rows, dim, 1, "rowwise_adagrad")
    grad = np.random.default_rng(5).standard_normal((batch, dim)).astype(np.float32)
    np.testing.assert_allclose(
        np.asarray(_jit(native.sparse_dense_matmul)(*csr, table, batch_size=batch)),
        np.asarray(_jit(reference.sparse_dense_matmul)(*csr, table, batch_size=batch)),
        **TOL,
    )
    hp = OPTIMIZERS["rowwise_adagrad"][1]
    op = "sparse_dense_matmul_grad_with_rowwise_adagrad"
    got = _as_tuple(jax.jit(getattr(native, op))(*csr, grad, table, acc, **hp))
    want = _as_tuple(jax.jit(getattr(reference, op))(*csr, grad, table, acc, **hp))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, **TOL)


def test_garbage_past_row_pointers_is_ignored():
    (rp, ids, samples, gains), batch, rows, dim = _csr(0, 3)
    table, _ = _state(0, rows, dim, 0, "sgd")
    grad = np.ones((batch, dim), np.float32)
    clean = _jit(native.sparse_dense_matmul)(rp, ids, samples, gains, table, batch_size=batch)
    clean_sgd = jax.jit(native.sparse_dense_matmul_grad_with_sgd)(
        rp, ids, samples, gains, grad, table, learning_rate=0.1
    )
    size = ids.shape[0] // rp.shape[0]
    ids, samples, gains = ids.copy(), samples.copy(), gains.copy()
    for p in range(rp.shape[0]):
        ids[rp[p] : (p + 1) * size], samples[rp[p] : (p + 1) * size], gains[rp[p] : (p + 1) * size] = 3, 0, np.nan
    dirty = _jit(native.sparse_dense_matmul)(rp, ids, samples, gains, table, batch_size=batch)
    dirty_sgd = jax.jit(native.sparse_dense_matmul_grad_with_sgd)(
        rp, ids, samples, gains, grad, table, learning_rate=0.1
    )
    np.testing.assert_array_equal(np.asarray(clean), np.asarray(dirty))
    np.testing.assert_array_equal(np.asarray(clean_sgd), np.asarray(dirty_sgd))


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_unsorted_and_misplaced_ids_match_reference(name):
    # Other producers may not sort partitions or may put an id in several
    # partitions; the kernel then sorts / falls back to one thread.
    rng = np.random.default_rng(9)
    partitions, size, rows, dim, batch = 3, 16, 7, 4, 10
    rp = (np.arange(partitions) * size + rng.integers(0, size + 1, partitions)).astype(np.int32)
    ids = rng.integers(0, rows, partitions * size).astype(np.int32)
    ids[5] = 2**31 - 1  # a padding entry inside the valid range
    samples = rng.integers(0, batch, partitions * size).astype(np.int32)
    gains = rng.uniform(0.5, 2, partitions * size).astype(np.float32)
    num_slots, hp = OPTIMIZERS[name]
    table, slots = _state(3, rows, dim, num_slots, name)
    grad = rng.standard_normal((batch, dim)).astype(np.float32)
    csr = (rp, ids, samples, gains)
    np.testing.assert_allclose(
        np.asarray(_jit(native.sparse_dense_matmul)(*csr, table, batch_size=batch)),
        np.asarray(_jit(reference.sparse_dense_matmul)(*csr, table, batch_size=batch)),
        **TOL,
    )
    op = f"sparse_dense_matmul_grad_with_{name}"
    got = _as_tuple(jax.jit(getattr(native, op))(*csr, grad, table, *slots, **hp))
    want = _as_tuple(jax.jit(getattr(reference, op))(*csr, grad, table, *slots, **hp))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, **TOL)


def test_new_data_and_hyperparameters_do_not_recompile():
    fwd = _jit(native.sparse_dense_matmul)
    step = jax.jit(native.sparse_dense_matmul_grad_with_adam)
    table, (m1, m2) = _state(0, 34, 8, 2, "adam")
    hp = dict(OPTIMIZERS["adam"][1])
    for seed in range(3):
        csr, batch, _, _ = _csr(100 + seed, 4)
        grad = np.random.default_rng(seed).standard_normal((batch, 8)).astype(np.float32)
        fwd(*csr, table, batch_size=batch)
        hp.update(learning_rate=0.01 * (seed + 1), step=np.int32(seed + 1))
        table, m1, m2 = step(*csr, grad, table, m1, m2, **hp)
        if seed == 0:
            counts = dict(native.TRACE_COUNTS)
    assert dict(native.TRACE_COUNTS) == counts


def test_donated_table_is_updated_in_place():
    csr, batch, rows, dim = _csr(0, 4)
    table, (acc,) = _state(0, rows, dim, 1, "rowwise_adagrad")
    # Buffers XLA owns (device_put of numpy may borrow the numpy memory, which cannot be donated).
    table, acc = jnp.asarray(table) * 1, jnp.asarray(acc) * 1
    pointers = (table.unsafe_buffer_pointer(), acc.unsafe_buffer_pointer())
    step = jax.jit(native.sparse_dense_matmul_grad_with_rowwise_adagrad, donate_argnums=(5, 6))
    grad = np.ones((batch, dim), np.float32)
    new_table, new_acc = step(*csr, grad, table, acc, **OPTIMIZERS["rowwise_adagrad"][1])
    assert (new_table.unsafe_buffer_pointer(), new_acc.unsafe_buffer_pointer()) == pointers


def test_float64_table_is_rejected():
    csr, batch, rows, dim = _csr(0, 2)
    with pytest.raises(TypeError, match="float32"):
        native.sparse_dense_matmul(*csr, np.zeros((rows, dim)), batch_size=batch)


def test_compile_failure_raises_with_compiler_output(tmp_path, monkeypatch):
    import tpurec.native

    bad = tmp_path / "sparse_cpu.cc"
    bad.write_text("this is not C++;\n")
    monkeypatch.setattr(tpurec.native, "_SOURCES", (bad, *tpurec.native._SOURCES[1:]))
    monkeypatch.setenv("TPUREC_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(native.NativeBuildError, match="(?s)compiling sparse_cpu.cc, .* failed.*error"):
        native.library_path()
    assert not list((tmp_path / "cache" / "native").glob("*.so*"))
