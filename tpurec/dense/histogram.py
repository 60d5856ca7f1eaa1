"""``histogram`` and ``histogramdd``: equal-width or given bins, binned as ATen's CPU kernel bins them.

The shapes are static (the bin counts), so they run on the device. Following
``histogramdd`` on CPU, per dimension: without a range the edges span the data's
min and max ([0, 1] for no data), widened by 0.5 each way when they are equal; with
a bin count an element's bin is ``(x - left) * bins / (right - left)`` in the input's
dtype, then moved by one where the edges (``linspace``) disagree; with given edges
it is found by binary search; the last bin includes the right edge. An element
outside the range (in any dimension) or NaN is not counted.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import torch

from tpurec.dense.registry import lower

aten = torch.ops.aten


def _span(values, limits, dtype):
    """Left and right edge of one dimension: ``limits`` (a range) or the data's min and max."""
    if limits is not None:
        left, right = jnp.asarray(limits[0], dtype), jnp.asarray(limits[1], dtype)
    elif values.size:
        left, right = values.min().astype(dtype), values.max().astype(dtype)
    else:
        left, right = jnp.asarray(0, dtype), jnp.asarray(1, dtype)
    same = left == right
    return jnp.where(same, left - 0.5, left).astype(dtype), jnp.where(same, right + 0.5, right).astype(dtype)


def _even_edges(left, right, bins: int, dtype):
    """``linspace(left, right, bins + 1)`` as torch computes it: the first half from the left, the rest from the right."""
    step = (right - left) / bins
    i = jnp.arange(bins + 1, dtype=dtype)
    return jnp.where(i < (bins + 1) // 2, left + i * step, right - (bins - i) * step).astype(dtype)


def _even_bins(values, edges, bins: int):
    """Bin of each value for ``bins`` equal-width bins between the first and last of ``edges``."""
    left, right = edges[0], edges[-1]
    position = ((values - left) * jnp.asarray(bins, values.dtype) / (right - left)).astype(jnp.int64)
    position = jnp.clip(position, 0, bins - 1)
    position = jnp.where(values < edges[position], position - 1, position)
    position = jnp.where(values >= edges[jnp.minimum(position + 1, bins)], position + 1, position)
    return jnp.clip(position, 0, bins - 1)  # the right edge belongs to the last bin


def _searched_bins(values, edges):
    """Bin of each value for increasing ``edges`` (binary search)."""
    return jnp.clip(jnp.searchsorted(edges, values, side="right") - 1, 0, edges.shape[0] - 2)


def _inside(values, edges):
    return (values >= edges[0]) & (values <= edges[-1])  # False for NaN


def _count(positions: list, inside, weight, edges: list, density: bool, dtype):
    """The histogram over the bins given per dimension (``positions``), of the values ``inside``."""
    shape = tuple(e.shape[0] - 1 for e in edges)
    flat = jnp.zeros_like(positions[0])
    for position, n in zip(positions, shape):
        flat = flat * n + position
    amounts = jnp.ones(inside.shape, dtype) if weight is None else weight.reshape(-1).astype(dtype)
    amounts = jnp.where(inside, amounts, jnp.zeros((), dtype))
    hist = jax.ops.segment_sum(amounts, flat, num_segments=math.prod(shape)).reshape(shape)
    if density:
        volume = jnp.ones((), dtype)
        for d, e in enumerate(edges):
            width = (e[1:] - e[:-1]).reshape(tuple(-1 if k == d else 1 for k in range(len(edges))))
            volume = volume * width
        hist = hist / (hist.sum() * volume)
    return hist.astype(dtype)


@lower(aten.histogram.bin_ct, static_scalars=True)
def histogram(x, bins: int = 100, *, range=None, weight=None, density: bool = False):  # noqa: A002 (torch's name)
    values = x.reshape(-1)
    edges = _even_edges(*_span(values, range, x.dtype), bins, x.dtype)
    hist = _count([_even_bins(values, edges, bins)], _inside(values, edges), weight, [edges], density, x.dtype)
    return hist, edges


@lower(aten.histogram.bins_tensor)
def histogram_edges(x, bins, *, weight=None, density: bool = False):
    values = x.reshape(-1)
    edges = bins.astype(x.dtype)
    return _count([_searched_bins(values, edges)], _inside(values, edges), weight, [edges], density, x.dtype), edges


def _points(x):
    """``histogramdd``'s input (..., D) as D columns of values."""
    columns = x.reshape(-1, x.shape[-1])
    return [columns[:, d] for d in range(x.shape[-1])]


def _dd_edges(x, bins: Sequence[int], range_):
    limits = [None if range_ is None else range_[2 * d : 2 * d + 2] for d in range(len(bins))]
    return [_even_edges(*_span(v, lim, x.dtype), n, x.dtype) for v, lim, n in zip(_points(x), limits, bins)]


@lower(aten._histogramdd_bin_edges.default, static_scalars=True)
def histogramdd_bin_edges(x, bins: Sequence[int], *, range=None, weight=None, density: bool = False):  # noqa: A002
    return _dd_edges(x, bins, range)


@lower(aten._histogramdd_from_bin_cts.default, static_scalars=True)
def histogramdd_from_bin_cts(x, bins: Sequence[int], *, range=None, weight=None, density: bool = False):  # noqa: A002
    edges = _dd_edges(x, bins, range)
    points = _points(x)
    inside = jnp.ones(points[0].shape, bool)
    for v, e in zip(points, edges):
        inside = inside & _inside(v, e)
    positions = [_even_bins(v, e, n) for v, e, n in zip(points, edges, bins)]
    return _count(positions, inside, weight, edges, density, x.dtype)


@lower(aten._histogramdd_from_bin_tensors.default)
def histogramdd_from_bin_tensors(x, bins, *, weight=None, density: bool = False):
    edges = [b.astype(x.dtype) for b in bins]
    points = _points(x)
    inside = jnp.ones(points[0].shape, bool)
    for v, e in zip(points, edges):
        inside = inside & _inside(v, e)
    return _count([_searched_bins(v, e) for v, e in zip(points, edges)], inside, weight, edges, density, x.dtype)
