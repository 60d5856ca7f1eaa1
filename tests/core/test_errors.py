"""Unsupported ops and bad calls raise clear Python errors."""

import subprocess
import sys

import pytest
import torch

import tpurec


# An op with a CPU kernel only and no lowering: stays unsupported whatever lowerings are added.
@torch.library.custom_op("tpurec_test::cpu_only_negate", mutates_args=(), device_types="cpu")
def _cpu_only_negate(x: torch.Tensor) -> torch.Tensor:
    return -x


_cpu_only_negate.register_fake(lambda x: torch.empty_like(x))


def test_op_without_lowering_names_the_overload():
    x = torch.ones(4, device="tpu")
    with pytest.raises(
        NotImplementedError, match=r"tpurec_test::cpu_only_negate.*not supported on the tpu device.*report"
    ):
        torch.ops.tpurec_test.cpu_only_negate(x)


def test_numpy_refuses_like_cuda():
    with pytest.raises(TypeError, match="can't convert tpu:0 device type tensor to numpy"):
        torch.ones(2, device="tpu").numpy()


def test_error_leaves_state_unchanged():
    x = torch.arange(4.0).to("tpu").reshape(2, 2)
    before = x.cpu().clone()
    with pytest.raises(NotImplementedError):
        torch.ops.tpurec_test.cpu_only_negate(x)
    assert torch.equal(x.cpu(), before)


@pytest.fixture
def broken_sinh(monkeypatch):
    from tpurec.dense.registry import LOWERINGS, Lowering, get_lowering

    op = torch.ops.aten.sinh.default
    get_lowering(op)

    def broken(x):
        raise TypeError("boom")

    monkeypatch.setitem(LOWERINGS, op, Lowering(op, broken))


@pytest.mark.parametrize("mode", ["eager", "fused", "debug"])
def test_lowering_failure_names_op_and_user_line(broken_sinh, mode):
    x = torch.ones(3, device="tpu")
    with tpurec.mode(mode):
        with pytest.raises(RuntimeError, match=r"(?s)aten::sinh.*boom.*test_errors.py.*torch.sinh\(x\)"):
            torch.sinh(x)
    assert x.tolist() == [1.0, 1.0, 1.0]


def test_data_dependent_ops_run_on_the_host():
    host = torch.tensor([[1.0, -2.0, 3.0], [-4.0, 5.0, -6.0]])
    dev = host.to("tpu")
    assert torch.equal(torch.nonzero(dev).cpu(), torch.nonzero(host))
    assert torch.equal(dev[dev > 0].cpu(), host[host > 0])
    assert torch.equal(torch.unique(dev.abs()).cpu(), torch.unique(host.abs()))
    host[host < 0] = 0.0
    dev[dev < 0] = 0.0
    assert torch.equal(dev.cpu(), host)
    with tpurec.mode("fused"):
        tpurec.reset_stats()
        picked = (dev * 2)[dev > 1]
        assert picked.tolist() == [6.0, 10.0]
    assert tpurec.stats()["sync_points"]["data-dependent op"] == 1


BROKEN_BACKWARD = """
import warnings, torch, tpurec
from tpurec.dense.registry import LOWERINGS, Lowering, get_lowering
op = torch.ops.aten.native_layer_norm_backward.default
get_lowering(op)
def broken(*args, **kwargs):
    raise TypeError("boom")
LOWERINGS[op] = Lowering(op, broken)
torch.manual_seed(0)
ln = torch.nn.LayerNorm(4)
x = torch.randn(2, 4)
torch.sigmoid(ln(x)).sum().backward()
dev = torch.nn.LayerNorm(4).to("tpu")
dev.load_state_dict(ln.state_dict())
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    torch.sigmoid(dev(x.to("tpu"))).sum().backward()
assert any("native_layer_norm_backward" in str(w.message) for w in caught)
torch.testing.assert_close(dev.weight.grad.cpu(), ln.weight.grad)
print("ok")
"""


def test_failing_backward_op_does_not_abort_the_interpreter():
    # Raising inside the autograd engine would abort the process (PyTorch's Python
    # device guard is noexcept); the op runs on the host instead, with a warning.
    result = subprocess.run([sys.executable, "-c", BROKEN_BACKWARD], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


USER_SCRIPT = """
import torch, tpurec
from tpurec.dense.registry import LOWERINGS, Lowering, get_lowering

op = torch.ops.aten.sinh.default
get_lowering(op)

def broken(x):
    raise TypeError("boom")

LOWERINGS[op] = Lowering(op, broken)
x = torch.ones(3, device="tpu")
try:
    torch.sinh(x)  # the user's line
except RuntimeError as e:
    print(e)
"""


def test_user_line_found_in_a_checkout_under_folders_named_like_the_libraries(tmp_path):
    # A user's project in .../tpurec/torch/ is still the user's code, not a library frame.
    folder = tmp_path / "tpurec" / "torch"
    folder.mkdir(parents=True)
    script = folder / "train.py"
    script.write_text(USER_SCRIPT)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "called from" in result.stdout and "train.py" in result.stdout and "the user's line" in result.stdout, (
        result.stdout
    )
