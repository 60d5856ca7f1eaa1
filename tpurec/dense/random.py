"""Random ops. Each receives a fresh ``jax.random`` key as ``key=`` (registry.py):
results follow torch's distributions, not its CPU generator's numbers, and are
deterministic given the key. ``generator`` arguments are ignored: the runtime
owns the key stream.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import torch

from tpurec.dense._util import cast, default_float
from tpurec.dense._util import acc_dtype as _acc
from tpurec.dense.registry import lower, to_jax_dtype
from tpurec.dense import transcendental

aten = torch.ops.aten


def _uniform(key, shape, dtype, lo=0.0, hi=1.0):
    acc = _acc(dtype)
    u = jax.random.uniform(key, tuple(shape), acc)
    return (cast(lo, acc) + u * (cast(hi, acc) - cast(lo, acc))).astype(dtype)


def _normal(key, shape, dtype, mean=0.0, std=1.0):
    acc = _acc(dtype)
    z = jax.random.normal(key, tuple(shape), acc)
    return (cast(mean, acc) + z * cast(std, acc)).astype(dtype)


def _dt(dtype, fallback) -> jnp.dtype:
    return to_jax_dtype(dtype) if dtype is not None else jnp.dtype(fallback)


@lower(aten.uniform.default, random=True)
def uniform(x, from_=0.0, to=1.0, *, generator=None, key):
    return _uniform(key, x.shape, x.dtype, from_, to)


@lower(aten.normal_functional.default, random=True)
def normal_functional(x, mean=0.0, std=1.0, *, generator=None, key):
    return _normal(key, x.shape, x.dtype, mean, std)


@lower(aten.normal.Tensor_float, aten.normal.float_Tensor, aten.normal.Tensor_Tensor, random=True)
def normal(mean, std=1.0, *, generator=None, key):
    shape = jnp.broadcast_shapes(jnp.shape(mean), jnp.shape(std))
    arrays = [v for v in (mean, std) if not isinstance(v, (int, float)) and not getattr(v, "weak_type", False)]
    dt = jnp.result_type(*arrays) if arrays else default_float()
    return _normal(key, shape, dt, mean, std)


@lower(aten.normal.float_float, random=True)
def normal_float_float(
    mean, std, size: Sequence[int], *, generator=None, dtype=None, layout=None, device=None, pin_memory=None, key
):
    return _normal(key, size, _dt(dtype, default_float()), mean, std)


@lower(aten.bernoulli.default, aten.bernoulli.Tensor, random=True)
def bernoulli(x, p=None, *, generator=None, key):
    prob = x if p is None else p
    acc = _acc(x.dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.float64
    u = jax.random.uniform(key, x.shape, acc)
    return (u < prob.astype(acc)).astype(x.dtype)


@lower(aten.bernoulli.p, random=True)
def bernoulli_p(x, p, *, generator=None, key):
    u = jax.random.uniform(key, x.shape, jnp.float64)
    return (u < cast(p, jnp.float64)).astype(x.dtype)


def _int_range(key, shape, dtype, lo: int, hi: int):
    return jax.random.randint(key, tuple(shape), lo, hi, dtype=jnp.int64).astype(dtype)


def _default_high(dtype) -> int:
    """torch.random_'s upper bound: 2**mantissa+1 for floats, the max for ints."""
    dt = jnp.dtype(dtype)
    if dt == jnp.bool_:
        return 2
    if jnp.issubdtype(dt, jnp.inexact):
        return 2 ** (jnp.finfo(dt).nmant + 1) + 1
    return int(jnp.iinfo(dt).max)  # exclusive here: a one-value bias, like torch's own [0, max)


@lower(aten.random.default, random=True)
def random_(x, *, generator=None, key):
    return _int_range(key, x.shape, x.dtype, 0, _default_high(x.dtype))


@lower(aten.random.to, random=True)
def random_to(x, to: int, *, generator=None, key):
    return _int_range(key, x.shape, x.dtype, 0, to)


@lower(getattr(aten.random, "from"), random=True)
def random_from(x, from_: int, to: int | None, *, generator=None, key):
    return _int_range(key, x.shape, x.dtype, from_, _default_high(x.dtype) if to is None else to)


@lower(aten.rand.default, aten.rand.generator, random=True)
def rand(size: Sequence[int], *, generator=None, dtype=None, layout=None, device=None, pin_memory=None, key):
    return _uniform(key, size, _dt(dtype, default_float()))


