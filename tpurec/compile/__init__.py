"""torch.compile for the tpu device: ``torch.compile(model, backend="tpu")``.

Dynamo captures graphs, AOTAutograd splits them into functional ATen forward
and backward graphs, and each graph becomes one jitted JAX program built from
the same lowering table as eager execution (docs/design.md, contract 1).

Example::

    import torch, tpurec
    model = torch.nn.Linear(16, 1).to("tpu")
    step = torch.compile(model, backend="tpu")
    step(torch.randn(8, 16, device="tpu")).sum().backward()
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tpurec.compile.dynamo import register

# ``import tpurec`` registers the backend, and Dynamo's patches (``dynamo``) wait for Dynamo's
# import; neither imports the compiler (``backend``, ``graph``), which imports the op runtime:
# the registered backend imports it on the first compilation, as does reading its names here.
__all__ = ["register", "tpu_backend", "decompositions", "CompiledGraph", "CompileError"]

# The compiler's names, with their module: read, they import it (see __getattr__).
_COMPILER = {
    "tpu_backend": "backend",
    "decompositions": "backend",
    "CompiledGraph": "backend",
    "CompileError": "graph",
}

if TYPE_CHECKING:
    from tpurec.compile.backend import CompiledGraph, decompositions, tpu_backend
    from tpurec.compile.graph import CompileError


def __getattr__(name: str) -> Any:
    if name in _COMPILER:
        value = getattr(importlib.import_module(f"tpurec.compile.{_COMPILER[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tpurec.compile' has no attribute {name!r}")
