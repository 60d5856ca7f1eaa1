"""A CI slice of the OpInfo-through-the-device suite (opinfo_device.py; `make coverage` runs it all).

Every entry of ``EAGER_SLICE`` runs in eager mode, in this one process, and must
agree with the known-failure list: a failure not on the list fails, and so does
a listed entry that passes. Smaller slices run in fused and compiled mode,
where every phase that passes in eager mode must pass too. The last tests
check the comparison rules themselves (float64 reference, sign/phase-free
outputs): they accept rounding and reject wrong results.
"""

from __future__ import annotations

import functools

import pytest
import torch

import tpurec
from opinfo_device import (
    BLOCKED,
    KNOWN_FAILURES,
    Mismatch,
    Result,
    _compare,
    _to_device,
    check_entry,
    entry_name,
    float32_entries,
    float64_verdict,
    gauge_phases,
    load_known,
    run_isolated,
    surprises,
)

# Families users hit first: arithmetic, reductions, shapes and views, indexing, nn
# layers and losses, random ops, data-dependent ops, factories (whose samples name
# their device), and a few known failures.
EAGER_SLICE = """
add mul div.no_rounding_mode pow exp log tanh sigmoid clamp where lerp sum mean amax var logsumexp cumsum
matmul mm bmm addmm nn.functional.linear cat stack reshape view transpose permute squeeze unsqueeze flatten t
as_strided narrow expand gather scatter_add index_select index_put masked_fill sort topk quantile nonzero
softmax log_softmax nn.functional.relu nn.functional.gelu nn.functional.layer_norm nn.functional.batch_norm
native_batch_norm _native_batch_norm_legit nn.functional.max_pool2d nn.functional.pixel_shuffle
nn.functional.embedding nn.functional.cross_entropy nn.functional.mse_loss nn.functional.binary_cross_entropy_with_logits
nn.functional.dropout uniform randn_like linalg.svd nn.functional.hardshrink
arange linspace full eye scalar_tensor to randn signal.windows.hann cummax nn.functional.group_norm
logspace as_strided.partial_views matrix_exp logcumsumexp linalg.eigh fft.rfft view_as_complex polar
""".split()

FUSED_SLICE = (
    "add matmul sum softmax nn.functional.layer_norm reshape transpose index_select nn.functional.cross_entropy".split()
)
COMPILED_SLICE = "add matmul sum softmax nn.functional.layer_norm transpose".split()


@functools.cache
def _entries() -> dict:
    return {entry_name(op): op for op in float32_entries()}


@functools.cache
def _known() -> dict:
    return load_known()


def test_the_slices_name_real_entries():
    missing = [n for n in EAGER_SLICE + FUSED_SLICE + COMPILED_SLICE if n not in _entries()]
    assert not missing, f"not float32 op_db entries: {missing}"


def test_known_failure_list_is_well_formed_and_names_real_entries():
    known = _known()
    assert known, f"{KNOWN_FAILURES.name} is empty"
    unknown = sorted({name for name, _ in known if name not in _entries()})
    assert not unknown, f"{KNOWN_FAILURES.name} lists entries that are not in op_db: {unknown}"
    assert all(reason.strip() for reason in known.values())


def test_list_mismatches_fail_both_ways():
    known = {("x", "forward"): "no lowering"}
    assert surprises(Result("x", forward="pass", backward="n/a"), known)  # listed but passes: stale
    assert surprises(Result("y", forward="error: boom", backward=BLOCKED), known)  # fails, not listed
    assert not surprises(Result("x", forward="error: boom", backward=BLOCKED), known)


@pytest.mark.parametrize("name", EAGER_SLICE)
def test_entry_through_the_device_eager(name):
    result = check_entry(_entries()[name])
    problems = surprises(result, _known())
    assert not problems, "\n".join(problems)


def _passing_in_eager(name: str) -> Result:
    result = check_entry(_entries()[name])
    assert result.forward == "pass", f"{name} fails in eager mode ({result.forward}); pick another entry for this slice"
    return result


@pytest.mark.parametrize("name", FUSED_SLICE)
def test_entry_through_the_device_fused(name):
    eager = _passing_in_eager(name)
    fused = check_entry(_entries()[name], mode=lambda: tpurec.mode("fused"))
    assert (fused.forward, fused.backward) == (eager.forward, eager.backward)


def _compiled(op):
    return torch.compile(lambda *args, **kwargs: op(*args, **kwargs), backend="tpu", dynamic=False)


@pytest.mark.parametrize("name", COMPILED_SLICE)
def test_entry_through_the_device_compiled(name):
    eager = _passing_in_eager(name)
    compiled = check_entry(_entries()[name], wrap=_compiled, max_samples=2)
    assert compiled.forward == "pass", compiled.forward
    assert compiled.backward in ("pass", eager.backward), compiled.backward


# --- the comparison rules themselves: they accept rounding and reject wrong results --------------


