"""tpurec's C++ PrivateUse1 hooks: pinned host memory for tpu, and the Python hooks where they cannot be built.

The cases that change the build (no compiler, a damaged library) run in a fresh process with
their own cache folder: PyTorch takes PrivateUse1 hooks once per process, at ``import tpurec``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tpurec.native import torch_hooks

ROOT = Path(__file__).resolve().parents[2]


def test_pinned_host_memory_for_tpu():
    assert torch_hooks.registered(), torch_hooks.failure()
    pinned = torch.empty(6, pin_memory=True)
    assert pinned.is_pinned()
    assert not torch.empty(6).is_pinned()
    assert pinned[1:].is_pinned()  # a view of a pinned storage is pinned, as with CUDA pinned memory
    pinned.copy_(torch.arange(6.0))
    torch.testing.assert_close(pinned.to("tpu").cpu(), torch.arange(6.0), rtol=0, atol=0)
    like = torch.empty_like(pinned, pin_memory=True)
    assert like.is_pinned() and like.data_ptr() != pinned.data_ptr()


def test_the_device_guard_is_cpp_and_backward_never_asks_python_for_it(monkeypatch):
    from tpurec.core import device

    assert torch_hooks.guard_registered(), torch_hooks.failure()
    calls = []
    monkeypatch.setattr(
        device._Guard, "type_", lambda self: calls.append(1) or torch._C._autograd.DeviceType.PrivateUse1
    )
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).to("tpu")
    model(torch.randn(5, 4, device="tpu")).sum().backward()
    assert all(p.grad is not None and p.grad.device.type == "tpu" for p in model.parameters())
    assert calls == []  # the Python guard (PyTorch's default for a Python backend) would answer each node
    assert torch.tensor(1.0, device="tpu").device == torch.device("tpu", 0)


def test_accelerator_and_stream_synchronize_wait_for_pending_work():
    import tpurec
    from tpurec.core import fused

    with tpurec.mode("fused"):
        x = torch.ones(4, device="tpu") * 3
        assert fused.pending_ops() > 0
        torch.accelerator.synchronize()  # the Python guard refused: "Backend doesn't support synchronizing"
        assert fused.pending_ops() == 0
        y = x + 1
        torch.Stream(device="tpu").synchronize()
        assert fused.pending_ops() == 0
    assert y.cpu().tolist() == [4.0] * 4


def test_a_failing_synchronize_raises_its_message(monkeypatch):
    def fail():
        raise ValueError("device lost")

    torch_hooks.set_synchronize(fail)
    try:
        with pytest.raises(RuntimeError, match="ValueError: device lost"):
            torch.accelerator.synchronize()
    finally:
        from tpurec.core import sync

        torch_hooks.set_synchronize(sync.synchronize)


def _run(script: str, cache: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TPUREC_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT), **env},
    )


def test_without_a_compiler_the_python_hooks_serve_and_say_why(tmp_path):
    script = """
import torch, tpurec
from tpurec.native import torch_hooks
assert not torch_hooks.registered()
print("failure:", torch_hooks.failure())
print("tpu:", (torch.arange(3.0, device="tpu") * 2).cpu().tolist())
try:
    torch.empty(2, pin_memory=True)
except NotImplementedError as e:
    print("pinned refused:", "getPinnedMemoryAllocator" in str(e))
"""
    result = _run(script, tmp_path / "cache", CXX="/nonexistent/g++")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "failure: the library of tpurec's C++ PrivateUse1 hooks could not be built or loaded" in result.stdout
    assert "/nonexistent/g++" in result.stdout
    assert "tpu: [0.0, 2.0, 4.0]" in result.stdout
    assert "pinned refused: True" in result.stdout


def test_a_damaged_hooks_library_is_rebuilt_before_it_is_loaded(tmp_path):
    script = """
import torch, tpurec
from tpurec.native import torch_hooks
assert torch_hooks.registered(), torch_hooks.failure()
assert torch.empty(2, pin_memory=True).is_pinned()
print("library", torch_hooks.library_path())
"""
    cache = tmp_path / "cache"
    first = _run(script, cache)
    assert first.returncode == 0, first.stderr[-3000:]
    (library,) = (cache / "native").glob("tpurec_torch_hooks-*.so")
    library.write_bytes(library.read_bytes()[:1000])  # loading this would kill the process
    second = _run(script, cache)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "does not match its build record" in second.stderr
    assert f"library {library}" in second.stdout
    assert library.stat().st_size > 1000


def test_a_tpu_process_group_without_the_hooks_warns_what_ddp_will_miss(tmp_path):
    script = """
import warnings, torch, torch.distributed as dist, tpurec
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    dist.init_process_group("tpu", store=dist.HashStore(), rank=0, world_size=1)
print("warned:", [str(w.message) for w in caught if "pinned host memory" in str(w.message)])
"""
    result = _run(script, tmp_path / "cache", CXX="/nonexistent/g++")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "find_unused_parameters=True or static_graph=True" in result.stdout
    assert "Install a C++ compiler (or set CXX)" in result.stdout
