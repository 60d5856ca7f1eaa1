"""What Dynamo needs to see tpu tensors as ordinary tensors, and the ``"tpu"`` backend's registration.

``import tpurec`` does not import Dynamo: ``tpurec/_patches.py`` applies these as
``torch._dynamo``'s import completes (``torch.compile`` imports it, so does TorchRec), or
at once if it is imported already. They import neither the compiler (``tpurec.compile``)
nor the op runtime: the backend registered here imports ``tpurec.compile`` when
``torch.compile`` first calls it.

A tpu tensor is a Python wrapper subclass with its own ``__torch_dispatch__``
(tpurec/core/tensor.py). Out of the box, torch.compile treats such a subclass as
an opaque Python object: Dynamo would trace *into* ``__torch_dispatch__`` and
the runtime core. For the compiler a tpu tensor is exactly a dense tensor on
a device, like a CUDA tensor; these patches say so (AOTAutograd's tangent
check is answered by ``TpuTensor.__coerce_same_metadata_as_tangent__``):

1. Dynamo wraps TpuTensors as tensors (fake tensors on device "tpu"), not as
   ``__torch_function__`` subclasses: it would rebuild such values after a graph
   break through a class global it never installs (NameError ``__subclass_Tensor_...``).
2. Fake tensor mode never holds a real tpu tensor: ``torch.tensor(data, device="tpu")``
   (and the index tensor of ``x[..., [i], :]``) is built on the CPU, lifted, then
   moved, as PyTorch does for devices it must not touch while tracing.
3. Dynamo never traces the runtime core (dispatch, tensor, views, lowerings)
   nor JAX: after a graph break, eager tpu ops run untraced. (Dynamo's skip
   lists are per file, not recursive, so JAX itself must be listed too, as
   numpy already is.) What JAX calls while it compiles a program runs with
   Dynamo's frame hook off (tpurec/core/recompiles.py).

Each patch is idempotent and touches only TpuTensor values, but for the fake-mode flag
(patch 2), which PyTorch applies on every machine without a CUDA/PrivateUse1 runtime.
"""

from __future__ import annotations

import importlib.util

from typing import Any

import torch

from tpurec.core import TpuTensor

__all__ = [
    "apply",
    "fake_mode_leaves_tpu_data_alone",
    "not_a_subclass_for_dynamo",
    "register",
    "skip_runtime_modules",
    "tpu_backend",
    "wrap_tpu_tensors_as_tensors",
]

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
_done: set[str] = set()  # the patches below that are in place (each is applied once)


def _once(fn):
    def patch() -> None:
        if fn.__name__ not in _done:
            fn()
            _done.add(fn.__name__)

    patch.__name__, patch.__doc__ = fn.__name__, fn.__doc__
    return patch


@_once
def wrap_tpu_tensors_as_tensors() -> None:
    """Dynamo wraps a TpuTensor as a tensor (``VariableBuilder._wrap``)."""
    from torch._dynamo.variables import builder

    original = builder.VariableBuilder._wrap

    def _wrap(self, value):
        # Dynamo otherwise requires the default __torch_dispatch__ (or a traceable subclass).
        if isinstance(value, TpuTensor):
            return self.wrap_tensor(value)
        return original(self, value)

    builder.VariableBuilder._wrap = _wrap


@_once
def not_a_subclass_for_dynamo() -> None:
    """Dynamo's ``infer_subclass_type`` answers None for a TpuTensor."""
    from torch._dynamo.variables import builder

    original = builder.infer_subclass_type

    def infer_subclass_type(value):
        if type(value) is TpuTensor:
            return None
        return original(value)

    # builder's wrap_tensor calls it by its module global; tensor.py imports it from builder per call.
    builder.infer_subclass_type = infer_subclass_type


@_once
def fake_mode_leaves_tpu_data_alone() -> None:
    """Fake tensor mode's treatment of devices without a usable runtime (its ``avoid_device_init``).

    ``torch.tensor(data, device=d)`` otherwise moves the data to ``d`` with every
    mode off and lifts the moved tensor: a real TpuTensor, which fake mode does not
    recognise (a subclass), so it reached tpurec's dispatch among fake tensors.
    With the flag, the CPU tensor is lifted (a fake constant) and the move is a
    fake op. Constant propagation of ``_to_copy`` to such a device is skipped too:
    fake mode computes constants under ``no_dispatch()``, which a Python backend
    cannot serve, so a tpu constant could not be used anyway.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    FakeTensorMode.avoid_device_init = property(lambda self: True)


@_once
def skip_runtime_modules() -> None:
    """Dynamo's skip list gets JAX and tpurec's runtime (``trace_rules.add``)."""
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
    wrap_tpu_tensors_as_tensors()
    not_a_subclass_for_dynamo()
    fake_mode_leaves_tpu_data_alone()
    skip_runtime_modules()


def tpu_backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
    """The Dynamo backend ``"tpu"``: ``tpurec.compile``'s, imported on the first compilation."""
    from tpurec.compile.backend import tpu_backend as compile_with_tpu

    return compile_with_tpu(gm, example_inputs)


_registered = False


def register() -> None:
    """Makes ``backend="tpu"`` available to ``torch.compile`` (called by ``import tpurec``), once."""
    global _registered
    if _registered:
        return
    _registered = True
    from torch._dynamo.backends.registry import register_backend

    apply()
    register_backend(compiler_fn=tpu_backend, name="tpu")