def test_float64_rule_accepts_rounding_no_worse_than_cpu_and_rejects_more():
    expected = torch.tensor([1.0, 2.0])  # CPU float32, off float64 by 1e-3 in the first element
    reference = torch.tensor([1.001, 2.0], dtype=torch.float64)
    tol = dict(rtol=1e-6, atol=1e-6)
    assert float64_verdict(expected, torch.tensor([1.0019, 2.0]), reference, tol) is None  # 1.9x CPU's error
    assert float64_verdict(expected, torch.tensor([1.001, 2.0]), reference, tol) is None  # exact in float64
    verdict = float64_verdict(expected, torch.tensor([1.0035, 2.0]), reference, tol)  # 2.5x CPU's error
    assert verdict is not None and "tpu errs by" in verdict
    assert float64_verdict(expected, torch.tensor([1.0, 2.01]), reference, tol) is not None  # CPU exact there


def _compare_on_tpu(expected, actual, reference64):
    return _compare(expected, actual.to("tpu"), "output", tol=dict(rtol=1e-6, atol=1e-6), reference64=reference64)


def test_compare_asks_float64_only_on_a_mismatch_and_rejects_a_wrong_result():
    expected = torch.tensor([1.0, 2.0])
    asked = []

    def reference64():
        asked.append(1)
        return torch.tensor([1.001, 2.0], dtype=torch.float64)

    _compare_on_tpu(expected, expected.clone(), reference64)
    assert not asked  # equal results never pay for a float64 run
    _compare_on_tpu(expected, torch.tensor([1.0015, 2.0]), reference64)  # rounding, as accurate as CPU
    with pytest.raises(Mismatch, match="against float64: tpu errs by"):
        _compare_on_tpu(expected, torch.tensor([1.1, 2.0]), reference64)
    with pytest.raises(Mismatch, match="wrong values"):  # without a reference, TOL against CPU decides
        _compare_on_tpu(expected, torch.tensor([1.0015, 2.0]), None)


def _device_result_changed(change):
    """A ``wrap`` for check_entry: the op runs on tpu, then ``change`` alters its result."""
    return lambda op: lambda *args, **kwargs: change(op(*args, **kwargs))


def test_a_wrong_matrix_exp_fails_despite_the_float64_rule():
    # exp(A)^T = exp(A^T): the right scale and rounding, the wrong matrix.
    result = check_entry(_entries()["matrix_exp"], wrap=_device_result_changed(lambda m: m.mT), backward=False)
    assert "wrong values" in result.forward and "against float64" in result.forward, result.forward


def _flip_every_other_column(outputs):
    values, vectors = outputs
    signs = torch.tensor([(-1.0) ** j for j in range(vectors.shape[-1])]).to(vectors.device)
    return values, vectors * signs


def test_eigenvectors_with_other_signs_pass_forward_and_backward():
    result = check_entry(_entries()["linalg.eigh"], wrap=_device_result_changed(_flip_every_other_column))
    assert (result.forward, result.backward) == ("pass", "pass"), result


def _swap_two_columns(outputs):
    values, vectors = outputs
    order = list(range(vectors.shape[-1]))
    order[0], order[-1] = order[-1], order[0]
    return values, vectors[..., order]


def _perturb_one_column(outputs):
    values, vectors = outputs
    bump = torch.zeros(vectors.shape[-1]).to(vectors.device)
    bump[0] = 0.01
    return values, vectors + bump


@pytest.mark.parametrize("change", [_swap_two_columns, _perturb_one_column], ids=["swapped", "perturbed"])
def test_wrong_eigenvectors_fail(change):
    result = check_entry(_entries()["linalg.eigh"], wrap=_device_result_changed(change), backward=False)
    assert result.forward.startswith("output[1]: wrong values"), result.forward


def test_gauge_phases_align_complex_vectors_and_not_different_ones():
    torch.manual_seed(0)
    vectors = torch.linalg.qr(torch.randn(4, 4, dtype=torch.complex64))[0]
    turned = vectors * torch.exp(1j * torch.rand(4))  # each column by its own unit phase
    phases = gauge_phases(vectors, turned, -2)
    torch.testing.assert_close(turned * phases.conj(), vectors)
    other = vectors[:, [1, 0, 2, 3]]
    assert not torch.allclose(other * gauge_phases(vectors, other, -2).conj(), vectors, atol=1e-3)


def test_a_partial_view_sample_moves_with_its_storage():
    # as_strided.partial_views: a view of elements 5..14 of a 20-element tensor; as_strided with
    # storage_offset=0 then reads elements before the view, which must exist on tpu as on CPU.
    base = torch.arange(20.0)
    view = base[5:15]
    moved = _to_device(view, "tpu")
    assert (moved.shape, moved.stride(), moved.storage_offset()) == (view.shape, view.stride(), view.storage_offset())
    assert torch.equal(moved.cpu(), view)
    read_before = moved.as_strided((2, 2), (1, 2), 0)
    assert torch.equal(read_before.cpu(), view.as_strided((2, 2), (1, 2), 0))


def test_an_isolated_run_fails_only_the_entry_whose_process_died():
    # On a TPU, XLA's compiler aborted the whole process on some programs (the SVD); with
    # --isolate the entry running at the abort fails and the run goes on in a new process.
    results = run_isolated(["abs", "exp", "neg"], per_child=3, timeout=300, child_args=["--abort-at", "exp"])
    assert [r.name for r in results] == ["abs", "exp", "neg"]
    assert results[0].forward == results[2].forward == "pass"
    assert results[1].forward.startswith("error: the process ended with exit code") and results[1].backward == BLOCKED
