"""The ATen lowering library: ATen overload -> JAX function, one file per op family.

Importing this package fills the lowering table (``tpurec.dense.registry``) with every
family in ``FAMILIES`` and with ``tpurec.composites``; the ``DEFERRED`` ones load on the first op of their namespace.
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

# The composites (fused PyTorch kernels written as ordinary ops) enter the same table.
import tpurec.composites  # noqa: E402,F401

__all__ = ["LOWERINGS", "Kind", "Lowering", "get_lowering", "lower"]
