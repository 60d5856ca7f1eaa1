"""``ShardedTensor.device`` on a rank that holds none of its shards, for the ``"tpu"`` process group.

PyTorch's rule (``torch.distributed._shard.sharded_tensor._ops.tensor_ops.tensor_device``): a
ShardedTensor answers ``.device`` with its first local shard's device; with no local shard, ``cpu``
for a ``"gloo"`` group and ``torch.cuda.current_device()`` for any other, the device an NCCL
group's shards live on. A group made by ``init_process_group("tpu")`` or
``"cpu:gloo,tpu:tpu"`` reports the backend name ``"tpu"``, so a rank without a shard of some
table (a table-wise plan of TorchRec's DistributedModelParallel) asked CUDA and failed; that is
what ``torch.distributed.checkpoint.load`` asks of every ShardedTensor of the state_dict.

:func:`install` (a patch of ``tpurec/_patches.py``, applied when
``torch.distributed._shard.sharded_tensor`` is imported) registers a rule that answers, for a
shardless ShardedTensor of a ``"tpu"`` group, the tpu device of this process
(``tpu:<torch.tpu.current_device()>``), where its shards live on every rank that has some;
everything else is PyTorch's own rule, called unchanged.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["install"]

_API = "torch.distributed._shard.sharded_tensor.api"


def _device_rule(original: Callable[..., torch.device]) -> Callable[..., torch.device]:
    """PyTorch's ``.device`` rule, with the ``"tpu"`` group's device for a shardless tensor."""

    def tensor_device(types: Any, args: Any = (), kwargs: Any = None, pg: Any = None) -> torch.device:
        tensor = args[0] if args else None
        if (
            tensor is not None
            and not getattr(tensor, "_local_shards", True)
            and pg is not None
            and pg._get_backend_name() == "tpu"
        ):
            return torch.device("tpu", torch.tpu.current_device())  # pyright: ignore[reportAttributeAccessIssue]
        return original(types, args, kwargs, pg)

    tensor_device._tpurec = True  # pyright: ignore[reportFunctionMemberAccess]
    tensor_device.__wrapped__ = original  # pyright: ignore[reportFunctionMemberAccess]
    return tensor_device


def install() -> None:
    """Registers the ``.device`` rule of shardless ShardedTensors of a ``"tpu"`` group (idempotent)."""
    ops: dict[Callable[..., Any], Callable[..., Any]] = importlib.import_module(_API)._SHARDED_OPS
    key = torch.Tensor.device.__get__  # pyright: ignore[reportAttributeAccessIssue]
    if key not in ops:
        raise RuntimeError(
            "torch.distributed._shard.sharded_tensor registers no rule for ShardedTensor.device; tpurec's patch "
            "sharded_tensor_device was written for torch 2.13 (install requirements.lock)"
        )
    if not getattr(ops[key], "_tpurec", False):
        ops[key] = _device_rule(ops[key])
