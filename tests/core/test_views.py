"""Views alias their base; in-place writes through a view show in the base."""

import pytest
import torch

import tpurec  # noqa: F401


def pair(shape=(4, 6)):
    host = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    return host, host.to("tpu")


VIEWS = {
    "view": lambda t: t.view(6, 4),
    "reshape": lambda t: t.reshape(2, 12),
    "slice": lambda t: t[1:3, ::2],
    "transpose": lambda t: t.transpose(0, 1),
    "t": lambda t: t.t(),
    "select": lambda t: t.select(1, 2),
    "unsqueeze": lambda t: t.unsqueeze(1),
    "narrow": lambda t: t.narrow(1, 2, 3),
    "as_strided": lambda t: t.as_strided((3, 2), (5, 2), 1),
    "diagonal": lambda t: t.diagonal(),
    "split": lambda t: t.split(2, dim=1)[1],
    "chunk": lambda t: t.chunk(2)[1],
    "unbind": lambda t: t.unbind(0)[2],
    "permute_slice": lambda t: t.permute(1, 0)[::2, 1:],
}


@pytest.mark.parametrize("name", sorted(VIEWS))
def test_view_values_and_write_through(name):
    make = VIEWS[name]
    host, dev = pair()
    hv, dv = make(host), make(dev)
    assert dv.shape == hv.shape and dv.stride() == hv.stride() and dv.storage_offset() == hv.storage_offset()
    assert torch.equal(dv.cpu(), hv)
    hv.mul_(-2).add_(1)
    dv.mul_(-2).add_(1)
    assert torch.equal(dev.cpu(), host)
    assert torch.equal(dv.cpu(), hv)


def test_expand_reads():
    host = torch.arange(3.0).reshape(3, 1)
    assert torch.equal(host.to("tpu").expand(3, 4).cpu(), host.expand(3, 4))


def test_write_to_base_visible_in_view():
    host, dev = pair()
    hv, dv = host[:, 1], dev[:, 1]
    host.fill_(3.0)
    dev.fill_(3.0)
    assert torch.equal(dv.cpu(), hv)


def test_copy_into_slice_and_index_assign():
    host, dev = pair()
    src = torch.randn(2, 3)
    host[2:, ::2] = src
    dev[2:, ::2] = src.to("tpu")
    host[0] = 9.0
    dev[0] = 9.0
    assert torch.equal(dev.cpu(), host)


def test_detach_shares_storage():
    dev = torch.zeros(3, device="tpu")
    d = dev.detach()
    d.add_(2)
    assert dev.tolist() == [2.0, 2.0, 2.0]


def test_inplace_chain_on_noncontiguous():
    host, dev = pair((3, 4, 5))
    for t in (host, dev):
        v = t.permute(2, 0, 1)[1:4]
        v.clamp_(min=10, max=40)
        v.sub_(v * 0.5)
    assert torch.equal(dev.cpu(), host)


def test_full_copy_shares_the_buffer_and_later_writes_stay_separate():
    a = torch.arange(4.0).to("tpu")
    b = torch.zeros(4, device="tpu")
    b.copy_(a)
    assert b._storage.array is a._storage.array
    a.add_(1)
    b.mul_(2)
    assert a.tolist() == [1.0, 2.0, 3.0, 4.0] and b.tolist() == [0.0, 2.0, 4.0, 6.0]


@pytest.mark.parametrize("mode", ["eager", "fused"])
def test_set_points_the_tensor_at_the_source_storage_as_on_cpu(mode):
    with tpurec.mode(mode):
        for device in ("cpu", "tpu"):
            t = torch.ones(2, 3, device=device)
            source = torch.arange(6.0, device=device)
            t.set_(source)
            assert t.shape == (6,) and t.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], device
            source.add_(1)  # t shares source's storage now
            assert t.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], device
        with pytest.raises(RuntimeError, match="set_"):
            torch.ones(2, device="tpu").set_(torch.ones(2))  # a CPU source
