"""The ATen lowering library: ATen overload -> JAX function, one file per op family.

Importing this package fills the lowering table (``tpurec.dense.registry``) with every
family in ``FAMILIES`` (``composites`` among them: fused PyTorch kernels written as ordinary ops); the ``DEFERRED`` ones load on the first op of their namespace.
"""

from tpurec.dense.registry import (
    LOWERINGS,
    Kind,
    Lowering,
    get_lowering,
    load_families,
    lower,
)

load_families()

__all__ = ["LOWERINGS", "Kind", "Lowering", "get_lowering", "lower"]
