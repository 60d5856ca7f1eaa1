"""The TensorCore kernels (XLA and streaming Pallas paths, Pallas in interpret mode here) equal
the reference kernels, and the op set picks its kernel from the chip."""

from __future__ import annotations

import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagConfig
from torchrec.modules.embedding_configs import PoolingType

import tpurec
import tpurec.sparse as sp
from helpers import random_kjt
from tpurec.sparse import ops
from tpurec.sparse.kernels import reference, tensorcore
from tpurec.sparse.planner.topology import DEVICE_KINDS, TPU_GENERATIONS

OPTIMIZERS = {
    "sgd": (0, dict(learning_rate=0.1)),
    "adagrad": (1, dict(learning_rate=0.1, eps=1e-8)),
    "rowwise_adagrad": (1, dict(learning_rate=0.1, eps=1e-8, weight_decay=0.01)),
    "adam": (2, dict(learning_rate=0.05, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=3)),
}


def _csr(
    seed: int, partitions: int, rows: int, *, pooling=PoolingType.SUM, weighted=True, batch=16, dim=8, capacity=256
):
    # Few rows per id slot make the streaming path run (and bags repeat ids); many rows the XLA path.
    tables = [
        EmbeddingBagConfig(
            name="a", embedding_dim=dim, num_embeddings=rows, feature_names=["f0", "f1"], pooling=pooling
        ),
        EmbeddingBagConfig(
            name="b", embedding_dim=dim, num_embeddings=rows // 2, feature_names=["f2"], pooling=pooling
        ),
    ]
    kjt = random_kjt(tables, batch, np.random.default_rng(seed), max_len=6, weighted=weighted)
    (stack,) = sp.preprocess_kjt(kjt, tables, partitions, sp.Capacity(capacity)).stacks.values()
    return stack.arrays(), 3 * batch, rows + rows // 2, dim


def _state(seed, rows, dim, name, dtype=np.float32):
    rng = np.random.default_rng(seed)
    table = rng.standard_normal((rows, dim)).astype(dtype)
    n = OPTIMIZERS[name][0]
    slots = (
        [rng.random(rows).astype(np.float32)]
        if name == "rowwise_adagrad"
        else [rng.random((rows, dim)).astype(np.float32) for _ in range(n)]
    )
    return table, slots


def _jit(fn):
    # A new function each time: jax.jit caches traces by function, and TPUREC_TENSORCORE_ONE_PASS
    # is read while tracing.
    return jax.jit(lambda *args, batch_size: fn(*args, batch_size=batch_size), static_argnames=("batch_size",))


def _tuple(x):
    return tuple(np.asarray(a) for a in (x if isinstance(x, tuple) else (x,)))


def _check_grad(name, csr, reference_csr, batch, table, slots, **tolerance):
    """The TensorCore gradient op on ``csr`` against the reference's on ``reference_csr``."""
    grad = np.random.default_rng(5).standard_normal((batch, table.shape[1])).astype(np.float32)
    op = f"sparse_dense_matmul_grad_with_{name}"
    got = _tuple(jax.jit(lambda *a: getattr(tensorcore, op)(*a, **OPTIMIZERS[name][1]))(*csr, grad, table, *slots))
    want = _tuple(jax.jit(getattr(reference, op))(*reference_csr, grad, table, *slots, **OPTIMIZERS[name][1]))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, **tolerance)


def _check_stream_update(name, csr, batch, table, slots, **options):
    """``tensorcore.stream_update`` with ``options`` against the reference's gradient op."""
    grad = np.random.default_rng(8).standard_normal((batch, table.shape[1])).astype(np.float32)
    hp = OPTIMIZERS[name][1]
    op = f"sparse_dense_matmul_grad_with_{name}"

    def step(*args):
        keys, samples, gains, _ = tensorcore._sorted_entries(*args[:4])
        return tensorcore.stream_update(op, args[5], args[6:], keys, samples, gains, args[4], hp, **options)

    got = _tuple(jax.jit(step)(*csr, grad, table, *slots))
    want = _tuple(jax.jit(lambda *a: getattr(reference, op)(*a, **hp))(*csr, grad, table, *slots))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)  # as the resident loop (FMA contraction)


# rows 23: 3 * 16 * 6 id slots over 34 rows -> streaming; rows 3000 (4500 in all) -> the one-pass optimizer
# step over 2048-row blocks (the last one partial); rows 100000 -> XLA gathers and scatters.
CASES = [(1, 23), (3, 23), (1, 3000), (4, 100000)]


