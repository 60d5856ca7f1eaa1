"""FFT: ``_fft_r2c``, ``_fft_c2c``, ``_fft_c2r`` through ``jnp.fft``.

Every ``torch.fft`` function (fft, ifft, rfft, irfft, hfft, ihfft and their n-d
forms) reaches one of these three ops. ``normalization`` is torch's
``fft_norm_mode``: 0 no scaling, 1 scale by ``1/sqrt(n)``, 2 scale by ``1/n``,
where ``n`` is the product of the transformed signal sizes; it maps onto
NumPy's ``norm`` names per direction.
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import torch

from tpurec.dense.registry import lower

aten = torch.ops.aten

# torch's normalization mode -> numpy's norm for a forward / an inverse transform
_FORWARD_NORM = {0: "backward", 1: "ortho", 2: "forward"}
_INVERSE_NORM = {0: "forward", 1: "ortho", 2: "backward"}


def _axes(dim: Sequence[int], ndim: int) -> tuple[int, ...]:
    return tuple(d % ndim for d in dim)


@lower(aten._fft_r2c.default)
def fft_r2c(x, dim: Sequence[int], normalization: int, onesided: bool):
    axes = _axes(dim, x.ndim)
    norm = _FORWARD_NORM[normalization]
    if onesided:
        return jnp.fft.rfftn(x, axes=axes, norm=norm)
    return jnp.fft.fftn(x, axes=axes, norm=norm)


@lower(aten._fft_c2c.default)
def fft_c2c(x, dim: Sequence[int], normalization: int, forward: bool):
    axes = _axes(dim, x.ndim)
    if not axes:
        return x
    if forward:
        return jnp.fft.fftn(x, axes=axes, norm=_FORWARD_NORM[normalization])
    return jnp.fft.ifftn(x, axes=axes, norm=_INVERSE_NORM[normalization])


@lower(aten._fft_c2r.default)
def fft_c2r(x, dim: Sequence[int], normalization: int, last_dim_size: int):
    axes = _axes(dim, x.ndim)
    sizes = [x.shape[a] for a in axes[:-1]] + [last_dim_size]
    return jnp.fft.irfftn(x, s=sizes, axes=axes, norm=_INVERSE_NORM[normalization])
