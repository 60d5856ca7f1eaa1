"""``KeyedTensor.regroup`` on the tpu device: FBGEMM's pooled-embedding permutations, forward and backward.

Through TorchRec's public API (``KeyedTensor.regroup``, ``regroup_as_dict``), against the same
calls on CPU, which run FBGEMM's CPU kernels. A permutation moves values without arithmetic, so
outputs and gradients must match exactly.
"""

from __future__ import annotations

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedTensor

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
