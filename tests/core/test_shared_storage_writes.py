"""Writes FSDP2 relies on: several destinations in one buffer, Tensor[] out= arguments, library kernels
for PrivateUse1, freeing and re-allocating a storage, and torch.tpu streams/events. Each against CPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import tpurec
from tpurec.core.tensor import alloc_storage, free_storage


@pytest.mark.parametrize("mode", ["eager", "fused"])
def test_foreach_copy_into_split_views_of_one_buffer(mode):
    """Every destination keeps its write (each used to overwrite the previous one's)."""
    results = {}
    for dev in ("cpu", "tpu"):
        with tpurec.mode(mode if dev == "tpu" else "eager"):
            out = torch.zeros(20, device=dev)
            dsts = torch.split(out.narrow(0, 4, 10), [8, 2])
            srcs = [torch.arange(8.0).to(dev), torch.tensor([9.0, 10.0]).to(dev)]
            torch._foreach_copy_(dsts, srcs)  # pyright: ignore[reportPrivateImportUsage]
            results[dev] = out.cpu()
    torch.testing.assert_close(results["tpu"], results["cpu"], rtol=0, atol=0)


def test_split_with_sizes_copy_out_list_of_views():
    """A Tensor[] out= argument writes every tensor of the list, here views of other tensors."""
    a = torch.arange(12.0).view(2, 6)
    results = {}
    for dev in ("cpu", "tpu"):
        outs = [torch.zeros(4, device=dev), torch.zeros(8, device=dev)]
        assert torch.split_with_sizes_copy(a.to(dev), [2, 4], dim=1, out=[o.view(2, -1) for o in outs]) is None
        results[dev] = [o.cpu() for o in outs]
    for got, want in zip(results["tpu"], results["cpu"], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_fsdp_library_kernels_equal_cpu():
    """FSDP2's own ops (registered for PrivateUse1 in torch ops) run on tpu like on CPU."""
    import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401 (defines torch.ops.fsdp)

    results = {}
    for dev in ("cpu", "tpu"):
        inputs = [torch.arange(6.0).to(dev), torch.tensor([7.0, 8.0]).to(dev)]
        output = torch.zeros(16, device=dev)
        given, whole = torch.ops.fsdp.all_gather_copy_in(inputs, output, [6, 2], 8, 1)
        chunks = [torch.zeros(2, 4, device=dev), torch.zeros(2, 4, device=dev)]
        cat = torch.zeros(2, 4, device=dev)
        torch.ops.fsdp.chunk_cat([torch.ones(2, 2, device=dev), torch.full((4,), 2.0, device=dev)], 0, 2, out=cat)
        torch.ops.fsdp.split_with_sizes_copy(whole.view(2, 8), [4, 4], dim=1, out=chunks)
        results[dev] = [given.cpu(), whole.cpu(), output.cpu(), cat.cpu(), *(c.cpu() for c in chunks)]
    for got, want in zip(results["tpu"], results["cpu"], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_free_and_alloc_storage():
    base = torch.arange(6.0, device="tpu")
    view = base[2:]
    free_storage(base)
    with pytest.raises(Exception):
        view.cpu()  # freed memory has no elements to read
    free_storage(view)  # freeing freed storage does nothing
    alloc_storage(base)
    assert base.shape == (6,)
    base.copy_(torch.full((6,), 3.0, device="tpu"))
    torch.testing.assert_close(view.cpu(), torch.full((4,), 3.0), rtol=0, atol=0)
    alloc_storage(base)  # storage that was not freed keeps its values
    torch.testing.assert_close(base.cpu(), torch.full((6,), 3.0), rtol=0, atol=0)
    with pytest.raises(TypeError, match="free_storage needs a tensor on the tpu device"):
        free_storage(torch.zeros(2))


def test_streams_and_events_order_work_in_issue_order():
    tpu: Any = torch.tpu  # pyright: ignore[reportAttributeAccessIssue] (installed by import tpurec)
    side = tpu.Stream(priority=-1)
    main = tpu.current_stream()
    assert side is not main
    with tpu.stream(side):
        assert tpu.current_stream() is side
        x = torch.ones(3, device="tpu") * 2
        event = side.record_event()
    assert tpu.current_stream() is main
    main.wait_event(event)
    main.wait_stream(side)
    event.synchronize()
    assert event.query() and side.query()
    torch.testing.assert_close(x.cpu(), torch.full((3,), 2.0), rtol=0, atol=0)
    assert isinstance(tpu.Event(), tpu.Event)
