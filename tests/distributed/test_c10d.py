"""torch.distributed's "tpu" backend: collectives on tpu tensors across processes equal gloo's on
the same CPU tensors (see c10d_worker.py for the checks each rank makes)."""

from __future__ import annotations

from pathlib import Path

import pytest
from launcher import run

HERE = Path(__file__).resolve().parent


def _launch(processes: int, backend: str, out: Path, *flags: str, checks: tuple[str, ...]) -> None:
    """Runs c10d_worker.py under torchrun; fails with its output unless every rank passed."""
    run(HERE / "c10d_worker.py", processes, backend, str(out), *flags)
    reports = [Path(f"{out}.{rank}").read_text().split("\n") for rank in range(processes)]
    for rank, report in enumerate(reports):
        # The sub-group checks run on its members, the odd ranks.
        wanted = [c for c in checks if rank % 2 or "sub-group" not in c]
        missing = [check for check in wanted if check not in report]
        assert not missing, (rank, missing, report)


def _same_training_as_one_process(out: Path) -> None:
    """DDP over the ranks trained like one process on the whole batch (1e-5 relative)."""
    import numpy as np

    import c10d_worker

    losses, params = c10d_worker.reference()
    got = np.load(f"{out}.ddp.npz")
    assert len(got["losses"]) == c10d_worker.STEPS
    np.testing.assert_allclose(got["losses"], losses, rtol=1e-5, atol=0)
    for i, want in enumerate(params):
        np.testing.assert_allclose(got[f"param{i}"], want, rtol=1e-5, atol=1e-7, err_msg=f"param{i}")


def test_backend_is_registered_for_tpu_tensors():
    import torch.distributed as dist

    import tpurec  # noqa: F401

    assert "tpu" in dist.Backend.backend_list
    assert dist.Backend.default_device_backend_map["tpu"] == "tpu"
    assert dist.Backend.backend_capability["tpu"] == ["tpu"]


@pytest.mark.slow
def test_two_processes_device_map_form(tmp_path):
    checks = ("all_to_all_single uneven trial 3 torch.int32", "all_to_all [1]", "scatter", "all_reduce async future", "reduce_scatter",
              "mismatch detected", "timeout detected", "send refused", "all_reduce sub-group", "ddp")  # fmt: skip
    _launch(2, "cpu:gloo,tpu:tpu", tmp_path / "two", checks=checks)
    _same_training_as_one_process(tmp_path / "two")


@pytest.mark.slow
def test_four_processes(tmp_path):
    checks = ("all_reduce PRODUCT torch.float32", "all_to_all_single uneven trial 1 torch.float32",
              "all_gather_into_tensor sub-group", "ddp")  # fmt: skip
    _launch(4, "tpu", tmp_path / "four", "quick", checks=checks)
    _same_training_as_one_process(tmp_path / "four")
