"""Elementwise ops: arithmetic, math functions, comparisons, logic, activations
and their autograd backward ops, dtype conversion.

Every lowering promotes its operands with torch's rules (``_util.promote``),
computes in torch's *computation* dtype (float32 for bf16/f16 inputs, as the
CPU kernels do) and returns the *result* dtype.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax
from jax._src.lax.lax import _convert_element_type

from tpurec.dense._util import ALWAYS_BOOL, DEFAULT, INT_TO_FLOAT, Kind, cast, is_float, is_weak_scalar, promote
from tpurec.dense.registry import lower, to_jax_dtype
from tpurec.dense import error_functions, gamma_functions, inverse_error_functions, transcendental

aten = torch.ops.aten


def _apply(fn: Callable, operands: tuple, kind: Kind, extra: tuple = ()):
    """Runs ``fn`` on operands cast to the computation dtype; ``extra`` values
    (alpha, weights...) are cast too but take no part in promotion."""
    comp, res = promote(*operands, kind=kind)
    vals = [None if x is None else cast(x, comp) for x in operands]
    ext = [None if x is None else cast(x, comp) for x in extra]
    return fn(*vals, *ext).astype(res)


def _unary(ops, fn: Callable, kind: Kind = INT_TO_FLOAT) -> None:
    @lower(*ops)
    def lowering(x):
        return _apply(fn, (x,), kind)


# --- unary math -------------------------------------------------------------
# Transcendentals: int inputs compute in the default float dtype.
for _ops, _fn in [
    ((aten.exp.default,), transcendental.exp),
    ((aten.exp2.default,), transcendental.exp2),
    ((aten.expm1.default,), transcendental.expm1),
    ((aten.log.default,), transcendental.log),
    ((aten.log2.default,), transcendental.log2),
    ((aten.log10.default,), transcendental.log10),
    ((aten.log1p.default,), transcendental.log1p),
    ((aten.sqrt.default,), jnp.sqrt),
    ((aten.rsqrt.default,), lax.rsqrt),
    ((aten.sin.default,), jnp.sin),
    ((aten.cos.default,), jnp.cos),
    ((aten.tan.default,), jnp.tan),
    ((aten.asin.default,), jnp.arcsin),
    ((aten.acos.default,), jnp.arccos),
    ((aten.atan.default,), jnp.arctan),
    ((aten.sinh.default,), transcendental.sinh),
    ((aten.cosh.default,), transcendental.cosh),
    ((aten.tanh.default,), transcendental.tanh),
    ((aten.asinh.default,), transcendental.asinh),
    ((aten.acosh.default,), transcendental.acosh),
    ((aten.atanh.default,), transcendental.atanh),
    ((aten.erf.default,), error_functions.erf),
    ((aten.erfc.default,), error_functions.erfc),
    ((aten.erfinv.default,), inverse_error_functions.erfinv),
    ((aten.lgamma.default,), gamma_functions.lgamma),
    ((aten.digamma.default,), gamma_functions.digamma),
    ((aten.sigmoid.default,), transcendental.sigmoid),
    ((aten.reciprocal.default,), lambda x: 1 / x),
]:
    _unary(_ops, _fn)


def _keep_int(fn: Callable) -> Callable:
    """Rounding functions are the identity on integers (torch keeps the dtype)."""
    return lambda x: fn(x) if is_float(x.dtype) else x


def _sign(x):
    # PyTorch's CPU kernels return +0 for NaN and for -0 (jnp.sign keeps both); complex sgn
    # is x/|x| with +0 at 0, where jnp.sign would keep the signs of a -0 component.
    if x.dtype == jnp.bool_:
        return x
    if jnp.iscomplexobj(x):
        mag = jnp.abs(x)
        return jnp.where(mag == 0, jnp.zeros((), x.dtype), x / mag.astype(x.dtype))
    if not is_float(x.dtype):
        return jnp.sign(x)
    one = jnp.ones((), x.dtype)
    zero = jnp.zeros((), x.dtype)
    return jnp.where(x > 0, one, jnp.where(x < 0, -one, zero))


for _ops, _fn in [
    ((aten.neg.default,), jnp.negative),
    # conj on tpu materialises (dispatch routes aten._conj here): tpu tensors carry no conj bit.
    ((aten._conj_physical.default,), jnp.conj),
    ((aten.sign.default, aten.sgn.default), _sign),
    ((aten.trunc.default,), _keep_int(jnp.trunc)),
    ((aten.floor.default,), _keep_int(jnp.floor)),
    ((aten.ceil.default,), _keep_int(jnp.ceil)),
    ((aten.round.default,), _keep_int(jnp.round)),
    ((aten.frac.default,), lambda x: x - jnp.trunc(x)),
    ((aten.relu.default,), lambda x: jnp.maximum(x, jnp.zeros((), x.dtype))),
    ((aten.bitwise_not.default,), lambda x: jnp.logical_not(x) if x.dtype == jnp.bool_ else jnp.invert(x)),
]:
    _unary(_ops, _fn, DEFAULT)


@lower(aten.abs.default)
def abs_(x):
    # |complex| is real (torch returns the real dtype): no promotion back to the complex input's dtype.
    return jnp.abs(x) if jnp.iscomplexobj(x) else _apply(jnp.abs, (x,), DEFAULT)


for _ops, _fn in [
    ((aten.logical_not.default,), lambda x: x == 0),
    ((aten.isnan.default,), jnp.isnan),
    ((aten.isinf.default,), jnp.isinf),
    ((aten.isfinite.default,), jnp.isfinite),
    ((aten.isposinf.default,), jnp.isposinf),
    ((aten.isneginf.default,), jnp.isneginf),
    ((aten.signbit.default,), jnp.signbit),
]:
    _unary(_ops, _fn, ALWAYS_BOOL)


@lower(aten.round.decimals)
def round_decimals(x, *, decimals: int = 0):
    if not is_float(x.dtype):
        return x
    comp, res = promote(x)
    return jnp.round(x.astype(comp), decimals).astype(res)


@lower(aten.nan_to_num.default)
def nan_to_num(x, nan=None, posinf=None, neginf=None):
    if not is_float(x.dtype):
        return x
    info = jnp.finfo(x.dtype)
    nan = 0.0 if nan is None else nan
    posinf = info.max if posinf is None else posinf
    neginf = info.min if neginf is None else neginf
    dt = x.dtype
    x = jnp.where(jnp.isnan(x), cast(nan, dt), x)
    x = jnp.where(jnp.isposinf(x), cast(posinf, dt), x)
    return jnp.where(jnp.isneginf(x), cast(neginf, dt), x)


# --- binary arithmetic --------------------------------------------------------


@lower(aten.add.Tensor, aten.add.Scalar)
def add(x, y, *, alpha=1):
    return _apply(lambda a, b, al: a + al * b, (x, y), DEFAULT, (alpha,))


@lower(aten.sub.Tensor, aten.sub.Scalar)
def sub(x, y, *, alpha=1):
    return _apply(lambda a, b, al: a - al * b, (x, y), DEFAULT, (alpha,))


@lower(aten.rsub.Tensor, aten.rsub.Scalar)
def rsub(x, y, *, alpha=1):
    return _apply(lambda a, b, al: b - al * a, (x, y), DEFAULT, (alpha,))


@lower(aten.mul.Tensor, aten.mul.Scalar)
def mul(x, y):
    def fn(a, b):
        return jnp.logical_and(a, b) if a.dtype == jnp.bool_ else a * b

    return _apply(fn, (x, y), DEFAULT)


def _div(x, y, rounding_mode: str | None):
    if rounding_mode is None:
        return _apply(jnp.true_divide, (x, y), INT_TO_FLOAT)
    if rounding_mode == "trunc":
        # lax.div truncates integers toward zero, like C (and torch).
        def trunc_div(a, b):
            if is_float(a.dtype):
                return jnp.trunc(a / b)
            return lax.div(*jnp.broadcast_arrays(a, b))

        return _apply(trunc_div, (x, y), DEFAULT)
    if rounding_mode == "floor":
        return _apply(jnp.floor_divide, (x, y), DEFAULT)
    raise ValueError(f"div: unknown rounding_mode {rounding_mode!r}")


@lower(aten.div.Tensor, aten.div.Scalar)
def div(x, y):
    return _div(x, y, None)


@lower(aten.div.Tensor_mode, aten.div.Scalar_mode)
def div_mode(x, y, *, rounding_mode: str | None = None):
    return _div(x, y, rounding_mode)


@lower(aten.floor_divide.default, aten.floor_divide.Scalar)
def floor_divide(x, y):
    return _div(x, y, "floor")


@lower(aten.remainder.Tensor, aten.remainder.Scalar, aten.remainder.Scalar_Tensor)
def remainder(x, y):
    return _apply(jnp.remainder, (x, y), DEFAULT)


@lower(aten.fmod.Tensor, aten.fmod.Scalar)
def fmod(x, y):
    return _apply(jnp.fmod, (x, y), DEFAULT)


@lower(aten.pow.Tensor_Scalar, special_scalars=transcendental.SPECIAL_EXPONENTS)
def pow_tensor_scalar(x, exponent):
    """``x ** exponent``; an exponent of ``SPECIAL_EXPONENTS`` arrives as a Python number (static) and a
    float32 ``x`` gets only its case, others take :func:`pow`'s path with the number traced as before."""
    if type(exponent) in (int, float):
        comp, res = promote(x, exponent, kind=DEFAULT)
        if comp == jnp.float32:
            return transcendental.special_power(cast(x, comp), float(exponent)).astype(res)
        # As a runtime scalar would arrive: weakly typed, of its Python type's default dtype.
        exponent = _convert_element_type(
            exponent, jax.dtypes.canonicalize_dtype(np.dtype(type(exponent))), weak_type=True
        )
    return pow(x, exponent)


