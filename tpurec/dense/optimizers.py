"""The fused optimizer kernels: ``torch.optim.{Adam, AdamW, SGD, Adagrad}(fused=True)``.

PyTorch lets a PrivateUse1 device take an optimizer's ``fused=True`` path: one
``_fused_adam_`` (``_fused_adamw_``, ``_fused_sgd_``, ``_fused_adagrad_``) call updates every
parameter of a device and dtype, instead of a dozen ``_foreach_*`` calls. That is one op to
dispatch and record per step instead of a dozen, which is what a host-bound step saves.

Each lowering here is the functional variant (``_fused_adam`` ...): it returns the new
values of everything the in-place op writes, in the schema's order (parameters, gradients,
then the optimizer's state), and ``tpurec.core.mutating`` writes them back. The arithmetic is
that of PyTorch's CPU kernels: bias corrections from the (already incremented) step, the
gradient unscaled by ``grad_scale`` and written back so, ``found_inf`` skipping the whole
update, and reduced-precision parameters updated in float32 and rounded once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from tpurec.dense.registry import lower

aten = torch.ops.aten


def _wide():
    # Step-dependent scalars (bias corrections, Adagrad's decayed rate) in double, as PyTorch's
    # kernels compute them: in float32, 1 - 0.999**step loses four digits to cancellation.
    return jnp.float64 if jax.config.read("jax_enable_x64") else jnp.float32


def _math_dtype(dtype):
    # float16/bfloat16 parameters are updated in float32, as PyTorch's kernels do (opmath).
    return jnp.float32 if dtype in (jnp.float16, jnp.bfloat16) else dtype


def _unscaled(grads: list, grad_scale) -> list:
    if grad_scale is None:
        return list(grads)
    return [(g.astype(_math_dtype(g.dtype)) / grad_scale.astype(_math_dtype(g.dtype))).astype(g.dtype) for g in grads]


def _decayed(weight_decay, plain, decayed):
    """``decayed`` where ``weight_decay`` is nonzero, else ``plain`` exactly (it is a runtime number)."""
    return jnp.where(weight_decay != 0, decayed, plain)


def _skipped(found_inf, old: list, new: list) -> list:
    """``new``, or ``old`` where ``found_inf`` says the step had an inf or nan (GradScaler)."""
    if found_inf is None:
        return new
    skip = jnp.reshape(found_inf, ()) == 1.0
    return [jnp.where(skip, o, n) for o, n in zip(old, new)]


def _adam(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1, beta2,
          weight_decay, eps, amsgrad, maximize, grad_scale, found_inf, decoupled):  # fmt: skip
    unscaled = _unscaled(grads, grad_scale)
    wide = _wide()
    rate = jnp.asarray(lr).reshape(()).astype(wide)
    new_params, new_avgs, new_sqs, new_maxes = [], [], [], []
    for k, (p, g) in enumerate(zip(params, unscaled)):
        math = _math_dtype(p.dtype)
        p32, g32 = p.astype(math), g.astype(math)
        step = jnp.reshape(state_steps[k], ()).astype(wide)
        if maximize:
            g32 = -g32
        if decoupled:
            p32 = _decayed(weight_decay, p32, p32 * (1 - rate * weight_decay).astype(math))
        else:
            g32 = _decayed(weight_decay, g32, g32 + p32 * weight_decay)
        avg = exp_avgs[k].astype(math) * beta1 + g32 * (1 - beta1)
        sq = exp_avg_sqs[k].astype(math) * beta2 + g32 * g32 * (1 - beta2)
        step_size = (rate / (1 - beta1**step)).astype(math)
        correction2_sqrt = jnp.sqrt(1 - beta2**step).astype(math)
        if amsgrad:
            peak = jnp.maximum(max_exp_avg_sqs[k].astype(math), sq)
            new_maxes.append(peak.astype(max_exp_avg_sqs[k].dtype))
            denominator = jnp.sqrt(peak) / correction2_sqrt + eps
        else:
            denominator = jnp.sqrt(sq) / correction2_sqrt + eps
        p32 = p32 - step_size * avg / denominator
        new_params.append(p32.astype(p.dtype))
        new_avgs.append(avg.astype(exp_avgs[k].dtype))
        new_sqs.append(sq.astype(exp_avg_sqs[k].dtype))
    maxes = list(max_exp_avg_sqs)
    return (
        _skipped(found_inf, list(params), new_params),
        _skipped(found_inf, list(grads), unscaled),
        _skipped(found_inf, list(exp_avgs), new_avgs),
        _skipped(found_inf, list(exp_avg_sqs), new_sqs),
        _skipped(found_inf, maxes, new_maxes) if amsgrad else maxes,
    )


@lower(aten._fused_adam.default, aten._fused_adam.tensor_lr)
def fused_adam(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1, beta2,
               weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None):  # fmt: skip
    return _adam(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1, beta2,
                 weight_decay, eps, amsgrad, maximize, grad_scale, found_inf, decoupled=False)  # fmt: skip


@lower(aten._fused_adamw.default, aten._fused_adamw.tensor_lr)
def fused_adamw(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1, beta2,
                weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None):  # fmt: skip
    return _adam(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1, beta2,
                 weight_decay, eps, amsgrad, maximize, grad_scale, found_inf, decoupled=True)  # fmt: skip


@lower(aten._fused_sgd.default, aten._fused_sgd.tensor_lr)
def fused_sgd(self, grads, momentum_buffer_list, *, weight_decay, momentum, lr, dampening, nesterov, maximize,
              is_first_step, grad_scale=None, found_inf=None):  # fmt: skip
    unscaled = _unscaled(grads, grad_scale)
    new_params, new_buffers = [], []
    for k, (p, g) in enumerate(zip(self, unscaled)):
        math = _math_dtype(p.dtype)
        p32, g32 = p.astype(math), g.astype(math)
        if maximize:
            g32 = -g32
        g32 = _decayed(weight_decay, g32, g32 + p32 * weight_decay)
        if momentum_buffer_list:  # SGD passes none without momentum
            buffer = g32 if is_first_step else momentum_buffer_list[k].astype(math) * momentum + g32 * (1 - dampening)
            new_buffers.append(buffer.astype(momentum_buffer_list[k].dtype))
            g32 = g32 + buffer * momentum if nesterov else buffer
        new_params.append((p32 - g32 * jnp.asarray(lr, math).reshape(())).astype(p.dtype))
    buffers = list(momentum_buffer_list)
    return (
        _skipped(found_inf, list(self), new_params),
        _skipped(found_inf, list(grads), unscaled),
        _skipped(found_inf, buffers, new_buffers) if buffers else buffers,
    )


def _adagrad(params, grads, state_sums, state_steps, lr, lr_decay, weight_decay, eps, maximize, grad_scale,
             found_inf):  # fmt: skip
    unscaled = _unscaled(grads, grad_scale)
    new_params, new_sums = [], []
    for k, (p, g) in enumerate(zip(params, unscaled)):
        math = _math_dtype(p.dtype)
        p32, g32 = p.astype(math), g.astype(math)
        step = jnp.reshape(state_steps[k], ()).astype(_wide())
        if maximize:
            g32 = -g32
        g32 = _decayed(weight_decay, g32, g32 + p32 * weight_decay)
        total = state_sums[k].astype(math) + g32 * g32
        rate = (jnp.asarray(lr).reshape(()).astype(_wide()) / (1 + (step - 1) * lr_decay)).astype(math)
        new_params.append((p32 - rate * g32 / (jnp.sqrt(total) + eps)).astype(p.dtype))
        new_sums.append(total.astype(state_sums[k].dtype))
    return (
        _skipped(found_inf, list(params), new_params),
        _skipped(found_inf, list(grads), unscaled),
        _skipped(found_inf, list(state_sums), new_sums),
    )


@lower(aten._fused_adagrad.default)
def fused_adagrad(self, grads, state_sums, state_steps, *, lr, lr_decay, weight_decay, eps, maximize,
                  grad_scale=None, found_inf=None):  # fmt: skip
    # This overload lists the steps among what it writes; they come back unchanged (the
    # optimizer counts them before the call).
    outs = _adagrad(self, grads, state_sums, state_steps, lr, lr_decay, weight_decay, eps, maximize, grad_scale,
                    found_inf)  # fmt: skip
    return (*outs, list(state_steps))


@lower(aten._fused_adagrad.tensor_lr)
def fused_adagrad_tensor_lr(self, grads, state_sums, state_steps, *, lr, lr_decay, weight_decay, eps, maximize,
                            grad_scale=None, found_inf=None):  # fmt: skip
    return _adagrad(self, grads, state_sums, state_steps, lr, lr_decay, weight_decay, eps, maximize, grad_scale,
                    found_inf)  # fmt: skip
