"""tpurec: recommendation models on TPUs from plain PyTorch."""

import jax

# torch int64/float64 values must round-trip exactly.
jax.config.update("jax_enable_x64", True)

from tpurec import device as _device  # noqa: E402

_device.register()

from tpurec.device import platform  # noqa: E402

__all__ = ["platform"]