@pytest.mark.parametrize("one_pass", [False, True], ids=["gather_then_pool", "one_pass"])
@pytest.mark.parametrize("partitions,rows", CASES)
@pytest.mark.parametrize("pooling,weighted", [(PoolingType.SUM, True), (PoolingType.MEAN, False)])
def test_forward_matches_reference(partitions, rows, pooling, weighted, one_pass):
    csr, batch, rows, dim = _csr(partitions + rows, partitions, rows, pooling=pooling, weighted=weighted)
    table = np.random.default_rng(7).standard_normal((rows, dim)).astype(np.float32)
    assert tensorcore.streams(csr[1].shape[0], table) == (rows < 10000)
    before = tensorcore.TRACE_COUNTS["stream_pool"]
    with tpurec.config.override(tensorcore_one_pass=one_pass):
        got = _jit(tensorcore.sparse_dense_matmul)(*csr, table, batch_size=batch)
    assert tensorcore.TRACE_COUNTS["stream_pool"] - before == int(one_pass and rows < 10000)
    want = _jit(reference.sparse_dense_matmul)(*csr, table, batch_size=batch)
    # Same products, summed in the same (entry) order: equal to float32 rounding of the order.
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


# The MXU row sum changes the one-pass step only, which runs on the (1, 3000) case.
GRAD_CASES = [(*case, one_pass, "loop") for case in CASES for one_pass in (False, True)] + [(1, 3000, True, "mxu")]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("partitions,rows,one_pass,row_sum", GRAD_CASES)
def test_grad_matches_reference(name, partitions, rows, one_pass, row_sum):
    csr, batch, rows, dim = _csr(partitions * 7 + rows, partitions, rows)
    table, slots = _state(3, rows, dim, name)
    fused = one_pass and tensorcore.BLOCK_ROWS <= rows < 10000  # the one-pass step needs whole blocks
    before = tensorcore.TRACE_COUNTS["stream_update"]
    with tpurec.config.override(tensorcore_one_pass=one_pass, tensorcore_row_sum=row_sum):
        if not fused:
            _check_grad(name, csr, csr, batch, table, slots, rtol=1e-6, atol=1e-7)
        else:
            # The one-pass step sums each row's gradients in entry order too, as multiply-adds that
            # XLA may contract into FMAs (one rounding instead of two), or on the MXU in its own
            # order (exact products): float32 rounding, amplified by Adam's division by sqrt(m2).
            _check_grad(name, csr, csr, batch, table, slots, rtol=1e-5, atol=1e-6)
    assert tensorcore.TRACE_COUNTS["stream_update"] - before == int(fused)


@pytest.mark.parametrize("row_sum", ["loop", "mxu"])
@pytest.mark.parametrize("name", ["rowwise_adagrad", "adam"])
def test_one_pass_step_with_the_output_gradient_streamed_per_entry(name, row_sum):
    # A batch whose output gradient does not fit VMEM: XLA gathers each entry's gradient row
    # first and the kernel reads them chunk by chunk with the ids (the MXU sum always, the loop
    # where no gradient window serves).
    csr, batch, rows, dim = _csr(31, 1, 3000)
    table, slots = _state(4, rows, dim, name)
    _check_stream_update(name, csr, batch, table, slots, resident=False, row_sum=row_sum, gradient_window=0)


# Lane-dense tables (several rows in each 128-lane line): rows 32 (48 in all) stream as one block of
# all its lines; rows 3072 (4608 in all) fill the one-pass step's 2048-row blocks (the last one partial).
LANE_DENSE = [(dim, rows) for dim in (8, 64) for rows in (32, 3072)]


