"""TorchRec's TPU lookup ops (its UNFUSED_TPU kernel's) and FBGEMM's sparse-feature index ops
on the tpu device equal their CPU kernels, forward and gradients."""

from __future__ import annotations

import pytest
import torch

import tpurec  # noqa: F401

pytest.importorskip("torchrec")
import fbgemm_gpu  # noqa: E402,F401
import torchrec.experimental.torch_tpu.pallas.ops  # noqa: E402,F401


def _both(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return t.clone().requires_grad_(t.is_floating_point()), t.to("tpu").requires_grad_(t.is_floating_point())


def _close(got: torch.Tensor | None, want: torch.Tensor | None) -> None:
    assert got is not None and want is not None
    assert got.device.type == "tpu"
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("padding", [0, 3])
def test_pooled_lookup_offset_forward_and_table_gradient(padding):
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(11, 16, generator=gen)
    lengths = torch.tensor([2, 0, 3, 1, 4])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
    # Entries past the last offset (padding, as the TPU kernels allow) belong to no bag; the
    # CPU kernel takes none, so it gets the ids without them.
    indices = torch.randint(0, 11, (int(lengths.sum()) + padding,), generator=gen, dtype=torch.int32)
    grad = torch.randn(5, 16, generator=gen)
    cpu_table, tpu_table = _both(table)
    want = torch.ops.torchrec.embedding_pooled_lookup_offset(indices[: int(lengths.sum())], offsets, cpu_table, 16)
    got = torch.ops.torchrec.embedding_pooled_lookup_offset(indices.to("tpu"), offsets.to("tpu"), tpu_table, 16)
    _close(got, want.detach())
    want.backward(grad)
    got.backward(grad.to("tpu"))
    _close(tpu_table.grad, cpu_table.grad)


def test_lookup_forward_and_table_gradient_with_repeated_ids():
    gen = torch.Generator().manual_seed(1)
    table = torch.randn(7, 16, generator=gen)
    indices = torch.tensor([3, 0, 3, 6, 3, 1], dtype=torch.int32)
    grad = torch.randn(6, 16, generator=gen)
    cpu_table, tpu_table = _both(table)
    want = torch.ops.torchrec.embedding_lookup(indices, cpu_table, 16)
    got = torch.ops.torchrec.embedding_lookup(indices.to("tpu"), tpu_table, 16)
    _close(got, want.detach())
    want.backward(grad)
    got.backward(grad.to("tpu"))
    _close(tpu_table.grad, cpu_table.grad)


def test_permute_pooled_embs_forward_and_gradient():
    gen = torch.Generator().manual_seed(2)
    pooled = torch.randn(3, 10, generator=gen)
    offset_dim_list = torch.tensor([0, 4, 6, 10])
    permute_list = torch.tensor([2, 0, 1])
    grad = torch.randn(3, 10, generator=gen)
    cpu_in, tpu_in = _both(pooled)
    want = torch.ops.torchrec.permute_pooled_embs(cpu_in, offset_dim_list, permute_list)
    got = torch.ops.torchrec.permute_pooled_embs(tpu_in, offset_dim_list.to("tpu"), permute_list.to("tpu"))
    _close(got, want.detach())
    want.backward(grad)
    got.backward(grad.to("tpu"))
    _close(tpu_in.grad, cpu_in.grad)


def test_fbgemm_permute_pooled_embeddings_split_forward_and_gradient():
    """FBGEMM's PermutePooledEmbeddingsSplit (TorchRec's grid sharding reorders its output with it)."""
    from fbgemm_gpu.permute_pooled_embedding_modules_split import PermutePooledEmbeddingsSplit

    # Its tpu lowering and autograd load with the torchrec family: in a sharded forward the
    # lookups (torchrec ops) come before the output permutation.
    torch.ops.torchrec.embedding_lookup(
        torch.zeros(1, dtype=torch.int32, device="tpu"), torch.zeros(2, 16).to("tpu"), 16
    )
    gen = torch.Generator().manual_seed(3)
    pooled = torch.randn(3, 48, generator=gen)
    grad = torch.randn(3, 48, generator=gen)
    dims, permute = [16, 8, 24], [2, 0, 1]
    cpu_in, tpu_in = _both(pooled)
    want = PermutePooledEmbeddingsSplit(dims, permute, device=torch.device("cpu"))(cpu_in)
    got = PermutePooledEmbeddingsSplit(dims, permute, device=torch.device("tpu"))(tpu_in)
    _close(got, want.detach())
    want.backward(grad)
    got.backward(grad.to("tpu"))
    _close(tpu_in.grad, cpu_in.grad)


def test_fbgemm_permute_and_bucketize_run_on_the_host_with_fbgemm_kernels():
    lengths = torch.tensor([[1, 2], [0, 3], [2, 1]], dtype=torch.int32)
    values = torch.arange(9, dtype=torch.int64)
    permute = torch.tensor([2, 0, 1], dtype=torch.int32)
    want = torch.ops.fbgemm.permute_2D_sparse_data(permute, lengths, values, None, None)
    got = torch.ops.fbgemm.permute_2D_sparse_data(permute.to("tpu"), lengths.to("tpu"), values.to("tpu"), None, None)
    for g, w in zip(got[:2], want[:2]):
        assert g.device.type == "tpu"
        torch.testing.assert_close(g.cpu(), w, rtol=0, atol=0)
    flat = lengths.reshape(-1)
    block_sizes = torch.tensor([5, 5, 5], dtype=torch.int64)
    want = torch.ops.fbgemm.block_bucketize_sparse_features(flat, values, False, False, block_sizes, 2, None)
    got = torch.ops.fbgemm.block_bucketize_sparse_features(
        flat.to("tpu"), values.to("tpu"), False, False, block_sizes.to("tpu"), 2, None
    )
    for g, w in zip(got[:2], want[:2]):
        torch.testing.assert_close(g.cpu(), w, rtol=0, atol=0)


def test_bad_indices_name_the_op():
    table = torch.randn(4, 16).to("tpu")
    with pytest.raises(Exception, match="embedding_lookup: the indices must be a 1-d integer tensor"):
        torch.ops.torchrec.embedding_lookup(torch.zeros(2, 2, dtype=torch.int32).to("tpu"), table, 16).cpu()
