"""Automatic mixed precision on the tpu device: ``torch.autocast("tpu", dtype)`` as on CUDA.

PyTorch casts for autocast in the ``Autocast<backend>`` dispatch key, with
kernels that CUDA, CPU and XPU register in C++; nothing is registered for
PrivateUse1, so every op under ``torch.autocast("tpu")`` would fail there.
This module registers, for ``AutocastPrivateUse1``:

* a fallthrough for every op (ops not listed run unchanged);
* CUDA's policies for the listed ops: matmul/conv/linear/RNN cells/attention
  run in the autocast dtype (bfloat16 or float16); precision-sensitive ops
  (exp, log, pow, norms, losses, softmax...) in float32; ops mixing inputs
  (cat, stack, addcmul, index_put...) in the widest input type.

The lists follow ``aten/src/ATen/autocast_mode.cpp`` (CUDA). Only floating
tensors on tpu other than float64 are cast, as on CUDA.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["LOWER_PRECISION_OPS", "FLOAT32_OPS", "FLOAT32_OPTIONAL_DTYPE_OPS", "PROMOTE_OPS", "register"]

# Run in the autocast dtype (CUDA's lower_precision_fp list).
LOWER_PRECISION_OPS = """
_convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d convolution prelu
addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm baddbmm bmm chain_matmul linalg_multi_dot
_thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell
_scaled_dot_product_flash_attention scaled_dot_product_attention
""".split()

# Run in float32 (CUDA's fp32 list).
FLOAT32_OPS = """
acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow softplus layer_norm
native_layer_norm group_norm frobenius_norm nuclear_norm cosine_similarity poisson_nll_loss cosine_embedding_loss
nll_loss nll_loss2d hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss
multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits
dist pdist cdist renorm logsumexp upsample_nearest1d upsample_nearest2d upsample_nearest3d upsample_linear1d
upsample_bilinear2d upsample_trilinear3d upsample_bicubic2d
""".split()

# Run with dtype=float32 unless the caller gave a dtype (CUDA's fp32_set_opt_dtype list).
FLOAT32_OPTIONAL_DTYPE_OPS = (
    "prod softmax log_softmax cumprod cumsum linalg_vector_norm linalg_matrix_norm sum nansum".split()
)

# Run in the widest floating type among the inputs (CUDA's promote list).
PROMOTE_OPS = "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put scatter_add tensordot cat stack index_copy".split()


def _eligible(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "tpu" and x.is_floating_point() and x.dtype != torch.float64


def _cast_to(dtype: torch.dtype) -> Callable[[Any], Any]:
    def cast(x: Any) -> Any:
        return x.to(dtype) if _eligible(x) and x.dtype != dtype else x

    return cast


_EXCLUDE = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)


def _kernel(op: torch._ops.OpOverload, policy: str) -> Callable[..., Any]:
    names = [a.name for a in op._schema.arguments]
    dtype_position = names.index("dtype") if "dtype" in names else None

    def autocast_kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            if policy == "lower":
                args, kwargs = tree_map(_cast_to(torch.get_autocast_dtype("tpu")), (args, kwargs))
            elif policy == "float32":
                args, kwargs = tree_map(_cast_to(torch.float32), (args, kwargs))
            elif policy == "float32_optional_dtype":
                first = args[0] if args else None
                if dtype_position is not None and _eligible(first):
                    if len(args) > dtype_position:
                        if args[dtype_position] is None:
                            args = args[:dtype_position] + (torch.float32,) + args[dtype_position + 1 :]
                    elif kwargs.get("dtype") is None:
                        kwargs = {**kwargs, "dtype": torch.float32}
            else:  # promote
                floats = [x.dtype for x in tree_flatten((args, kwargs))[0] if _eligible(x)]
                if floats:
                    widest = floats[0]
                    for dtype in floats[1:]:
                        widest = torch.promote_types(widest, dtype)
                    args, kwargs = tree_map(_cast_to(widest), (args, kwargs))
            return op(*args, **kwargs)

    return autocast_kernel


_libraries: list[torch.library.Library] = []


def register() -> None:
    """Registers the fallthrough and the per-op autocast kernels for ``AutocastPrivateUse1`` (once)."""
    if _libraries:
        return
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    kernels = torch.library.Library("aten", "IMPL")
    policies = (
        [(n, "lower") for n in LOWER_PRECISION_OPS]
        + [(n, "float32") for n in FLOAT32_OPS]
        + [(n, "float32_optional_dtype") for n in FLOAT32_OPTIONAL_DTYPE_OPS]
        + [(n, "promote") for n in PROMOTE_OPS]
    )
    for name, policy in policies:
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            schema = op._schema
            # out= and in-place variants keep their given dtypes (CUDA lists functional overloads only).
            if schema.is_mutable or "Dimname" in str(schema):
                continue
            kernels.impl(op, _kernel(op, policy), "AutocastPrivateUse1")
    _libraries.extend([fallback, kernels])


# --- GradScaler's two ops, on tpu tensors (run by the dispatcher like decompositions) ---


def non_finite_check_and_unscale_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """``_amp_foreach_non_finite_check_and_unscale_``: ``found_inf`` becomes 1 if any grad is inf/NaN; grads *= inv_scale.

    As CUDA's and CPU's kernels: every grad is unscaled whether or not one is
    non-finite (the optimizer step is skipped then anyway).
    """
    if not grads:
        return
    if inv_scale.numel() != 1 or found_inf.numel() != 1:
        raise ValueError(
            f"GradScaler: inv_scale and found_inf must hold one element, got {tuple(inv_scale.shape)} and {tuple(found_inf.shape)}"
        )
    non_finite = torch.stack([torch.logical_not(torch.isfinite(g)).any() for g in grads]).any()
    found_inf.copy_(torch.where(non_finite, torch.ones_like(found_inf), found_inf))
    torch._foreach_mul_(grads, inv_scale)


def update_scale_(
    scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
) -> torch.Tensor:
    """``_amp_update_scale_``: back off after an inf/NaN, grow after ``growth_interval`` clean steps.

    Same rule as ATen's kernel: a grown scale that is not finite is not taken.
    """
    found = found_inf > 0
    successful = growth_tracker + 1
    grow = successful >= growth_interval
    grown = scale * growth_factor
    grown = torch.where(torch.isfinite(grown), grown, scale)
    new_scale = torch.where(found, scale * backoff_factor, torch.where(grow, grown, scale))
    new_tracker = torch.where(torch.logical_or(found, grow), torch.zeros_like(growth_tracker), successful)
    scale.copy_(new_scale)
    growth_tracker.copy_(new_tracker)
    return scale