@pytest.mark.parametrize("dim,rows", LANE_DENSE)
@pytest.mark.parametrize("partitions", [1, 3])
def test_lane_dense_forward_matches_reference(dim, rows, partitions):
    csr, batch, rows, dim = _csr(dim + rows + partitions, partitions, rows, dim=dim)
    table = np.random.default_rng(7).standard_normal((rows, dim)).astype(np.float32)
    assert tensorcore.rows_per_line(rows, dim) == 128 // dim and tensorcore.streams(csr[1].shape[0], table)
    got = _jit(tensorcore.sparse_dense_matmul)(*csr, table, batch_size=batch)
    want = _jit(reference.sparse_dense_matmul)(*csr, table, batch_size=batch)
    # Each row rotated to lane 0 and added in entry order, as the row layout does.
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dim,rows", [(64, 3072), (8, 3000)], ids=["lane_dense", "rows"])
@pytest.mark.parametrize("empty_window", [False, True])
def test_pooled_output_larger_than_vmem_is_made_in_windows(dim, rows, empty_window):
    # An output beyond what VMEM holds (batch 16384 of 26 tables: 426k rows) is made window by window:
    # here windows of 16 of the 48 output rows, with entries in every window or none in the middle one.
    csr, batch, rows, dim = _csr(dim + rows + empty_window, 1, rows, dim=dim)
    table = np.random.default_rng(9).standard_normal((rows, dim)).astype(np.float32)
    keys, samples, gains, valid = tensorcore._sorted_entries(*csr)
    if empty_window:
        gains = jnp.where((samples >= 16) & (samples < 32), 0.0, gains)
        valid = valid & ((samples < 16) | (samples >= 32))
        keys = jnp.where(valid, keys, sp.types.PAD_ID)
    want = jax.ops.segment_sum(
        jnp.where(valid[:, None], jnp.asarray(table)[jnp.minimum(keys, rows - 1)] * gains[:, None], 0.0),
        jnp.where(valid, samples, batch),
        num_segments=batch + 1,
    )[:batch]
    before = tensorcore.TRACE_COUNTS["stream_pool"]
    got = jax.jit(lambda *a: tensorcore.stream_pool(*a, batch, window_rows=16))(table, keys, samples, gains)
    assert tensorcore.TRACE_COUNTS["stream_pool"] == before + 1 and batch == 48
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    if empty_window:
        assert not np.asarray(got)[16:32].any()
    # Mosaic's rules (see test_every_block_index_is_int32_as_mosaic_requires) hold for the windows too.
    jaxpr = jax.make_jaxpr(lambda *a: tensorcore.stream_pool(*a, batch, window_rows=16))(table, keys, samples, gains)
    (call,) = _pallas_calls(jaxpr.jaxpr)
    for mapping in call.params["grid_mapping"].block_mappings:
        assert {str(a.dtype) for a in mapping.index_map_jaxpr.out_avals} <= {"int32"}
    assert not _wide_values(call.params["jaxpr"])


def test_the_op_pools_in_windows_when_the_output_does_not_fit(monkeypatch):
    csr, batch, rows, dim = _csr(77, 2, 3072, dim=64)
    table = np.random.default_rng(10).standard_normal((rows, dim)).astype(np.float32)
    want = _jit(reference.sparse_dense_matmul)(*csr, table, batch_size=batch)
    monkeypatch.setattr(tensorcore, "_POOL_VMEM", 20 * 128 * 4)  # 12 output rows a window
    assert tensorcore._pool_window(batch, 128) == 8
    got = _jit(tensorcore.sparse_dense_matmul)(*csr, table, batch_size=batch)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "gradient",
    [dict(resident=True), dict(resident=False), dict(resident=False, gradient_window=0)],
    ids=["resident", "gradient_window", "gathered_gradient"],
)
@pytest.mark.parametrize("dim", [8, 64])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_lane_dense_one_pass_step_matches_reference(name, dim, gradient):
    csr, batch, rows, dim = _csr(dim + 5, 1, 3072, dim=dim)
    assert tensorcore.rows_per_line(rows, dim) == 128 // dim
    table, slots = _state(6, rows, dim, name)
    _check_stream_update(name, csr, batch, table, slots, **gradient)


def _lowers_for_a_tpu(monkeypatch, fn, *args) -> None:
    """``fn(*args)`` lowers for a TPU here on the CPU (see test_every_kernel_lowers_for_a_tpu)."""
    from jax._src.pallas.mosaic import tpu_info

    v5e = tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V5E, 1)
    with monkeypatch.context() as patch:
        patch.setitem(tpu_info.registry, jax.devices()[0].device_kind, lambda: v5e)
        patch.setattr(tensorcore, "_interpret", lambda: False)
        # a new function: jax.jit would reuse a trace made with the interpreter
        exported = jax.export.export(jax.jit(lambda *a: fn(*a)), platforms=("tpu",))(*args)
    assert "tpu_custom_call" in exported.mlir_module()


