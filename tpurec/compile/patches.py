"""What Dynamo needs to see tpu tensors as ordinary tensors.

A tpu tensor is a Python wrapper subclass with its own ``__torch_dispatch__``
(tpurec/core/tensor.py). Out of the box, torch.compile treats such a subclass as
an opaque Python object: Dynamo would trace *into* ``__torch_dispatch__`` and
the runtime core. For the compiler a tpu tensor is exactly a dense tensor on
a device, like a CUDA tensor; these patches say so (AOTAutograd's tangent
check is answered by ``TpuTensor.__coerce_same_metadata_as_tangent__``):

1. Dynamo wraps TpuTensors as tensors (fake tensors on device "tpu").
2. Dynamo never traces the runtime core (dispatch, tensor, views, lowerings)
   nor JAX: after a graph break, eager tpu ops run untraced. (Dynamo's skip
   lists are per file, not recursive, so JAX itself must be listed too, as
   numpy already is.)

Each patch is idempotent and touches only TpuTensor values.
"""

from __future__ import annotations

import importlib.util

import torch

from tpurec.core.tensor import TpuTensor

__all__ = ["apply"]

# Modules Dynamo must not trace: they run eager tpu execution or build programs.
_SKIPPED_MODULES = (
    "jax",
    "jaxlib",
    "ml_dtypes",
    "opt_einsum",
    "tpurec.compile",
    "tpurec.core",  # a package: its folder, so every runtime module in it
    "tpurec.dense",
)

_applied = False


def _wrap_tpu_tensors_as_tensors() -> None:
    from torch._dynamo.variables import builder

    original = builder.VariableBuilder._wrap

    def _wrap(self, value):
        # Dynamo otherwise requires the default __torch_dispatch__ (or a traceable subclass).
        if isinstance(value, TpuTensor):
            return self.wrap_tensor(value)
        return original(self, value)

    builder.VariableBuilder._wrap = _wrap


def _skip_runtime_modules() -> None:
    from torch._dynamo import trace_rules

    for name in _SKIPPED_MODULES:
        if importlib.util.find_spec(name) is not None:  # optional modules may be absent
            trace_rules.add(name)


def apply() -> None:
    """Installs the patches (once)."""
    global _applied
    if _applied:
        return
    _applied = True
    _wrap_tpu_tensors_as_tensors()
    _skip_runtime_modules()
