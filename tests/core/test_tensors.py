"""Tensors on tpu: factories, transfers, dtypes, repr, item/tolist."""

import pytest
import torch

import tpurec

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtype_round_trip_is_exact(dtype):
    if dtype.is_floating_point:
        host = torch.randn(5, 3).to(dtype)
    elif dtype == torch.bool:
        host = torch.tensor([[True, False, True]] * 5)
    else:
        info = torch.iinfo(dtype)
        host = torch.randint(info.min, info.max, (5, 3), dtype=dtype)
    t = host.to("tpu")
    assert t.dtype == dtype and t.device.type == "tpu"
    back = t.cpu()
    assert back.dtype == dtype and torch.equal(back, host)


def test_int64_beyond_int32_round_trips():
    values = [2**31, 2**40 + 7, -(2**53) - 1, 2**62]
    t = torch.tensor(values, device="tpu")
    assert t.dtype == torch.int64
    assert t.tolist() == values
    assert (t + 1).tolist() == [v + 1 for v in values]


def test_factories():
    assert torch.zeros(2, 3, device="tpu").cpu().eq(0).all()
    assert torch.ones(4, device="tpu", dtype=torch.int32).cpu().tolist() == [1, 1, 1, 1]
    assert torch.full((2,), 7.5, device="tpu").tolist() == [7.5, 7.5]
    assert torch.arange(5, device="tpu").tolist() == [0, 1, 2, 3, 4]
    assert torch.arange(1, 2, 0.25, device="tpu").tolist() == [1.0, 1.25, 1.5, 1.75]
    assert torch.empty(3, 2, device="tpu").shape == (3, 2)
    x = torch.randn(3, 4, device="tpu")
    for like in (torch.zeros_like, torch.ones_like, torch.empty_like, torch.rand_like, torch.randn_like):
        y = like(x)
        assert y.shape == x.shape and y.device == x.device and y.dtype == x.dtype
    r = torch.rand(1000, device="tpu").cpu()
    assert 0 <= r.min() and r.max() < 1 and abs(r.mean() - 0.5) < 0.05
    n = torch.randn(2000, device="tpu").cpu()
    assert abs(n.mean()) < 0.1 and abs(n.std() - 1) < 0.1
    i = torch.randint(3, 9, (500,), device="tpu").cpu()
    assert i.dtype == torch.int64 and i.min() >= 3 and i.max() < 9


def test_tensor_methods():
    host = torch.arange(6.0).reshape(2, 3)
    t = host.tpu() if hasattr(host, "tpu") else host.to("tpu")
    assert t.device == torch.device("tpu", 0)
    assert torch.equal(t.cpu(), host)
    assert t.tolist() == host.tolist()
    assert t[1, 2].item() == 5.0
    assert "device='tpu:0'" in repr(t)
    assert "requires_grad=True" in repr(torch.ones(1, device="tpu", requires_grad=True))


def test_manual_seed_reproducible_on_device():
    torch.manual_seed(123)
    a = torch.randn(8, device="tpu").cpu()
    b = torch.rand(8, device="tpu").cpu()
    torch.manual_seed(123)
    assert torch.equal(a, torch.randn(8, device="tpu").cpu())
    assert torch.equal(b, torch.rand(8, device="tpu").cpu())
    state = torch.tpu.get_rng_state()
    c = torch.randn(8, device="tpu").cpu()
    torch.tpu.set_rng_state(state)
    assert torch.equal(c, torch.randn(8, device="tpu").cpu())
    assert not torch.equal(a, c)


def test_array_accessors_read_and_replace_the_storage():
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from tpurec.core.tensor import array_of, is_global, replace_array

    t = torch.arange(8, dtype=torch.float32, device="tpu")
    view = t[2:4]
    tpurec.synchronize()
    assert array_of(view) is array_of(t)  # a view reads its whole storage
    replace_array(t, jnp.full((8,), 3.0, jnp.float32))
    assert view.tolist() == [3.0, 3.0] and t.sum().item() == 24.0
    assert not is_global(t) and not is_global(torch.zeros(2))

    mesh = Mesh(jax.devices()[:2], ("d",))
    replace_array(t, jax.device_put(array_of(t), NamedSharding(mesh, PartitionSpec("d"))))
    assert is_global(t) and t.tolist() == [3.0] * 8

    before = array_of(t)
    with pytest.raises(ValueError, match=r"float32\[4\].*storage is float32\[8\]"):
        replace_array(t, jnp.zeros((4,), jnp.float32))
    with pytest.raises(ValueError, match=r"int32\[8\].*keeps the shape and dtype"):
        replace_array(t, jnp.zeros((8,), jnp.int32))
    assert array_of(t) is before  # unchanged after the errors
    with pytest.raises(TypeError, match="tpu device, got a Tensor on cpu"):
        array_of(torch.zeros(2))
    with pytest.raises(TypeError, match="needs a jax.Array"):
        replace_array(t, torch.zeros(8))


def test_a_storage_kept_in_another_shape_reads_writes_and_replaces_as_the_tensor():
    import jax.numpy as jnp

    from tpurec.core import array_of, replace_array, with_storage_shape

    cpu = torch.randn(6, 4)
    t = with_storage_shape(cpu.to("tpu"), (3, 8))
    assert tuple(t.shape) == (6, 4) and tuple(array_of(t).shape) == (3, 8)
    torch.testing.assert_close(t.cpu(), cpu, rtol=0, atol=0)
    torch.testing.assert_close(t[1:3, 2:].cpu(), cpu[1:3, 2:], rtol=0, atol=0)
    t.add_(1.0)  # an in-place write keeps the storage's shape
    assert tuple(array_of(t).shape) == (3, 8)
    torch.testing.assert_close(t.cpu(), cpu + 1.0, rtol=0, atol=0)
    replace_array(t, jnp.zeros((6, 4), jnp.float32))  # the tensor's own shape: stored in the storage's
    assert tuple(array_of(t).shape) == (3, 8) and float(t.sum().cpu()) == 0.0
    with pytest.raises(ValueError, match="whole storage"):
        with_storage_shape(t[1:], (5, 4))
    with pytest.raises(ValueError, match="holds 20 elements"):
        with_storage_shape(t, (5, 4))
