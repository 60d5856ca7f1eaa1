"""tpurec: recommendation models on TPUs from plain PyTorch."""

import jax

# torch int64/float64 values must round-trip exactly.
jax.config.update("jax_enable_x64", True)