@lower(aten.randn.default, aten.randn.generator, random=True)
def randn(size: Sequence[int], *, generator=None, dtype=None, layout=None, device=None, pin_memory=None, key):
    return _normal(key, size, _dt(dtype, default_float()))


@lower(aten.randint.default, aten.randint.generator, random=True)
def randint(
    high: int, size: Sequence[int], *, generator=None, dtype=None, layout=None, device=None, pin_memory=None, key
):
    return _int_range(key, size, _dt(dtype, jnp.int64), 0, high)


@lower(aten.randint.low, aten.randint.low_generator, random=True)
def randint_low(
    low: int,
    high: int,
    size: Sequence[int],
    *,
    generator=None,
    dtype=None,
    layout=None,
    device=None,
    pin_memory=None,
    key,
):
    return _int_range(key, size, _dt(dtype, jnp.int64), low, high)


@lower(aten.rand_like.default, aten.rand_like.generator, random=True)
def rand_like(x, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None, key):
    return _uniform(key, x.shape, _dt(dtype, x.dtype))


@lower(aten.randn_like.default, aten.randn_like.generator, random=True)
def randn_like(x, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None, key):
    return _normal(key, x.shape, _dt(dtype, x.dtype))


@lower(aten.randint_like.default, aten.randint_like.generator, random=True)
def randint_like(
    x, high: int, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None, key
):
    return _int_range(key, x.shape, _dt(dtype, x.dtype), 0, high)


@lower(aten.randint_like.low_dtype, aten.randint_like.low_generator_dtype, random=True)
def randint_like_low(
    x,
    low: int,
    high: int,
    *,
    generator=None,
    dtype=None,
    layout=None,
    device=None,
    pin_memory=None,
    memory_format=None,
    key,
):
    return _int_range(key, x.shape, _dt(dtype, x.dtype), low, high)


@lower(aten.randperm.default, aten.randperm.generator, random=True)
def randperm(n: int, *, generator=None, dtype=None, layout=None, device=None, pin_memory=None, key):
    return jax.random.permutation(key, n).astype(_dt(dtype, jnp.int64))


@lower(aten.multinomial.default, random=True)
def multinomial(probs, num_samples: int, replacement: bool = False, *, generator=None, key):
    """``num_samples`` category indices per row of (unnormalised) ``probs`` (C,) or (N, C), as int64.

    Without replacement: the Gumbel top-k trick (the k largest of log p + Gumbel noise are a
    sample of k distinct categories drawn in proportion to p, one after another). Where a row has
    fewer than ``num_samples`` nonzero categories CPU raises; here (inside a compiled program) the
    remaining draws are zero-probability categories.
    """
    acc = _acc(probs.dtype)
    logits = transcendental.log(probs.astype(acc))
    if replacement:  # each draw the largest of log p + its own Gumbel noise
        noisy = logits[..., None, :] + _gumbel(key, logits.shape[:-1] + (num_samples,) + logits.shape[-1:], acc)
        return jnp.argmax(noisy, axis=-1).astype(jnp.int64)
    noisy = logits + _gumbel(key, logits.shape, acc)
    return jax.lax.top_k(noisy, num_samples)[1].astype(jnp.int64)


def _gumbel(key, shape, dtype):
    """Standard Gumbel noise -log(-log(u)) with accurate float32 logarithms (jax.random.gumbel's are
    approximated on a TPU)."""
    u = jax.random.uniform(key, shape, dtype, minval=jnp.finfo(dtype).tiny, maxval=1.0)
    return -transcendental.log(-transcendental.log(u))


@lower(aten.rrelu_with_noise_functional.default, random=True)
def rrelu_with_noise_functional(x, noise, lower=0.125, upper=1.0 / 3.0, training: bool = False, *, generator=None, key):
    """Randomized leaky ReLU, and the slopes it used (``noise``; 1 where x > 0).

    Training: each x <= 0 gets its own slope drawn from U(lower, upper). Evaluation: the
    mean slope (lower + upper) / 2, as ``leaky_relu``, and ``noise`` is returned unchanged.
    """
    if not training:
        slope = (lower + upper) / 2
        return jnp.where(x > 0, x, x * jnp.asarray(slope, x.dtype)), noise
    slopes = _uniform(key, x.shape, x.dtype, lower, upper)
    negative = x <= 0
    return jnp.where(negative, x * slopes, x), jnp.where(negative, slopes, jnp.ones((), x.dtype)).astype(noise.dtype)
