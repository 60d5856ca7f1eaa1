"""The tpu device: registration, torch.tpu, device indices, platform."""

import subprocess
import sys

import jax
import pytest
import torch

import tpurec


def test_linear_to_tpu_lands_on_tpu0():
    assert torch.nn.Linear(4, 4).to("tpu").weight.device == torch.device("tpu", 0)


def test_torch_tpu_module():
    assert torch.tpu.is_available()
    assert torch.tpu.device_count() == len(jax.devices())
    assert torch.tpu.current_device() == 0
    assert tpurec.platform() in ("tpu", "gpu", "cpu")
    torch.tpu.synchronize()


def test_set_device_and_index_mapping():
    assert torch.tpu.device_count() == 8  # conftest asks XLA for 8 host devices
    try:
        torch.tpu.set_device(3)
        t = torch.ones(2, device="tpu")
        assert t.device == torch.device("tpu", 3)
        assert t.to_jax().devices() == {jax.devices()[3]}
    finally:
        torch.tpu.set_device(0)
    u = torch.zeros(2, device="tpu:5")
    assert u.device == torch.device("tpu", 5)
    assert (u + 1).device == torch.device("tpu", 5)


def test_device_index_out_of_range_raises_like_cuda():
    with pytest.raises(RuntimeError, match="Invalid device ordinal"):
        torch.zeros(2, device="tpu:99")
    with pytest.raises(RuntimeError, match="Invalid device ordinal"):
        torch.tpu.set_device(99)
    with pytest.raises(RuntimeError, match="Invalid device ordinal"):
        torch.ones(2).to("tpu:8")


def test_mixed_devices_raise():
    a = torch.ones(2, device="tpu:0")
    b = torch.ones(2, device="tpu:1")
    with pytest.raises(RuntimeError, match="same device"):
        a + b
    with pytest.raises(RuntimeError, match="same device"):
        a + torch.ones(2)


def _run_snippet(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    "snippet",
    [
        # Autograd on the device needs the device guard and hooks (a missing one aborts).
        "x = torch.ones(3, device='tpu', requires_grad=True); (x * 2).sum().backward(); print(x.grad.cpu())",
        # A fresh process asking for an unsupported op must get a Python error, not an abort.
        "x = torch.ones(2, 2, device='tpu')\ntry:\n    torch.ops.aten.linalg_ldl_factor_ex(x)\nexcept NotImplementedError as e:\n    print('clean', e)",
        "print(torch.tpu.device_count(), torch.tpu.current_device(), torch.tpu.get_rng_state().shape)",
        "torch.manual_seed(0); print(torch.randn(2, device='tpu'))",
    ],
)
def test_nothing_aborts_the_interpreter(snippet):
    result = _run_snippet("import torch, tpurec\n" + snippet)
    assert result.returncode == 0, result.stderr[-2000:]


def test_fused_mode_keeps_each_device_in_its_own_graph():
    with tpurec.mode("fused"):
        torch.tpu.synchronize()
        tpurec.reset_stats()
        a = torch.ones(3, device="tpu:0") * 2
        b = torch.ones(3, device="tpu:1") * 3
        c = b + 1
        assert a.to_jax().devices() == {jax.devices()[0]}
        assert c.to_jax().devices() == {jax.devices()[1]}
        assert a.tolist() == [2.0] * 3 and c.tolist() == [4.0] * 3
    assert tpurec.stats()["sync_points"].get("device change", 0) == 1


# --- pin_memory: tpurec pins for tpu only -----------------------------------------------------

_PIN_CASES = (
    "import warnings, torch\n"
    "warnings.simplefilter('ignore')  # device= is deprecated\n"
    "def outcome(device):\n"
    "    try:\n"
    "        r = torch.arange(4.0).pin_memory(device=device)\n"
    "        return ('ok', r.device.type, r.tolist())\n"
    "    except Exception as e:\n"
    "        return (type(e).__name__, str(e).splitlines()[0])\n"
    "cases = {d: outcome(d) for d in ('cpu', 'cuda', 'meta')}\n"
)


def test_pinning_for_other_devices_behaves_as_without_tpurec():
    """CPU and CUDA pinning (``pin_memory(device=...)``) give what PyTorch gives without tpurec:
    on this machine the same exception type and message; on a CUDA machine, pinned memory."""

    def outcomes(first: str) -> str:
        code = first + _PIN_CASES + "import sys\nprint(repr(cases), 'tpurec' in sys.modules)"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.strip()

    without, with_tpurec = outcomes(""), outcomes("import tpurec\n")
    assert without.endswith(" False") and with_tpurec.endswith(" True")
    assert with_tpurec.removesuffix(" True") == without.removesuffix(" False")


def test_pinning_for_tpu_pins_as_pytorch_does():
    """With no device, pinning is for the current accelerator: tpu in a process with tpurec. With
    tpurec's C++ hooks PyTorch's own kernel pins (a copy with the same strides, ``is_pinned()``),
    as ``empty(pin_memory=True)`` does."""
    from tpurec.native import torch_hooks

    assert torch.accelerator.current_accelerator() == torch.device("tpu")
    assert torch_hooks.registered(), torch_hooks.failure()
    host = torch.arange(6.0).reshape(2, 3).t()
    for pinned in (host.pin_memory(), host.pin_memory(device="tpu")):
        assert pinned.device.type == "cpu" and pinned.is_pinned() and torch.equal(pinned, host)
        assert pinned.stride() == host.stride() and pinned.data_ptr() != host.data_ptr()
        assert torch.equal(pinned.to("tpu", non_blocking=True).cpu(), host)
    assert not host.is_pinned() and torch.empty(3, pin_memory=True).is_pinned()
