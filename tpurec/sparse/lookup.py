"""The lifecycle every tpurec embedding collection shares, written once.

tpurec's embedding collections (:class:`~tpurec.sparse.EmbeddingBagCollection`, the sharded
collection :func:`tpurec.shard` makes, :class:`~tpurec.sparse.QuantEmbeddingBagCollection` and
:class:`~tpurec.sparse.EmbeddingCollection`) differ in how a batch reaches their tables
(SparseCore CSR per stacked table, fixed-capacity entries per shard, sequences as bags of one
id) and in the programs that look it up. Around that they share one lifecycle, kept here:

* the batches a collection prepares ahead of its forward: what ``prefetch(kjt)`` made of a
  KeyedJaggedTensor object (:class:`Prepared`, taken by the forward of that same object), and
  the batch ``stage(kjt)`` wrote into the collection's static input tensors (:class:`Staged`).
"""

from __future__ import annotations

import dataclasses
from typing import Generic, NamedTuple, TypeVar

from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["Prepared", "Staged"]

BatchT = TypeVar("BatchT")


@dataclasses.dataclass
class Prepared:
    """What a collection's ``prefetch`` prepared for one KeyedJaggedTensor object.

    Kept by the object's ``id`` until the forward of that same object takes it; the
    collection's own kind adds the prepared input (CSR arrays, routed entries).
    """

    features: KeyedJaggedTensor


class Staged(NamedTuple, Generic[BatchT]):
    """The batch ``stage`` wrote into a collection's static input tensors, and its KJT object.

    The next forward of ``features`` reads the static tensors (its dropped entries were
    counted by ``stage``).
    """

    features: KeyedJaggedTensor
    batch: BatchT
