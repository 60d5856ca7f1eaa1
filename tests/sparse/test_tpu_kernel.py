"""The TPU kernels (jax-tpu-embedding primitives), checked on CPU.

* The CSR conversion is compared with jax-tpu-embedding's own host
  preprocessing, buffer for buffer.
* A numpy model of the SparseCore kernels (per SparseCore, per partition,
  shard-local ids into the MOD-sharded table) run on the converted buffers
  must reproduce the reference kernels: this checks the table layout, the
  batch split and the optimizer row updates end to end.
* Each kernel is exported for platform "tpu": the StableHLO must hold the
  SparseCore custom calls with the expected operand shapes, and two batches of
  the same capacities must give the same module.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import PoolingType

import tpurec.sparse as sp
from tpurec.sparse.kernels import reference
from tpurec.sparse.types import PAD_ID

jte = pytest.importorskip("jax_tpu_embedding.sparsecore.lib.nn.embedding")
from jax_tpu_embedding.sparsecore.lib.nn import embedding_spec  # noqa: E402

from tpurec.sparse.kernels import tpu  # noqa: E402

PAD = PAD_ID
ROWS, DIM = 37, 8


def _batch(rng, batch_size, rows=ROWS, max_len=5, weighted=True):
    lens = rng.integers(0, max_len, batch_size)
    ids = [rng.integers(0, rows, n).astype(np.int32) for n in lens]
    ws = [rng.uniform(0.5, 2.0, n).astype(np.float32) if weighted else np.ones(n, np.float32) for n in lens]
    return lens, ids, ws


def _ours(lens, ids, ws, num_partitions, cap, rows=ROWS, dim=DIM, pooling=PoolingType.SUM):
    table = EmbeddingBagConfig(name="t", embedding_dim=dim, num_embeddings=rows, feature_names=["f"], pooling=pooling)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f"],
        values=torch.from_numpy(np.concatenate(ids).astype(np.int64)),
        lengths=torch.from_numpy(lens),
        weights=torch.from_numpy(np.concatenate(ws)),
    )
    csr = sp.preprocess_kjt(kjt, [table], num_partitions=num_partitions, capacities=sp.Capacity(cap)).stacks["t"]
    return tuple(jnp.asarray(a) for a in csr.arrays())


def _theirs(lens, ids, ws, num_sc, cap):
    B = len(lens)
    spec = embedding_spec.TableSpec(
        name="t",
        vocabulary_size=ROWS,
        embedding_dim=DIM,
        initializer=lambda *a, **k: None,
        optimizer=embedding_spec.SGDOptimizerSpec(),
        combiner="sum",
        max_ids_per_partition=cap,
        max_unique_ids_per_partition=cap,
    )
    specs = {"f": embedding_spec.FeatureSpec(name="f", table_spec=spec, input_shape=[B, 1], output_shape=[B, DIM])}
    feats, weights = np.empty(B, dtype=object), np.empty(B, dtype=object)
    for b in range(B):
        feats[b], weights[b] = ids[b], ws[b]
    jte.prepare_feature_specs_for_training(specs, global_device_count=1, num_sc_per_device=num_sc)
    out, _ = jte.preprocess_sparse_dense_matmul_input(
        {"f": feats}, {"f": weights}, specs, 1, 1, num_sc_per_device=num_sc
    )
    return tuple(
        np.asarray(getattr(out, k)["t"])
        for k in ("lhs_row_pointers", "lhs_embedding_ids", "lhs_sample_ids", "lhs_gains")
    )


@pytest.mark.parametrize("num_sc", [2, 4])
def test_conversion_matches_jax_tpu_embedding(num_sc):
    rng = np.random.default_rng(num_sc)
    B, cap = 16, 24
    lens, ids, ws = _batch(rng, B)
    rp, eids, samples, gains = _theirs(lens, ids, ws, num_sc, cap)
    mine = tpu.to_sparsecore_csr(*_ours(lens, ids, ws, num_sc, cap), batch_size=B, num_sc=num_sc)
    assert mine.device_batch_size == B and mine.max_ids_per_partition == cap
    # Same static buffer sizes as jax-tpu-embedding for the same capacity.
    assert mine.row_pointers.shape == rp.shape and mine.embedding_ids.shape == eids.shape
    np.testing.assert_array_equal(np.asarray(mine.row_pointers), rp)
    chunk = eids.shape[0] // num_sc
    for c in range(num_sc):
        # Past the last aligned end their buffers are uninitialised; padding
        # inside partitions' 8-blocks is PAD in both.
        used = c * chunk + int(rp.reshape(num_sc, -1)[c, -1])
        sl = slice(c * chunk, used)
        np.testing.assert_array_equal(np.asarray(mine.embedding_ids)[sl], eids[sl])
        np.testing.assert_array_equal(np.asarray(mine.sample_ids)[sl], samples[sl])
        valid = eids[sl] != PAD
        np.testing.assert_allclose(np.asarray(mine.gains)[sl][valid], gains[sl][valid], rtol=1e-6)
        assert (np.asarray(mine.embedding_ids)[used : (c + 1) * chunk] == PAD).all()


# --- a numpy model of the SparseCore kernels -------------------------------


def _sc_entries(sc: tpu.SparseCoreCsr, num_sc):
    """Yields (sparsecore, partition, local ids, local samples, gains) of the valid ranges."""
    rp = np.asarray(sc.row_pointers).reshape(num_sc, -1)
    ids, samples, gains = (np.asarray(a).reshape(num_sc, -1) for a in (sc.embedding_ids, sc.sample_ids, sc.gains))
    for c in range(num_sc):
        start = 0
        for p in range(num_sc):
            end = int(rp[c, p])
            yield c, p, ids[c, start:end], samples[c, start:end], gains[c, start:end]
            start = -(-end // 8) * 8


def _model_forward(sc, table_sc, num_sc):
    v = table_sc.shape[0] // num_sc
    b_sc = sc.device_batch_size // num_sc
    out = np.zeros((sc.device_batch_size, table_sc.shape[1]), np.float64)
    for c, p, ids, samples, gains in _sc_entries(sc, num_sc):
        for i, s, g in zip(ids, samples, gains):
            out[c * b_sc + s] += g * table_sc[p * v + i]
    return out


def _model_grad(sc, grad, variables, hyperparameters, update, num_sc):
    """Sums the gradient per touched row, then applies ``update`` to each row."""
    v = variables[0].shape[0] // num_sc
    b_sc = sc.device_batch_size // num_sc
    row_grads: dict[int, np.ndarray] = {}
    for c, p, ids, samples, gains in _sc_entries(sc, num_sc):
        for i, s, g in zip(ids, samples, gains):
            r = p * v + int(i)
            row_grads[r] = row_grads.get(r, 0.0) + g * grad[c * b_sc + s]
    out = [np.array(x) for x in variables]
    hp = [np.full((1, variables[0].shape[1]), h, np.float32) for h in hyperparameters]
    for r, g in row_grads.items():
        new = update(jnp.asarray(g[None], jnp.float32), *(jnp.asarray(x[r : r + 1]) for x in variables), *hp)
        for x, n in zip(out, new if isinstance(new, tuple) else (new,)):
            x[r] = np.asarray(n)[0]
    return out


def _sgd_row(g, w, lr):
    return (w - lr * g,)


@pytest.mark.parametrize("num_partitions,num_sc,dim", [(2, 2, 8), (4, 2, 6), (1, 4, 8), (3, 2, 8)])
def test_sparsecore_model_matches_reference(num_partitions, num_sc, dim):
    rng = np.random.default_rng(7 + num_partitions)
    B, cap = 10, 40  # B not a multiple of num_sc when num_sc=4: padded
    lens, ids, ws = _batch(rng, B)
    csr = _ours(lens, ids, ws, num_partitions, cap, dim=dim)
    table = jnp.asarray(rng.normal(size=(ROWS, dim)), jnp.float32)
    grad = jnp.asarray(rng.normal(size=(B, dim)), jnp.float32)
    sc = tpu.to_sparsecore_csr(*csr, batch_size=B, num_sc=num_sc)
    assert sc.device_batch_size % num_sc == 0 and sc.device_batch_size >= B

    def natural(x):
        return np.asarray(tpu.from_sparsecore_layout(jnp.asarray(x), num_sc, ROWS, dim))

    table_sc = np.asarray(tpu.to_sparsecore_layout(table, num_sc), np.float64)
    assert natural(table_sc).shape == (ROWS, dim)
    np.testing.assert_array_equal(natural(table_sc), np.asarray(table))
    out = _model_forward(sc, table_sc, num_sc)[:B, :dim]
    np.testing.assert_allclose(out, reference.sparse_dense_matmul(*csr, table, batch_size=B), rtol=1e-5, atol=1e-5)

    grad_sc = np.zeros((sc.device_batch_size, table_sc.shape[1]), np.float32)
    grad_sc[:B, :dim] = np.asarray(grad)
    acc = jnp.asarray(rng.uniform(0.1, 1.0, (ROWS, dim)), jnp.float32)
    acc_rows = jnp.asarray(rng.uniform(0.1, 1.0, ROWS), jnp.float32)
    m1 = jnp.asarray(rng.normal(size=(ROWS, dim)), jnp.float32)
    m2 = jnp.asarray(rng.uniform(0.1, 1.0, (ROWS, dim)), jnp.float32)
    lay = lambda x: np.asarray(tpu.to_sparsecore_layout(x, num_sc))  # noqa: E731
    b1, b2, step = 0.9, 0.99, 3.0
    cases = [
        (_sgd_row, [table], [0.1], reference.sparse_dense_matmul_grad_with_sgd(*csr, grad, table, learning_rate=0.1)),
        (
            tpu._adagrad_row,
            [table, acc],
            [0.1, 1e-3],
            reference.sparse_dense_matmul_grad_with_adagrad(*csr, grad, table, acc, learning_rate=0.1, eps=1e-3),
        ),
        (
            tpu._rowwise_adagrad_row(dim),
            [table, jnp.broadcast_to(acc_rows[:, None], table.shape)],
            [0.1, 1e-3, 0.01],
            reference.sparse_dense_matmul_grad_with_rowwise_adagrad(
                *csr, grad, table, acc_rows, learning_rate=0.1, eps=1e-3, weight_decay=0.01
            ),
        ),
        (
            tpu._adam_row,
            [table, m1, m2],
            [0.1, b1, b2, 1e-3, 0.01, 1 / (1 - b1**step), 1 / (1 - b2**step)],
            reference.sparse_dense_matmul_grad_with_adam(
                *csr, grad, table, m1, m2, learning_rate=0.1, beta1=b1, beta2=b2, eps=1e-3, weight_decay=0.01, step=step
            ),
        ),
    ]
    for update, variables, hps, expected in cases:
        got = _model_grad(sc, grad_sc, [lay(x) for x in variables], hps, update, num_sc)
        expected = expected if isinstance(expected, tuple) else (expected,)
        for i, (g, e) in enumerate(zip(got, expected)):
            g = natural(g)
            if e.ndim == 1:  # row-wise accumulator: every column holds the row's value
                g = g[:, 0]
            np.testing.assert_allclose(g, np.asarray(e), rtol=2e-5, atol=2e-6, err_msg=f"{update} output {i}")


# --- export for platform "tpu" ----------------------------------------------

S, P, CAP, B = 4, 4, 24, 16
N = P * CAP  # CAP is already a multiple of 8
SC_N = S * S * CAP
_DISABLED = [jax.export.DisabledSafetyCheck.custom_call(t) for t in tpu.CUSTOM_CALL_TARGETS]


def _export(fn, *args):
    exported = jax.export.export(jax.jit(fn), platforms=["tpu"], disabled_checks=_DISABLED)(*args)
    return exported.mlir_module()


def _structs(*shapes_dtypes):
    return [jax.ShapeDtypeStruct(s, d) for s, d in shapes_dtypes]


CSR = _structs(((P,), jnp.int32), ((N,), jnp.int32), ((N,), jnp.int32), ((N,), jnp.float32))
TABLE_SC = "tensor<64x8xf32>"  # 37 rows padded to 8 * S = 32 -> 64
CSR_TYPES = f"tensor<{S * 8}xi32>, tensor<{SC_N}xi32>, tensor<{SC_N}xi32>, tensor<{SC_N}xf32>"


def _custom_calls(text, target):
    return [line for line in text.splitlines() if f"stablehlo.custom_call @{target}(" in line]


def _config(line):
    return {
        k: int(v)
        for k, v in re.findall(
            r"\\22(max_ids_per_partition|max_unique_ids_per_partition|num_slot_variables|num_hyperparameters)\\22: (\d+)",
            line,
        )
    }


def test_export_forward():
    fn = lambda rp, i, s, g, t: tpu.sparse_dense_matmul(rp, i, s, g, t, batch_size=B, num_sc_per_device=S)  # noqa: E731
    text = _export(fn, *CSR, *_structs(((ROWS, DIM), jnp.float32)))
    (call,) = _custom_calls(text, "SparseDenseMatmulOp")
    assert f"({CSR_TYPES}, {TABLE_SC}, tensor<{B}x{DIM}xf32>) -> tensor<{B}x{DIM}xf32>" in call
    assert "DEVICE_TYPE_SPARSECORE" in call
    assert _config(call) == {"max_ids_per_partition": CAP, "max_unique_ids_per_partition": CAP}


_GRAD_CASES = {
    "sgd": (tpu.sparse_dense_matmul_grad_with_sgd, 0, dict(learning_rate=0.1)),
    "adagrad": (tpu.sparse_dense_matmul_grad_with_adagrad, 1, dict(learning_rate=0.1, eps=1e-8)),
    "rowwise_adagrad": (
        tpu.sparse_dense_matmul_grad_with_rowwise_adagrad,
        1,
        dict(learning_rate=0.1, eps=1e-8, weight_decay=0.0),
    ),
    "adam": (
        tpu.sparse_dense_matmul_grad_with_adam,
        2,
        dict(learning_rate=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1.0),
    ),
}


@pytest.mark.parametrize("name", list(_GRAD_CASES))
def test_export_grad(name):
    kernel, num_slots, hps = _GRAD_CASES[name]
    slot_shape = (ROWS,) if name == "rowwise_adagrad" else (ROWS, DIM)
    slots = _structs(*[(slot_shape, jnp.float32)] * num_slots)

    def fn(rp, i, s, g, grad, table, *slots_and_hps):
        slots, hp = slots_and_hps[:num_slots], slots_and_hps[num_slots:]
        return kernel(
            rp,
            i,
            s,
            g,
            grad,
            table,
            *slots,
            **dict(zip(hps, hp)),
            num_sc_per_device=S,
            max_ids_per_partition=20,
            max_unique_ids_per_partition=12,
        )

    hp_structs = _structs(*[((), jnp.float32)] * len(hps))  # traced hyperparameters
    text = _export(fn, *CSR, *_structs(((B, DIM), jnp.float32), ((ROWS, DIM), jnp.float32)), *slots, *hp_structs)
    (call,) = _custom_calls(text, "SparseDenseMatmulGradOpWithOptimizerUpdate")
    n_hp = {"sgd": 1, "adagrad": 2, "rowwise_adagrad": 3, "adam": 7}[name]
    variables = ", ".join([TABLE_SC] * (1 + num_slots))
    scalars = ", ".join(["tensor<f32>"] * n_hp)
    assert f"({CSR_TYPES}, tensor<{B}x{DIM}xf32>, {variables}, {scalars}) -> tuple<{variables}>" in call
    assert _config(call) == {
        "max_ids_per_partition": 20,
        "max_unique_ids_per_partition": 12,
        "num_slot_variables": num_slots,
        "num_hyperparameters": n_hp,
    }
    # The per-row optimizer computation is a private function of [1, dim] rows.
    symbol = re.search(r"called_computations = \[@([\w\"-]+)\]", call).group(1).strip('"')
    assert re.search(rf"func\.func private @\"?{re.escape(symbol)}\"?\(%arg0: tensor<1x{DIM}xf32>", text)
    assert _custom_calls(text, "SparseDenseMatmulOp") == []


def _strip_locations(text):
    return "\n".join(
        re.sub(r"\s*loc\(.*?\)+$|loc\(#loc\d*\)", "", line) for line in text.splitlines() if not line.startswith("#loc")
    )


def test_lowering_is_static():
    """Two batches with the same capacities export the same module (no data-dependent shapes)."""
    modules = []
    for seed in (1, 2):
        rng = np.random.default_rng(seed)
        lens, ids, ws = _batch(rng, B)
        csr = _ours(lens, ids, ws, P, CAP)
        table = jnp.zeros((ROWS, DIM), jnp.float32)
        acc = jnp.zeros((ROWS, DIM), jnp.float32)

        def step(rp, i, s, g, table, acc):
            out = tpu.sparse_dense_matmul(rp, i, s, g, table, batch_size=B, num_sc_per_device=S)
            return tpu.sparse_dense_matmul_grad_with_adagrad(
                rp, i, s, g, out, table, acc, learning_rate=0.1, eps=1e-8, num_sc_per_device=S
            )

        modules.append(_strip_locations(_export(step, *csr, table, acc)))
    assert modules[0] == modules[1]
    assert len(_custom_calls(modules[0], "SparseDenseMatmulOp")) == 1
    assert len(_custom_calls(modules[0], "SparseDenseMatmulGradOpWithOptimizerUpdate")) == 1


def test_two_stacks_in_one_program():
    """Grad ops of two tables (same and different shapes) in one exported program."""
    other = jax.ShapeDtypeStruct((ROWS + 64, 16), jnp.float32)

    def fn(rp, i, s, g, t1, t2, t3, g8, g16):
        kw = dict(learning_rate=0.1, num_sc_per_device=S)
        return (
            tpu.sparse_dense_matmul_grad_with_sgd(rp, i, s, g, g8, t1, **kw),
            tpu.sparse_dense_matmul_grad_with_sgd(rp, i, s, g, g8, t2, **kw),
            tpu.sparse_dense_matmul_grad_with_sgd(rp, i, s, g, g16, t3, **kw),
        )

    t = jax.ShapeDtypeStruct((ROWS, DIM), jnp.float32)
    text = _export(fn, *CSR, t, t, other, *_structs(((B, DIM), jnp.float32), ((B, 16), jnp.float32)))
    assert len(_custom_calls(text, "SparseDenseMatmulGradOpWithOptimizerUpdate")) == 3


def test_sparsecore_layout_skips_the_permutation():
    table = jax.ShapeDtypeStruct((64, DIM), jnp.float32)
    fn = lambda rp, i, s, g, t: tpu.sparse_dense_matmul(  # noqa: E731
        rp, i, s, g, t, batch_size=B, num_sc_per_device=S, sparsecore_layout=True
    )
    text = _export(fn, *CSR, table)
    assert "stablehlo.transpose" not in text
    with pytest.raises(ValueError, match="multiple of 32"):
        _export(fn, *CSR, jax.ShapeDtypeStruct((40, DIM), jnp.float32))


def test_num_sparsecores():
    assert tpu.num_sparsecores(2) == 2
    if jax.default_backend() != "tpu":
        with pytest.raises(ValueError):
            tpu.num_sparsecores()


def test_the_op_set_picks_the_kernel_of_the_platform():
    from tpurec.dense.registry import get_lowering
    from tpurec.sparse import ops

    for name in ops.OP_NAMES:
        # A TPU whose SparseCores the primitives drive (v5p) gets them; a v5e the TensorCore kernel.
        assert ops.kernel_for(name, "tpu", device_kind="TPU v5") is getattr(tpu, name)
        assert ops.kernel_for(name, "tpu", device_kind="TPU v5 lite") is getattr(ops.tensorcore, name)
        assert ops.kernel_for(name, "cpu") is getattr(ops.native, name)
        assert ops.kernel_for(name, "gpu") is getattr(reference, name)
        # The lowering table entry (what the tpu device runs) goes through kernel_for.
        assert get_lowering(getattr(torch.ops.tpurec, name).default).fn.__name__ == name
