"""Backward of the upsampling ops (nearest, nearest-exact, linear, bilinear, trilinear, bicubic), and
antialiased bilinear (``_upsample_bilinear2d_aa``) forward and backward.

The other forwards run through torch's decompositions. Each is linear in its input
and separable: along every spatial dim, output = W @ input with a fixed
(output size x input size) weight matrix W. The backward is therefore the
transpose, ``grad_input = W.T @ grad_output`` along each dim. W is built at
trace time (sizes and scales are static) with the index and weight arithmetic
of ATen's CPU kernels, in float32 as they compute it (``UpSample.h``:
``compute_scales_value``, ``area_pixel_compute_source_index``,
``guard_index_and_lambda``, the cubic convolution with A = -0.75), so the
gradients match CPU's.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from tpurec.dense.registry import lower

# PyTorch interpolates in full float32 whatever its matmul precision; XLA's TPU default would
# round the operands of these products to bfloat16 (errors of 4e-3, measured on a TPU v5e).
_EXACT = lax.Precision.HIGHEST

aten = torch.ops.aten

_f32 = np.float32


def _scale(scale: float | None, input_size: int, output_size: int) -> np.float32:
    """``compute_scales_value``: 1/scale when a positive scale is given, else input/output."""
    if scale is not None and scale > 0:
        return _f32(1.0 / scale)
    return _f32(input_size) / _f32(output_size)


def _area_scale(input_size: int, output_size: int, align_corners: bool, scale: float | None) -> np.float32:
    """``area_pixel_compute_scale``."""
    if align_corners:
        return _f32(input_size - 1) / _f32(output_size - 1) if output_size > 1 else _f32(0)
    return _scale(scale, input_size, output_size)


def _source_index(scale: np.float32, dst: int, align_corners: bool, cubic: bool) -> np.float32:
    """``area_pixel_compute_source_index``."""
    if align_corners:
        return scale * _f32(dst)
    src = scale * (_f32(dst) + _f32(0.5)) - _f32(0.5)
    return _f32(0) if not cubic and src < 0 else src


def _guard(real_index: np.float32, input_size: int) -> tuple[int, np.float32]:
    """``guard_index_and_lambda``: the lower tap and the weight of the upper one."""
    index = min(int(np.floor(real_index)), input_size - 1)
    return index, min(max(real_index - _f32(index), _f32(0)), _f32(1))


def _nearest_matrix(input_size: int, output_size: int, scale: float | None, exact: bool) -> np.ndarray:
    weights = np.zeros((output_size, input_size), np.float32)
    s = _scale(scale, input_size, output_size)
    for dst in range(output_size):
        if output_size == input_size:
            src = dst
        elif not exact and output_size == 2 * input_size:
            src = dst >> 1
        else:
            offset = _f32(0.5) if exact else _f32(0)
            src = min(int(np.floor((_f32(dst) + offset) * s)), input_size - 1)
        weights[dst, src] = 1
    return weights


def _linear_matrix(input_size: int, output_size: int, align_corners: bool, scale: float | None) -> np.ndarray:
    weights = np.zeros((output_size, input_size), np.float32)
    ratio = _area_scale(input_size, output_size, align_corners, scale)
    for dst in range(output_size):
        if output_size == input_size:
            weights[dst, dst] = 1
            continue
        i0, lambda1 = _guard(_source_index(ratio, dst, align_corners, cubic=False), input_size)
        i1 = i0 + (1 if i0 < input_size - 1 else 0)
        weights[dst, i0] += _f32(1) - lambda1
        weights[dst, i1] += lambda1
    return weights


_A = _f32(-0.75)


def _cubic_inner(x: np.float32) -> np.float32:
    return ((_A + 2) * x - (_A + 3)) * x * x + 1


def _cubic_outer(x: np.float32) -> np.float32:
    return ((_A * x - 5 * _A) * x + 8 * _A) * x - 4 * _A


def _cubic_matrix(input_size: int, output_size: int, align_corners: bool, scale: float | None) -> np.ndarray:
    weights = np.zeros((output_size, input_size), np.float32)
    ratio = _area_scale(input_size, output_size, align_corners, scale)
    for dst in range(output_size):
        index, t = _guard(_source_index(ratio, dst, align_corners, cubic=True), input_size)
        taps = (_cubic_outer(t + 1), _cubic_inner(t), _cubic_inner(1 - t), _cubic_outer(2 - t))
        for k, w in enumerate(taps):
            # Taps past an edge read (and here receive gradient into) the edge element.
            weights[dst, min(max(index - 1 + k, 0), input_size - 1)] += w
    return weights


def _antialias_matrix(input_size: int, output_size: int, align_corners: bool, scale: float | None) -> np.ndarray:
    """Antialiased bilinear (``_upsample_bilinear2d_aa``): a triangle filter stretched by the scale when
    shrinking, so every input pixel under an output pixel counts; each row normalised to sum 1."""
    weights = np.zeros((output_size, input_size), np.float32)
    ratio = _area_scale(input_size, output_size, align_corners, scale)
    support = _f32(1) * ratio if ratio >= 1 else _f32(1)  # interp_size / 2 = 1 for the triangle
    inverse = _f32(1) / ratio if ratio >= 1 else _f32(1)
    for dst in range(output_size):
        center = ratio * (_f32(dst) + _f32(0.5))
        low = max(int(center - support + _f32(0.5)), 0)
        high = min(int(center + support + _f32(0.5)), input_size)
        taps = np.arange(low, high)
        distance = ((taps - low).astype(np.float32) + _f32(low) - center + _f32(0.5)) * inverse
        row = np.maximum(_f32(0), _f32(1) - np.abs(distance)).astype(np.float32)
        total = row.sum(dtype=np.float32)
        weights[dst, low:high] = row / total if total != 0 else row
    return weights


def _apply(x, matrices: list[np.ndarray]):
    """Each trailing spatial dim of ``x`` contracted with its W (out x in): the forward."""
    spatial = len(matrices)
    out = x
    for k, weights in enumerate(matrices):
        axis = x.ndim - spatial + k
        w = jnp.asarray(weights.T, dtype=x.dtype)
        out = jnp.moveaxis(jnp.tensordot(jnp.moveaxis(out, axis, -1), w, axes=([-1], [0]), precision=_EXACT), -1, axis)
    return out


def _transpose_apply(grad, input_size: Sequence[int], matrices: list[np.ndarray]):
    """``grad_input``: each trailing spatial dim of ``grad`` contracted with its W (out x in)."""
    spatial = len(matrices)
    out = grad
    for k, weights in enumerate(matrices):
        axis = grad.ndim - spatial + k
        w = jnp.asarray(weights, dtype=grad.dtype)
        out = jnp.moveaxis(jnp.tensordot(jnp.moveaxis(out, axis, -1), w, axes=([-1], [0]), precision=_EXACT), -1, axis)
    return out.reshape(tuple(input_size))


def _scales_list(scales: tuple, spatial: int) -> list:
    return list(scales) + [None] * (spatial - len(scales))


def _nearest_backward(spatial: int, exact: bool) -> Callable:
    def backward(grad, output_size: Sequence[int], input_size: Sequence[int], *scales):
        sizes = list(input_size)[-spatial:]
        matrices = [
            _nearest_matrix(n_in, n_out, s, exact)
            for n_in, n_out, s in zip(sizes, output_size, _scales_list(scales, spatial))
        ]
        return _transpose_apply(grad, input_size, matrices)

    return backward


def _interpolating_backward(spatial: int, matrix: Callable) -> Callable:
    def backward(grad, output_size: Sequence[int], input_size: Sequence[int], align_corners: bool, *scales):
        sizes = list(input_size)[-spatial:]
        if matrix is _cubic_matrix and sizes == list(output_size):
            return grad.reshape(tuple(input_size))  # ATen copies when the sizes agree
        matrices = [
            matrix(n_in, n_out, align_corners, s)
            for n_in, n_out, s in zip(sizes, output_size, _scales_list(scales, spatial))
        ]
        return _transpose_apply(grad, input_size, matrices)

    return backward


for _spatial, _name in ((1, "1d"), (2, "2d"), (3, "3d")):
    lower(getattr(aten, f"upsample_nearest{_name}_backward").default, static_scalars=True)(
        _nearest_backward(_spatial, exact=False)
    )
    lower(getattr(aten, f"_upsample_nearest_exact{_name}_backward").default, static_scalars=True)(
        _nearest_backward(_spatial, exact=True)
    )

lower(aten.upsample_linear1d_backward.default, static_scalars=True)(_interpolating_backward(1, _linear_matrix))
lower(aten.upsample_bilinear2d_backward.default, static_scalars=True)(_interpolating_backward(2, _linear_matrix))
lower(aten.upsample_trilinear3d_backward.default, static_scalars=True)(_interpolating_backward(3, _linear_matrix))
lower(aten.upsample_bicubic2d_backward.default, static_scalars=True)(_interpolating_backward(2, _cubic_matrix))


@lower(aten._upsample_bilinear2d_aa.default, static_scalars=True)
def upsample_bilinear2d_aa(x, output_size: Sequence[int], align_corners: bool, scales_h=None, scales_w=None):
    sizes = x.shape[-2:]
    matrices = [
        _antialias_matrix(n_in, n_out, align_corners, s)
        for n_in, n_out, s in zip(sizes, output_size, (scales_h, scales_w))
    ]
    return _apply(x, matrices)


lower(aten._upsample_bilinear2d_aa_backward.default, static_scalars=True)(_interpolating_backward(2, _antialias_matrix))
