"""Composite versions of fused ATen kernels that PyTorch ships without a decomposition.

``nn.TransformerEncoderLayer`` and ``nn.MultiheadAttention`` take a "fast path"
in eval mode under ``torch.no_grad()`` that calls one fused kernel per layer
(``_transformer_encoder_layer_fwd``, ``_native_multi_head_attention``). Those
have CPU/CUDA kernels only, so here they are written in terms of ordinary ops
(linear, softmax, layer_norm...), each of which the tpu device lowers. Eager
dispatch and the ``torch.compile`` backend both use :data:`COMPOSITES`, the
``COMPOSITE`` part of the one lowering table (``tpurec.dense.registry``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tpurec.dense.registry import TABLE, Kind, lower

__all__ = ["COMPOSITES", "native_multi_head_attention", "register_composite", "transformer_encoder_layer_fwd"]

aten = torch.ops.aten


def _apply_mask(scores: torch.Tensor, mask: torch.Tensor | None, mask_type: int | None) -> torch.Tensor:
    """Adds (float) or applies (bool, True = masked out) ``mask`` to (B, H, L, S) attention scores.

    ``mask_type`` follows ATen's fast path: 0 an attention mask (L, S), 1 a key
    padding mask (B, S), 2 a mask already shaped (B, H, L, S) or broadcastable to it.
    """
    if mask is None:
        return scores
    if mask_type == 1:
        mask = mask.reshape(mask.shape[0], 1, 1, mask.shape[-1])
    if mask.dtype == torch.bool:
        return scores.masked_fill(mask, float("-inf"))
    return scores + mask.to(scores.dtype)


@lower(aten._native_multi_head_attention.default, kind=Kind.COMPOSITE)
def native_multi_head_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    embed_dim: int,
    num_head: int,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor,
    proj_weight: torch.Tensor,
    proj_bias: torch.Tensor,
    mask: torch.Tensor | None = None,
    need_weights: bool = True,
    average_attn_weights: bool = True,
    mask_type: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten::_native_multi_head_attention`` on batch-first (B, L, E) inputs, from ordinary ops."""
    head_dim = embed_dim // num_head
    w_q, w_k, w_v = qkv_weight.chunk(3)
    b_q, b_k, b_v = qkv_bias.chunk(3)
    batch, length, source = query.shape[0], query.shape[1], key.shape[1]

    def heads(x: torch.Tensor, n: int) -> torch.Tensor:
        return x.reshape(batch, n, num_head, head_dim).transpose(1, 2)

    q = heads(F.linear(query, w_q, b_q), length)
    k = heads(F.linear(key, w_k, b_k), source)
    v = heads(F.linear(value, w_v, b_v), source)
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(head_dim)
    weights = torch.softmax(_apply_mask(scores, mask, mask_type), dim=-1)
    attended = torch.matmul(weights, v).transpose(1, 2).reshape(batch, length, embed_dim)
    out = F.linear(attended, proj_weight, proj_bias)
    if not need_weights:
        return out, torch.empty((0,), dtype=out.dtype, device=out.device)
    return out, weights.mean(dim=1) if average_attn_weights else weights


@lower(aten._transformer_encoder_layer_fwd.default, kind=Kind.COMPOSITE)
def transformer_encoder_layer_fwd(
    src: torch.Tensor,
    embed_dim: int,
    num_heads: int,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor,
    proj_weight: torch.Tensor,
    proj_bias: torch.Tensor,
    use_gelu: bool,
    norm_first: bool,
    eps: float,
    norm_weight_1: torch.Tensor,
    norm_bias_1: torch.Tensor,
    norm_weight_2: torch.Tensor,
    norm_bias_2: torch.Tensor,
    ffn_weight_1: torch.Tensor,
    ffn_bias_1: torch.Tensor,
    ffn_weight_2: torch.Tensor,
    ffn_bias_2: torch.Tensor,
    mask: torch.Tensor | None = None,
    mask_type: int | None = None,
) -> torch.Tensor:
    """``aten::_transformer_encoder_layer_fwd``: one post- or pre-norm encoder layer, from ordinary ops."""

    def attention(x: torch.Tensor) -> torch.Tensor:
        out, _ = native_multi_head_attention(
            x,
            x,
            x,
            embed_dim,
            num_heads,
            qkv_weight,
            qkv_bias,
            proj_weight,
            proj_bias,
            mask,
            need_weights=False,
            mask_type=mask_type,
        )
        return out

    def feed_forward(x: torch.Tensor) -> torch.Tensor:
        hidden = F.linear(x, ffn_weight_1, ffn_bias_1)
        hidden = F.gelu(hidden) if use_gelu else F.relu(hidden)
        return F.linear(hidden, ffn_weight_2, ffn_bias_2)

    shape = (embed_dim,)
    if norm_first:
        x = src + attention(F.layer_norm(src, shape, norm_weight_1, norm_bias_1, eps))
        return x + feed_forward(F.layer_norm(x, shape, norm_weight_2, norm_bias_2, eps))
    x = F.layer_norm(src + attention(src), shape, norm_weight_1, norm_bias_1, eps)
    return F.layer_norm(x + feed_forward(x), shape, norm_weight_2, norm_bias_2, eps)


# op -> entry (callable like its function).
COMPOSITES = TABLE[Kind.COMPOSITE]


def register_composite(op: torch._ops.OpOverload):
    """Decorator: ``fn`` is how the tpu device runs ``op`` (eager and compiled).

    The same as ``lower(op, kind=Kind.COMPOSITE)``. tpurec keeps its
    decompositions in its own table, never in ``torch._decomp``'s global
    table: an entry there changes what every other backend (inductor
    included) sees, and inductor refuses to start under ``CI=1`` when an op it
    falls back on gains a decomposition.
    """
    return lower(op, kind=Kind.COMPOSITE)
