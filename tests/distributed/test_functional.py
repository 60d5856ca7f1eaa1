"""torch.distributed._functional_collectives on tpu tensors over a "tpu" group equal gloo's on CPU copies.

The checks each rank makes are in stack_worker.py (``functional``): in eager and in fused mode, and inside
``torch.compile(backend="tpu")`` graphs (forward and backward).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import launcher


def test_group_name_is_visible_to_cpp():
    """The functional collectives find a group by the name c10d registered (a Python group keeps it)."""
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import HashStore, _resolve_process_group

    import tpurec  # noqa: F401

    dist.init_process_group("tpu", store=HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        assert group is not None
        assert group.group_name == "0"
        assert _resolve_process_group(group.group_name) is group
        t = torch.arange(4.0, device="tpu")
        out = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(t, "sum", "0"))
        assert out.device.type == "tpu"
        torch.testing.assert_close(out.cpu(), torch.arange(4.0), rtol=0, atol=0)
    finally:
        dist.destroy_process_group()


HERE = Path(__file__).resolve().parent


@pytest.mark.slow
def test_functional_collectives_two_processes(tmp_path):
    reports = launcher.reports(HERE / "stack_worker.py", 2, tmp_path / "functional", "functional")
    for mode in ("eager", "fused"):
        wanted = [f"{mode} all_reduce avg", f"{mode} all_gather_tensor dim 1", f"{mode} reduce_scatter_tensor",
                  f"{mode} broadcast", f"{mode} all_to_all_single uneven", f"{mode} all_to_all_single even",
                  f"{mode} _c10d_functional.all_reduce + wait_tensor", f"{mode} all_gather_into_tensor_coalesced 1",
                  f"{mode} mismatch detected"]  # fmt: skip
        for rank, report in enumerate(reports):
            missing = [w for w in wanted if w not in report]
            assert not missing, (rank, missing, report)
    for rank, report in enumerate(reports):
        assert {"compiled collectives 1", "compiled collective backward", "compiled c10d all_reduce"} <= set(report), (
            rank,
            report,
        )
