"""torch.tpu memory statistics behave as torch.cuda's."""

import jax
import pytest
import torch

import tpurec
from tpurec.core import memory


@pytest.fixture(autouse=True)
def _start_in_eager_mode():
    """These tests check eager-mode mechanics or enter the mode they test themselves, so each
    starts in eager mode even when the suite runs with TPUREC_MODE=fused."""
    with tpurec.mode("eager"):
        yield


MIB = 1 << 20


def test_allocating_and_freeing_moves_allocated_and_peak_like_cuda():
    torch.tpu.synchronize()
    base = torch.tpu.memory_allocated()
    torch.tpu.reset_peak_memory_stats()
    assert torch.tpu.max_memory_allocated() == base
    x = torch.empty(256, 1024, device="tpu")  # 1 MiB of float32
    assert torch.tpu.memory_allocated() == base + MIB
    y = x + 1
    assert torch.tpu.memory_allocated() == base + 2 * MIB
    view = y[10:20]  # a view shares its base's buffer
    assert torch.tpu.memory_allocated() == base + 2 * MIB
    del x
    assert torch.tpu.memory_allocated() == base + MIB
    del y, view
    assert torch.tpu.memory_allocated() == base
    assert torch.tpu.max_memory_allocated() == base + 2 * MIB  # the peak stays
    torch.tpu.reset_peak_memory_stats()
    assert torch.tpu.max_memory_allocated() == base
    assert (
        torch.tpu.memory_allocated(0)
        == torch.tpu.memory_allocated("tpu:0")
        == torch.tpu.memory_allocated(torch.device("tpu", 0))
    )


def test_in_place_updates_do_not_grow_allocated_memory():
    w = torch.zeros(512, 512, device="tpu")  # 1 MiB
    before = torch.tpu.memory_allocated()
    for _ in range(3):
        w.add_(1.0)
    assert torch.tpu.memory_allocated() == before
    assert w[0, 0].item() == 3.0


def test_fused_mode_counts_a_buffer_once_its_sync_point_computed_it():
    base = torch.tpu.memory_allocated()
    x = torch.ones(128, 1024).to("tpu")  # 512 KiB
    with tpurec.mode("fused"):
        y = x * 2
        pending = torch.tpu.memory_allocated()
        torch.tpu.synchronize()
        assert torch.tpu.memory_allocated() == base + 2 * (MIB // 2)
    assert pending == base + MIB // 2
    del x, y


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int64, torch.bool, torch.float64])
def test_fused_mode_counts_each_output_by_its_own_dtypes_bytes(dtype):
    x = torch.ones(3, 40).to(dtype).to("tpu")
    with tpurec.mode("fused"):
        before = torch.tpu.memory_allocated()
        y, z = x.clone(), x.sum(dtype=torch.int32).reshape(1)  # two outputs of one program
        torch.tpu.synchronize()
        assert torch.tpu.memory_allocated() == before + 120 * x.element_size() + 4
    del x, y, z


def test_memory_stats_use_cuda_key_names():
    x = torch.empty(1024, device="tpu")
    stats = torch.tpu.memory_stats()
    assert stats["allocated_bytes.all.current"] == torch.tpu.memory_allocated()
    assert stats["allocated_bytes.all.peak"] == torch.tpu.max_memory_allocated()
    assert stats["reserved_bytes.all.current"] >= stats["allocated_bytes.all.current"]
    assert stats["allocation.all.current"] >= 1
    assert stats["allocated_bytes.all.allocated"] - stats["allocated_bytes.all.freed"] == memory._devices[0].current
    assert torch.tpu.memory_reserved() >= torch.tpu.memory_allocated()
    del x


def test_device_name_properties_and_free_memory():
    device = jax.devices()[0]
    assert torch.tpu.get_device_name() == device.device_kind == torch.tpu.get_device_name("tpu:0")
    properties = torch.tpu.get_device_properties(0)
    assert properties.platform == tpurec.platform() and properties.name == device.device_kind
    free, total = torch.tpu.mem_get_info()
    assert 0 < free <= total == properties.total_memory


def test_bad_devices_are_refused_like_cuda():
    with pytest.raises(RuntimeError, match="Invalid device ordinal"):
        torch.tpu.memory_allocated(99)
    with pytest.raises(ValueError, match="tpu device"):
        torch.tpu.memory_allocated("cpu")
    with pytest.raises(TypeError, match="device must be"):
        torch.tpu.max_memory_allocated(1.5)


def test_platform_allocator_statistics_are_used_where_xla_reports_them(monkeypatch):
    # XLA:CPU reports none; TPU and GPU report these keys (jax.Device.memory_stats()).
    platform = {"bytes_in_use": 1000, "peak_bytes_in_use": 5000, "bytes_limit": 10_000, "pool_bytes": 3000}
    # The reset below notes XLA's peak in the device's accounting: undo() puts back what was there, for the
    # tests that run after this one in the process.
    account = memory._devices[torch.tpu.current_device()]
    for name in ("platform_peak_at_reset", "platform_in_use_at_reset", "own_at_reset"):
        monkeypatch.setattr(account, name, getattr(account, name))
    monkeypatch.setattr(memory, "_platform_stats", lambda index: dict(platform))
    assert torch.tpu.memory_allocated() == 1000 and torch.tpu.max_memory_allocated() == 5000
    assert torch.tpu.memory_reserved() == 3000
    assert torch.tpu.mem_get_info() == (9000, 10_000)
    assert torch.tpu.memory_stats()["xla.bytes_limit"] == 10_000
    torch.tpu.reset_peak_memory_stats()
    # XLA's peak cannot be reset: until it rises, the peak is what was in use at the reset (plus tpurec's growth).
    assert torch.tpu.max_memory_allocated() == 1000
    x = torch.empty(256, device="tpu")  # 1 KiB more in tpurec's own accounting
    assert torch.tpu.max_memory_allocated() == 1000 + 1024
    platform.update(bytes_in_use=2000, peak_bytes_in_use=7000)  # a new peak after the reset: exact again
    assert torch.tpu.max_memory_allocated() == 7000
    del x
    monkeypatch.undo()
    torch.tpu.reset_peak_memory_stats()
