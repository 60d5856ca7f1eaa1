"""FSDP2 (``torch.distributed.fsdp.fully_shard``) on tpu tensors: freeing and re-allocating parameters.

FSDP2 frees each unsharded parameter after use with ``untyped_storage().resize_(0)`` and gives it
memory back before the next all-gather with ``resize_(n)``; the all-gather then writes into it and
the unsharded parameter, a view of the same storage, sees the values. A tpu tensor's storage is a
jax.Array torch cannot resize, so :func:`install` (a patch of ``tpurec/_patches.py``) makes FSDP2's
two helpers free and re-allocate the jax.Array for tpu tensors
(:func:`tpurec.core.tensor.free_storage`, :func:`~tpurec.core.tensor.alloc_storage`) and leaves
every other device to torch's own code.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

__all__ = ["install"]

# The modules of torch 2.13's FSDP2 that hold (by import) the two helpers.
_MODULES = (
    "torch.distributed.fsdp._fully_shard._fsdp_param",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group",
)


def _for_tpu(original: Callable[[torch.Tensor], None], on_tpu: Callable[[torch.Tensor], None]) -> Callable:
    def helper(tensor: torch.Tensor) -> None:
        (on_tpu if tensor.device.type == "tpu" else original)(tensor)

    helper.__name__ = original.__name__
    helper.__doc__ = f"FSDP2's {original.__name__}, on tpu tensors through tpurec (see tpurec.distributed.fsdp)."
    helper._tpurec_original = original  # pyright: ignore[reportFunctionMemberAccess]
    return helper


def install() -> None:
    """Makes FSDP2's ``free_storage`` / ``alloc_storage`` work on tpu tensors (idempotent)."""
    from tpurec.core import alloc_storage, free_storage

    for name in _MODULES:
        module = importlib.import_module(name)
        for helper, on_tpu in (("free_storage", free_storage), ("alloc_storage", alloc_storage)):
            original = getattr(module, helper, None)
            if original is None or hasattr(original, "_tpurec_original"):
                continue
            setattr(module, helper, _for_tpu(original, on_tpu))
