"""The forward graph's saved activations, packed into one tensor per dtype for the backward.

AOTAutograd's partition splits a training graph into a forward graph, which returns the
user's outputs and then every tensor the backward needs (the saved activations), and a
backward graph that takes them back. Each saved tensor costs the host a few microseconds a
step (a tpu tensor made for it, AOTAutograd's ``save_for_backward``, its value gathered again
for the backward); a small transformer saves about 80. On a TPU the device needs a fraction
of that to copy a small tensor, so :func:`partition` packs the small ones: the forward graph
concatenates the flattened saved tensors of one dtype into one tensor, and the backward graph
slices each back out and views it in its shape. When the forward and backward run in one
program (fused mode's window), XLA sees the concatenation and the slices together.

Packed are saved tensors that the forward graph computes (not its inputs, not its user
outputs) on the tpu device, with static shapes, contiguous, of at most
:data:`MAX_PACKED_ELEMENTS` elements, that AOTAutograd checks for in-place changes as usual.
A saved tensor the graph computes on the CPU (a 0-dim scale made with ``torch.tensor``, an
index built with ``torch.arange``) stays as it is: it cannot join a tpu tensor, and it costs
the device nothing. ``TPUREC_COMPILE_PACK_SAVED=0`` keeps
AOTAutograd's own partition.

Example::

    model = torch.compile(model, backend="tpu")  # the "tpu" backend partitions with this
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch._functorch.partitioners import default_partition
from torch._subclasses.fake_tensor import FakeTensor

from tpurec import config

__all__ = ["MAX_PACKED_ELEMENTS", "pack_saved", "partition"]

aten = torch.ops.aten

# A larger saved tensor costs the device more to copy than its own host cost saves (about
# 5 us a tensor against a TPU's copy of 1 MiB of float32 in about 1.3 us at 800 GB/s).
MAX_PACKED_ELEMENTS = 2**18


def partition(joint: torch.fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **kwargs):
    """AOTAutograd's default partition, then :func:`pack_saved` (``TPUREC_COMPILE_PACK_SAVED``).

    Args:
        joint: the joint forward and backward graph.
        joint_inputs: its example inputs.
        num_fwd_outputs: how many of the forward graph's outputs are the user's.
        **kwargs: the partition options AOTAutograd passes on.

    Returns:
        The forward and backward graphs.
    """
    forward, backward = default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
    if config.get("TPUREC_COMPILE_PACK_SAVED"):
        pack_saved(forward, backward, num_fwd_outputs)
    return forward, backward


def _packable(node: Any, user_outputs: set) -> bool:
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or node in user_outputs:
        return False
    if node.meta.get("saved_tensor_with_no_vc_check", False):
        return False
    value = node.meta.get("val")
    return (
        isinstance(value, FakeTensor)
        and value.device.type == "tpu"
        and all(isinstance(d, int) for d in value.shape)
        and value.numel() <= MAX_PACKED_ELEMENTS
        and value.storage_offset() == 0
        and value.is_contiguous()
    )


def pack_saved(forward: torch.fx.GraphModule, backward: torch.fx.GraphModule, num_fwd_outputs: int) -> int:
    """Packs the small saved tensors of a partitioned graph pair, one tensor per dtype; how many were packed.

    The forward graph returns, after its ``num_fwd_outputs`` user outputs, one packed tensor per
    dtype (first) and the saved values it did not pack, in their order; the backward graph takes
    the packed tensors ahead of the saved tensors it still takes (after the saved SymInts, which
    AOTAutograd passes first). A dtype with a single packable tensor is left as it is.

    Args:
        forward: the forward graph (changed in place).
        backward: the backward graph (changed in place).
        num_fwd_outputs: how many of the forward graph's outputs are the user's.
    """
    output = next(n for n in reversed(forward.graph.nodes) if n.op == "output")
    outs = list(output.args[0])
    user, saved = outs[:num_fwd_outputs], outs[num_fwd_outputs:]
    # The backward takes the saved values under their forward names, the saved sizes (SymInts)
    # first: AOTAutograd passes ctx's symints, then its saved tensors.
    by_name = {n.name: n for n in backward.graph.nodes if n.op == "placeholder"}
    if not saved or any(not isinstance(s, torch.fx.Node) or s.name not in by_name for s in saved):
        return 0
    inputs = [by_name[s.name] for s in saved]
    user_outputs = set(user)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, node in enumerate(saved):
        if _packable(node, user_outputs) and saved.count(node) == 1:  # a value saved twice stays as it is
            by_dtype.setdefault(node.meta["val"].dtype, []).append(i)
    groups = [members for members in by_dtype.values() if len(members) > 1]
    if not groups:
        return 0
    fake_mode = saved[groups[0][0]].meta["val"].fake_mode
    packed = {i for members in groups for i in members}
    # Ahead of the first saved tensor, as the forward returns them ahead of the rest.
    first_saved = inputs[0]
    sources = []
    for k in range(len(groups)):
        with backward.graph.inserting_before(first_saved):
            sources.append(backward.graph.placeholder(f"packed_saved_{k}"))
    # The slices go after every input: the graph's inputs come first.
    after = [n for n in backward.graph.nodes if n.op == "placeholder" and n not in {inputs[i] for i in packed}][-1]
    packed_outputs = []
    for members, source in zip(groups, sources):
        with forward.graph.inserting_before(output), fake_mode:
            flat = []
            for i in members:
                value = saved[i].meta["val"]
                node = forward.graph.call_function(aten.view.default, (saved[i], [value.numel()]))
                node.meta["val"] = value.view(-1)
                flat.append(node)
            joined = forward.graph.call_function(aten.cat.default, (flat,))
            joined.meta["val"] = torch.cat([n.meta["val"] for n in flat])
        packed_outputs.append(joined)
        source.meta["val"] = joined.meta["val"]
        offset = 0
        for i in members:
            value = saved[i].meta["val"]
            n = value.numel()
            with backward.graph.inserting_after(after), fake_mode:
                piece = backward.graph.call_function(aten.slice.Tensor, (source, 0, offset, offset + n))
                piece.meta["val"] = source.meta["val"][offset : offset + n]
            with backward.graph.inserting_after(piece), fake_mode:
                shaped = backward.graph.call_function(aten.view.default, (piece, list(value.shape)))
                shaped.meta["val"] = piece.meta["val"].view(value.shape)
            inputs[i].replace_all_uses_with(shaped)
            backward.graph.erase_node(inputs[i])
            after = shaped
            offset += n
    output.args = (tuple(user + packed_outputs + [s for i, s in enumerate(saved) if i not in packed]),)
    forward.graph.lint()
    backward.graph.lint()
    forward.recompile()
    backward.recompile()
    return len(packed)
