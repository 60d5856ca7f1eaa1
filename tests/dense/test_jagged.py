"""FBGEMM's jagged operators (tpurec/dense/jagged.py) through the tpu device against FBGEMM's CPU kernels.

Every case runs the op the way TorchRec does (``torch.ops.fbgemm.*`` on tpu tensors,
FBGEMM's own autograd), with the same inputs and upstream gradient on CPU, and compares
values exactly (a gather/scatter and integer sums round nothing) and gradients.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from torchrec.sparse.jagged_tensor import JaggedTensor

import tpurec
from tpurec.core import accounting

pytestmark = pytest.mark.usefixtures("no_host_fallback")

fbgemm = torch.ops.fbgemm
EXACT = dict(rtol=0, atol=0)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- asynchronous_complete_cumsum -------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(5,), (0,), (3, 4), (2, 0)], ids=["1d", "empty", "2d", "2d-empty-rows"])
def test_complete_cumsum_matches_fbgemm(dtype, shape):
    lengths = torch.randint(0, 6, shape, generator=_gen()).to(dtype)
    expected = fbgemm.asynchronous_complete_cumsum(lengths)
    got = fbgemm.asynchronous_complete_cumsum(lengths.to("tpu"))
    assert got.device.type == "tpu" and got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got.cpu(), expected, **EXACT)


def test_complete_cumsum_refuses_what_fbgemm_refuses():
    with pytest.raises(RuntimeError, match="1-D or 2-D"):
        fbgemm.asynchronous_complete_cumsum(torch.zeros(2, 2, 2, dtype=torch.long, device="tpu"))
    with pytest.raises(RuntimeError, match="int32, int64, float32 or float16"):
        fbgemm.asynchronous_complete_cumsum(torch.zeros(3, dtype=torch.int16, device="tpu"))


# --- jagged_to_padded_dense, forward and backward ---------------------------------------


def _both(values: torch.Tensor, offsets: list[torch.Tensor], max_lengths: list[int], padding: float, seed: int = 1):
    """(CPU, tpu) padded results and value gradients for one random upstream gradient."""
    results = []
    upstream = None
    for device in ("cpu", "tpu"):
        v = values.detach().to(device).requires_grad_()
        dense = fbgemm.jagged_to_padded_dense(v, [o.to(device) for o in offsets], max_lengths, padding)
        if upstream is None:
            upstream = torch.randn(dense.shape, generator=_gen(seed))
        dense.backward(upstream.to(device))
        results.append((dense.detach().cpu(), v.grad.cpu()))
    return results


LENGTH_CASES = {
    "mixed": [2, 0, 3, 1],
    "empty-bags": [0, 0, 0],
    "no-bags": [],
    "one-long": [7],
}


@pytest.mark.parametrize("offset_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("case", list(LENGTH_CASES))
@pytest.mark.parametrize("max_length", [0, 2, 3, 8], ids=lambda n: f"L{n}")
@pytest.mark.parametrize("inner", [None, 3], ids=["1d-values", "2d-values"])
def test_jagged_to_padded_dense_matches_fbgemm(offset_dtype, case, max_length, inner):
    lengths = torch.tensor(LENGTH_CASES[case], dtype=offset_dtype)
    offsets = fbgemm.asynchronous_complete_cumsum(lengths)
    total = int(lengths.sum())
    values = torch.randn((total,) if inner is None else (total, inner), generator=_gen())
    (dense_cpu, grad_cpu), (dense_tpu, grad_tpu) = _both(values, [offsets], [max_length], -1.5)
    assert dense_tpu.shape == dense_cpu.shape
    torch.testing.assert_close(dense_tpu, dense_cpu, **EXACT)
    torch.testing.assert_close(grad_tpu, grad_cpu, **EXACT)  # truncated rows: zero gradient, as in FBGEMM


@pytest.mark.parametrize("padding", [0.0, 2.25, -math.inf, math.nan])
def test_padding_values(padding):
    offsets = torch.tensor([0, 1, 1, 4])
    values = torch.randn(4, 2, generator=_gen())
    (dense_cpu, _), (dense_tpu, _) = _both(values, [offsets], [3], padding)
    torch.testing.assert_close(dense_tpu, dense_cpu, rtol=0, atol=0, equal_nan=True)


def test_two_jagged_dimensions_match_fbgemm():
    # Two sequences of lists: [[a], [b, c]] and [[d, e, f]]; padded to 2 x 2 (f truncated).
    offsets = [torch.tensor([0, 2, 3], dtype=torch.int32), torch.tensor([0, 1, 3, 6], dtype=torch.int32)]
    values = torch.randn(6, 2, generator=_gen())
    (dense_cpu, grad_cpu), (dense_tpu, grad_tpu) = _both(values, offsets, [2, 2], 7.0)
    torch.testing.assert_close(dense_tpu, dense_cpu, **EXACT)
    torch.testing.assert_close(grad_tpu, grad_cpu, **EXACT)


def test_new_lengths_reuse_the_programs():
    def step(lengths):
        offsets = fbgemm.asynchronous_complete_cumsum(torch.tensor(lengths, device="tpu"))
        values = torch.randn(6, 4, device="tpu", requires_grad=True)
        fbgemm.jagged_to_padded_dense(values, [offsets], [5], 0.0).sum().backward()
        return values.grad.cpu()

    step([2, 0, 3, 1])
    built = accounting.counters().programs_built
    grad = step([0, 6, 0, 0])  # same total, other lengths: no new program
    assert accounting.counters().programs_built == built
    assert grad[:5].eq(1).all() and grad[5].eq(0).all()  # the sixth id is past max_length 5


@pytest.mark.parametrize(
    "values,offsets,max_lengths,match",
    [
        (torch.zeros(6, 2), [torch.tensor([0, 2, 6])], [2, 3], "2 max_lengths"),
        (torch.zeros(6, 2), [torch.tensor([0.0, 2.0, 6.0])], [2], "must be int32 or int64"),
        (torch.zeros(6, 2), [torch.tensor([[0, 2, 6]])], [2], "must be 1-D"),
        (torch.zeros(6, 2, 1), [torch.tensor([0, 2, 6])], [2], "values must be 1-D or 2-D"),
        (torch.zeros(6, 2), [torch.tensor([0, 2]), torch.tensor([0, 2, 6], dtype=torch.int32)], [1, 2], "one dtype"),
    ],
    ids=["lengths-count", "float-offsets", "2d-offsets", "3d-values", "mixed-offset-dtypes"],
)
def test_bad_arguments_raise_naming_what_is_wrong(values, offsets, max_lengths, match):
    with pytest.raises(RuntimeError, match=match):
        fbgemm.jagged_to_padded_dense_forward(values.to("tpu"), [o.to("tpu") for o in offsets], max_lengths, 0.0)


# --- dense_to_jagged ---------------------------------------------------------------------


@pytest.mark.parametrize("offset_dtype", [torch.int32, torch.int64])
def test_dense_to_jagged_matches_fbgemm(offset_dtype):
    offsets = torch.tensor([0, 2, 2, 5, 6], dtype=offset_dtype)  # the third bag (3 ids) is longer than L=2
    dense = torch.randn(4, 2, 3, generator=_gen())
    upstream = torch.randn(6, 3, generator=_gen(1))
    results = []
    for device in ("cpu", "tpu"):
        d = dense.detach().to(device).requires_grad_()
        values, _ = fbgemm.dense_to_jagged(d, [offsets.to(device)], total_L=6)
        values.backward(upstream.to(device))
        results.append((values.detach().cpu(), d.grad.cpu()))
    (values_cpu, grad_cpu), (values_tpu, grad_tpu) = results
    torch.testing.assert_close(values_tpu, values_cpu, **EXACT)
    torch.testing.assert_close(grad_tpu, grad_cpu, **EXACT)


def test_dense_to_jagged_forward_needs_total_length():
    with pytest.raises(RuntimeError, match="needs total_L"):
        fbgemm.dense_to_jagged_forward(torch.zeros(2, 2, 1, device="tpu"), [torch.tensor([0, 1, 3], device="tpu")])


# --- through TorchRec's JaggedTensor --------------------------------------------------------


@pytest.mark.parametrize("mode", ["eager", "fused", "debug"])  # debug: each output checked against FBGEMM's meta kernel
def test_jagged_tensor_paths_match_cpu(mode):
    lengths = torch.tensor([2, 0, 3, 1])
    values = torch.randn(6, 4, generator=_gen())
    upstream = torch.randn(4, 3, 4, generator=_gen(1))
    results = []
    for device in ("cpu", "tpu"):
        with tpurec.mode(mode) if device == "tpu" else torch.enable_grad():
            v = values.detach().to(device).requires_grad_()
            jt = JaggedTensor(values=v, lengths=lengths.to(device))
            offsets = jt.offsets()
            padded = jt.to_padded_dense(desired_length=3, padding_value=0.5)
            longest = jt.to_padded_dense()  # desired_length None: the longest sequence (read on the host)
            (padded * upstream.to(device)).sum().add(longest.sum()).backward()
            pieces = [p.detach().cpu() for p in jt.to_dense()]
            results.append((offsets.cpu(), padded.detach().cpu(), longest.detach().cpu(), v.grad.cpu(), pieces))
    cpu, tpu = results
    for got, expected in zip(tpu[:4], cpu[:4]):
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, **EXACT)
    for got, expected in zip(tpu[4], cpu[4]):
        torch.testing.assert_close(got, expected, **EXACT)


def test_offsets_past_the_values_read_as_padding():
    # Invalid input (FBGEMM's CPU kernel reads out of bounds here): the row past the end is padding.
    values = torch.arange(4.0).reshape(4, 1).to("tpu").requires_grad_()
    offsets = torch.tensor([0, 2, 5], device="tpu")
    dense = fbgemm.jagged_to_padded_dense(values, [offsets], [3], -1.0)
    assert dense.squeeze(-1).cpu().tolist() == [[0.0, 1.0, -1.0], [2.0, 3.0, -1.0]]
    dense.sum().backward()
    assert values.grad.squeeze(-1).cpu().tolist() == [1.0, 1.0, 1.0, 1.0]


def test_to_padded_dense_under_torch_compile():
    def loss(values, lengths):
        jagged = JaggedTensor(values=values, lengths=lengths)
        return jagged.to_padded_dense(desired_length=3, padding_value=0.5).pow(2).sum()

    values = torch.randn(6, 4, generator=_gen())
    lengths = torch.tensor([2, 0, 3, 1])
    ours = values.to("tpu").requires_grad_()
    theirs = values.clone().requires_grad_()
    got = torch.compile(loss, backend="tpu")(ours, lengths.to("tpu"))
    got.backward()
    expected = loss(theirs, lengths)
    expected.backward()
    torch.testing.assert_close(got.detach().cpu(), expected.detach(), rtol=1e-5, atol=1e-6)  # a sum of squares
    torch.testing.assert_close(ours.grad.cpu(), theirs.grad, **EXACT)


def test_dense_programs_do_not_import_fbgemm():
    # The family loads on the first fbgemm op (tpurec/dense/registry.py), not with every lowering.
    script = (
        "import sys, torch, tpurec\n"
        "(torch.ones(3, device='tpu') * 2).sum().cpu()\n"
        "from tpurec.dense.registry import LOWERINGS\n"
        "assert len(LOWERINGS) > 350 and 'fbgemm_gpu' not in sys.modules, sorted(m for m in sys.modules if 'fbgemm' in m)\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
