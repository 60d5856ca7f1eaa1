"""Weight normalisation (``torch.nn.utils.weight_norm`` and its parametrization):
``_weight_norm_interface`` and ``_weight_norm_interface_backward``.

``w = v * g / ||v||``, the norm taken over every dimension but ``dim`` (PyTorch
calls the fused op for ``dim`` 0 or the last one and composes ordinary ops
otherwise). As in PyTorch's CPU kernels, the norms and both gradients compute
in float32 for bfloat16/float16 and the saved norms stay float32 for bfloat16 ``g``;
the backward is the kernel's closed form, so nothing runs on the host.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch

from tpurec.dense._util import acc_dtype, norm_dim
from tpurec.dense.registry import lower

aten = torch.ops.aten


def _others(v, dim: int) -> tuple[int, ...]:
    d = norm_dim(dim, v.ndim)
    return tuple(i for i in range(v.ndim) if i != d)


def _kept(x, v, dim: int):
    """``x`` (g or the norms, keepdim-shaped or 1-D) broadcastable against ``v``."""
    d = norm_dim(dim, v.ndim)
    shape = [1] * v.ndim
    shape[d] = v.shape[d]
    return x.reshape(shape)


@lower(aten._weight_norm_interface.default)
def weight_norm_interface(v, g, dim: int = 0):
    acc = acc_dtype(v.dtype)
    norms = jnp.sqrt(jnp.sum(jnp.square(v.astype(acc)), axis=_others(v, dim), keepdims=True))
    # PyTorch rounds g / norm to g's dtype before the product (its decomposition, matched by the kernels).
    scale = (_kept(g, v, dim).astype(acc) / norms).astype(g.dtype)
    w = (v.astype(acc) * scale.astype(acc)).astype(jnp.result_type(v.dtype, g.dtype))
    return w, norms.reshape(g.shape) if g.ndim != v.ndim else norms


@lower(aten._weight_norm_interface_backward.default)
def weight_norm_interface_backward(grad_w, saved_v, saved_g, saved_norms, dim: int):
    acc = acc_dtype(saved_v.dtype)
    v = saved_v.astype(acc)
    grad = grad_w.astype(acc)
    g = _kept(saved_g, saved_v, dim).astype(acc)
    norms = _kept(saved_norms, saved_v, dim).astype(acc)
    dot = jnp.sum(grad * v, axis=_others(saved_v, dim), keepdims=True)
    grad_g = dot / norms
    grad_v = (g / norms) * (grad - v * (dot / (norms * norms)))
    return grad_v.astype(saved_v.dtype), grad_g.reshape(saved_g.shape).astype(saved_g.dtype)
