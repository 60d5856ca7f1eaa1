"""Data types of the SparseCore input contract (docs/design.md, contract 3).

A batch of sparse features becomes, per *stacked table*, one CSR-like block of
four arrays padded to a static capacity:

* ``row_pointers`` (int32, ``[num_partitions]``): the *end* of each partition's
  valid entries. Partition ``p`` starts at ``p * partition_capacity`` (starts are
  aligned, as in jax-tpu-embedding, whose row pointers are also end pointers
  with aligned starts); entries past ``row_pointers[p]`` are padding.
* ``embedding_ids`` (int32, ``[num_partitions * partition_capacity]``): the row
  in the stacked table (table row offset already added); padding is
  ``PAD_ID = 2**31 - 1``. Rows are partitioned by ``id % num_partitions`` (MOD
  sharding); within a partition entries are sorted by (id, sample).
* ``sample_ids`` (int32): the output row. Features sharing a stack each own a
  block of ``batch_size`` output rows: ``sample = feature_slot * batch_size + b``.
* ``gains`` (float32): the multiplier of the embedding row (1, the feature
  weight, ``1 / bag length`` for MEAN pooling; duplicates summed).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np
from torchrec.modules.embedding_configs import PoolingType

__all__ = [
    "PAD_ID",
    "PARTITION_ALIGNMENT",
    "Capacity",
    "CapacityError",
    "FeatureSlot",
    "TableInStack",
    "StackedTable",
    "StackedCsr",
    "SparseCoreInput",
]

PAD_ID: int = 2**31 - 1
"""Embedding/sample id of padding entries (the SparseCore convention)."""

PARTITION_ALIGNMENT: int = 8
"""Partition buffers are rounded up to this many entries (SparseCore DMA granule)."""


class CapacityError(ValueError):
    """A batch needs more entries per partition than the static capacity allows."""


@dataclasses.dataclass(frozen=True)
class Capacity:
    """Static per-partition capacity of one stacked table.

    Args:
        max_ids_per_partition: entries ((sample, id) pairs after merging
            duplicates) one partition may hold.
        max_unique_ids_per_partition: distinct embedding ids one partition may
            hold (the rows the optimizer touches there).

    Example::

        cap = Capacity(max_ids_per_partition=256, max_unique_ids_per_partition=128)
    """

    max_ids_per_partition: int
    max_unique_ids_per_partition: int | None = None

    def __post_init__(self) -> None:
        if self.max_ids_per_partition <= 0:
            raise ValueError(f"max_ids_per_partition must be positive, got {self.max_ids_per_partition}")
        if self.max_unique_ids_per_partition is None:
            object.__setattr__(self, "max_unique_ids_per_partition", self.max_ids_per_partition)
        if not 0 < self.max_unique_ids_per_partition <= self.max_ids_per_partition:
            raise ValueError(
                f"max_unique_ids_per_partition must be in (0, max_ids_per_partition="
                f"{self.max_ids_per_partition}], got {self.max_unique_ids_per_partition}"
            )

    @property
    def partition_size(self) -> int:
        """Buffer entries per partition: the capacity rounded up to the alignment."""
        a = PARTITION_ALIGNMENT
        return -(-self.max_ids_per_partition // a) * a


@dataclasses.dataclass(frozen=True)
class FeatureSlot:
    """One feature's place in a stacked table.

    Args:
        feature: the KeyedJaggedTensor key.
        table: the table the feature looks up.
        slot: index of the feature's block of output rows in the stack.
        row_offset: first row of ``table`` in the stack.
        num_embeddings: rows of ``table`` (valid ids are ``[0, num_embeddings)``).
        pooling: SUM or MEAN.
    """

    feature: str
    table: str
    slot: int
    row_offset: int
    num_embeddings: int
    pooling: PoolingType


@dataclasses.dataclass(frozen=True)
class TableInStack:
    """One logical table's rows inside a stack.

    Args:
        name: table name.
        row_offset: first row in the stack.
        num_embeddings: number of rows.
    """

    name: str
    row_offset: int
    num_embeddings: int


@dataclasses.dataclass(frozen=True)
class StackedTable:
    """Several tables of one dim (and optimizer) stored as one table.

    Args:
        name: stack name (the table names joined by ``"__"``, or the only name).
        embedding_dim: common embedding dim.
        tables: the tables, in row order.
        features: the features looking up this stack, in output-slot order.

    Example::

        stacks = stack_tables(ebc_configs)   # see tpurec.sparse.preprocess
        stacks[0].num_rows
    """

    name: str
    embedding_dim: int
    tables: tuple[TableInStack, ...]
    features: tuple[FeatureSlot, ...]

    @property
    def num_rows(self) -> int:
        return sum(t.num_embeddings for t in self.tables)

    @property
    def num_slots(self) -> int:
        return len(self.features)


@dataclasses.dataclass
class StackedCsr:
    """The four SparseCore arrays of one stacked table (numpy, on the host).

    Args:
        row_pointers: int32 ``[num_partitions]`` end pointers.
        embedding_ids: int32 ``[num_partitions * partition_size]``.
        sample_ids: int32, same shape.
        gains: float32, same shape.
        max_ids: observed entries per partition (before any drop), ``[num_partitions]``.
        max_unique_ids: observed distinct ids per partition, ``[num_partitions]``.
        dropped: entries dropped for capacity (``overflow="drop"`` only).
        dropped_by_feature: ``dropped`` per feature (features with drops only).
    """

    row_pointers: np.ndarray
    embedding_ids: np.ndarray
    sample_ids: np.ndarray
    gains: np.ndarray
    max_ids: np.ndarray
    max_unique_ids: np.ndarray
    dropped: int = 0
    dropped_by_feature: dict[str, int] = dataclasses.field(default_factory=dict)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(row_pointers, embedding_ids, sample_ids, gains)``: the op inputs."""
        return self.row_pointers, self.embedding_ids, self.sample_ids, self.gains


@dataclasses.dataclass
class SparseCoreInput:
    """A preprocessed batch: one :class:`StackedCsr` per stacked table.

    Args:
        batch_size: rows per feature slot (the KJT stride; with a variable batch
            size per feature, the output batch, or more if a feature has more bags).
        num_partitions: MOD partitions.
        stacks: stack name -> CSR arrays.
        inverse_indices: per feature, the row (bag) each output sample repeats
            (the KJT's ``inverse_indices``, int64); None: output sample ``b`` is row ``b``.
    """

    batch_size: int
    num_partitions: int
    stacks: dict[str, StackedCsr]
    inverse_indices: dict[str, np.ndarray] | None = None

    @property
    def output_batch_size(self) -> int:
        """Samples of the pooled output (``inverse_indices``' width, else ``batch_size``)."""
        if self.inverse_indices:
            return int(next(iter(self.inverse_indices.values())).shape[0])
        return self.batch_size

    @property
    def dropped(self) -> Mapping[str, int]:
        """Entries dropped per stack (all zero unless ``overflow="drop"``)."""
        return {name: csr.dropped for name, csr in self.stacks.items()}

    @property
    def dropped_by_feature(self) -> dict[str, int]:
        """Entries dropped per feature, over all stacks (features with drops only)."""
        out: dict[str, int] = {}
        for csr in self.stacks.values():
            for feature, n in csr.dropped_by_feature.items():
                out[feature] = out.get(feature, 0) + n
        return out
