"""``KeyedTensor.regroup`` on the tpu device: FBGEMM's pooled-embedding permutations, forward and backward.

Through TorchRec's public API (``KeyedTensor.regroup``, ``regroup_as_dict``, the ``KTRegroupAsDict`` module
and FBGEMM's ``permute_multi_embedding`` it calls, TorchRec's ``regroup_kts`` and ``permute_multi_embedding``),
against the same calls on CPU, which run FBGEMM's CPU kernels. A permutation moves values without
arithmetic, so outputs and gradients must match exactly.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from torchrec.modules.regroup import KTRegroupAsDict
from torchrec.sparse.jagged_tensor import KeyedTensor, permute_multi_embedding, regroup_kts

import tpurec

# Two keyed tensors of pooled embeddings (batch 3), keys of different widths.
_KEYS = [(["f1", "f2"], [2, 3]), (["f3", "f4", "f5"], [4, 1, 8])]


def _keyed_tensors(device: str) -> tuple[list[KeyedTensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(3, sum(dims), generator=g).to(device) for _, dims in _KEYS]
    if not torch.is_inference_mode_enabled():
        leaves = [leaf.requires_grad_() for leaf in leaves]
    return [KeyedTensor(keys, dims, values) for (keys, dims), values in zip(_KEYS, leaves)], leaves


def _regroup(device: str, groups: list[list[str]], as_dict: bool = False) -> tuple[list[torch.Tensor], list]:
    """The regrouped tensors and the gradients of the keyed tensors' values under a weighted sum."""
    kts, leaves = _keyed_tensors(device)
    if as_dict:
        out = list(KeyedTensor.regroup_as_dict(kts, groups, [f"g{i}" for i in range(len(groups))]).values())
    else:
        out = KeyedTensor.regroup(kts, groups)
    weights = [torch.arange(o.numel(), dtype=o.dtype).view(o.shape).to(device) for o in out]
    sum((o * w).sum() for o, w in zip(out, weights)).backward()
    return [o.detach().cpu() for o in out], [leaf.grad.cpu() for leaf in leaves]


GROUPS = {
    "interleaved": [["f3", "f1"], ["f5", "f2", "f4"]],
    "one_group_reversed": [["f5", "f4", "f3", "f2", "f1"]],
    "as_given": [["f1", "f2"], ["f3", "f4", "f5"]],
    "a_key_twice": [["f1", "f3"], ["f3", "f5"]],  # TorchRec's concatenating path
}


@pytest.mark.parametrize("mode", ["eager", "fused"])
@pytest.mark.parametrize("as_dict", [False, True])
@pytest.mark.parametrize("groups", list(GROUPS))
def test_regroup_matches_fbgemm_on_cpu_forward_and_backward(groups: str, as_dict: bool, mode: str) -> None:
    want_out, want_grads = _regroup("cpu", GROUPS[groups], as_dict)
    with tpurec.mode(mode):
        got_out, got_grads = _regroup("tpu", GROUPS[groups], as_dict)
    assert len(got_out) == len(want_out)
    for got, want in zip(got_out + got_grads, want_out + want_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_regroup_in_inference_mode_and_compiled() -> None:
    # Without autograd the op arrives whole (permute_pooled_embs_auto_grad), as in a compiled graph.
    groups = GROUPS["interleaved"]
    want, _ = _regroup("cpu", groups)
    with torch.inference_mode():
        kts, _ = _keyed_tensors("tpu")
        got = KeyedTensor.regroup(kts, groups)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w, rtol=0, atol=0)

    torch._dynamo.reset()
    compiled = torch.compile(
        lambda a, b: KeyedTensor.regroup([KeyedTensor(*_KEYS[0], a), KeyedTensor(*_KEYS[1], b)], groups), backend="tpu"
    )
    _, leaves = _keyed_tensors("tpu")
    out = compiled(*leaves)
    sum((o * torch.arange(o.numel(), dtype=o.dtype).view(o.shape).to("tpu")).sum() for o in out).backward()
    _, want_grads = _regroup("cpu", groups)
    for g, w in zip(out, want):
        torch.testing.assert_close(g.detach().cpu(), w, rtol=0, atol=0)
    for leaf, w in zip(leaves, want_grads):
        torch.testing.assert_close(leaf.grad.cpu(), w, rtol=0, atol=0)
    torch._dynamo.reset()


def _regroup_module(device: str, groups: list[list[str]]) -> tuple[list[torch.Tensor], list]:
    """TorchRec's ``KTRegroupAsDict`` (``fbgemm::permute_multi_embedding``) over two steps: the first sets its
    permutation up, the second runs it as set; outputs and gradients of the second."""
    module = KTRegroupAsDict(groups, [f"g{i}" for i in range(len(groups))])
    out: list[torch.Tensor] = []
    leaves: list[torch.Tensor] = []
    for _ in range(2):
        kts, leaves = _keyed_tensors(device)
        out = list(module(kts).values())
    weights = [torch.arange(o.numel(), dtype=o.dtype).view(o.shape).to(device) for o in out]
    sum((o * w).sum() for o, w in zip(out, weights)).backward()
    return [o.detach().cpu() for o in out], [leaf.grad.cpu() for leaf in leaves]


