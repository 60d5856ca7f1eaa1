"""The lowering table covers what the models and optimizers need, and holds
only what it should (functional, non-view overloads; no out=/in-place)."""

from __future__ import annotations

import torch

from tpurec.dense.registry import LOWERINGS, get_lowering

aten = torch.ops.aten

# Everything an MLP, the DLRM dense/over arch with dot interaction, a small
# transformer block (forward + backward) and SGD/Adam/AdamW/Adagrad emit.
REQUIRED = """
mm.default addmm.default bmm.default baddbmm.default dot.default mv.default
add.Tensor add.Scalar sub.Tensor sub.Scalar rsub.Tensor rsub.Scalar mul.Tensor mul.Scalar div.Tensor div.Scalar
div.Tensor_mode div.Scalar_mode neg.default abs.default exp.default log.default log1p.default expm1.default
sqrt.default rsqrt.default pow.Tensor_Tensor pow.Tensor_Scalar pow.Scalar reciprocal.default sign.default
clamp.default clamp.Tensor clamp_min.default clamp_min.Tensor clamp_max.default clamp_max.Tensor
maximum.default minimum.default where.self where.ScalarOther where.ScalarSelf where.Scalar lerp.Scalar lerp.Tensor
addcmul.default addcdiv.default eq.Tensor eq.Scalar ne.Tensor ne.Scalar lt.Tensor lt.Scalar le.Tensor le.Scalar
gt.Tensor gt.Scalar ge.Tensor ge.Scalar logical_and.default logical_or.default logical_not.default
bitwise_and.Tensor bitwise_or.Tensor bitwise_not.default relu.default sigmoid.default tanh.default gelu.default
silu.default leaky_relu.default elu.default softplus.default hardtanh.default threshold_backward.default
sigmoid_backward.default tanh_backward.default gelu_backward.default silu_backward.default
leaky_relu_backward.default elu_backward.default softplus_backward.default hardtanh_backward.default
sum.default sum.dim_IntList mean.default mean.dim prod.default prod.dim_int amax.default amin.default
max.default max.dim min.default min.dim argmax.default argmin.default var.correction std.correction
logsumexp.default cumsum.default linalg_vector_norm.default any.default any.dim all.default all.dim
cat.default stack.default gather.default scatter.src scatter.value scatter_add.default index_select.default
index.Tensor index_put.default masked_fill.Scalar masked_fill.Tensor flip.default roll.default repeat.default
constant_pad_nd.default tril.default triu.default sort.default sort.stable topk.default clone.default
_to_copy.default embedding.default embedding_dense_backward.default one_hot.default _softmax.default
_log_softmax.default _softmax_backward_data.default _log_softmax_backward_data.default _safe_softmax.default
native_layer_norm.default native_layer_norm_backward.default native_dropout.default native_dropout_backward.default
binary_cross_entropy_with_logits.default binary_cross_entropy.default binary_cross_entropy_backward.default
mse_loss.default mse_loss_backward.default nll_loss_forward.default nll_loss_backward.default
nll_loss2d_forward.default nll_loss2d_backward.default isnan.default isinf.default isfinite.default
nan_to_num.default trunc.default floor.default ceil.default round.default fmod.Tensor fmod.Scalar
remainder.Tensor remainder.Scalar sin.default cos.default erf.default select_backward.default
slice_backward.default full.default zeros.default ones.default arange.default arange.start arange.start_step
scalar_tensor.default zeros_like.default ones_like.default full_like.default linspace.default eye.default
fill.Scalar fill.Tensor zero.default uniform.default normal_functional.default normal.Tensor_Tensor
bernoulli.p bernoulli.default random.from random.to random.default rand.default randn.default
randint.default randint.low randperm.default
_foreach_add.List _foreach_add.Scalar _foreach_add.ScalarList _foreach_add.Tensor _foreach_sub.List
_foreach_mul.Scalar _foreach_mul.List _foreach_mul.Tensor _foreach_div.List _foreach_div.Scalar
_foreach_div.ScalarList _foreach_addcdiv.Scalar _foreach_addcdiv.ScalarList _foreach_addcdiv.Tensor
_foreach_addcmul.Scalar _foreach_addcmul.ScalarList _foreach_lerp.Scalar _foreach_lerp.List
_foreach_sqrt.default _foreach_neg.default _foreach_maximum.List _foreach_pow.Scalar _foreach_pow.List
_foreach_pow.ScalarAndTensor _foreach_norm.Scalar _foreach_copy.default _foreach_zero.default
""".split()


def _op(name: str):
    packet, overload = name.split(".")
    return getattr(getattr(aten, packet), overload)


def test_required_overloads_have_lowerings():
    missing = [n for n in REQUIRED if get_lowering(_op(n)) is None]
    assert not missing, missing


def test_table_holds_only_functional_non_view_overloads():
    get_lowering(aten.add.Tensor)  # loads every family
    bad = []
    for op in LOWERINGS:
        schema = op._schema
        if schema.is_mutable or any(r.alias_info is not None for r in schema.returns):
            bad.append(str(op))
    assert not bad, bad
    assert len(LOWERINGS) > 350