@lower(aten.pow.Tensor_Tensor, aten.pow.Scalar)
def pow(x, y):
    comp, res = promote(x, y, kind=DEFAULT)
    if comp == jnp.float32 and is_weak_scalar(y) and not isinstance(y, (bool, int)):
        # A Python number exponent stays in double precision, as in PyTorch's CPU kernel
        # (x ** 0.3 for x near 1e30 differs by 8e-7 with the exponent rounded to float32).
        return transcendental.power(cast(x, comp), cast(y, jnp.float64)).astype(res)
    return _apply(transcendental.power, (x, y), DEFAULT)


@lower(aten.atan2.default)
def atan2(x, y):
    return _apply(jnp.arctan2, (x, y), INT_TO_FLOAT)


@lower(aten.hypot.default)
def hypot(x, y):
    return _apply(jnp.hypot, (x, y), DEFAULT)


@lower(aten.copysign.Tensor, aten.copysign.Scalar)
def copysign(x, y):
    return _apply(jnp.copysign, (x, y), INT_TO_FLOAT)


@lower(aten.xlogy.Tensor, aten.xlogy.Scalar_Self, aten.xlogy.Scalar_Other)
def xlogy(x, y):
    return _apply(transcendental.xlogy, (x, y), INT_TO_FLOAT)


