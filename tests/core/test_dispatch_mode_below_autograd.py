"""``Tensor.to`` arriving whole below autograd (backward thread, a TorchDispatchMode's own calls)."""

import subprocess
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _ReadsEveryResult(TorchDispatchMode):
    """A debugging mode that copies every result to the host, as users write them to print values."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            out.cpu()
            self.seen.append(func.__name__)
        return out


def test_a_mode_that_reads_results_to_the_host_during_backward():
    # Before: aten.to.dtype_layout(device="cpu") was run as a view on a meta tensor
    # ("Cannot copy out of meta tensor"), and the process aborted at exit.
    x = torch.tensor([0.5, 1.0, 2.0, 4.0])
    a = x.to("tpu").requires_grad_()
    y = torch.rsqrt(a)
    mode = _ReadsEveryResult()
    with mode:
        y.backward(torch.ones(4, device="tpu"))
    expected = -0.5 * x.pow(-1.5)
    torch.testing.assert_close(a.grad.cpu(), expected)
    assert mode.seen


def test_the_same_in_a_fresh_process_exits_cleanly():
    code = (
        "import torch, tpurec\n"
        "from torch.utils._python_dispatch import TorchDispatchMode\n"
        "class M(TorchDispatchMode):\n"
        "    def __torch_dispatch__(self, func, types, args=(), kwargs=None):\n"
        "        out = func(*args, **(kwargs or {}))\n"
        "        if isinstance(out, torch.Tensor): out.cpu()\n"
        "        return out\n"
        "a = torch.ones(4, device='tpu', requires_grad=True)\n"
        "y = torch.rsqrt(a)\n"
        "with M():\n"
        "    y.backward(torch.ones(4, device='tpu'))\n"
        "print(a.grad.cpu().tolist())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[-0.5, -0.5, -0.5, -0.5]"
    assert "terminate" not in done.stderr