@pytest.mark.parametrize("window,served", [(384, True), (128, False)])
def test_step_reads_an_output_gradient_too_large_for_vmem_through_a_moving_window(window, served, monkeypatch):
    # Batch 256 of 3 features: 768 output gradient rows, features 0-1 on table a, feature 2 on table b.
    # Windows of 2 x 384 rows hold each chunk's samples (the window moves from row 0 to row 384 when
    # the walk reaches table b); windows of 2 x 128 cannot hold table a's 512 rows, so every entry's
    # gradient row is gathered first. Both give the reference's step.
    csr, batch, rows, dim = _csr(21, 1, 3072, dim=64, batch=256, capacity=4096)
    table, slots = _state(13, rows, dim, "rowwise_adagrad")
    keys, samples, gains, valid = tensorcore._sorted_entries(*csr)
    keys, chunk, _, _ = tensorcore._walk(keys, rows, tensorcore.BLOCK_ROWS)
    samples = tensorcore._pad_to(samples, keys.shape[0])
    window_of, fits = tensorcore._gradient_windows(keys < rows, samples, chunk, window)
    assert bool(fits) == served and batch == 768
    if served:
        assert set(np.asarray(window_of).tolist()) == {0, 1}
    options = dict(resident=False, gradient_window=window)
    _check_stream_update("rowwise_adagrad", csr, batch, table, slots, **options)
    op, hp = "sparse_dense_matmul_grad_with_rowwise_adagrad", OPTIMIZERS["rowwise_adagrad"][1]

    def step(*args):
        keys, samples, gains, _ = tensorcore._sorted_entries(*args[:4])
        return tensorcore.stream_update(op, args[5], args[6:], keys, samples, gains, args[4], hp, **options)

    _lowers_for_a_tpu(monkeypatch, step, *csr, np.zeros((batch, dim), np.float32), table, *slots)


@pytest.mark.parametrize("dim", [8, 64])
def test_lane_dense_row_slots_on_the_mxu_match_reference(dim):
    # TPUREC_TENSORCORE_ROW_SLOTS=mxu: row-wise Adagrad's accumulator moved between its lanes and the
    # block's lines, and each row's mean, by exact products (only the float32 accumulation's order
    # differs from the lane sums').
    csr, batch, rows, dim = _csr(dim + 9, 1, 3072, dim=dim)
    table, slots = _state(8, rows, dim, "rowwise_adagrad")
    grad = np.zeros((batch, dim), np.float32)
    op = tensorcore.sparse_dense_matmul_grad_with_rowwise_adagrad
    products = {}
    for choice in ("xlu", "mxu"):
        with tpurec.config.override(tensorcore_row_slots=choice):
            jaxpr = jax.make_jaxpr(lambda *a: op(*a, **OPTIMIZERS["rowwise_adagrad"][1]))(*csr, grad, table, *slots)
        kernels = _pallas_calls(jaxpr.jaxpr)
        products[choice] = sum(str(e.params["jaxpr"]).count("dot_general") for e in kernels)
    assert products["xlu"] == 0 and products["mxu"] > 0, products  # the flag picks the product path
    with tpurec.config.override(tensorcore_row_slots="mxu"):
        _check_stream_update("rowwise_adagrad", csr, batch, table, slots, resident=True)


@pytest.mark.parametrize(
    "block_rows,gradient",
    [(2048, dict(resident=True)), (2048, dict(resident=False, gradient_window=0)), (4096, dict(resident=True))],
    ids=["resident", "gathered_gradient", "blocks_of_4096"],
)
def test_lane_dense_row_math_once_a_row_matches_reference(block_rows, gradient):
    # TPUREC_TENSORCORE_ROW_SLOTS=transpose: row-wise Adagrad's accumulator stays one value a row (in
    # the kernel's pair order), each row's mean is a transposed sum and the per-row multiplier goes
    # back to the row's lanes by a transpose: no product, and only the sums' order differs.
    csr, batch, rows, dim = _csr(17, 1, 6144, dim=64, capacity=1024)
    table, slots = _state(9, rows, dim, "rowwise_adagrad")
    grad = np.zeros((batch, dim), np.float32)
    op = tensorcore.sparse_dense_matmul_grad_with_rowwise_adagrad
    with tpurec.config.override(tensorcore_row_slots="transpose"):
        jaxpr = jax.make_jaxpr(lambda *a: op(*a, **OPTIMIZERS["rowwise_adagrad"][1]))(*csr, grad, table, *slots)
        kernels = _pallas_calls(jaxpr.jaxpr)
        assert not any("dot_general" in str(e.params["jaxpr"]) for e in kernels)
        assert any("transpose" in str(e.params["jaxpr"]) for e in kernels)
        _check_stream_update("rowwise_adagrad", csr, batch, table, slots, block_rows=block_rows, **gradient)