@lower(aten.maximum.default)
def maximum(x, y):
    return _apply(jnp.maximum, (x, y), DEFAULT)


@lower(aten.minimum.default)
def minimum(x, y):
    return _apply(jnp.minimum, (x, y), DEFAULT)


@lower(aten.fmax.default)
def fmax(x, y):
    return _apply(jnp.fmax, (x, y), DEFAULT)


@lower(aten.fmin.default)
def fmin(x, y):
    return _apply(jnp.fmin, (x, y), DEFAULT)


def _clamp(x, lo, hi):
    def fn(a, mn, mx):
        if mn is not None:
            a = jnp.maximum(a, mn)
        if mx is not None:
            a = jnp.minimum(a, mx)  # torch: min > max gives max
        return a

    return _apply(fn, (x, lo, hi), DEFAULT)


@lower(aten.clamp.default, aten.clamp.Tensor)
def clamp(x, min=None, max=None):
    return _clamp(x, min, max)


@lower(aten.clamp_min.default, aten.clamp_min.Tensor)
def clamp_min(x, min):
    return _clamp(x, min, None)


@lower(aten.clamp_max.default, aten.clamp_max.Tensor)
def clamp_max(x, max):
    return _clamp(x, None, max)


@lower(aten.lerp.Scalar, aten.lerp.Tensor)
def lerp(x, end, weight):
    # torch's two-sided formula keeps lerp exact at weight 0 and 1.
    def fn(a, b, w):
        d = b - a
        return jnp.where(jnp.abs(w) < 0.5, a + w * d, b - d * (1 - w))

    return _apply(fn, (x, end), DEFAULT, (weight,))


