"""Checkpoints of embedding models: everything a resume needs, checked before anything is written.

=============  ===========================================================================
``unsharded``  a model on one device: one ``torch.save`` file, written atomically (the model's
               ``state_dict`` in TorchRec's keys, the fused optimizers' slots and step counts,
               the dense optimizer, the RNG states, checksums); its functions are this
               package's: ``tpurec.sparse.checkpoint.save(path, model, optimizer)``, ``load``
``sharded``    a model sharded by ``tpurec.shard``: an Orbax folder of sharded arrays, each
               process writing its shards, loaded under any plan or device count
``integrity``  what both check before anything is written, and their errors' words
=============  ===========================================================================

A damaged, incomplete or partly written checkpoint is a :class:`CheckpointError` naming the file
or entry; one that does not fit the model is a ``ValueError`` naming the first key or shape that
differs. Either way the model is left as it was.

Example::

    from tpurec.sparse import checkpoint
    checkpoint.save("ckpt.pt", model, dense_optimizer)   # every N steps
    checkpoint.load("ckpt.pt", model, dense_optimizer)   # resume

    from tpurec.sparse.checkpoint import sharded
    sharded.save(sharded_model, "/ckpt/step_100")
"""

from tpurec.sparse.checkpoint.integrity import CheckpointError
from tpurec.sparse.checkpoint.unsharded import (
    FORMAT,
    list_checkpoints,
    load,
    load_state_dict,
    save,
    state_dict,
)

__all__ = ["FORMAT", "CheckpointError", "list_checkpoints", "load", "load_state_dict", "save", "state_dict"]
