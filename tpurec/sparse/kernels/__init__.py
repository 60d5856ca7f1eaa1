"""Kernels of the tpurec sparse op set, one module per platform family.

``reference``: plain JAX (gather + segment sum; scatter-add + optimizer on the
touched rows), used on XLA:CPU and XLA:GPU until native kernels land.
"""
