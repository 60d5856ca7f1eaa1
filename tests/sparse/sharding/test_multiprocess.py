"""2 processes x 4 CPU devices (torchrun, gloo collectives) train like 1 process x 8 devices, in the
plain loop, through TrainPipeline and through TrainPipeline(graphed=True) (captured steps); their
sharded checkpoint loads in 1 process under another plan."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import launcher

import tpurec.distributed as distributed

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


@pytest.mark.slow
def test_two_processes_of_four_devices_match_one_of_eight(tmp_path):
    # A hang (see docs/sharding.md) fails the test with every thread's stack.
    env = launcher.environment(devices=4, hang_seconds=240)
    two = tmp_path / "two.npz"
    launcher.run(HERE / "multiprocess_train.py", 2, str(two), str(tmp_path / "ckpt"), env=env, seconds=540)

    # The reference: this process, 8 devices (tests/conftest.py), same script.
    import multiprocess_train

    one = tmp_path / "one.npz"
    multiprocess_train.main(str(one))
    a, b = np.load(one), np.load(two)
    assert sorted(a.files) == sorted(b.files)
    assert len(a["losses"]) == multiprocess_train.STEPS
    for key in a.files:
        np.testing.assert_allclose(b[key], a[key], atol=1e-5, rtol=0, err_msg=key)
    # Through TrainPipeline (worker routes, step packs with several processes): the plain loop's results.
    for key in a.files:
        if not key.startswith(("pipeline/", "graphed/")):
            np.testing.assert_array_equal(a["pipeline/" + key], a[key], err_msg=key)
            np.testing.assert_allclose(b["pipeline/" + key], b[key], atol=1e-6, rtol=0, err_msg=key)
            # Captured steps (fused mode, a fused dense Adagrad): XLA fuses the step's programs
            # into one, so the last bits may move; the same tolerance as between the process counts.
            np.testing.assert_allclose(a["graphed/" + key], a[key], atol=1e-5, rtol=0, err_msg=key)
            np.testing.assert_allclose(b["graphed/" + key], b[key], atol=1e-5, rtol=0, err_msg=key)

    # The checkpoint both processes wrote (each its own shards) loads in this one
    # process under another plan (every table row-wise over 8 devices), bit-identical.
    from tpurec.sparse.checkpoint import sharded as checkpoint

    _tables, loaded = multiprocess_train.build("row_wise")
    checkpoint.load(loaded, tmp_path / "ckpt")
    tables, slots = loaded.sparse_arch.embedding_bag_collection.full_tables()
    for name, value in tables.items():
        np.testing.assert_array_equal(value, b[f"table/{name}"])
        for slot, got in slots[name].items():
            np.testing.assert_array_equal(got, b[f"slot/{name}/{slot}"])
    dense = {k: v.cpu().numpy() for k, v in loaded.state_dict().items() if "embedding_bag_collection" not in k}
    for key, value in dense.items():
        np.testing.assert_array_equal(value, b[f"dense/{key}"])


def test_torchrun_environment_is_read():
    env = {"MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "29500", "WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"}
    assert distributed.torchrun_settings(env) == {
        "coordinator_address": "10.0.0.2:29501",
        "num_processes": 4,
        "process_id": 3,
    }
    assert (
        distributed.torchrun_settings({**env, "TPUREC_COORDINATOR_PORT": "1234"})["coordinator_address"]
        == "10.0.0.2:1234"
    )
    assert distributed.torchrun_settings({}) is None


@pytest.mark.parametrize(
    "env,message",
    [
        (
            {"MASTER_ADDR": "h", "RANK": "0"},
            r"incomplete: \['MASTER_ADDR', 'RANK'\] are set but \['MASTER_PORT', 'WORLD_SIZE'\]",
        ),
        ({"MASTER_ADDR": "h", "MASTER_PORT": "x", "WORLD_SIZE": "2", "RANK": "0"}, "must be integers"),
        (
            {"MASTER_ADDR": "h", "MASTER_PORT": "1", "WORLD_SIZE": "2", "RANK": "2"},
            r"RANK=2 is outside \[0, WORLD_SIZE=2\)",
        ),
    ],
)
def test_bad_torchrun_environment(env, message):
    with pytest.raises(ValueError, match=message):
        distributed.torchrun_settings(env)


def test_initialize_needs_all_arguments_or_none():
    with pytest.raises(ValueError, match=r"missing \['num_processes', 'process_id'\]"):
        distributed.initialize("127.0.0.1:1234")


def test_initialize_after_devices_are_in_use_is_refused():
    import jax

    jax.devices()  # this test process already uses its devices
    with pytest.raises(RuntimeError, match="must run before the first tpu tensor"):
        distributed.initialize("127.0.0.1:1234", 2, 0)


def _mesh_tensor():
    import torch

    from tpurec.core import runtime
    from tpurec.sparse.sharding import default_mesh, distribute_batch

    runtime.mesh_arrays_in_use()
    return distribute_batch(torch.arange(32, dtype=torch.float32).reshape(8, 4), default_mesh())


@pytest.mark.parametrize("setting,expected", [(None, True), ("0", False), ("off", False), ("1", True)])
def test_multiprocess_cpu_jobs_wait_for_each_mesh_program(monkeypatch, setting, expected):
    """On XLA:CPU with several processes each mesh program finishes before the next is dispatched
    (docs/sharding.md: queued gloo programs deadlocked); single-device programs are not waited for."""
    import jax
    import torch

    from tpurec.core import runtime

    x = _mesh_tensor()
    waited = []
    real_wait = jax.block_until_ready
    monkeypatch.setattr(jax, "block_until_ready", lambda out: waited.append(out) or real_wait(out))
    monkeypatch.setattr(jax, "process_count", lambda: 2)  # what a 2-process job reports
    monkeypatch.setattr(runtime, "_LOCKSTEP", None)
    if setting is None:
        monkeypatch.delenv("TPUREC_CPU_LOCKSTEP", raising=False)
    else:
        monkeypatch.setenv("TPUREC_CPU_LOCKSTEP", setting)
    y = x * 3 + 1
    assert bool(waited) == expected
    np.testing.assert_array_equal(y.cpu().numpy(), np.arange(32, dtype=np.float32).reshape(8, 4) * 3 + 1)
    waited.clear()
    (torch.ones(3, device="tpu") * 2).cpu()  # one device: nothing to keep in step
    assert not waited


def test_one_process_on_cpu_waits_for_each_mesh_program(monkeypatch):
    """One process too: XLA:CPU may start queued multi-device programs out of order on its local devices,
    and their in-process all-reduces then wait on each other until XLA aborts the process after 40 s
    ("Termination timeout for `all reduce ...`": two jitted all-reduce programs over the 8 host devices,
    alternated 3000 times without a wait, aborted in each of 3 tries). The sharded training tests lost xdist
    workers so."""
    import jax

    from tpurec.core import runtime

    x = _mesh_tensor()
    waited = []
    real_wait = jax.block_until_ready
    monkeypatch.setattr(jax, "block_until_ready", lambda out: waited.append(out) or real_wait(out))
    monkeypatch.setattr(runtime, "_LOCKSTEP", None)
    monkeypatch.delenv("TPUREC_CPU_LOCKSTEP", raising=False)
    (x * 3).cpu()
    assert waited and runtime._LOCKSTEP is True
