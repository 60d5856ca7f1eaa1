"""Convolutions: ``convolution`` and ``convolution_backward`` (1-3d) on ``lax.conv_general_dilated``.

``aten.convolution`` is where every ``nn.ConvNd`` / ``nn.ConvTransposeNd`` /
``F.conv*`` call lands (padding modes other than zeros arrive already padded by
``F.pad``; ``padding="same"`` arrives as explicit padding). Precision follows
``torch.get_float32_matmul_precision()`` as the matrix products do, and
bfloat16/float16 inputs accumulate in float32 and round once.

The backward is the vector-Jacobian product of the forward lowering: XLA turns
it into the transposed / dilated convolutions a hand-written backward would use,
and it stays on the device.
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import torch
from jax import lax

from tpurec.dense.linalg import _PRECISION
from tpurec.dense._util import acc_dtype as _acc
from tpurec.dense.registry import lower

aten = torch.ops.aten


def _expand(values: Sequence[int], n: int) -> tuple[int, ...]:
    """An int list argument as one value per spatial dim (torch accepts one value for all)."""
    values = tuple(values)
    return values * n if len(values) == 1 else values


def _dimension_numbers(n: int) -> tuple[str, str, str]:
    spatial = "DHW"[3 - n :] if n <= 3 else None
    if spatial is None:
        raise ValueError(f"convolution supports 1-3 spatial dims, got {n}")
    return "NC" + spatial, "OI" + spatial, "NC" + spatial


def _transposed_weight(weight, groups: int):
    """ConvTranspose weight ``(C_in, C_out/g, k...)`` as the forward-conv weight
    ``(C_out, C_in/g, k...)`` of the equivalent input-dilated convolution, kernel flipped."""
    c_in, c_out_g = weight.shape[0], weight.shape[1]
    k = weight.shape[2:]
    w = weight.reshape((groups, c_in // groups, c_out_g) + k)
    w = jnp.swapaxes(w, 1, 2).reshape((groups * c_out_g, c_in // groups) + k)
    return jnp.flip(w, axis=tuple(range(2, w.ndim)))


def conv(x, weight, bias, stride, padding, dilation, transposed: bool, output_padding, groups: int):
    """The forward convolution over batched ``x`` ``(N, C, *spatial)``."""
    n = weight.ndim - 2
    stride, padding, dilation = _expand(stride, n), _expand(padding, n), _expand(dilation, n)
    output_padding = _expand(output_padding, n) if output_padding else (0,) * n
    acc = _acc(x.dtype)
    precision = _PRECISION.get(torch.get_float32_matmul_precision(), lax.Precision.HIGHEST)
    if transposed:
        kernel = weight.shape[2:]
        w = _transposed_weight(weight, groups)
        # A transposed conv is the forward conv of the stride-dilated input with
        # "full" padding dilation*(k-1) minus the forward padding.
        pads = [
            (d * (k - 1) - p, d * (k - 1) - p + op) for k, p, d, op in zip(kernel, padding, dilation, output_padding)
        ]
        lhs_dilation, strides = stride, (1,) * n
    else:
        w = weight
        pads = [(p, p) for p in padding]
        lhs_dilation, strides = (1,) * n, stride
    # Negative padding crops; XLA's convolution wants non-negative padding, so crop
    # the input first.
    crop = [(max(-lo, 0), max(-hi, 0)) for lo, hi in pads]
    pads = [(max(lo, 0), max(hi, 0)) for lo, hi in pads]
    out = lax.conv_general_dilated(
        x,
        w.astype(x.dtype),
        window_strides=strides,
        padding=pads,
        lhs_dilation=lhs_dilation,
        rhs_dilation=dilation,
        dimension_numbers=_dimension_numbers(n),
        feature_group_count=groups,
        precision=precision,
        preferred_element_type=acc,
    )
    if any(lo or hi for lo, hi in crop):
        index = (slice(None), slice(None)) + tuple(slice(lo, out.shape[2 + i] - hi) for i, (lo, hi) in enumerate(crop))
        out = out[index]
    if bias is not None:
        out = out + bias.astype(acc).reshape((1, -1) + (1,) * n)
    return out.astype(x.dtype)


@lower(aten.convolution.default)
def convolution(x, weight, bias, stride, padding, dilation, transposed: bool, output_padding, groups: int):
    if x.ndim == weight.ndim - 1:  # unbatched input
        return conv(x[None], weight, bias, stride, padding, dilation, transposed, output_padding, groups)[0]
    return conv(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups)


# The patches a weight gradient may read on a TPU (see _weight_grad_by_patches): at most this many bytes.
_PATCH_BYTES = 32 * 1024 * 1024


def _weight_grad_by_patches(grad, x, kernel: tuple, stride: tuple, padding: tuple, dilation: tuple, precision):
    """The weight gradient of a plain convolution (not transposed, one group) as one matrix product.

    ``grad`` ``(N, O, *out)``, ``x`` ``(N, C, *spatial)``: each kernel offset's strided slice of the
    padded input (``(N, C, K, *out)`` for ``K`` offsets) contracted with ``grad`` over the batch and
    the output positions. XLA's TPU compiler takes 26 s (v5e) for the float32 HIGHEST weight
    gradient of a ResNet stem (3 channels, 7x7, stride 2, 32x32 input), 2 s for this product.
    """
    n = len(kernel)
    out = grad.shape[2:]
    padded = jnp.pad(x, [(0, 0), (0, 0)] + [(p, p) for p in padding])
    slices = []
    for offset in itertools.product(*(range(k) for k in kernel)):
        index = tuple(
            slice(o * d, o * d + s * (size - 1) + 1, s) for o, d, s, size in zip(offset, dilation, stride, out)
        )
        slices.append(padded[(slice(None), slice(None)) + index])
    patches = jnp.stack(slices, axis=2)  # (N, C, K, *out)
    spatial = tuple(range(3, 3 + n))
    product = lax.dot_general(
        grad,
        patches,
        (((0, *range(2, 2 + n)), (0, *spatial)), ((), ())),
        precision=precision,
        preferred_element_type=_acc(x.dtype),
    )  # (O, C, K)
    return product.reshape(grad.shape[1:2] + x.shape[1:2] + tuple(kernel)).astype(x.dtype)


def _patches_fit(grad, x, kernel: tuple, transposed: bool, groups: int) -> bool:
    """A weight gradient :func:`_weight_grad_by_patches` computes: float32, plain, patches within ``_PATCH_BYTES``."""
    if transposed or groups != 1 or x.dtype != jnp.float32 or grad.ndim != x.ndim:
        return False
    return x.shape[0] * x.shape[1] * math.prod(kernel) * math.prod(grad.shape[2:]) * 4 <= _PATCH_BYTES


@lower(aten.convolution_backward.default)
def convolution_backward(
    grad, x, weight, bias_sizes, stride, padding, dilation, transposed: bool, output_padding, groups: int, output_mask
):
    def forward(x_, w_):
        return convolution(x_, w_, None, stride, padding, dilation, transposed, output_padding, groups)

    _, vjp = jax.vjp(forward, x, weight)
    grad_input, grad_weight = vjp(grad.astype(x.dtype))
    n = weight.ndim - 2
    kernel = tuple(weight.shape[2:])
    if output_mask[1] and _patches_fit(grad, x, kernel, transposed, groups):
        # On a TPU, the weight gradient as a product of the input's patches (XLA's float32 convolution
        # there can take most of a training step's compile time); elsewhere XLA's convolution.
        precision = _PRECISION.get(torch.get_float32_matmul_precision(), lax.Precision.HIGHEST)
        geometry = (kernel, _expand(stride, n), _expand(padding, n), _expand(dilation, n), precision)
        grad_weight = lax.platform_dependent(
            grad.astype(x.dtype),
            x,
            tpu=lambda g, x_: _weight_grad_by_patches(g, x_, *geometry),
            default=lambda g, x_: vjp(g)[1],
        )
    grad_bias = None
    if output_mask[2]:
        batched = grad.ndim == weight.ndim
        reduce_dims = ((0,) if batched else ()) + tuple(range(2 if batched else 1, grad.ndim))
        grad_bias = jnp.sum(grad.astype(_acc(grad.dtype)), axis=reduce_dims).astype(grad.dtype)
    return (
        grad_input if output_mask[0] else None,
        grad_weight if output_mask[1] else None,
        grad_bias,
    )
