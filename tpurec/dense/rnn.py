"""Recurrent cells and packed sequences.

``nn.LSTM`` / ``nn.GRU`` on a non-CPU device run their per-step cells through
``_thnn_fused_lstm_cell`` / ``_thnn_fused_gru_cell`` (the CUDA fused kernels'
ops; the input and hidden projections are ordinary matmuls before them). The
lowerings follow the CUDA kernels' contract, workspace included, so the
matching backward ops can be lowered too:

* LSTM workspace ``(B, 4H)``: the activated gates ``i, f, g, o``.
* GRU workspace ``(B, 5H)``: ``r, z, n`` (activated), ``hx`` and the hidden
  candidate term ``h_n + b_hn``.

``_pack_padded_sequence`` has a data-dependent output size, but the lengths
live on the host (``pack_padded_sequence`` puts them there), so it is a
decomposition rather than a lowering: the row indices are computed on the host
from the lengths and the rows are gathered on the device with one ``index``
op. It is registered in tpurec's composite table, which the dispatcher and the
compile backend fall back to for ops without a lowering.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

from tpurec.dense._util import acc_dtype as _acc
from tpurec.dense.registry import Kind, lower
from tpurec.dense import transcendental

aten = torch.ops.aten


def _with_biases(input_gates, hidden_gates, input_bias, hidden_bias):
    acc = _acc(input_gates.dtype)
    ig, hg = input_gates.astype(acc), hidden_gates.astype(acc)
    if input_bias is not None:
        ig = ig + input_bias.astype(acc)
    if hidden_bias is not None:
        hg = hg + hidden_bias.astype(acc)
    return ig, hg


# --- LSTM -----------------------------------------------------------------------


@lower(aten._thnn_fused_lstm_cell.default)
def fused_lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    ig, hg = _with_biases(input_gates, hidden_gates, input_bias, hidden_bias)
    i, f, g, o = jnp.split(ig + hg, 4, axis=-1)
    i, f, g, o = transcendental.sigmoid(i), transcendental.sigmoid(f), transcendental.tanh(g), transcendental.sigmoid(o)
    cy = f * cx.astype(ig.dtype) + i * g
    hy = o * transcendental.tanh(cy)
    dtype = input_gates.dtype
    return hy.astype(dtype), cy.astype(dtype), jnp.concatenate([i, f, g, o], axis=-1).astype(dtype)


@lower(aten._thnn_fused_lstm_cell_backward_impl.default)
def fused_lstm_cell_backward_impl(grad_hy, grad_cy, cx, cy, workspace, has_bias: bool):
    acc = _acc(workspace.dtype)
    i, f, g, o = jnp.split(workspace.astype(acc), 4, axis=-1)
    cx, cy = cx.astype(acc), cy.astype(acc)
    zeros = jnp.zeros(cy.shape, acc)
    grad_hy = zeros if grad_hy is None else grad_hy.astype(acc)
    grad_cy = zeros if grad_cy is None else grad_cy.astype(acc)
    tanh_cy = transcendental.tanh(cy)
    # cy = f*cx + i*g, hy = o*tanh(cy): the total gradient reaching cy first.
    d_cy = grad_cy + grad_hy * o * (1 - tanh_cy * tanh_cy)
    d_i = d_cy * g * i * (1 - i)
    d_f = d_cy * cx * f * (1 - f)
    d_g = d_cy * i * (1 - g * g)
    d_o = grad_hy * tanh_cy * o * (1 - o)
    grad_gates = jnp.concatenate([d_i, d_f, d_g, d_o], axis=-1)
    grad_cx = d_cy * f
    grad_bias = jnp.sum(grad_gates, axis=0) if has_bias else None
    dtype = workspace.dtype
    return (
        grad_gates.astype(dtype),
        grad_cx.astype(dtype),
        None if grad_bias is None else grad_bias.astype(dtype),
    )


# --- GRU ------------------------------------------------------------------------


@lower(aten._thnn_fused_gru_cell.default)
def fused_gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    ig, hg = _with_biases(input_gates, hidden_gates, input_bias, hidden_bias)
    i_r, i_z, i_n = jnp.split(ig, 3, axis=-1)
    h_r, h_z, h_n = jnp.split(hg, 3, axis=-1)
    r = transcendental.sigmoid(i_r + h_r)
    z = transcendental.sigmoid(i_z + h_z)
    n = transcendental.tanh(i_n + r * h_n)
    h = hx.astype(ig.dtype)
    hy = (1 - z) * n + z * h
    dtype = input_gates.dtype
    return hy.astype(dtype), jnp.concatenate([r, z, n, h, h_n], axis=-1).astype(dtype)


@lower(aten._thnn_fused_gru_cell_backward.default)
def fused_gru_cell_backward(grad_hy, workspace, has_bias: bool):
    acc = _acc(workspace.dtype)
    r, z, n, h, h_n = jnp.split(workspace.astype(acc), 5, axis=-1)
    gh = grad_hy.astype(acc)
    d_n = gh * (1 - z) * (1 - n * n)  # through tanh: the pre-activation of n
    d_z = gh * (h - n) * z * (1 - z)
    d_r = d_n * h_n * r * (1 - r)
    grad_input_gates = jnp.concatenate([d_r, d_z, d_n], axis=-1)
    grad_hidden_gates = jnp.concatenate([d_r, d_z, d_n * r], axis=-1)
    grad_hx = gh * z
    dtype = workspace.dtype
    grad_input_bias = jnp.sum(grad_input_gates, axis=0).astype(dtype) if has_bias else None
    grad_hidden_bias = jnp.sum(grad_hidden_gates, axis=0).astype(dtype) if has_bias else None
    return (
        grad_input_gates.astype(dtype),
        grad_hidden_gates.astype(dtype),
        grad_hx.astype(dtype),
        grad_input_bias,
        grad_hidden_bias,
    )


# --- packed sequences --------------------------------------------------------------


def _pack_padded_sequence(input: torch.Tensor, lengths: torch.Tensor, batch_first: bool):
    """``(data, batch_sizes)`` of ``input`` padded to ``(T, B, *)`` (``(B, T, *)`` if ``batch_first``)."""
    if lengths.device.type != "cpu" or lengths.dim() != 1:
        raise ValueError(
            f"_pack_padded_sequence: lengths must be a 1-d CPU int64 tensor, got {lengths.dim()}-d on "
            f"{lengths.device}; pass them as a list or a CPU tensor"
        )
    lens = np.asarray(lengths.tolist(), dtype=np.int64)
    steps, batch = (input.shape[1], input.shape[0]) if batch_first else (input.shape[0], input.shape[1])
    if lens.shape[0] != batch:
        raise ValueError(f"_pack_padded_sequence: got {lens.shape[0]} lengths for a batch of {batch}")
    if lens.size == 0 or lens.min() <= 0:
        raise ValueError("_pack_padded_sequence: every sequence length must be positive")
    if np.any(lens[:-1] < lens[1:]):
        raise ValueError(
            "_pack_padded_sequence: lengths must be sorted in decreasing order; "
            "use pack_padded_sequence(..., enforce_sorted=False) for unsorted lengths"
        )
    if lens[0] > steps:
        raise ValueError(f"_pack_padded_sequence: a length of {lens[0]} exceeds the padded length {steps}")
    # batch_sizes[t] = how many sequences are longer than t; the packed rows
    # are, step by step, the first batch_sizes[t] sequences of step t.
    batch_sizes = (lens[None, :] > np.arange(lens[0])[:, None]).sum(axis=1)
    t_idx = np.repeat(np.arange(lens[0]), batch_sizes)
    b_idx = np.concatenate([np.arange(b) for b in batch_sizes])
    # One gather with two index tensors (no reshape: it may be a strided view).
    t, b = torch.from_numpy(t_idx).to(input.device), torch.from_numpy(b_idx).to(input.device)
    data = input[b, t] if batch_first else input[t, b]
    return data, torch.from_numpy(batch_sizes.astype(np.int64))


lower(aten._pack_padded_sequence.default, kind=Kind.COMPOSITE)(_pack_padded_sequence)
