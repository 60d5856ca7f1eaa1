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

from tpurec.compile.backend import CompiledGraph, decompositions, tpu_backend
from tpurec.compile.graph import CompileError

__all__ = ["register", "tpu_backend", "decompositions", "CompiledGraph", "CompileError"]

_registered = False


def register() -> None:
    """Makes ``backend="tpu"`` available to ``torch.compile`` (called by ``import tpurec``)."""
    global _registered
    if _registered:
        return
    _registered = True
    from torch._dynamo.backends.registry import register_backend

    from tpurec.compile import patches

    patches.apply()
    register_backend(compiler_fn=tpu_backend, name="tpu")
