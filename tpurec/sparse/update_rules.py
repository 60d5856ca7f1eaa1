"""The fused embedding optimizers' update rules, each declared once.

An :class:`UpdateRule` says what an embedding optimizer is: its name, its slots (the
optimizer state kept per table), its hyperparameters, and the math that updates the
touched rows. Everything else is generated from it: the op
``torch.ops.tpurec.sparse_dense_matmul_grad_with_<name>`` (schema, argument checks, fake
kernel, CPU kernel and lowering, in :mod:`tpurec.sparse.ops`) and each kernel family's
entry point (:mod:`tpurec.sparse.kernels`), which supplies only how rows are gathered,
reduced and written. The user-facing config (:class:`tpurec.sparse.EmbeddingOptimizer`)
names its rule.

The row math follows FBGEMM's CPU kernels: the gradient, the weights and the slots are
in the table's accumulator dtype (float32 for float16/bfloat16/float32 tables) and only
the new weights are rounded back to the table's dtype.

Example (SGD with heavy-ball momentum on the touched rows)::

    def momentum_rows(g, w, m, *, learning_rate, momentum, dtype):
        m = momentum * m + g
        return (w - learning_rate * m).astype(dtype), m

    SGD_MOMENTUM = UpdateRule(
        name="sgd_momentum",
        summary="SGD with momentum: m = mu m + g; w -= lr m",
        slots=(Slot("momentum1", "element"),),
        hyperparameters=("learning_rate", "momentum"),
        rows=momentum_rows,
    )
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Literal

import jax.numpy as jnp

__all__ = [
    "Slot",
    "UpdateRule",
    "RULES",
    "rule_of",
    "register",
    "row_mean",
    "bias_correction",
    "SGD",
    "ADAGRAD",
    "ROWWISE_ADAGRAD",
    "ADAM",
]

_PREFIX = "sparse_dense_matmul_grad_with_"


@dataclasses.dataclass(frozen=True)
class Slot:
    """One optimizer state tensor per table.

    Attributes:
        name: its name in the modules' buffers and state dicts (``momentum1``).
        kind: ``"element"`` (``[rows, dim]``, like the table) or ``"row"`` (``[rows]``).
        argument: its argument name in the op's schema (default: ``name``).
    """

    name: str
    kind: Literal["element", "row"]
    argument: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("element", "row"):
            raise ValueError(f"slot {self.name!r}: kind must be 'element' or 'row', got {self.kind!r}")
        if not self.argument:
            object.__setattr__(self, "argument", self.name)


@dataclasses.dataclass(frozen=True)
class UpdateRule:
    """An embedding optimizer's update of the rows a batch touched.

    Attributes:
        name: lower-case identifier; the gradient op is ``sparse_dense_matmul_grad_with_<name>``.
        summary: one line for the generated docstrings.
        slots: the optimizer state, in the op's argument order.
        hyperparameters: the op's float keyword arguments, in schema order (``step``, if
            present, is the update number counted from 1).
        rows: ``rows(g, w, *slots, dtype=, **hyperparameters) -> (w, *slots)`` on the touched
            rows: ``g`` and ``w`` are ``[n, dim]``, an element slot ``[n, dim]``, a row slot
            ``[n]`` (or ``[n, 1]``: write row reductions with ``keepdims`` and reshape to the
            slot's shape); all in the accumulator dtype. Returns the new weights in ``dtype``
            (the table's) and the new slots. Pure ``jax.numpy``: it runs inside XLA programs
            and Pallas kernels. A rule that reduces over each row's elements takes the keyword
            ``row_mean`` (default :func:`row_mean`) and reduces only with it, and reshapes
            per-row values with ``reshape(g.shape[0], -1)``: kernels that keep several rows
            in one 128-lane line (:func:`tpurec.sparse.kernels.tensorcore.rows_per_line`) call
            it on ``[lines, 128]`` arrays, each row slot given per element, with a mean over
            each row's lanes. A rule may also take the keyword ``spread`` (default None: reshape
            per-row values with ``reshape(g.shape[0], -1)``): when given, a row slot arrives as
            one value a row in a kernel's own order, ``row_mean`` returns its values in that
            shape and order, and ``spread(x)`` turns such per-row values into values broadcastable
            against ``g`` (each row's value on its elements); the row math on per-row values then
            runs once a row instead of once an element.
        half_tables: whether float16/bfloat16 tables may use it (FBGEMM has CPU kernels to follow).
    """

    name: str
    summary: str
    slots: tuple[Slot, ...]
    hyperparameters: tuple[str, ...]
    rows: Callable
    half_tables: bool = True

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9_]*", self.name):
            raise ValueError(f"update rule name {self.name!r}: use lower-case letters, digits and _")
        if "learning_rate" not in self.hyperparameters:
            raise ValueError(f"update rule {self.name!r}: its hyperparameters must include learning_rate")

    @property
    def op_name(self) -> str:
        """The gradient op's name (``sparse_dense_matmul_grad_with_<name>``)."""
        return _PREFIX + self.name

    def schema(self) -> str:
        """The op's torch schema (after its name)."""
        csr = "Tensor row_pointers, Tensor embedding_ids, Tensor sample_ids, Tensor gains"
        tensors = ", ".join(f"Tensor {s.argument}" for s in self.slots)
        floats = ", ".join(f"float {h}" for h in self.hyperparameters)
        outs = ", ".join(["Tensor"] * (1 + len(self.slots)))
        returns = f"({outs})" if self.slots else "Tensor"
        state = f", {tensors}" if tensors else ""
        return f"({csr}, Tensor grad_output, Tensor table{state}, *, {floats}) -> {returns}"


def _round_update(update, w, dtype):
    """``update`` as FBGEMM's CPU kernels apply it to a ``dtype`` weight with ``w -= update``.

    The right-hand side is converted to the weight's type before the subtraction
    (C++ ``at::Half -= float``), so a float16 weight sees the update rounded to float16
    first; for a float32 weight both casts are exact.
    """
    return w - update.astype(dtype).astype(w.dtype)


def _sgd_rows(g, w, *, learning_rate, dtype):
    return (_round_update(learning_rate * g, w, dtype).astype(dtype),)


def _adagrad_rows(g, w, m, *, learning_rate, eps, dtype):
    m = m + g * g
    return _round_update(learning_rate * g / (jnp.sqrt(m) + eps), w, dtype).astype(dtype), m


def row_mean(x):
    """The mean of each row of ``x`` (``[n, dim]`` -> ``[n, 1]``): the rules' default row reduction."""
    return jnp.mean(x, axis=1, keepdims=True)


def _rowwise_adagrad_rows(g, w, m, *, learning_rate, eps, weight_decay, dtype, row_mean=row_mean, spread=None):
    # FBGEMM's form (L2 weight decay): the decay enters the accumulator through the
    # gradient and the weight through a correction factor, and the new weight is one
    # float32 expression rounded once to the table's dtype.
    decayed = g + weight_decay * w
    m = m + row_mean(decayed * decayed).reshape(m.shape)
    multiplier = learning_rate / (jnp.sqrt(m) + eps)
    multiplier = multiplier.reshape(g.shape[0], -1) if spread is None else spread(multiplier)
    correction = 1.0 - multiplier * weight_decay
    return (correction * w - g * multiplier).astype(dtype), m


def bias_correction(beta, step):
    """``1 - beta**step`` within a few float32 ulps, for Adam's bias corrections.

    ``1 - beta**step`` in float32 loses digits to cancellation (827 ulps at ``beta = 0.9999``,
    ``step = 2`` where pow is correctly rounded), and a TPU's float32 ``pow``, ``exp`` and ``log``
    are approximations: on a TPU v5e, Adam's table after a few steps differed from the CPU's by
    2e-6, and ``-expm1(step * log1p(beta - 1))`` was thousands of ulps off there. So the correction
    is built from its own recurrences, with float32 products and sums only (correctly rounded on
    every platform, in XLA and in Pallas kernels): with ``A(a) = 1 - beta**a``,
    ``A(2a) = A(a) (2 - A(a))`` and ``A(a + b) = A(a) + A(b) (1 - A(a))``, each a sum of positive
    terms, over the bits of ``step`` (below 2**24).

    Args:
        beta: the decay rate in [0, 1], a Python float or a float32 scalar array.
        step: the step, a whole number from 1 (a Python number or a float32 scalar array).

    Example::

        bias_correction(0.999, jnp.float32(1))  # 0.001 (to float32's precision)
    """
    # A Python float beta stays a double until 1 - beta, as the rules' own (1 - beta) does.
    power_bit = jnp.asarray(1.0 - beta, jnp.float32)  # 1 - beta**(2**k)
    whole = jnp.asarray(step, jnp.float32).astype(jnp.int32)
    correction = jnp.zeros_like(power_bit)  # 1 - beta**(step's bits below k)
    for k in range(24):
        take = ((whole >> k) & 1) == 1
        correction = jnp.where(take, correction + power_bit * (1.0 - correction), correction)
        power_bit = power_bit * (2.0 - power_bit)
    return correction


def _adam_rows(g, w, m1, m2, *, learning_rate, beta1, beta2, eps, weight_decay, step, dtype):
    m1 = beta1 * m1 + (1.0 - beta1) * g
    m2 = beta2 * m2 + (1.0 - beta2) * g * g
    m1_hat = m1 / bias_correction(beta1, step)
    m2_hat = m2 / bias_correction(beta2, step)
    return (w - learning_rate * (m1_hat / (jnp.sqrt(m2_hat) + eps) + weight_decay * w)).astype(dtype), m1, m2


SGD = UpdateRule("sgd", "SGD (FBGEMM EXACT_SGD): w -= lr * g", (), ("learning_rate",), _sgd_rows)
ADAGRAD = UpdateRule(
    "adagrad",
    "Adagrad (FBGEMM EXACT_ADAGRAD): m += g**2; w -= lr * g / (sqrt(m) + eps)",
    (Slot("momentum1", "element", "accumulator"),),
    ("learning_rate", "eps"),
    _adagrad_rows,
)
ROWWISE_ADAGRAD = UpdateRule(
    "rowwise_adagrad",
    "Row-wise Adagrad (FBGEMM EXACT_ROWWISE_ADAGRAD, L2 weight decay): g += wd * w; m += mean(g**2); "
    "w -= lr * g / (sqrt(m) + eps), one accumulator value per row",
    (Slot("momentum1", "row", "accumulator"),),
    ("learning_rate", "eps", "weight_decay"),
    _rowwise_adagrad_rows,
)
ADAM = UpdateRule(
    "adam",
    "Lazy Adam on the touched rows (FBGEMM ADAM; step counts from 1): m1 = b1 m1 + (1-b1) g; "
    "m2 = b2 m2 + (1-b2) g**2; w -= lr * (m1/(1-b1**t) / (sqrt(m2/(1-b2**t)) + eps) + wd * w)",
    (Slot("momentum1", "element"), Slot("momentum2", "element")),
    ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "step"),
    _adam_rows,
    half_tables=False,  # FBGEMM's GPU Adam rounds stochastically; there is no CPU kernel to follow
)

RULES: dict[str, UpdateRule] = {r.op_name: r for r in (SGD, ADAGRAD, ROWWISE_ADAGRAD, ADAM)}
"""Gradient op name -> its rule: the built-in ones and those added with :func:`register`."""

_listeners: list[Callable[[UpdateRule], None]] = []


def rule_of(op_name: str) -> UpdateRule:
    """The rule of gradient op ``op_name``.

    Raises:
        KeyError: no rule has that op name.
    """
    try:
        return RULES[op_name]
    except KeyError:
        raise KeyError(f"no embedding update rule for op {op_name!r}; known: {sorted(RULES)}") from None


def register(rule: UpdateRule) -> UpdateRule:
    """Adds ``rule``: its op is defined and every kernel family serves it from then on.

    Registering the same rule again does nothing; another rule of the same name raises.
    """
    known = RULES.get(rule.op_name)
    if known is rule:
        return rule
    if known is not None:
        raise ValueError(f"an update rule named {rule.name!r} is registered already")
    RULES[rule.op_name] = rule
    for listener in _listeners:
        listener(rule)
    return rule


def on_register(listener: Callable[[UpdateRule], None]) -> None:
    """Calls ``listener(rule)`` for every rule registered from now on (the op set defines its ops)."""
    _listeners.append(listener)