@lower(aten.addcmul.default)
def addcmul(x, t1, t2, *, value=1):
    return _apply(lambda a, b, c, v: a + v * b * c, (x, t1, t2), DEFAULT, (value,))


@lower(aten.addcdiv.default)
def addcdiv(x, t1, t2, *, value=1):
    return _apply(lambda a, b, c, v: a + v * (b / c), (x, t1, t2), DEFAULT, (value,))


# --- comparisons and logic ----------------------------------------------------

for _name, _fn in [
    ("eq", jnp.equal),
    ("ne", jnp.not_equal),
    ("lt", jnp.less),
    ("le", jnp.less_equal),
    ("gt", jnp.greater),
    ("ge", jnp.greater_equal),
]:
    _packet = getattr(aten, _name)

    def _cmp(x, y, _fn=_fn):
        return _apply(_fn, (x, y), ALWAYS_BOOL)

    lower(_packet.Tensor, _packet.Scalar)(_cmp)


def _truthy(fn):
    return lambda a, b: fn(a != 0, b != 0)


for _name, _fn in [("logical_and", jnp.logical_and), ("logical_or", jnp.logical_or), ("logical_xor", jnp.logical_xor)]:
    lower(getattr(aten, _name).default)(lambda x, y, _fn=_fn: _apply(_truthy(_fn), (x, y), ALWAYS_BOOL))

for _name, _fn in [
    ("bitwise_and", jnp.bitwise_and),
    ("bitwise_or", jnp.bitwise_or),
    ("bitwise_xor", jnp.bitwise_xor),
    ("bitwise_left_shift", jnp.left_shift),
    ("bitwise_right_shift", jnp.right_shift),
]:
    _ovs = []
    # ``t << 2`` and ``t >> 1`` reach the dunder overloads, with the same semantics.
    for _packet_name in (_name, {"bitwise_left_shift": "__lshift__", "bitwise_right_shift": "__rshift__"}.get(_name)):
        if _packet_name is None:
            continue
        _packet = getattr(aten, _packet_name)
        _ovs += [
            getattr(_packet, o)
            for o in ("Tensor", "Tensor_Scalar", "Scalar", "Scalar_Tensor")
            if o in _packet.overloads()
        ]
    lower(*_ovs)(lambda x, y, _fn=_fn: _apply(_fn, (x, y), DEFAULT))


