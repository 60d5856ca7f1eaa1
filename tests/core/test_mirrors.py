"""Host mirrors (tpurec.core.mirrors): small integer tensors read on the host without a sync point,
with the values PyTorch CPU gives, and never a stale value after a write."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tpurec
from tpurec.core import fused


def _syncs() -> int:
    return sum(tpurec.stats()["sync_points"].values())


@pytest.fixture(autouse=True)
def _fresh_window():
    fused.flush("test")
    yield
    fused.flush("test")


def test_an_all_ones_check_on_a_mask_from_the_host_needs_no_sync_point():
    cpu = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    with tpurec.mode("fused"):
        mask = cpu.to("tpu")
        hidden = torch.randn(2, 4).to("tpu") * 2  # pending work before the check
        before = _syncs()
        assert bool(mask.bool().all()) is False
        assert bool(mask[1].bool().all()) is True
        assert (mask.sum(-1) == torch.tensor([3, 4]).to("tpu")).all().item() is True
        assert mask.sum().item() == 7
        assert mask.tolist() == cpu.tolist()
        assert _syncs() == before and fused.pending_ops() > 0
        assert torch.equal(hidden.cpu(), hidden.cpu())  # the pending work still runs


@pytest.mark.parametrize("mode", ["eager", "fused"])
def test_a_write_to_the_tensor_or_a_view_of_its_storage_is_seen(mode):
    with tpurec.mode(mode):
        mask = torch.ones(2, 3, dtype=torch.long).to("tpu")
        assert bool(mask.all())
        mask[0, 1] = 0  # in place, through a view
        assert not bool(mask.all()) and mask.sum().item() == 5
        flat = mask.view(-1)
        flat.fill_(2)  # the storage written through another tensor
        assert mask.sum().item() == 12 and (mask == 2).all().item()
        mask.add_(1)
        assert mask.tolist() == [[3, 3, 3], [3, 3, 3]]
        other = torch.zeros(4, dtype=torch.long).to("tpu")
        mask.set_(other)  # the tensor points at another storage
        assert mask.tolist() == [0, 0, 0, 0] and not bool(mask.any())
        mask.unsqueeze_(0)  # in-place metadata change
        assert mask.shape == (1, 4) and mask.tolist() == [[0, 0, 0, 0]]


def test_the_host_source_and_a_copy_back_are_not_the_mirror():
    cpu = torch.tensor([1, 2, 3])
    t = cpu.to("tpu")
    cpu[0] = 100  # the caller's tensor changes after the copy
    back = t.cpu()
    back[1] = 100  # and so does the copy handed back
    assert t.tolist() == [1, 2, 3] and t.sum().item() == 6


def test_float_tensors_and_large_tensors_are_not_mirrored():
    with tpurec.mode("fused"):
        x = torch.ones(3).to("tpu") + 1
        before = _syncs()
        assert x.sum().item() == 6.0
        assert _syncs() == before + 1
        big = torch.ones(tpurec.config.get("TPUREC_HOST_MIRRORS") + 1, dtype=torch.long).to("tpu")
        big.all().item()
        assert _syncs() == before + 2
        mask = torch.ones(3, dtype=torch.long).to("tpu")
        (mask.float() > 0).all().item()  # through a float tensor: computed on the device
        assert _syncs() == before + 3


def test_turned_off_every_read_is_a_sync_point():
    with tpurec.config.override(host_mirrors=0), tpurec.mode("fused"):
        mask = torch.ones(3, dtype=torch.long).to("tpu")
        torch.ones(2).to("tpu").add_(1)
        before = _syncs()
        assert bool(mask.all())
        assert _syncs() == before + 1


def test_factories_and_arange_chains_are_known():
    with tpurec.mode("fused"):
        positions = torch.arange(6, device="tpu")
        lengths = torch.full((2,), 3, dtype=torch.long, device="tpu")
        torch.ones(2).to("tpu").add_(1)
        before = _syncs()
        mask = positions.view(2, 3) < lengths.unsqueeze(1) + 1
        assert mask.tolist() == [[True, True, True], [True, False, False]]
        assert _syncs() == before


_OPS = {
    "eq": lambda a, b: a == b,
    "lt": lambda a, b: a < b,
    "and": lambda a, b: (a > 0) & (b > 0),
    "add": lambda a, b: a + b * 3,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "where": lambda a, b: torch.where(a > b, a, b),
    "cat": lambda a, b: torch.cat([a, b], dim=1),
    "cumsum": lambda a, b: a.cumsum(1),
    "sum_dim": lambda a, b: b.sum(0),
    "any_dim": lambda a, b: (a == b).any(1),
    "slice_t": lambda a, b: a[:, 1:].t(),
    "expand": lambda a, b: a[:1].expand(3, -1),
    "to_int32": lambda a, b: (a * 1000003).to(torch.int32),
    "max": lambda a, b: torch.maximum(a, b).amax(),
}


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.sampled_from(sorted(_OPS)), min_size=1, max_size=3),
    st.lists(st.integers(-(2**40), 2**40), min_size=12, max_size=12),
    st.sampled_from([torch.int64, torch.int32, torch.int8, torch.bool]),
)
def test_chains_of_mirrored_ops_read_what_pytorch_cpu_computes(names, values, dtype):
    """Each op's mirrored result is PyTorch CPU's, and the device (read with mirrors off) agrees."""
    a = torch.tensor(values[:6]).view(3, 2).to(dtype)
    b = torch.tensor(values[6:]).view(3, 2).to(dtype)
    with tpurec.mode("fused"):
        ta, tb = a.to("tpu"), b.to("tpu")
        for name in names:
            try:
                expected = _OPS[name](a, b)
            except RuntimeError:  # e.g. subtraction of booleans: not defined on CPU either
                return
            got = _OPS[name](ta, tb)
            before = _syncs()
            assert torch.equal(got.cpu(), expected), name
            assert _syncs() == before, f"{name}: read with a sync point"
            with tpurec.config.override(host_mirrors=0):
                assert torch.equal(got.cpu(), expected), f"{name}: the device disagrees"
            if expected.shape == a.shape:
                a, ta = expected.to(a.dtype), got.to(ta.dtype)


def test_a_hugging_face_step_with_a_padded_mask_is_one_program():
    pytest.importorskip("transformers")
    from tpurec.bench.text import tiny_bert

    cpu = tiny_bert(hidden=32, intermediate=64, positions=32)
    model = copy.deepcopy(cpu).to("tpu")
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, 9:] = 0  # padding: transformers checks mask.all() to decide whether to use the mask
    with tpurec.mode("fused"):
        for _ in range(2):
            before = dict(tpurec.stats()["sync_points"])
            loss = model(input_ids=ids.to("tpu"), attention_mask=mask.to("tpu"), labels=ids.to("tpu")).loss
            loss.backward()
            got = loss.item()
            after = tpurec.stats()["sync_points"]
            assert {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)} == {"item": 1}
    expected = cpu(input_ids=ids, attention_mask=mask, labels=ids).loss
    assert got == pytest.approx(expected.item(), rel=1e-5)


def test_data_dependent_ops_on_known_tensors_run_on_the_host_without_a_sync_point():
    labels = torch.tensor([[3, -100, 5], [7, 8, -100]])
    with tpurec.mode("fused"):
        t = labels.to("tpu")
        torch.ones(2).to("tpu").add_(1)
        before = _syncs()
        picked = t.masked_select(t >= 0)  # a data-dependent shape: computed on the host
        assert picked.tolist() == [3, 5, 7, 8] and (t != -100).nonzero().tolist() == labels.ne(-100).nonzero().tolist()
        assert bool((picked.max() < 99).item())
        assert _syncs() == before
        x = torch.ones(2, 3).to("tpu") * 2
        assert x.masked_select(t >= 0).tolist() == [2.0] * 4  # a float input: read from the device
        assert _syncs() == before + 1