@pytest.mark.parametrize("dim,row_slots", [(8, "mxu"), (64, "mxu"), (64, "transpose")])
@pytest.mark.parametrize("name", ["sgd", "rowwise_adagrad"])
def test_rows_marked_with_their_block_number_match_reference(name, dim, row_slots, monkeypatch):
    # block_marks: the touched-row buffer is cleared once and each block marks its rows with its own
    # number, so rows an earlier block marked at the same offsets must not count as touched (4 blocks).
    csr, batch, rows, dim = _csr(23, 1, 6144, dim=dim, capacity=512)
    table, slots = _state(4, rows, dim, name)
    with tpurec.config.override(tensorcore_row_slots=row_slots, tensorcore_lane_dense=dim == 64):
        assert tensorcore.rows_per_line(rows, dim) == (2 if dim == 64 else 1)  # rows as they are, or lines
        _check_stream_update(name, csr, batch, table, slots, resident=True, block_marks=True)
        op, hp = f"sparse_dense_matmul_grad_with_{name}", OPTIMIZERS[name][1]

        def step(*args):
            keys, samples, gains, _ = tensorcore._sorted_entries(*args[:4])
            return tensorcore.stream_update(op, args[5], args[6:], keys, samples, gains, args[4], hp, block_marks=True)

        _lowers_for_a_tpu(monkeypatch, step, *csr, np.zeros((batch, dim), np.float32), table, *slots)


def test_lane_dense_xla_rows_gather_and_write_whole_lines():
    # Keys sharing lines (every row of some lines, one row of others), keys past the table skipped.
    rng = np.random.default_rng(2)
    table = rng.standard_normal((64, 16)).astype(np.float32)  # 8 rows a line
    keys = np.array([0, 1, 2, 3, 4, 5, 6, 7, 9, 23, 24, 63, 64, 70], np.int32)
    new_rows = rng.standard_normal((keys.size, 16)).astype(np.float32)
    assert tensorcore.rows_per_line(64, 16) == 8
    got = jax.jit(tensorcore._xla_take_rows)(table, keys)
    np.testing.assert_array_equal(np.asarray(got), table[np.minimum(keys, 63)])
    put = jax.jit(tensorcore._xla_put_rows)(table, keys, new_rows)
    want = table.copy()
    want[keys[keys < 64]] = new_rows[keys < 64]
    np.testing.assert_array_equal(np.asarray(put), want)


def test_lane_dense_layout_rule():
    assert tensorcore.rows_per_line(100_000, 64) == 2
    assert tensorcore.rows_per_line(100_001, 64) == 1  # the rows do not fill whole lines
    assert tensorcore.rows_per_line(100_000, 128) == 1 and tensorcore.rows_per_line(100_000, 48) == 1
    assert tensorcore.rows_per_line(100_000, 64, jnp.bfloat16) == 1
    with tpurec.config.override(tensorcore_lane_dense=False):
        assert tensorcore.rows_per_line(100_000, 64) == 1


@pytest.mark.parametrize("family", ["native", "reference", "tensorcore"])
def test_tables_are_stored_lane_dense_only_where_the_tensorcore_kernel_runs(family):
    # The lines are the TensorCore kernels' layout; the native XLA:CPU kernel's step copied a table stored
    # so (a DLRM step twice as long), and the SparseCore primitives take rows.
    from tpurec.core import array_of

    configs = [EmbeddingBagConfig(name="t", embedding_dim=64, num_embeddings=1024, feature_names=["f"])]
    with tpurec.config.override(sparse_kernel=family):
        ebc = sp.EmbeddingBagCollection(configs, optimizer=sp.Adagrad(learning_rate=0.1), device="tpu")
        kjt = random_kjt(configs, 8, np.random.default_rng(0))
        before = ebc.stacked_weight(0).detach().cpu().clone()
        out = ebc(kjt)
        out.values().sum().backward()
    stored = (512, 128) if family == "tensorcore" else (1024, 64)
    assert tuple(array_of(ebc.stacked_weight(0)).shape) == stored
    assert tuple(array_of(ebc.stacked_momentum1_0).shape) == stored  # Adagrad's element slot too
    assert tuple(ebc.stacked_weight(0).shape) == (1024, 64)  # the tensor keeps its rows either way
    assert not torch.equal(ebc.stacked_weight(0).detach().cpu(), before)  # it trained