@pytest.mark.parametrize("mode", ["eager", "fused"])
@pytest.mark.parametrize("groups", list(GROUPS))
def test_kt_regroup_as_dict_matches_torchrec_on_cpu_forward_and_backward(groups: str, mode: str) -> None:
    # A key in two groups gets the sum of both blocks' gradients (FBGEMM's reverse permutation). The reference
    # is KeyedTensor.regroup on CPU: the module on CPU leaves the gradient of a key in no group uninitialized
    # (FBGEMM's CPU backward allocates it empty and writes only the keys it moved), where it is 0.
    want_out, want_grads = _regroup("cpu", GROUPS[groups])
    module_out, module_grads = _regroup_module("cpu", GROUPS[groups])
    for got, want in zip(module_out, want_out):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with tpurec.mode(mode):
        got_out, got_grads = _regroup_module("tpu", GROUPS[groups])
    assert len(got_out) == len(want_out)
    for got, want in zip(got_out + got_grads, want_out + want_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("reverse", [False, True])
def test_permute_multi_embedding_matches_fbgemm_on_cpu(reverse: bool) -> None:
    # The op as TorchRec's module and FBGEMM's autograd kernel call it, inputs of several widths, a block that
    # no permutation row covers (a key of no group) and a key in three groups.
    keys, lengths = [k for k, _ in _KEYS], [d for _, d in _KEYS]
    groups = [["f3", "f1"], ["f1", "f5"], ["f4", "f1"]]  # f2 in no group
    g = torch.Generator().manual_seed(1)
    values = [torch.randn(3, sum(dims), generator=g) for dims in lengths]
    permutes, in_shapes, out_shapes, out_lengths = torch.ops.fbgemm.kt_regroup_arguments(
        values[0], keys, lengths, groups
    )
    op = torch.ops.fbgemm.permute_multi_embedding_function
    if reverse:
        given = [torch.randn(3, n, generator=g) for n in out_lengths]
        args = (permutes, out_shapes, in_shapes, [v.shape[1] for v in values], True)
    else:
        given, args = values, (permutes, in_shapes, out_shapes, out_lengths, False)
    want = op(given, *args)
    got = op([t.to("tpu") for t in given], *(a.to("tpu") if isinstance(a, torch.Tensor) else a for a in args))
    assert len(got) == len(want)
    if reverse:
        # FBGEMM's CPU kernel leaves the input blocks no row covers uninitialized; their gradient is 0.
        covered = [torch.zeros(v.shape[1], dtype=torch.bool) for v in values]
        for in_tensor, _, in_start, _, width, _ in permutes.tolist():
            covered[in_tensor][in_start : in_start + width] = True
        assert not all(c.all() for c in covered)
        want = [torch.where(c, w, 0.0) for c, w in zip(covered, want)]
    for got_tensor, want_tensor in zip(got, want):
        torch.testing.assert_close(got_tensor.cpu(), want_tensor, rtol=0, atol=0)


def test_kt_regroup_as_dict_in_inference_mode() -> None:
    # Without autograd the module's op arrives whole (fbgemm::permute_multi_embedding).
    groups = GROUPS["a_key_twice"]
    module_cpu, module_tpu = (KTRegroupAsDict(groups, ["x", "y"]) for _ in range(2))
    with torch.inference_mode():
        want = module_cpu(_keyed_tensors("cpu")[0])
        got = module_tpu(_keyed_tensors("tpu")[0])
    assert list(got) == list(want)
    for key in want:
        torch.testing.assert_close(got[key].cpu(), want[key], rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["eager", "fused"])
@pytest.mark.parametrize("function", [regroup_kts, permute_multi_embedding])
@pytest.mark.parametrize("groups", list(GROUPS))
def test_torchrecs_regroup_functions_match_on_cpu_forward_and_backward(
    groups: str, function: Callable[..., list[torch.Tensor]], mode: str
) -> None:
    # TorchRec's functions behind KeyedTensor's regrouping, which call FBGEMM's kt_regroup_arguments on the
    # values' device and regroup_keyed_tensor or permute_multi_embedding. Reference: KeyedTensor.regroup on CPU
    # (a key in no group gets a zero gradient there, an uninitialized one from FBGEMM's CPU backward).
    want_out, want_grads = _regroup("cpu", GROUPS[groups])
    with tpurec.mode(mode):
        kts, leaves = _keyed_tensors("tpu")
        out = function(kts, GROUPS[groups])
        weights = [torch.arange(o.numel(), dtype=o.dtype).view(o.shape).to("tpu") for o in out]
        sum((o * w).sum() for o, w in zip(out, weights)).backward()
    assert len(out) == len(want_out)
    for got, want in zip([o.detach().cpu() for o in out] + [leaf.grad.cpu() for leaf in leaves], want_out + want_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
