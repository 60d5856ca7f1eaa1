"""Grid sampling: ``grid_sampler_2d_backward``, and ``grid_sampler_3d`` with its backward.

The forwards are JAX functions written as ATen's CPU kernels compute them (the 2d
forward op itself runs through torch's decomposition). Each backward
differentiates its forward with ``jax.vjp``; where ATen's hand-written gradient picks a side
at a kink (a coordinate exactly on a clipping or reflection boundary gets the
gradient of the inside branch, see ``clip_coordinates_set_grad`` and
``reflect_coordinates_set_grad`` in GridSampler.h), the forward is written with
``jnp.where`` on the same comparison, so autodiff picks the same side.

Modes: 0 bilinear, 1 nearest, 2 bicubic. Padding: 0 zeros, 1 border, 2 reflection.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from tpurec.dense.registry import lower

aten = torch.ops.aten

_BILINEAR, _NEAREST, _BICUBIC = 0, 1, 2
_ZEROS, _BORDER, _REFLECTION = 0, 1, 2
_A = -0.75  # the cubic convolution's A, as in ATen


def _unnormalize(coord, size: int, align_corners: bool):
    """[-1, 1] -> pixel coordinates (corner pixels' centres, or their outer edges)."""
    if align_corners:
        return (coord + 1) / 2 * (size - 1)
    return ((coord + 1) * size - 1) / 2


def _clip(coord, size: int):
    """``clip_coordinates``: at or past a bound, the bound (and no gradient)."""
    high = size - 1
    return jnp.where(coord <= 0, jnp.zeros_like(coord), jnp.where(coord >= high, jnp.full_like(coord, high), coord))


def _reflect(coord, twice_low: int, twice_high: int):
    """``reflect_coordinates``: folds ``coord`` into [low, high] by reflections at the bounds."""
    if twice_low == twice_high:
        return jnp.zeros_like(coord)
    low = twice_low / 2
    span = (twice_high - twice_low) / 2
    shifted = coord - low
    distance = jnp.where(shifted < 0, -shifted, shifted)
    extra = jnp.fmod(distance, span)
    flips = jnp.floor(distance / span)
    return jnp.where(jnp.fmod(flips, 2) == 0, extra + low, span - extra + low)


def _source_index(coord, size: int, padding: int, align_corners: bool):
    """``grid_sampler_compute_source_index``."""
    coord = _unnormalize(coord, size, align_corners)
    if padding == _BORDER:
        coord = _clip(coord, size)
    elif padding == _REFLECTION:
        coord = _reflect(coord, 0, 2 * (size - 1)) if align_corners else _reflect(coord, -1, 2 * size - 1)
        coord = _clip(coord, size)
    return coord


def _gather(x, *indices):
    """``x[n, :, i_1, ..., i_d]`` for integer maps, one per spatial dim of ``x`` (each (N, *out)),
    zeros where out of bounds -> (N, C, *out)."""
    sizes = x.shape[2:]
    inside = jnp.ones(indices[0].shape, bool)
    for index, size in zip(indices, sizes):
        inside = inside & (index >= 0) & (index < size)
    clipped = [jnp.clip(index, 0, size - 1) for index, size in zip(indices, sizes)]
    values = jax.vmap(lambda image, *idx: image[(slice(None),) + idx])(x, *clipped)
    return jnp.where(inside[:, None], values, jnp.zeros((), x.dtype))


def _bounded_index(index, size: int, padding: int, align_corners: bool):
    """``compute_coordinates`` applied to an integer tap of the bicubic kernel."""
    coord = index.astype(jnp.float32)  # small integers: exact
    if padding == _BORDER:
        coord = _clip(coord, size)
    elif padding == _REFLECTION:
        coord = _reflect(coord, 0, 2 * (size - 1)) if align_corners else _reflect(coord, -1, 2 * size - 1)
        coord = _clip(coord, size)
    return coord.astype(jnp.int32)


def _cubic_weights(t):
    inner = lambda s: ((_A + 2) * s - (_A + 3)) * s * s + 1  # noqa: E731
    outer = lambda s: ((_A * s - 5 * _A) * s + 8 * _A) * s - 4 * _A  # noqa: E731
    return (outer(t + 1), inner(t), inner(1 - t), outer(2 - t))


def grid_sampler_2d(x, grid, mode: int, padding: int, align_corners: bool):
    """``grid_sampler_2d`` forward: x (N, C, H, W), grid (N, Ho, Wo, 2) of (x, y) in [-1, 1]."""
    _, _, height, width = x.shape
    gx, gy = grid[..., 0], grid[..., 1]
    if mode == _BICUBIC:
        ix, iy = _unnormalize(gx, width, align_corners), _unnormalize(gy, height, align_corners)
        x0, y0 = jnp.floor(ix), jnp.floor(iy)
        wx, wy = _cubic_weights(ix - x0), _cubic_weights(iy - y0)
        x0, y0 = x0.astype(jnp.int32), y0.astype(jnp.int32)
        out = 0
        for j in range(4):
            rows = _bounded_index(y0 - 1 + j, height, padding, align_corners)
            for i in range(4):
                cols = _bounded_index(x0 - 1 + i, width, padding, align_corners)
                out = out + _gather(x, rows, cols) * (wy[j] * wx[i])[:, None]
        return out
    ix = _source_index(gx, width, padding, align_corners)
    iy = _source_index(gy, height, padding, align_corners)
    if mode == _NEAREST:
        return _gather(x, jnp.round(iy).astype(jnp.int32), jnp.round(ix).astype(jnp.int32))  # half to even
    x0, y0 = jnp.floor(ix), jnp.floor(iy)
    x1, y1 = x0 + 1, y0 + 1
    corners = [
        (y0, x0, (x1 - ix) * (y1 - iy)),
        (y0, x1, (ix - x0) * (y1 - iy)),
        (y1, x0, (x1 - ix) * (iy - y0)),
        (y1, x1, (ix - x0) * (iy - y0)),
    ]
    out = 0
    for r, c, w in corners:
        out = out + _gather(x, r.astype(jnp.int32), c.astype(jnp.int32)) * w[:, None]
    return out


@lower(aten.grid_sampler_3d.default)
def grid_sampler_3d(x, grid, mode: int, padding: int, align_corners: bool):
    """``grid_sampler_3d`` forward: x (N, C, D, H, W), grid (N, Do, Ho, Wo, 3) of (x, y, z) in [-1, 1].

    Trilinear (mode 0) or nearest (mode 1); PyTorch has no bicubic in 3d.
    """
    depth, height, width = x.shape[2:]
    ix = _source_index(grid[..., 0], width, padding, align_corners)
    iy = _source_index(grid[..., 1], height, padding, align_corners)
    iz = _source_index(grid[..., 2], depth, padding, align_corners)
    if mode == _NEAREST:
        return _gather(x, *(jnp.round(i).astype(jnp.int32) for i in (iz, iy, ix)))
    x0, y0, z0 = jnp.floor(ix), jnp.floor(iy), jnp.floor(iz)
    out = 0
    for dz in (0, 1):
        wz = (iz - z0) if dz else (z0 + 1 - iz)
        for dy in (0, 1):
            wy = (iy - y0) if dy else (y0 + 1 - iy)
            for dx in (0, 1):
                wx = (ix - x0) if dx else (x0 + 1 - ix)
                taps = ((z0 + dz).astype(jnp.int32), (y0 + dy).astype(jnp.int32), (x0 + dx).astype(jnp.int32))
                out = out + _gather(x, *taps) * (wz * wy * wx)[:, None]
    return out


@lower(aten.grid_sampler_3d_backward.default)
def grid_sampler_3d_backward(grad, x, grid, mode: int, padding: int, align_corners: bool, output_mask):
    _, vjp = jax.vjp(lambda a, g: grid_sampler_3d(a, g, mode, padding, align_corners), x, grid)
    grad_x, grad_grid = vjp(grad.astype(x.dtype))
    return (grad_x if output_mask[0] else None, grad_grid if output_mask[1] else None)


@lower(aten.grid_sampler_2d_backward.default)
def grid_sampler_2d_backward(grad, x, grid, mode: int, padding: int, align_corners: bool, output_mask):
    _, vjp = jax.vjp(lambda a, g: grid_sampler_2d(a, g, mode, padding, align_corners), x, grid)
    grad_x, grad_grid = vjp(grad.astype(x.dtype))
    return (grad_x if output_mask[0] else None, grad_grid if output_mask[1] else None)
