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

from tpurec._dynamo import register
from tpurec.compile.backend import CompiledGraph, decompositions, tpu_backend
from tpurec.compile.graph import CompileError

# ``import tpurec`` registers the backend and Dynamo's patches (tpurec/_dynamo.py) without
# importing this package, which imports the op runtime; the registered backend imports it
# on the first compilation.
__all__ = ["register", "tpu_backend", "decompositions", "CompiledGraph", "CompileError"]
