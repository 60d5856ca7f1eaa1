"""CTC loss (``_ctc_loss``) and its backward: the forward (alpha) recursion as a ``lax.scan``.

``log_alpha`` is (N, T, 2 S + 1) over the blank-extended targets; a batch element's
recursion stops at its input length. The backward is ATen's formula: the derivative of
the negative log likelihood with respect to ``log_probs`` (here ``jax.vjp`` of the
forward) plus ``exp(log_probs)`` times the incoming gradient for t < input length, i.e.
the gradient as if through the ``log_softmax`` that produced ``log_probs``, as on CPU
and CUDA; zero past the input length; for an infinite loss zero with ``zero_infinity``,
else NaN (as on CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from tpurec.dense.registry import lower
from tpurec.dense import transcendental

aten = torch.ops.aten

_NEG_INF = -jnp.inf


def _logsumexp(*terms):
    """log(sum(exp(terms))) that is -inf (with zero gradient, not NaN) when every term is -inf."""
    stacked = jnp.stack(terms)
    top = stacked.max(axis=0)
    finite_top = jnp.where(jnp.isfinite(top), top, 0)
    total = transcendental.exp(stacked - finite_top).sum(axis=0)
    positive = total > 0
    return jnp.where(positive, finite_top + transcendental.log(jnp.where(positive, total, 1)), _NEG_INF)


def _padded_targets(targets, target_lengths):
    """Targets as (N, S): already so, or cut from the concatenated 1-D form (S = its length, an upper bound)."""
    if targets.ndim == 2:
        return targets
    starts = jnp.cumsum(target_lengths) - target_lengths
    span = max(targets.shape[0], 1)
    index = jnp.clip(starts[:, None] + jnp.arange(span)[None, :], 0, max(targets.shape[0] - 1, 0))
    return targets[index] if targets.shape[0] else jnp.zeros((target_lengths.shape[0], 1), targets.dtype)


def _forward(log_probs, targets, input_lengths, target_lengths, blank: int):
    """(nll (N,), log_alpha (N, T, L)) for log_probs (T, N, C)."""
    steps, batch, _ = log_probs.shape
    input_lengths = jnp.asarray(input_lengths).astype(jnp.int32).reshape(batch)
    target_lengths = jnp.asarray(target_lengths).astype(jnp.int32).reshape(batch)
    labels = _padded_targets(targets, target_lengths).astype(jnp.int32)
    length = 2 * labels.shape[1] + 1
    s = jnp.arange(length)
    extended = jnp.where(s[None, :] % 2 == 0, blank, labels[:, jnp.clip((s - 1) // 2, 0, labels.shape[1] - 1)])
    previous2 = jnp.concatenate([jnp.full((batch, 2), -1, jnp.int32), extended[:, :-2]], axis=1)
    may_skip = (s[None, :] >= 2) & (extended != blank) & (extended != previous2)
    emissions = jnp.take_along_axis(log_probs, jnp.broadcast_to(extended[None], (steps, batch, length)), axis=2)
    start = jnp.full((batch, length), _NEG_INF, log_probs.dtype)
    start = start.at[:, 0].set(emissions[0, :, 0])
    if length > 1:
        start = start.at[:, 1].set(jnp.where(target_lengths > 0, emissions[0, :, 1], _NEG_INF))

    def step(alpha, inputs):
        t, emission = inputs
        shift1 = jnp.concatenate([jnp.full((batch, 1), _NEG_INF, alpha.dtype), alpha[:, :-1]], axis=1)
        shift2 = jnp.concatenate([jnp.full((batch, 2), _NEG_INF, alpha.dtype), alpha[:, :-2]], axis=1)
        new = _logsumexp(alpha, shift1, jnp.where(may_skip, shift2, _NEG_INF)) + emission
        new = jnp.where((t < input_lengths)[:, None], new, alpha)  # past its input: frozen
        return new, new

    if steps > 1:
        final, history = jax.lax.scan(step, start, (jnp.arange(1, steps), emissions[1:]))
        log_alpha = jnp.concatenate([start[None], history], axis=0)
    else:
        final, log_alpha = start, start[None]
    end = 2 * target_lengths
    last = jnp.take_along_axis(final, end[:, None], axis=1)[:, 0]
    before = jnp.take_along_axis(final, jnp.maximum(end - 1, 0)[:, None], axis=1)[:, 0]
    before = jnp.where(target_lengths > 0, before, _NEG_INF)
    nll = -_logsumexp(last, before)
    return nll, jnp.swapaxes(log_alpha, 0, 1)


def _batched(log_probs):
    return log_probs[:, None] if log_probs.ndim == 2 else log_probs


@lower(aten._ctc_loss.default, aten._ctc_loss.Tensor)
def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank: int = 0, zero_infinity: bool = False):
    unbatched = log_probs.ndim == 2
    if unbatched:
        targets = targets[None] if targets.ndim == 1 else targets
    nll, log_alpha = _forward(_batched(log_probs), targets, input_lengths, target_lengths, blank)
    if zero_infinity:
        nll = jnp.where(jnp.isinf(nll), jnp.zeros((), nll.dtype), nll)
    return (nll[0], log_alpha[0]) if unbatched else (nll, log_alpha)


@lower(aten._ctc_loss_backward.default, aten._ctc_loss_backward.Tensor)
def ctc_loss_backward(
    grad,
    log_probs,
    targets,
    input_lengths,
    target_lengths,
    neg_log_likelihood,
    log_alpha,
    blank: int,
    zero_infinity: bool = False,
):
    unbatched = log_probs.ndim == 2
    if unbatched:
        targets = targets[None] if targets.ndim == 1 else targets
    lp = _batched(log_probs)
    nll, pullback = jax.vjp(lambda x: _forward(x, targets, input_lengths, target_lengths, blank)[0], lp)
    upstream = grad.reshape(-1).astype(lp.dtype)
    (pure,) = pullback(upstream)
    steps, batch = lp.shape[:2]
    inside = jnp.arange(steps)[:, None] < jnp.asarray(input_lengths).astype(jnp.int32).reshape(1, batch)
    out = jnp.where(
        inside[:, :, None], pure + transcendental.exp(lp) * upstream[None, :, None], jnp.zeros((), lp.dtype)
    )
    # An infinite loss (no alignment fits): zero with zero_infinity, else NaN, as CPU's formula gives.
    impossible = jnp.isinf(nll)[None, :, None]
    out = jnp.where(impossible, jnp.zeros((), lp.dtype) if zero_infinity else jnp.nan, out)
    return out[:, 0] if unbatched else out
