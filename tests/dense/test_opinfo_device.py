"""A CI slice of the OpInfo-through-the-device suite (opinfo_device.py; `make coverage` runs it all).

Every entry of ``EAGER_SLICE`` runs in eager mode, in this one process, and must
agree with the known-failure list: a failure not on the list fails, and so does
a listed entry that passes. Smaller slices run in fused and compiled mode,
where every phase that passes in eager mode must pass too.
"""

from __future__ import annotations

import functools

import pytest
import torch

import tpurec
from opinfo_device import BLOCKED, KNOWN_FAILURES, Result, check_entry, entry_name, float32_entries, load_known, surprises

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
""".split()

FUSED_SLICE = "add matmul sum softmax nn.functional.layer_norm reshape transpose index_select nn.functional.cross_entropy".split()
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
