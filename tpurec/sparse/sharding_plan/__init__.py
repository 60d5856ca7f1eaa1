"""What a sharding plan says, independent of any device: the leaf below the planner and the executor.

Nothing here imports the device runtime (``tpurec.core``), the lowerings
(``tpurec.dense``) or another part of ``tpurec.sparse``, so the planner
(``tpurec.sparse.planner``) and the executor (``tpurec.sparse.sharding``)
both build on it without importing each other's machinery.

==================  ========================================================================
``sharding_types``  the TorchRec sharding types tpurec runs (the one list), and their kinds
``tables``          :class:`TableSpec`: one embedding table as planned
``shards``          a module's plan read into per-table shard pieces, checked
``layout``          where every shard lives on each device and where its pooled rows go
``validate``        a whole plan checked against a model's tables and a mesh size
``traffic``         bytes each device sends per step to run a plan (payload and buffers)
==================  ========================================================================

The submodules are imported by name (this package imports none of them), so
one of them costs only what it needs.
"""
