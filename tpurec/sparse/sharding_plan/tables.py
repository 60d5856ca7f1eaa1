"""One embedding table as the planner and the traffic model see it.

Example::

    TableSpec("t0", num_embeddings=40_000_000, embedding_dim=128, pooling_factor=3)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

from torchrec.modules.embedding_configs import BaseEmbeddingConfig, DataType

__all__ = ["DTYPES", "TableSpec", "as_table_spec"]

DTYPES: Dict[str, DataType] = {"fp32": DataType.FP32, "fp16": DataType.FP16, "bf16": DataType.BF16}


@dataclass
class TableSpec:
    """One embedding table as the planner sees it.

    Args:
        name: table name.
        num_embeddings: rows.
        embedding_dim: columns.
        pooling_factor: average ids per sample per feature (multi-hot size).
        feature_names: features looked up in this table (default: the name).
        data_type: ``"fp32"``, ``"fp16"`` or ``"bf16"`` weights.

    Example::

        TableSpec("t0", num_embeddings=40_000_000, embedding_dim=128, pooling_factor=3)
    """

    name: str
    num_embeddings: int
    embedding_dim: int
    pooling_factor: float = 1.0
    feature_names: Optional[List[str]] = None
    data_type: str = "fp32"

    def features(self) -> List[str]:
        return list(self.feature_names) if self.feature_names else [self.name]


def as_table_spec(table: Union["TableSpec", BaseEmbeddingConfig, Dict[str, Any]]) -> TableSpec:
    """A :class:`TableSpec` from a spec, a TorchRec embedding config or a dict.

    TorchRec configs carry no pooling factor; they are planned with 1.0.

    Args:
        table: the table.

    Returns:
        The spec.

    Raises:
        TypeError: ``table`` is none of these.
    """
    if isinstance(table, TableSpec):
        return table
    if isinstance(table, dict):
        return TableSpec(**table)
    if isinstance(table, BaseEmbeddingConfig):
        dt = {v: k for k, v in DTYPES.items()}.get(table.data_type, "fp32")
        return TableSpec(table.name, table.num_embeddings, table.embedding_dim, 1.0, list(table.feature_names), dt)
    raise TypeError(
        f"Cannot read a table from {type(table).__name__}; pass a TableSpec, a TorchRec "
        f"EmbeddingBagConfig/EmbeddingConfig or a dict of TableSpec fields"
    )
