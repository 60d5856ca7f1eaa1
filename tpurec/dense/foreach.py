"""``_foreach_*`` ops (what torch.optim's foreach paths emit): each one is the
matching single-tensor lowering mapped over the lists, so promotion and
numerics are exactly those of the per-tensor op. XLA fuses the resulting
elementwise graph in fused/compiled mode anyway.

Overload mapping: ``.List`` pairs tensors, ``.Scalar`` broadcasts one scalar,
``.ScalarList`` pairs each tensor with a scalar, ``.Tensor`` broadcasts one
tensor (e.g. a 0-dim learning rate).
"""

from __future__ import annotations

import jax.numpy as jnp
import torch

from tpurec.dense import elementwise as ew
from tpurec.dense import reductions as red
from tpurec.dense.registry import lower

aten = torch.ops.aten

_UNARY = {
    "abs": "abs",
    "acos": "acos",
    "asin": "asin",
    "atan": "atan",
    "ceil": "ceil",
    "cos": "cos",
    "cosh": "cosh",
    "erf": "erf",
    "erfc": "erfc",
    "exp": "exp",
    "expm1": "expm1",
    "floor": "floor",
    "frac": "frac",
    "lgamma": "lgamma",
    "log": "log",
    "log10": "log10",
    "log1p": "log1p",
    "log2": "log2",
    "neg": "neg",
    "reciprocal": "reciprocal",
    "round": "round",
    "rsqrt": "rsqrt",
    "sigmoid": "sigmoid",
    "sign": "sign",
    "sin": "sin",
    "sinh": "sinh",
    "sqrt": "sqrt",
    "tan": "tan",
    "tanh": "tanh",
    "trunc": "trunc",
}


def _fn(op):
    """The registered JAX function of a single-tensor ATen overload."""
    from tpurec.dense.registry import LOWERINGS

    return LOWERINGS[op].fn


for _name, _base in _UNARY.items():
    _f = _fn(getattr(aten, _base).default)
    lower(getattr(aten, f"_foreach_{_name}").default)(lambda xs, _f=_f: [_f(x) for x in xs])

# name -> (op for tensor/tensor, op for tensor/scalar)
_BINARY = {
    "add": (aten.add.Tensor, aten.add.Scalar),
    "sub": (aten.sub.Tensor, aten.sub.Scalar),
    "mul": (aten.mul.Tensor, aten.mul.Scalar),
    "div": (aten.div.Tensor, aten.div.Scalar),
    "pow": (aten.pow.Tensor_Tensor, aten.pow.Tensor_Scalar),
    "maximum": (aten.maximum.default, aten.clamp_min.default),
    "minimum": (aten.minimum.default, aten.clamp_max.default),
    "clamp_min": (aten.clamp_min.Tensor, aten.clamp_min.default),
    "clamp_max": (aten.clamp_max.Tensor, aten.clamp_max.default),
}


def _register_binary(name: str, tensor_op, scalar_op) -> None:
    packet = getattr(aten, f"_foreach_{name}")
    ovs = packet.overloads()
    tf, sf = _fn(tensor_op), _fn(scalar_op)

    if "List" in ovs:

        @lower(packet.List)
        def lst(xs, others, **kw):
            return [tf(x, o, **kw) for x, o in zip(xs, others)]

    if "Scalar" in ovs:

        @lower(packet.Scalar)
        def scalar(xs, s, **kw):
            return [sf(x, s, **kw) for x in xs]

    if "ScalarList" in ovs:

        @lower(packet.ScalarList)
        def scalar_list(xs, ss, **kw):
            return [sf(x, s, **kw) for x, s in zip(xs, ss)]

    if "Tensor" in ovs:

        @lower(packet.Tensor)
        def tensor(xs, other, **kw):
            return [tf(x, other, **kw) for x in xs]


for _name, (_t, _s) in _BINARY.items():
    _register_binary(_name, _t, _s)


@lower(aten._foreach_pow.ScalarAndTensor)
def foreach_pow_scalar_and_tensor(s, exponents):
    return [ew.pow(s, e) for e in exponents]


def _register_pointwise(name: str, fn) -> None:
    packet = getattr(aten, f"_foreach_{name}")

    @lower(packet.Scalar)
    def scalar(xs, t1, t2, value=1):
        return [fn(x, a, b, value=value) for x, a, b in zip(xs, t1, t2)]

    @lower(packet.ScalarList)
    def scalar_list(xs, t1, t2, scalars):
        return [fn(x, a, b, value=s) for x, a, b, s in zip(xs, t1, t2, scalars)]

    @lower(packet.Tensor)
    def tensor(xs, t1, t2, scalars):
        # `scalars` is a 1-d tensor holding one value per list entry.
        return [fn(x, a, b, value=scalars[i]) for i, (x, a, b) in enumerate(zip(xs, t1, t2))]


_register_pointwise("addcmul", ew.addcmul)
_register_pointwise("addcdiv", ew.addcdiv)


@lower(aten._foreach_lerp.List)
def foreach_lerp_list(xs, ends, weights):
    return [ew.lerp(x, e, w) for x, e, w in zip(xs, ends, weights)]


@lower(aten._foreach_lerp.Scalar)
def foreach_lerp_scalar(xs, ends, weight):
    return [ew.lerp(x, e, weight) for x, e in zip(xs, ends)]


@lower(aten._foreach_lerp.ScalarList)
def foreach_lerp_scalar_list(xs, ends, weights):
    return [ew.lerp(x, e, w) for x, e, w in zip(xs, ends, weights)]


@lower(aten._foreach_norm.Scalar)
def foreach_norm(xs, ord=2, dtype=None):
    return [red.linalg_vector_norm(x, ord, None, False, dtype=dtype) for x in xs]


@lower(aten._foreach_max.default)
def foreach_max(xs):
    return [jnp.max(x) for x in xs]


@lower(aten._foreach_copy.default)
def foreach_copy(xs, srcs, non_blocking: bool = False):
    return [jnp.broadcast_to(s.astype(x.dtype), x.shape) for x, s in zip(xs, srcs)]


@lower(aten._foreach_clone.default)
def foreach_clone(xs, *, memory_format=None):
    return list(xs)


@lower(aten._foreach_zero.default)
def foreach_zero(xs):
    return [jnp.zeros_like(x) for x in xs]
