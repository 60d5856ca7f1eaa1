"""Shard layout on the devices: moved to :mod:`tpurec.sparse.spec.layout` (this path keeps working)."""

from tpurec.sparse.spec.layout import DataParallelGroup, Group, Layout, TableRouting

__all__ = ["Group", "DataParallelGroup", "TableRouting", "Layout"]
