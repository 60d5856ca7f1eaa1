"""The "tpu" backend in this process (a group of one rank): results and the errors bad calls get.

The multi-process behaviour is in test_c10d.py; here every call is cheap, so each bad input is
checked: the error names the collective and what to change, and the tensors are left unchanged.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

import tpurec  # noqa: F401 (registers the backend)


@pytest.fixture
def group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("tpu", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=5))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_one_rank_collectives_are_identities(group):
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    t = x.to("tpu")
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT):
        dist.all_reduce(t, op=op)
    torch.testing.assert_close(t.cpu(), x, rtol=0, atol=0)
    out = torch.empty(2, 3, device="tpu")
    dist.all_gather_into_tensor(out, t)
    torch.testing.assert_close(out.cpu(), x, rtol=0, atol=0)
    a2a = torch.empty(6, device="tpu")
    dist.all_to_all_single(a2a, t.reshape(6), [6], [6])
    torch.testing.assert_close(a2a.cpu(), x.reshape(6), rtol=0, atol=0)
    flags = torch.tensor([True, False], device="tpu")
    dist.all_reduce(flags, op=dist.ReduceOp.SUM)
    assert flags.cpu().tolist() == [True, False]
    ints = torch.tensor([6, 3], device="tpu")
    dist.all_reduce(ints, op=dist.ReduceOp.BAND)
    assert ints.cpu().tolist() == [6, 3]
    dist.barrier()


@pytest.mark.parametrize(
    "call,error,message",
    [
        (lambda t: dist.all_reduce(t.long(), op=dist.ReduceOp.AVG), TypeError, "AVG needs a floating-point tensor"),
        (lambda t: dist.all_reduce(t, op=dist.ReduceOp.BAND), TypeError, "BAND needs an integer or bool tensor"),
        (
            lambda t: dist.all_to_all_single(torch.empty(4, device="tpu"), t, [4], [5]),
            ValueError,
            (
                r"all_to_all_single: input_split_sizes \[5\] must be 1 non-negative sizes adding up to the input's "
                r"first dimension \(4\)"
            ),
        ),
        (
            lambda t: dist.all_to_all_single(torch.empty(3, device="tpu"), t, [4], [4]),
            ValueError,
            r"output_split_sizes \[4\] must be 1 non-negative sizes adding up to the output's first dimension \(3\)",
        ),
        (
            lambda t: dist.all_gather_into_tensor(torch.empty(5, device="tpu"), t),
            ValueError,
            "all_gather_into_tensor: the output must hold group size",
        ),
    ],
)
def test_bad_calls_are_refused_and_leave_tensors_unchanged(group, call, error, message):
    t = torch.arange(4, dtype=torch.float32, device="tpu")
    with pytest.raises(error, match=message):
        call(t)
    assert t.cpu().tolist() == [0.0, 1.0, 2.0, 3.0]


def test_send_names_the_alternative(group):
    # torch.distributed refuses a send to oneself before the backend sees it: call the group.
    with pytest.raises(NotImplementedError, match="all_to_all_single"):
        group.send([torch.ones(2, device="tpu")], 0, 0)


def test_tpu_and_cpu_tensors_in_one_call_are_refused(group):
    with pytest.raises(
        TypeError, match=r"the tensors of one call must all be on tpu .* got tensors on \['cpu', 'tpu'\]"
    ):
        dist.all_gather_into_tensor(torch.empty(4), torch.ones(4, device="tpu"))


def test_cpu_tensors_go_to_gloo(group):
    c = torch.ones(3)
    dist.all_reduce(c)
    assert c.tolist() == [1.0, 1.0, 1.0]
