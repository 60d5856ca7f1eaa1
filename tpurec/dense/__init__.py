"""The ATen lowering library: ATen overload -> JAX function, one file per op family."""

from tpurec.dense.registry import LOWERINGS, Lowering, get_lowering, lower

__all__ = ["LOWERINGS", "Lowering", "get_lowering", "lower"]
