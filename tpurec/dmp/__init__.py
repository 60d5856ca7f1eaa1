"""TorchRec's DistributedModelParallel on the tpu device: its compute kernels, lookups and plans.

A TorchRec model sharded by ``DistributedModelParallel`` (one process per tpu device, torchrun,
the ``"tpu"`` process group) builds its tables' compute kernels through TorchRec's grouped
lookups. The patches of ``tpurec/_patches.py`` that make those kernels run on tpu, applied when
TorchRec imports the module each one changes, and what they build:

=========================  ========================================================================
``grouped_lookups``        the grouped lookups build tpurec's kernels for a tpu table group (below),
                           after checking its shards' placements
``fused_kernel``           TorchRec's ``FUSED`` kernel: the lookup and its in-backward optimizer as
                           tpurec's sparse ops (``torch.ops.tpurec.sparse_dense_matmul...``)
``fused_sequence_kernel``  the same for an EmbeddingCollection's ``FUSED`` groups (unpooled lookups)
``dense_kernel``           TorchRec's ``DENSE`` kernel (data-parallel tables, or sharded ones trained
                           by the dense optimizer) as TorchRec's tpu kernel, any table width
``unfused_tables``         TorchRec's ``UNFUSED_TPU`` kernel's tables registered with the sharded module
``lookup_ops``             TorchRec's tpu lookup operators (``torch.ops.torchrec``) lowered to
                           ``sparse_dense_matmul``, loaded on the first ``torchrec`` op
``placements``             a TorchRec plan's shards placed on each process's own tpu device
=========================  ========================================================================

This package imports none of its modules. The patches run while TorchRec's distributed modules
are still being imported, so the modules they load import ``tpurec.sparse`` (which imports those
TorchRec modules too) only inside the functions that build a kernel.

Example::

    from tpurec.dmp.placements import on_process_devices
    plan = on_process_devices(planner.collective_plan(model, sharders, group))
"""