@lower(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def where(condition, x, y):
    return _apply(lambda a, b: jnp.where(condition, a, b), (x, y), Kind.NO_OPMATH)


@lower(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def masked_fill(x, mask, value):
    return jnp.where(mask, cast(value, x.dtype), x)


# --- activations and their backward ops ----------------------------------------

_SQRT2 = math.sqrt(2.0)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_KAPPA = 0.044715


def _normal_cdf(x):
    """Phi(x) = erfc(-x / sqrt 2) / 2 by the accurate float32 erfc (tpurec.dense.error_functions): PyTorch CPU's
    ``1 + erf`` cancels below about -3 (relative error 2e-5 at -3, 1.2e-2 at -5.3, and 0 from about -5.4 on),
    and XLA's erf is an approximation on a TPU."""
    return 0.5 * error_functions.erfc(-x / _SQRT2)


def _gelu(x, approximate: str):
    if approximate == "tanh":
        return 0.5 * x * (1 + transcendental.tanh(_SQRT_2_OVER_PI * (x + _KAPPA * x * x * x)))
    return x * _normal_cdf(x)


@lower(aten.gelu.default)
def gelu(x, *, approximate: str = "none"):
    return _apply(lambda a: _gelu(a, approximate), (x,), DEFAULT)


@lower(aten.gelu_backward.default)
def gelu_backward(grad, x, *, approximate: str = "none"):
    def fn(g, a):
        if approximate == "tanh":
            inner = _SQRT_2_OVER_PI * (a + _KAPPA * a * a * a)
            t = transcendental.tanh(inner)
            left = 0.5 * a
            right = 1 + t
            d_right = left * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * _KAPPA * a * a)
            return g * (0.5 * right + d_right)
        cdf = _normal_cdf(a)
        pdf = transcendental.exp(-0.5 * a * a) * _INV_SQRT_2PI
        return g * (cdf + a * pdf)

    return _apply(fn, (grad, x), DEFAULT)


@lower(aten.silu.default)
def silu(x):
    return _apply(lambda a: a * transcendental.sigmoid(a), (x,), DEFAULT)


@lower(aten.silu_backward.default)
def silu_backward(grad, x):
    def fn(g, a):
        s = transcendental.sigmoid(a)
        return g * s * (1 + a * (1 - s))

    return _apply(fn, (grad, x), DEFAULT)


@lower(aten.mish.default)
def mish(x):
    return _apply(lambda a: a * transcendental.tanh(transcendental.softplus(a)), (x,), DEFAULT)


@lower(aten.mish_backward.default)
def mish_backward(grad, x):
    def fn(g, a):
        t = transcendental.tanh(transcendental.softplus(a))
        return g * (t + a * transcendental.sigmoid(a) * (1 - t * t))

    return _apply(fn, (grad, x), DEFAULT)


@lower(aten.sigmoid_backward.default)
def sigmoid_backward(grad, y):
    return _apply(lambda g, o: g * (1 - o) * o, (grad, y), DEFAULT)


@lower(aten.tanh_backward.default)
def tanh_backward(grad, y):
    return _apply(lambda g, o: g * (1 - o * o), (grad, y), DEFAULT)


@lower(aten.threshold.default)
def threshold(x, threshold, value):
    return _apply(lambda a, t, v: jnp.where(a <= t, v, a), (x,), DEFAULT, (threshold, value))


@lower(aten.threshold_backward.default)
def threshold_backward(grad, x, threshold):
    return _apply(lambda g, a, t: jnp.where(a <= t, jnp.zeros((), g.dtype), g), (grad, x), DEFAULT, (threshold,))


@lower(aten.leaky_relu.default)
def leaky_relu(x, negative_slope=0.01):
    return _apply(lambda a, s: jnp.where(a > 0, a, a * s), (x,), DEFAULT, (negative_slope,))


@lower(aten.leaky_relu_backward.default)
def leaky_relu_backward(grad, x, negative_slope, self_is_result: bool):
    return _apply(lambda g, a, s: jnp.where(a > 0, g, g * s), (grad, x), DEFAULT, (negative_slope,))


@lower(aten.elu.default)
def elu(x, alpha=1, scale=1, input_scale=1):
    def fn(a, al, sc, isc):
        return jnp.where(a > 0, a * sc, transcendental.expm1(a * isc) * al * sc)

    return _apply(fn, (x,), DEFAULT, (alpha, scale, input_scale))


@lower(aten.elu_backward.default)
def elu_backward(grad, alpha, scale, input_scale, is_result: bool, self_or_result):
    def fn(g, a, al, sc, isc):
        if is_result:
            neg = g * isc * (a + al * sc)
        else:
            neg = g * isc * al * sc * transcendental.exp(a * isc)
        return jnp.where(a > 0, g * sc, neg)

    return _apply(fn, (grad, self_or_result), DEFAULT, (alpha, scale, input_scale))


@lower(aten.celu.default)
def celu(x, alpha=1.0):
    def fn(a, al):
        return jnp.where(a > 0, a, transcendental.expm1(a / al) * al)

    return _apply(fn, (x,), DEFAULT, (alpha,))


@lower(aten.softplus.default)
def softplus(x, beta=1, threshold=20):
    def fn(a, b, t):
        return jnp.where(a * b > t, a, transcendental.log1p(transcendental.exp(a * b)) / b)

    return _apply(fn, (x,), DEFAULT, (beta, threshold))


@lower(aten.softplus_backward.default)
def softplus_backward(grad, x, beta, threshold):
    def fn(g, a, b, t):
        z = transcendental.exp(a * b)
        return jnp.where(a * b > t, g, g * z / (z + 1))

    return _apply(fn, (grad, x), DEFAULT, (beta, threshold))


@lower(aten.hardtanh.default)
def hardtanh(x, min_val=-1, max_val=1):
    return _apply(lambda a, lo, hi: jnp.minimum(jnp.maximum(a, lo), hi), (x,), DEFAULT, (min_val, max_val))


@lower(aten.hardtanh_backward.default)
def hardtanh_backward(grad, x, min_val, max_val):
    def fn(g, a, lo, hi):
        return jnp.where((a <= lo) | (a >= hi), jnp.zeros((), g.dtype), g)

    return _apply(fn, (grad, x), DEFAULT, (min_val, max_val))


@lower(aten.hardsigmoid.default)
def hardsigmoid(x):
    return _apply(lambda a: jnp.clip(a + 3, 0, 6) / 6, (x,), DEFAULT)


@lower(aten.hardsigmoid_backward.default)
def hardsigmoid_backward(grad, x):
    return _apply(lambda g, a: jnp.where((a > -3) & (a < 3), g / 6, jnp.zeros((), g.dtype)), (grad, x), DEFAULT)


@lower(aten.hardswish.default)
def hardswish(x):
    return _apply(lambda a: a * jnp.clip(a + 3, 0, 6) / 6, (x,), DEFAULT)


@lower(aten.hardswish_backward.default)
def hardswish_backward(grad, x):
    def fn(g, a):
        return jnp.where(a < -3, jnp.zeros((), g.dtype), jnp.where(a <= 3, g * (a / 3 + 0.5), g))

    return _apply(fn, (grad, x), DEFAULT)


@lower(aten.logit.default)
def logit(x, eps=None):
    def fn(a, *e):
        if e:
            a = jnp.clip(a, e[0], 1 - e[0])
        return transcendental.log(a / (1 - a))

    return _apply(fn, (x,), INT_TO_FLOAT, () if eps is None else (eps,))


# --- copies and dtype conversion -------------------------------------------------


@lower(aten.clone.default)
def clone(x, *, memory_format=None):
    # jax arrays are immutable: a copy is the value itself.
    return x


@lower(aten._to_copy.default)
def to_copy(x, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None):
    if dtype is None:
        return x
    target = to_jax_dtype(dtype)
    if target == jnp.bool_:
        return x != 0
    return x.astype(target)


@lower(aten.fill.Scalar, aten.fill.Tensor)
def fill(x, value):
    return jnp.full(x.shape, cast(value, x.dtype))


@lower(aten.zero.default)
def zero(x):
    return jnp.zeros_like(x)


def _real_angle(x):
    # torch: pi for negative values, 0 otherwise (-0.0 included), NaN kept.
    # jnp.angle would give pi for -0.0 (it is atan2(0, x)).
    return jnp.where(jnp.isnan(x), x, jnp.where(x < 0, jnp.asarray(math.pi, x.dtype), jnp.zeros_like(x)))


@lower(aten.angle.default)
def angle(x):
    if jnp.iscomplexobj(x):
        return jnp.angle(x)
    return _apply(_real_angle, (x,), INT_TO_FLOAT)


@lower(torch.ops.prims.frexp.default, aten.frexp.Tensor)
def frexp(x):
    mantissa, exponent = jnp.frexp(x)
    # torch (like C's frexp) gives exponent 0 for inf and NaN, and keeps them as the mantissa.
    finite = jnp.isfinite(x)
    return jnp.where(finite, mantissa, x), jnp.where(finite, exponent, 0).astype(jnp.int32)


@lower(torch.ops.prims.nextafter.default, aten.nextafter.default)
def nextafter(x, y):
    return jnp.nextafter(x, y.astype(x.dtype))
