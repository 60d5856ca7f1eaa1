"""``histogram`` with a bin count: equal-width bins, binned as ATen's CPU kernel bins them.

The shapes are static (``bins`` bins, ``bins + 1`` edges), so it runs on the device.
Following ``histogramdd`` on CPU: without a range the edges span the data's min and
max ([0, 1] for no data), widened by 0.5 each way when they are equal; an element's bin is
``(x - left) * bins / (right - left)`` in the input's dtype, then moved by one if the
edges (``linspace``) disagree; the last bin includes the right edge; elements outside
the range and NaNs are not counted.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from tpurec.dense.registry import lower

aten = torch.ops.aten


def _edges(left, right, bins: int, dtype):
    """``linspace(left, right, bins + 1)`` as torch computes it: the first half from the left, the rest from the right."""
    step = (right - left) / bins
    i = jnp.arange(bins + 1, dtype=dtype)
    return jnp.where(i < (bins + 1) // 2, left + i * step, right - (bins - i) * step).astype(dtype)


@lower(aten.histogram.bin_ct, static_scalars=True)
def histogram(x, bins: int = 100, *, range=None, weight=None, density: bool = False):  # noqa: A002 (torch's name)
    dtype = x.dtype
    values = x.reshape(-1)
    if range is not None:
        left, right = jnp.asarray(range[0], dtype), jnp.asarray(range[1], dtype)
    else:
        # An empty input spans [0, 1], as on CPU.
        left = values.min().astype(dtype) if values.size else jnp.asarray(0, dtype)
        right = values.max().astype(dtype) if values.size else jnp.asarray(1, dtype)
    same = left == right
    left = jnp.where(same, left - 0.5, left).astype(dtype)
    right = jnp.where(same, right + 0.5, right).astype(dtype)
    edges = _edges(left, right, bins, dtype)
    counted = (values >= left) & (values <= right)  # False for NaN
    position = ((values - left) * jnp.asarray(bins, dtype) / (right - left)).astype(jnp.int64)
    position = jnp.clip(position, 0, bins - 1)
    position = jnp.where(values < edges[position], position - 1, position)
    position = jnp.where(values >= edges[jnp.minimum(position + 1, bins)], position + 1, position)
    position = jnp.clip(position, 0, bins - 1)  # the right edge belongs to the last bin
    amounts = jnp.ones_like(values) if weight is None else weight.reshape(-1).astype(dtype)
    amounts = jnp.where(counted, amounts, jnp.zeros((), dtype))
    hist = jax.ops.segment_sum(amounts, position, num_segments=bins)
    if density:
        hist = hist / (hist.sum() * (edges[1:] - edges[:-1]))
    return hist.astype(dtype), edges


@lower(aten.histogram.bins_tensor)
def histogram_edges(x, bins, *, weight=None, density: bool = False):
    """``histogram`` with given (increasing) edges: an element's bin is found by binary search."""
    dtype = x.dtype
    values = x.reshape(-1)
    edges = bins.astype(dtype)
    count = edges.shape[0] - 1
    counted = (values >= edges[0]) & (values <= edges[-1])
    position = jnp.clip(jnp.searchsorted(edges, values, side="right") - 1, 0, count - 1)
    amounts = jnp.ones_like(values) if weight is None else weight.reshape(-1).astype(dtype)
    amounts = jnp.where(counted, amounts, jnp.zeros((), dtype))
    hist = jax.ops.segment_sum(amounts, position, num_segments=count)
    if density:
        hist = hist / (hist.sum() * (edges[1:] - edges[:-1]))
    return hist.astype(dtype), edges
