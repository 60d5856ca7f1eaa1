"""Bounded dynamism for sequence models: pad a varying dimension up to one of a few bucket sizes.

XLA compiles one program per shape. A text model fed batches of every length from 1 to 128
compiles a new program (eager: one per op, fused or compiled: one per step) for each new
length. Padding each batch's length up to the next of a few bucket sizes bounds that: at most
one program per bucket.

Padding is exact only where the model ignores the padded positions, so the padding value of
every tensor is the caller's to give, never guessed: for a Hugging Face model, ``input_ids``
padded with the pad token, ``attention_mask`` with 0 (the padded keys get no attention) and
``labels`` with -100 (the loss skips them) give the same loss and the same gradients as the
unpadded batch, up to float summation order.

With ``torch.compile``, pass ``dynamic=False``: each bucket then gets one static graph.
(With automatic dynamic shapes, Dynamo traces a second, symbolic graph when the second
bucket arrives, and every bucket compiles once more under it.) Dynamo keeps at most
``torch._dynamo.config.cache_size_limit`` (8) graphs per function: use at most that many buckets.

Example::

    buckets = tpurec.buckets.SequenceBuckets((16, 32, 64, 128))
    batch = buckets.pad({"input_ids": ids, "attention_mask": mask, "labels": ids},
                        {"input_ids": 0, "attention_mask": 0, "labels": -100})
    loss = model(**{k: v.to("tpu") for k, v in batch.items()}).loss
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F

__all__ = ["SequenceBuckets", "pad_to", "power_of_two_buckets"]


@dataclasses.dataclass(frozen=True)
class SequenceBuckets:
    """The sizes one dimension of a batch is padded up to.

    Args:
        sizes: the bucket sizes, strictly increasing positive integers; the largest is the
            longest length accepted.
        dim: the dimension padded (default 1: ``[batch, length, ...]``).
    """

    sizes: Sequence[int]
    dim: int = 1

    def __post_init__(self) -> None:
        sizes = tuple(self.sizes)
        if not sizes or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in sizes):
            raise ValueError(f"SequenceBuckets: sizes must be positive integers, got {self.sizes!r}")
        if any(a >= b for a, b in zip(sizes, sizes[1:])):
            raise ValueError(f"SequenceBuckets: sizes must be strictly increasing, got {sizes}")
        object.__setattr__(self, "sizes", sizes)

    def size_for(self, length: int) -> int:
        """The smallest bucket size that holds ``length``.

        Raises:
            ValueError: ``length`` is longer than the largest bucket (truncating would change the result).
        """
        index = bisect.bisect_left(self.sizes, length)
        if index == len(self.sizes):
            raise ValueError(
                f"SequenceBuckets: length {length} is longer than the largest bucket ({self.sizes[-1]}); "
                f"add a bucket of at least {length} or shorten the batch"
            )
        return self.sizes[index]

    def pad(self, batch: Mapping[str, torch.Tensor], pad_values: Mapping[str, float | int]) -> dict[str, torch.Tensor]:
        """Pads every tensor of ``batch`` along ``dim`` to the bucket of the batch's length, at the end.

        Args:
            batch: tensors that share the length of dimension ``dim`` (e.g. input ids, attention
                mask, labels).
            pad_values: the value each tensor is padded with, one per key of ``batch``.

        Returns:
            A new dict with the padded tensors (a tensor already at its bucket size is returned as is).

        Raises:
            ValueError: a key without a padding value, tensors of different lengths, or a length
                longer than the largest bucket.
        """
        missing = sorted(set(batch) - set(pad_values))
        if missing:
            raise ValueError(
                f"SequenceBuckets.pad: no padding value for {missing}; give one per tensor "
                "(for Hugging Face models: the pad token id, 0 for attention_mask, -100 for labels)"
            )
        lengths = {name: tensor.shape[self.dim] for name, tensor in batch.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"SequenceBuckets.pad: the tensors' lengths along dim {self.dim} differ: {lengths}")
        if not lengths:
            return {}
        length = next(iter(lengths.values()))
        target = self.size_for(length)
        return {name: pad_to(tensor, target, pad_values[name], self.dim) for name, tensor in batch.items()}


def pad_to(tensor: torch.Tensor, size: int, value: float | int, dim: int = 1) -> torch.Tensor:
    """``tensor`` padded with ``value`` at the end of dimension ``dim`` to ``size``.

    Raises:
        ValueError: the tensor is already longer than ``size``.
    """
    length = tensor.shape[dim]
    if length > size:
        raise ValueError(f"pad_to: dimension {dim} has length {length}, longer than {size}")
    if length == size:
        return tensor
    dim = dim % tensor.dim()
    # F.pad lists (before, after) pairs from the last dimension backwards.
    widths = [0, 0] * (tensor.dim() - 1 - dim) + [0, size - length]
    return F.pad(tensor, widths, value=value)


def power_of_two_buckets(longest: int, shortest: int = 16) -> SequenceBuckets:
    """Buckets ``shortest, 2*shortest, ...`` up to the first power-of-two multiple at least ``longest``.

    Example::

        power_of_two_buckets(128)   # sizes (16, 32, 64, 128)
    """
    if shortest < 1 or longest < 1:
        raise ValueError(f"power_of_two_buckets: sizes must be positive, got longest={longest}, shortest={shortest}")
    sizes = [shortest]
    while sizes[-1] < longest:
        sizes.append(sizes[-1] * 2)
    return SequenceBuckets(tuple(sizes))