def test_a_collection_on_the_cpu_does_not_start_jax():
    # Which kernel runs (and so the tables' layout) is asked only for tables on the tpu device: asking starts
    # JAX's runtime, which a process must be able to defer (jax.distributed.initialize comes first).
    code = (
        "import tpurec.sparse as sp\n"
        "from torchrec import EmbeddingBagConfig\n"
        "from jax._src import xla_bridge\n"
        "c = EmbeddingBagConfig(name='t', embedding_dim=64, num_embeddings=1024, feature_names=['f'])\n"
        "sp.EmbeddingBagCollection([c], optimizer=sp.Adagrad(learning_rate=0.1)).float()\n"
        "assert not xla_bridge._backends, list(xla_bridge._backends)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_half_tables_match_reference(dtype):
    csr, batch, rows, dim = _csr(11, 1, 23)
    table, slots = _state(4, rows, dim, "rowwise_adagrad", np.float32)
    table = jnp.asarray(table, dtype)
    assert not tensorcore.streams(csr[1].shape[0], table)  # half rows go through XLA's gathers
    grad = np.random.default_rng(6).standard_normal((batch, dim)).astype(np.float32)
    got = jax.jit(tensorcore.sparse_dense_matmul, static_argnames="batch_size")(*csr, table, batch_size=batch)
    want = jax.jit(reference.sparse_dense_matmul, static_argnames="batch_size")(*csr, table, batch_size=batch)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    hp = OPTIMIZERS["rowwise_adagrad"][1]
    op = "sparse_dense_matmul_grad_with_rowwise_adagrad"
    got = _tuple(jax.jit(getattr(tensorcore, op))(*csr, grad, table, *slots, **hp))
    want = _tuple(jax.jit(getattr(reference, op))(*csr, grad, table, *slots, **hp))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


@pytest.mark.parametrize("name", ["sgd", "rowwise_adagrad"])
def test_entries_out_of_id_order(name):
    # A sharded program hands the kernel one partition of entries received from several devices,
    # each part sorted, the whole not: the kernel sorts them (the reference sums in entry order).
    csr, batch, rows, dim = _csr(21, 1, 23)
    rp, ids, samples, gains = (np.asarray(a) for a in csr)
    n = int(rp[0])
    perm = np.concatenate([np.random.default_rng(0).permutation(n), np.arange(n, ids.shape[0])])
    shuffled = (rp, ids[perm], samples[perm], gains[perm])
    table, slots = _state(2, rows, dim, name)
    got = _jit(tensorcore.sparse_dense_matmul)(*shuffled, table, batch_size=batch)
    want = _jit(reference.sparse_dense_matmul)(*csr, table, batch_size=batch)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    # Summed in another order than the reference's: float32 rounding of the order.
    _check_grad(name, shuffled, csr, batch, table, slots, rtol=1e-5, atol=1e-6)


def test_empty_batch():
    csr, batch, rows, dim = _csr(2, 1, 23)
    table, slots = _state(1, rows, dim, "adagrad")
    out = tensorcore.sparse_dense_matmul(*csr, table, batch_size=0)
    assert out.shape == (0, dim)
    new_table, new_acc = tensorcore.sparse_dense_matmul_grad_with_adagrad(
        *csr, np.zeros((0, dim), np.float32), table, *slots, learning_rate=0.1, eps=1e-8
    )
    np.testing.assert_array_equal(np.asarray(new_table), table)
    np.testing.assert_array_equal(np.asarray(new_acc), slots[0])


@pytest.mark.parametrize("rows,n,block_rows", [(100, 37, 16), (1000, 600, 64), (64, 200, 8), (5000, 3, 2048)])
def test_stream_gather_and_scatter(rows, n, block_rows):
    # Sorted keys with repeats and PAD padding; blocks that no key touches; partial last block.
    rng = np.random.default_rng(rows + n)
    keys = np.sort(rng.integers(0, rows, n)).astype(np.int32)
    keys = np.concatenate([keys, np.full(5, 2**31 - 1, np.int32)])
    table = rng.standard_normal((rows, 8)).astype(np.float32)
    got = np.asarray(jax.jit(lambda t, k: tensorcore.stream_gather(t, k, block_rows=block_rows))(table, keys))
    np.testing.assert_array_equal(got[:n], table[keys[:n]])
    unique = np.unique(keys[:n])
    padded = np.concatenate([unique, np.full(n + 5 - unique.size, 2**31 - 1, np.int32)])
    new_rows = rng.standard_normal((padded.size, 8)).astype(np.float32)
    want = table.copy()
    want[unique] = new_rows[: unique.size]
    got = jax.jit(lambda t, k, r: tensorcore.stream_scatter(t, k, r, block_rows=block_rows))(table, padded, new_rows)
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("kind", sorted(DEVICE_KINDS))
def test_kernel_family_for_every_known_chip(kind):
    generation = TPU_GENERATIONS[DEVICE_KINDS[kind]]
    want = "sparsecore" if generation.name in ("v5p", "v6e", "v7x") else "tensorcore"
    assert ops.kernel_family("tpu", jnp.float32, device_kind=kind) == want
    # Half tables never take the SparseCore primitives (float32 rows only).
    assert ops.kernel_family("tpu", jnp.bfloat16, device_kind=kind) == "tensorcore"


def test_v5e_gets_the_tensorcore_kernel_and_no_sparsecore_count():
    assert ops.kernel_family("tpu", jnp.float32, device_kind="TPU v5 lite") == "tensorcore"
    assert TPU_GENERATIONS["v5e"].sparsecores_per_chip == 0


def test_unknown_tpu_kind_warns_once_and_uses_the_tensorcore_kernel():
    ops._warned_kinds.discard("TPU v99 hyper")
    with pytest.warns(UserWarning, match="TPU v99 hyper"):
        assert ops.kernel_family("tpu", jnp.float32, device_kind="TPU v99 hyper") == "tensorcore"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ops.kernel_family("tpu", jnp.float32, device_kind="TPU v99 hyper") == "tensorcore"


def test_other_platforms_and_override():
    assert ops.kernel_family("cpu", jnp.float32) == "native"
    assert ops.kernel_family("cpu", jnp.bfloat16) == "reference"
    assert ops.kernel_family("gpu", jnp.float32) == "reference"
    with tpurec.config.override(sparse_kernel="tensorcore"):
        assert ops.kernel_family("cpu", jnp.float32) == "tensorcore"
        assert ops.kernel_for("sparse_dense_matmul", "cpu") is tensorcore.sparse_dense_matmul
    with tpurec.config.override(sparse_kernel="reference"):
        assert ops.kernel_family("tpu", jnp.float32, device_kind="TPU v5") == "reference"
    with tpurec.config.override(sparse_kernel="sparsecore"), pytest.raises(ValueError, match="needs a TPU"):
        ops.kernel_family("cpu", jnp.float32)


def _pallas_calls(jaxpr) -> list:
    """Every ``pallas_call`` equation of a jaxpr, nested jaxprs included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.append(eqn)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    found += _pallas_calls(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    found += _pallas_calls(sub)
    return found


def _wide_values(jaxpr) -> list[str]:
    """The 64-bit vectors computed anywhere in a jaxpr (nested jaxprs included), as ``primitive:dtype``.

    (Scalars, such as a loop's counter, live in the scalar core, which takes 64-bit values.)"""
    found = []
    for eqn in jaxpr.eqns:
        found += [
            f"{eqn.primitive.name}:{v.aval.dtype}"
            for v in eqn.outvars
            if getattr(v.aval, "shape", ()) != () and np.dtype(v.aval.dtype).itemsize == 8
        ]
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    found += _wide_values(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    found += _wide_values(sub)
    return found


_KERNEL_LAYOUTS = pytest.mark.parametrize(
    "layout", ["rows", "lane_dense", "lane_dense_mxu_row_slots", "lane_dense_transpose_row_slots"]
)
_KERNEL_PASSES = pytest.mark.parametrize(
    "one_pass,row_sum", [(False, "loop"), (True, "loop"), (True, "mxu")], ids=["two_pass", "one_pass", "mxu"]
)


def _streaming_calls(name: str, one_pass: bool, row_sum: str, layout: str):
    """The forward and the optimizer step of one kernel configuration, as (function, arguments) pairs,
    and the config overrides that select it (to apply while tracing them)."""
    dim, rows = (8, 3000) if layout == "rows" else (64, 3072)
    row_slots = {"lane_dense_mxu_row_slots": "mxu", "lane_dense_transpose_row_slots": "transpose"}.get(layout, "xlu")
    csr, batch, rows, dim = _csr(3, 1, rows, dim=dim)
    assert (tensorcore.rows_per_line(rows, dim) > 1) == layout.startswith("lane_dense")
    table, slots = _state(3, rows, dim, name)
    grad = np.zeros((batch, dim), np.float32)
    op = getattr(tensorcore, f"sparse_dense_matmul_grad_with_{name}")
    # Hyperparameters traced, as the op set passes them (they go to SMEM).
    hp = {k: jnp.float32(v) for k, v in OPTIMIZERS[name][1].items()}
    calls = [
        (lambda *a: tensorcore.sparse_dense_matmul(*a, batch_size=batch), (*csr, table)),
        (lambda *a: op(*a, **hp), (*csr, grad, table, *slots)),
    ]
    overrides = dict(tensorcore_one_pass=one_pass, tensorcore_row_sum=row_sum, tensorcore_row_slots=row_slots)
    return calls, overrides


@_KERNEL_LAYOUTS
@_KERNEL_PASSES
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_block_index_is_int32_as_mosaic_requires(name, one_pass, row_sum, layout):
    # tpurec runs JAX with x64 on, where a Python 0 in an index map (or a BlockSpec without one)
    # traces as int64 and a Python float in jnp.where as float64: Pallas' interpreter accepts them
    # and Mosaic refuses the kernel ("failed to legalize operation 'func.func' ... -> i64", or a
    # crash in its layout inference), so only a TPU would show it.
    functions, overrides = _streaming_calls(name, one_pass, row_sum, layout)
    with tpurec.config.override(**overrides):
        jaxprs = [jax.make_jaxpr(f)(*args) for f, args in functions]
    calls = [eqn for j in jaxprs for eqn in _pallas_calls(j.jaxpr)]
    assert len(calls) >= 2  # the forward's and the backward's streaming kernels
    for eqn in calls:
        for mapping in eqn.params["grid_mapping"].block_mappings:
            dtypes = [str(a.dtype) for a in mapping.index_map_jaxpr.out_avals]
            assert set(dtypes) <= {"int32"}, (eqn.params.get("name"), mapping.block_shape, dtypes)
        assert not _wide_values(eqn.params["jaxpr"]), (eqn.params.get("name"), _wide_values(eqn.params["jaxpr"]))


@_KERNEL_LAYOUTS
@_KERNEL_PASSES
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_kernel_lowers_for_a_tpu(name, one_pass, row_sum, layout, monkeypatch):
    # Lowering for a TPU runs Pallas' Mosaic lowering and the MLIR verifier here on the CPU, which
    # catch what the interpreter lets through (a loop counted in int64 under x64 multiplied by an
    # int32 fails verification: "'arith.muli' op requires the same type for all operands"). The
    # chip-specific figures Mosaic asks for are a v5e's.
    functions, overrides = _streaming_calls(name, one_pass, row_sum, layout)
    with tpurec.config.override(**overrides):
        for f, args in functions:
            _lowers_for_a_tpu(monkeypatch, f, *args)


def test_the_sharded_collection_streams_its_shards_as_rows():
    # A sharded collection keeps each shard as a [rows, dim] array: its kernels must stream those
    # rows, not repack them into lane-dense lines on every call.
    from tpurec.sparse.sharding.ebc import ShardedEmbeddingBagCollection

    csr, batch, rows, dim = _csr(9, 1, 3072, dim=64)
    table = np.zeros((rows, dim), np.float32)
    assert tensorcore.rows_per_line(rows, dim) == 2
    with tpurec.config.override(sparse_kernel="tensorcore"):  # (the kernel is chosen when traced, by the stack's dtype)
        lookup = ShardedEmbeddingBagCollection._kernel(None, "sparse_dense_matmul")  # pyright: ignore[reportArgumentType]
        jaxpr = jax.make_jaxpr(lambda *a: lookup(*a, batch_size=batch))(*csr, table)
    widths = {
        m.block_shape[-1] for eqn in _pallas_calls(jaxpr.jaxpr) for m in eqn.params["grid_mapping"].block_mappings
    }
    assert 128 not in widths and "Blocked(block_size=64)" in str(widths), widths
