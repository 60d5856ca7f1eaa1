"""What Dynamo and AOTAutograd need to see tpu tensors as ordinary tensors.

A tpu tensor is a Python wrapper subclass with its own ``__torch_dispatch__``
(tpurec/tensor.py). Out of the box, torch.compile treats such a subclass as
an opaque Python object: Dynamo would trace *into* ``__torch_dispatch__`` and
the runtime core, and AOTAutograd would reject a TpuTensor tangent because it
expected a plain tensor. For the compiler a tpu tensor is exactly a dense
tensor on a device, like a CUDA tensor; these patches say so:

1. Dynamo wraps TpuTensors as tensors (fake tensors on device "tpu").
2. AOTAutograd accepts a TpuTensor where its trace saw a plain tensor.
3. Dynamo never traces the runtime core (dispatch, tensor, views, lowerings):
   after a graph break, eager tpu ops run untraced.

Each patch is idempotent and touches only TpuTensor values.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from tpurec.tensor import TpuTensor

__all__ = ["apply"]

# Modules Dynamo must not trace: they run eager tpu execution or build programs.
_RUNTIME_MODULES = (
    "tpurec.compile",
    "tpurec.dense",
    "tpurec.device",
    "tpurec.dispatch",
    "tpurec.errors",
    "tpurec.fused",
    "tpurec.modes",
    "tpurec.rng",
    "tpurec.runtime",
    "tpurec.tensor",
    "tpurec.views",
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


def _accept_tpu_tangents() -> None:
    # AOTAutograd compares a runtime tangent's type with the traced one (torch.Tensor);
    # this hook is how a subclass says "I am that tensor".
    def __coerce_same_metadata_as_tangent__(self, expected_metadata, expected_type=None):
        if expected_type is not None and expected_type is not torch.Tensor:
            return None
        return self

    TpuTensor.__coerce_same_metadata_as_tangent__ = __coerce_same_metadata_as_tangent__


def _skip_runtime_modules() -> None:
    from torch._dynamo import trace_rules

    for name in _RUNTIME_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue  # an optional module (fused mode) not present in this checkout
        origin = spec.origin
        path = os.path.dirname(origin) + os.sep if origin.endswith("__init__.py") else origin
        if path not in trace_rules.SKIP_DIRS:
            trace_rules.SKIP_DIRS.append(path)
    trace_rules._recompile_re()


def apply() -> None:
    """Installs the patches (once)."""
    global _applied
    if _applied:
        return
    _applied = True
    _wrap_tpu_tensors_as_tensors()
    _accept_tpu_tangents()
    _skip_runtime_modules()
