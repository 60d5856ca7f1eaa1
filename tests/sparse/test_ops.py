"""The torch.ops.tpurec sparse op set: CPU kernels, fake kernels, lowering table."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torchrec import EmbeddingBagConfig

import tpurec.sparse as sp
from helpers import random_kjt
from tpurec.dense.registry import call_lowering, get_lowering
from tpurec.sparse.kernels import reference
from tpurec.sparse.kernels import native
from tpurec.sparse.ops import OP_NAMES, kernel_for

TABLES = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=12, feature_names=["a", "b"])]


def _batch(seed=0, partitions=3):
    kjt = random_kjt(TABLES, 4, np.random.default_rng(seed), max_len=5, weighted=True)
    csr = sp.preprocess_kjt(kjt, TABLES, partitions, sp.Capacity(16)).stacks["t"]
    return kjt, [torch.from_numpy(a) for a in csr.arrays()]


def _dense_reference(kjt, table):
    """Pooled sums in numpy, [slots * batch, dim]."""
    out = np.zeros((2 * 4, table.shape[1]))
    lengths = kjt.lengths().numpy()
    rows = np.repeat(np.arange(8), lengths)
    np.add.at(out, rows, table[kjt.values().numpy()] * kjt.weights().numpy()[:, None])
    return out


def test_forward_matches_numpy():
    kjt, csr = _batch()
    table = torch.randn(12, 4)
    out = torch.ops.tpurec.sparse_dense_matmul(*csr, table, batch_size=8)
    assert out.dtype == torch.float32 and out.shape == (8, 4)
    np.testing.assert_allclose(out.numpy(), _dense_reference(kjt, table.numpy()), atol=1e-6)


def test_garbage_past_row_pointers_is_ignored():
    # jax-tpu-embedding leaves uninitialised gains (even NaN) past the row pointers.
    _, (rp, ids, samples, gains) = _batch()
    table = torch.randn(12, 4)
    clean = torch.ops.tpurec.sparse_dense_matmul(rp, ids, samples, gains, table, batch_size=8)
    size = ids.shape[0] // rp.shape[0]
    gains, ids = gains.clone(), ids.clone()
    for p in range(rp.shape[0]):
        gains[int(rp[p]) : (p + 1) * size] = float("nan")
        ids[int(rp[p]) : (p + 1) * size] = 3
    dirty = torch.ops.tpurec.sparse_dense_matmul(rp, ids, samples, gains, table, batch_size=8)
    assert torch.equal(clean, dirty)


def test_grad_ops_touch_only_batch_rows():
    kjt, csr = _batch()
    table, acc = torch.randn(12, 4), torch.rand(12)
    grad = torch.randn(8, 4)
    new_table, new_acc = torch.ops.tpurec.sparse_dense_matmul_grad_with_rowwise_adagrad(
        *csr, grad, table, acc, learning_rate=0.1, eps=1e-8, weight_decay=0.0
    )
    touched = np.zeros(12, bool)
    touched[kjt.values().numpy()] = True
    untouched = torch.from_numpy(~touched)
    assert torch.equal(new_table[untouched], table[untouched]) and torch.equal(new_acc[untouched], acc[untouched])
    assert not torch.equal(new_table[~untouched], table[~untouched])
    # Inputs are not modified (the ops are functional).
    assert new_table.data_ptr() != table.data_ptr()


def test_sgd_grad_matches_dense_gradient():
    kjt, csr = _batch()
    table = torch.randn(12, 4, requires_grad=True)
    grad = torch.randn(8, 4)
    offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(kjt.lengths()).long()
    out = torch.nn.functional.embedding_bag(
        kjt.values(), table, offsets[:-1], mode="sum", per_sample_weights=kjt.weights()
    )
    out.backward(grad)
    new = torch.ops.tpurec.sparse_dense_matmul_grad_with_sgd(*csr, grad, table.detach(), learning_rate=0.5)
    torch.testing.assert_close(new, table.detach() - 0.5 * table.grad, atol=1e-6, rtol=0)


def test_every_op_has_a_lowering_and_traces_with_fake_tensors():
    for name in OP_NAMES:
        # On XLA:CPU the lowering runs the native kernel (test_tpu_kernel checks the TPU choice).
        assert get_lowering(getattr(torch.ops.tpurec, name).default) is not None
        assert kernel_for(name) is getattr(native, name)
        assert kernel_for(name, table_dtype=jnp.float64) is getattr(reference, name)
    _, csr = _batch()
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in csr]
        table = torch.empty(12, 4)
        out = torch.ops.tpurec.sparse_dense_matmul(*fake, table, batch_size=8)
        assert out.shape == (8, 4)
        t, m1, m2 = torch.ops.tpurec.sparse_dense_matmul_grad_with_adam(
            *fake,
            out,
            table,
            torch.empty(12, 4),
            torch.empty(12, 4),
            learning_rate=0.1,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.0,
            step=1.0,
        )
        assert t.shape == m1.shape == m2.shape == (12, 4)


def test_ops_compile_fullgraph():
    _, csr = _batch()
    table, acc = torch.randn(12, 4), torch.zeros(12, 4)

    def step(rp, ids, samples, gains, table, acc):
        out = torch.ops.tpurec.sparse_dense_matmul(rp, ids, samples, gains, table, batch_size=8)
        return torch.ops.tpurec.sparse_dense_matmul_grad_with_adagrad(
            rp, ids, samples, gains, out * 2, table, acc, learning_rate=0.1, eps=1e-8
        )

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    for got, want in zip(compiled(*csr, table, acc), step(*csr, table, acc)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", ["sparse_dense_matmul_grad_with_sgd", "sparse_dense_matmul_grad_with_adam"])
def test_lowering_convention_matches_cpu_kernel(name):
    _, csr = _batch()
    table, grad = torch.randn(12, 4), torch.randn(8, 4)
    op = getattr(torch.ops.tpurec, name).default
    if name.endswith("sgd"):
        args, kwargs = (*csr, grad, table), {"learning_rate": 0.3}
    else:
        args = (*csr, grad, table, torch.zeros(12, 4), torch.zeros(12, 4))
        kwargs = {"learning_rate": 0.3, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.0, "step": 3.0}
    via_table = call_lowering(op, args, kwargs)
    via_cpu = op(*args, **kwargs)
    via_table = via_table if isinstance(via_table, tuple) else (via_table,)
    via_cpu = via_cpu if isinstance(via_cpu, tuple) else (via_cpu,)
    for a, b in zip(via_table, via_cpu):
        np.testing.assert_allclose(np.asarray(a), b.numpy(), atol=1e-6)
