"""DistributedDataParallel's options on a "tpu" group: 2 processes train like 1 process on the whole batch.

Each scenario of ddp_worker.py (no_sync gradient accumulation, find_unused_parameters with a
branch some ranks skip, static_graph, many small buckets, gradient_as_bucket_view, DDP's own
allreduce and fp16 communication hooks, Adam with a StepLR schedule, device_ids None and [0])
trains 10 steps in eager and in fused mode; the losses and parameters must equal the same
scenario trained by PyTorch on the CPU in one process over the concatenated batch (1e-5
relative). The fp16 hook's reference compresses each slice's gradients as the hook does.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import ddp_worker
import numpy as np
import pytest
import torch
import torch.distributed as dist
from launcher import run

HERE = Path(__file__).resolve().parent
MODES = ("eager", "fused")


@pytest.mark.slow
def test_ddp_options_two_processes_equal_one_process(tmp_path):
    out = tmp_path / "ddp"
    names = list(ddp_worker.SCENARIOS)
    run(HERE / "ddp_worker.py", 2, str(out), ",".join(MODES), ",".join(names), seconds=420)
    for rank in range(2):
        report = Path(f"{out}.{rank}").read_text().split("\n")
        wanted = [f"{name} {mode}" for mode in MODES for name in names] + [
            f"no_sync local gradients {m}" for m in MODES
        ]
        assert not [w for w in wanted if w not in report], (rank, report)
    for name in names:
        scenario = ddp_worker.SCENARIOS[name]
        losses, params = ddp_worker.reference(name)
        for mode in MODES:
            got = np.load(f"{out}.{name}.{mode}.npz")
            where = f"{name} {mode}"
            np.testing.assert_allclose(got["losses"], losses, rtol=1e-5, atol=0, err_msg=where)
            for i, want in enumerate(params):
                np.testing.assert_allclose(got[f"param{i}"], want, rtol=1e-5, atol=1e-7, err_msg=f"{where} param{i}")
            # DDP's buckets on tpu are the ones it makes on the CPU over gloo; a tiny cap makes several.
            buckets = int(got["buckets"])
            assert buckets == int(got["cpu_buckets"]), where
            assert (buckets > 1) == ("bucket_cap_mb" in scenario.ddp), (where, buckets)
            if scenario.hook is not None:
                # One bucket at the first step, the rebuilt buckets at each later step.
                assert int(got["hook_calls"]) == 1 + (ddp_worker.STEPS - 1) * buckets, where


@pytest.fixture
def one_rank_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    store = dist.HashStore()  # pyright: ignore[reportPrivateImportUsage] (torch's stubs)
    dist.init_process_group("tpu", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("option", [{"find_unused_parameters": True}, {"static_graph": True}])
def test_ddp_options_that_stage_through_pinned_memory(one_rank_group, option):
    # DDP's reducer copies its map of used parameters to a tpu device through a pinned host
    # tensor; with the Python hooks PyTorch offers a backend, that failed with "implement
    # getPinnedMemoryAllocator".
    # The extra head is never used: its gradient stays None, as on the CPU.
    model = ddp_worker._model("branchy").to("tpu")
    ddp = torch.nn.parallel.DistributedDataParallel(model, **option)
    x = torch.randn(4, 4)
    for _ in range(3):
        ddp(x.to("tpu"), False).sum().backward()
    reference = ddp_worker._model("branchy")
    for _ in range(3):
        reference(x, False).sum().backward()
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        if want.grad is None:
            assert got.grad is None, name
        else:
            assert got.grad is not None, name
            torch.testing.assert_close(got.grad.cpu(), want.grad, rtol=1e-5, atol=1e-6, msg=name)
