"""Several processes (hosts) as one tpurec job, on JAX's multi-controller runtime.

Every process runs the same program; ``initialize()`` joins them through
``jax.distributed.initialize`` so that ``jax.devices()`` (and the default mesh
of :func:`tpurec.shard`) spans every process's devices, while ``tpu:N`` stays
this process's N-th local device. Only batch loading and preprocessing are
per process.

Where the coordinator, the process count and this process's rank come from,
in order:

1. the arguments;
2. torchrun's environment: ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``,
   ``RANK`` (and ``LOCAL_RANK``). torchrun's own store already listens on
   ``MASTER_PORT``, so JAX's coordinator uses ``MASTER_PORT + 1`` unless
   ``TPUREC_COORDINATOR_PORT`` says otherwise;
3. the TPU environment (Cloud TPU VMs, GKE): JAX detects it by itself.

On XLA:CPU the processes' collectives run over gloo.

With several processes, each watches the others (:mod:`tpurec.distributed.peers`): a
process that dies, is stopped, fails or finishes early ends the others within
``TPUREC_PEER_TIMEOUT`` seconds with a :class:`PeerLost` naming it and its step, and
``tpurec.shard`` first checks that every process shards the same model alike
(:class:`PeerMismatch` on every process otherwise).

Example::

    # torchrun --nproc-per-node 2 train.py
    import tpurec, tpurec.distributed
    tpurec.distributed.initialize()
    model = tpurec.shard(model, plan)   # mesh over both processes' devices
"""

from __future__ import annotations

from tpurec.distributed.peers import PeerError, PeerLost, PeerMismatch, PeerTimeout
from tpurec.distributed.startup import (
    CoordinatorPortInUse,
    initialize,
    is_initialized,
    process_count,
    process_index,
    torchrun_settings,
)

__all__ = [
    "CoordinatorPortInUse",
    "PeerError",
    "PeerLost",
    "PeerMismatch",
    "PeerTimeout",
    "initialize",
    "is_initialized",
    "process_count",
    "process_index",
    "register_c10d_backend",
    "torchrun_settings",
]


def _create_c10d_backend(options, backend_options=None):
    """c10d's creator for the ``"tpu"`` backend (imported on the first process group)."""
    from tpurec.distributed.backend import create

    return create(options, backend_options)


def register_c10d_backend() -> None:
    """Makes ``"tpu"`` a ``torch.distributed`` backend for tpu tensors (``import tpurec`` calls it).

    After it ``torch.distributed.init_process_group("tpu")`` and ``"cpu:gloo,tpu:tpu"`` work; see
    :mod:`tpurec.distributed.backend`.
    """
    import torch.distributed as dist

    if not dist.is_available() or "tpu" in dist.Backend.backend_list:
        return
    dist.Backend.register_backend("tpu", _create_c10d_backend, extended_api=True, devices=["tpu"])
