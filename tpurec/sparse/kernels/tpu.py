"""TPU kernels of the SparseCore op set: jax-tpu-embedding's primitives.

Same signatures and semantics as :mod:`tpurec.sparse.kernels.reference`; each
kernel converts our CSR contract (:mod:`tpurec.sparse.types`) into the
per-SparseCore layout the primitives expect, in JAX with static shapes, and
binds the primitive, which lowers to the SparseCore custom calls
(``SparseDenseMatmulOp`` forward, ``SparseDenseMatmulGradOpWithOptimizerUpdate``
for every optimizer). One device: the kernel sees the whole table, and the
table's partitions are the device's ``S`` SparseCores.

The mapping (ours -> jax-tpu-embedding, ``P`` our partitions, ``S``
SparseCores per device, ``B`` our ``batch_size``):

* **Batch split.** SparseCore ``c`` computes output rows
  ``[c * B_sc, (c + 1) * B_sc)`` with ``B_sc = ceil(B / S)``: our sample ``s``
  goes to SparseCore ``s // B_sc`` with local sample id ``s % B_sc``. The
  kernel's output row is ``c * B_sc + local``, i.e. our sample id again, so
  stacked features need no unstacking. ``B`` is padded up to ``S * B_sc``.
* **Partitions and ids.** Their partition of id ``i`` is ``i % S`` and the id
  is shard-local, ``i // S``; our partition ``p`` (ids ``= p mod P``) feeds
  their partitions ``q = p mod gcd(P, S)``, so one of theirs receives at most
  ``P / gcd(P, S)`` of ours: that factor times our per-partition capacity is
  the static ``max_ids_per_partition`` (and ``max_unique_ids_per_partition``)
  handed to the primitive, and ``S * round8(that)`` is the per-SparseCore
  buffer length. Nothing can overflow.
* **Buffers.** One chunk per SparseCore, concatenated. Inside a chunk,
  partition ``q`` starts at the previous partition's end rounded up to 8
  (SparseCore DMA granule) and ends at ``row_pointers[c * R + q]``; the row
  pointer block of a chunk has ``R = round8(S)`` entries, those past ``S``
  repeat the last end rounded up to 8 (as jax-tpu-embedding's host
  preprocessing writes them). Entries are sorted by (id, sample) inside a
  partition; everything else is ``PAD_ID`` (ids, samples) and 0 (gains).
  This needs a sort of the ``P * partition_size`` entries on the TensorCore.
* **Table.** Their device table is MOD-sharded over SparseCores: row ``r`` sits
  at ``(r % S) * V + r // S``, ``V = rows_padded / S``, rows padded up to a
  multiple of ``8 * S``, the dim up to a multiple of 8, float32. By default
  (``sparsecore_layout=False``) the kernels take and return tables in our
  natural layout and pay a permuting copy per call; keep tables in
  :func:`to_sparsecore_layout` form and pass ``sparsecore_layout=True`` to
  skip it (then rows must be a multiple of ``8 * S`` and the dim of 8).
* **Optimizers.** SGD uses jax-tpu-embedding's SGD primitive (same math).
  Adagrad, row-wise Adagrad and Adam use the generic
  ``sparse_dense_matmul_optimizer_grad`` primitive with our per-row update
  (their Adagrad has no ``eps``, their Adam no weight decay, and they have no
  row-wise Adagrad). Hyperparameters stay traced float32 scalars; Adam's bias
  corrections are computed on the TensorCore so the row update uses only
  elementwise ops. Row-wise Adagrad's accumulator is stored full width on the
  SparseCore (the primitive wants every slot shaped like the table): ``[rows]``
  in, broadcast to ``[rows, dim]``, column 0 out. Any other update rule
  (:mod:`tpurec.sparse.update_rules`) with element slots only runs its row math
  in the generic primitive as written (elementwise ``jax.numpy`` on padded rows).

Extra static keyword arguments of every kernel: ``num_sc_per_device`` (None:
from the device kind through jax-tpu-embedding's ``NUM_SC_PER_DEVICE_MAP``),
``max_ids_per_partition`` / ``max_unique_ids_per_partition`` (our
:class:`~tpurec.sparse.types.Capacity`; None: the partition buffer size) and
``sparsecore_layout``.

Example::

    out = sparse_dense_matmul(rp, ids, samples, gains, table, batch_size=64, num_sc_per_device=4)
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax_tpu_embedding.sparsecore.lib.core.primitives import sparse_dense_matmul_csr as _csr
from jax_tpu_embedding.sparsecore.lib.core.primitives import sparse_dense_matmul_grad_with_sgd as _sgd
from jax_tpu_embedding.sparsecore.lib.core.primitives import sparse_dense_matmul_optimizer_grad as _opt
from jax_tpu_embedding.sparsecore.utils import utils as _jte_utils

from tpurec.sparse.update_rules import RULES, bias_correction, rule_of

from tpurec.sparse.types import PAD_ID, PARTITION_ALIGNMENT

__all__ = [
    "CUSTOM_CALL_TARGETS",
    "SparseCoreCsr",
    "num_sparsecores",
    "to_sparsecore_csr",
    "to_sparsecore_layout",
    "from_sparsecore_layout",
    "sparse_dense_matmul",
]

CUSTOM_CALL_TARGETS: tuple[str, ...] = ("SparseDenseMatmulOp", "SparseDenseMatmulGradOpWithOptimizerUpdate")
"""The SparseCore custom calls these kernels lower to (for ``jax.export``'s
``DisabledSafetyCheck.custom_call``: they carry no compatibility guarantee)."""

_MOD_SHARDING = 1  # jax-tpu-embedding's ShardingStrategy.MOD
_A = PARTITION_ALIGNMENT


def _round_up(x, m: int):
    return -(-x // m) * m


def num_sparsecores(num_sc_per_device: int | None = None) -> int:
    """SparseCores per device: the argument, or the first device's kind looked up in
    jax-tpu-embedding's ``NUM_SC_PER_DEVICE_MAP`` (ValueError off TPU)."""
    if num_sc_per_device is not None:
        if num_sc_per_device < 1:
            raise ValueError(f"num_sc_per_device must be >= 1, got {num_sc_per_device}")
        return num_sc_per_device
    return _jte_utils.num_sparsecores_per_device()


class SparseCoreCsr(NamedTuple):
    """Our CSR in jax-tpu-embedding's per-SparseCore layout, plus its static sizes."""

    row_pointers: jax.Array  # int32 [S * round8(S)]
    embedding_ids: jax.Array  # int32 [S * S * partition_capacity], shard-local
    sample_ids: jax.Array  # int32, same shape, SparseCore-local
    gains: jax.Array  # float32, same shape
    device_batch_size: int  # output rows of the kernel, S * B_sc
    max_ids_per_partition: int
    max_unique_ids_per_partition: int


def to_sparsecore_csr(
    row_pointers: jax.Array,
    embedding_ids: jax.Array,
    sample_ids: jax.Array,
    gains: jax.Array,
    *,
    batch_size: int,
    num_sc: int,
    max_ids_per_partition: int | None = None,
    max_unique_ids_per_partition: int | None = None,
) -> SparseCoreCsr:
    """Converts our CSR (any ``P``) into the per-SparseCore buffers (see the module docstring).

    Shapes of the result depend only on the input shapes and the static
    arguments, never on the data.
    """
    P = row_pointers.shape[0]
    n = embedding_ids.shape[0]
    size = n // P
    S = num_sc
    ours_max_ids = size if max_ids_per_partition is None else max_ids_per_partition
    ours_max_unique = ours_max_ids if max_unique_ids_per_partition is None else max_unique_ids_per_partition
    # Worst case: every one of our partitions that feeds one of theirs is full
    # and all its entries fall in one SparseCore's slice of the batch.
    feed = P // math.gcd(P, S)
    max_ids = min(feed * ours_max_ids, n)
    max_unique = min(feed * ours_max_unique, max_ids)
    capacity = _round_up(max(max_ids, 1), _A)
    chunk = S * capacity
    b_sc = -(-batch_size // S)

    ids = embedding_ids.astype(jnp.int32)
    samples = sample_ids.astype(jnp.int32)
    position = jnp.arange(n, dtype=jnp.int32)
    valid = (position < row_pointers.astype(jnp.int32)[position // size]) & (ids != PAD_ID)
    # Invalid entries sort last (SparseCore S does not exist) and are dropped.
    sc = jnp.where(valid, samples // b_sc, S)
    part = jnp.where(valid, ids % S, 0)
    local_id = jnp.where(valid, ids // S, PAD_ID)
    local_sample = jnp.where(valid, samples - sc * b_sc, PAD_ID)
    sc, part, local_id, local_sample, g = jax.lax.sort(
        (sc, part, local_id, local_sample, gains.astype(jnp.float32)), num_keys=4
    )
    valid = sc < S
    group = jnp.where(valid, sc * S + part, S * S)
    counts = jax.ops.segment_sum(valid.astype(jnp.int32), group, num_segments=S * S + 1)[: S * S]
    group_first = jnp.cumsum(counts) - counts  # sorted: groups are contiguous, in order
    rank = position - jnp.concatenate([group_first, jnp.zeros(1, jnp.int32)])[group]
    counts = counts.reshape(S, S)
    ends_aligned = jnp.cumsum(_round_up(counts, _A), axis=1)
    starts = ends_aligned - _round_up(counts, _A)
    ends = starts + counts
    target = sc * chunk + starts.reshape(-1)[jnp.minimum(group, S * S - 1)] + rank
    target = jnp.where(valid, target, S * chunk)  # out of bounds: dropped

    def scatter(values, fill, dtype):
        return jnp.full(S * chunk, fill, dtype).at[target].set(values.astype(dtype), mode="drop")

    rp_width = _round_up(S, _A)
    tail = jnp.broadcast_to(_round_up(ends[:, -1:], _A), (S, rp_width - S))
    rp = jnp.concatenate([ends, tail], axis=1).reshape(-1).astype(jnp.int32)
    return SparseCoreCsr(
        rp,
        scatter(local_id, PAD_ID, jnp.int32),
        scatter(local_sample, PAD_ID, jnp.int32),
        scatter(g, 0.0, jnp.float32),
        S * b_sc,
        max_ids,
        max_unique,
    )


def to_sparsecore_layout(table: jax.Array, num_sc: int) -> jax.Array:
    """``[rows, dim]`` -> the SparseCore table ``[S * V, round8(dim)]`` (float32, zero padded)."""
    rows, dim = table.shape
    padded = jnp.pad(
        table.astype(jnp.float32), ((0, _round_up(rows, _A * num_sc) - rows), (0, _round_up(dim, _A) - dim))
    )
    v = padded.shape[0] // num_sc
    return padded.reshape(v, num_sc, -1).transpose(1, 0, 2).reshape(num_sc * v, -1)


def from_sparsecore_layout(table: jax.Array, num_sc: int, rows: int, dim: int) -> jax.Array:
    """Inverse of :func:`to_sparsecore_layout` (float32, padding removed)."""
    v = table.shape[0] // num_sc
    return table.reshape(num_sc, v, -1).transpose(1, 0, 2).reshape(num_sc * v, -1)[:rows, :dim]


def _check_sparsecore_table(table: jax.Array, S: int) -> None:
    rows, dim = table.shape
    if rows % (_A * S) or dim % _A or table.dtype != jnp.float32:
        raise ValueError(
            f"sparsecore_layout=True needs a float32 table with rows a multiple of {_A * S} and dim a multiple "
            f"of {_A} (see to_sparsecore_layout), got {table.dtype} {table.shape}"
        )


def _convert(csr, batch_size, num_sc_per_device, max_ids, max_unique) -> tuple[int, SparseCoreCsr]:
    S = num_sparsecores(num_sc_per_device)
    return S, to_sparsecore_csr(
        *csr, batch_size=batch_size, num_sc=S, max_ids_per_partition=max_ids, max_unique_ids_per_partition=max_unique
    )


def _one_minibatch() -> jax.Array:
    # Operand of the primitives; only read when minibatching is enabled.
    return jnp.asarray(1, jnp.int32)


def sparse_dense_matmul(
    row_pointers,
    embedding_ids,
    sample_ids,
    gains,
    table,
    *,
    batch_size: int,
    num_sc_per_device: int | None = None,
    max_ids_per_partition: int | None = None,
    max_unique_ids_per_partition: int | None = None,
    sparsecore_layout: bool = False,
):
    """Pooled lookup on the SparseCores: ``out[s] = sum_i gains[i] * table[ids[i]]``.

    Returns:
        ``[batch_size, dim]`` (``[batch_size, round8(dim)]`` float32 when ``sparsecore_layout``).
    """
    S, sc = _convert(
        (row_pointers, embedding_ids, sample_ids, gains),
        batch_size,
        num_sc_per_device,
        max_ids_per_partition,
        max_unique_ids_per_partition,
    )
    if sparsecore_layout:
        _check_sparsecore_table(table, S)
        sc_table = table
    else:
        sc_table = to_sparsecore_layout(table, S)
    out = _csr.tpu_sparse_dense_matmul_csr_primitive.bind(
        sc.row_pointers,
        sc.embedding_ids,
        sc.sample_ids,
        sc.gains,
        _one_minibatch(),
        sc_table,
        device_batch_size=sc.device_batch_size,
        max_ids_per_partition=sc.max_ids_per_partition,
        max_unique_ids_per_partition=sc.max_unique_ids_per_partition,
        sharding_strategy=_MOD_SHARDING,
    )
    if sparsecore_layout:
        return out[:batch_size]
    return out[:batch_size, : table.shape[1]].astype(table.dtype)


# Per-row optimizer updates, run by the SparseCore on one touched row at a time:
# every argument is a [1, dim] float32 row (hyperparameters arrive broadcast).


def _adagrad_row(g, w, m, lr, eps):
    m = m + g * g
    return w - lr * g / (jnp.sqrt(m) + eps), m


def _rowwise_adagrad_row(dim: int) -> Callable:
    def update(g, w, m, lr, eps, wd):
        g = g + wd * w
        # Padded columns of g are 0, so the mean is over the real dim.
        m = m + jnp.sum(g * g, axis=1, keepdims=True) * (1.0 / dim)
        return w - lr * g / (jnp.sqrt(m) + eps), m

    return update


def _adam_row(g, w, m1, m2, lr, b1, b2, eps, wd, c1, c2):
    # c1, c2 = 1 / (1 - beta**step) (update_rules.bias_correction), computed on the TensorCore (no pow here).
    m1 = b1 * m1 + (1.0 - b1) * g
    m2 = b2 * m2 + (1.0 - b2) * g * g
    return w - lr * (m1 * c1 / (jnp.sqrt(m2 * c2) + eps) + wd * w), m1, m2


def _grad_with_optimizer(
    name: str,
    update: Callable | None,
    csr: tuple,
    grad_output,
    table,
    slots: Sequence,
    hyperparameters: Sequence,
    *,
    num_sc_per_device: int | None,
    max_ids_per_partition: int | None,
    max_unique_ids_per_partition: int | None,
    sparsecore_layout: bool,
    rowwise_slots: bool = False,
):
    """Shared body of the gradient kernels; ``update=None`` is jax-tpu-embedding's SGD."""
    rows, dim = table.shape
    batch_size = grad_output.shape[0]
    S, sc = _convert(csr, batch_size, num_sc_per_device, max_ids_per_partition, max_unique_ids_per_partition)
    if sparsecore_layout:
        for x in (table, *slots):
            _check_sparsecore_table(x, S)
        variables = [table, *slots]
    else:
        full = [jnp.broadcast_to(s[:, None], table.shape) if rowwise_slots else s for s in slots]
        variables = [to_sparsecore_layout(x, S) for x in (table, *full)]
    padded_dim = variables[0].shape[1]
    grad = jnp.pad(
        grad_output.astype(jnp.float32),
        ((0, sc.device_batch_size - batch_size), (0, padded_dim - grad_output.shape[1])),
    )
    hps = [jnp.asarray(h, jnp.float32) for h in hyperparameters]
    # Distinct shapes get distinct symbol names; equal names mean equal bodies.
    computation = f"tpurec_{name}_{variables[0].shape[0]}x{padded_dim}_d{dim}"
    common = dict(
        max_ids_per_partition=sc.max_ids_per_partition,
        max_unique_ids_per_partition=sc.max_unique_ids_per_partition,
        computation_name=computation,
        sharding_strategy=_MOD_SHARDING,
    )
    head = (sc.row_pointers, sc.embedding_ids, sc.sample_ids, sc.gains, _one_minibatch())
    if update is None:
        new = [_sgd.tpu_sparse_dense_matmul_grad_with_sgd_primitive.bind(*head, variables[0], grad, *hps, **common)]
    else:
        row = jax.ShapeDtypeStruct((1, padded_dim), jnp.float32)
        jaxpr = jax.make_jaxpr(update)(*[row] * (1 + len(variables) + len(hps)))
        new = _opt.tpu_sparse_dense_matmul_optimizer_grad_primitive.bind(
            *head, grad, *hps, *variables, num_hyperparameters=len(hps), jaxpr=jaxpr, **common
        )
    if sparsecore_layout:
        out = tuple(new)
    else:
        natural = [from_sparsecore_layout(x, S, rows, dim) for x in new]
        outs = [natural[0].astype(table.dtype)]
        for s, x in zip(slots, natural[1:]):
            outs.append((x[:, 0] if rowwise_slots else x).astype(s.dtype))
        out = tuple(outs)
    return out if len(out) > 1 else out[0]


def _adam_hyperparameters(hp: dict) -> list:
    # Bias corrections on the TensorCore: the row update then uses only elementwise ops.
    beta1, beta2, step = (jnp.asarray(hp[k], jnp.float32) for k in ("beta1", "beta2", "step"))
    c1, c2 = 1.0 / bias_correction(beta1, step), 1.0 / bias_correction(beta2, step)
    return [hp["learning_rate"], beta1, beta2, hp["eps"], hp["weight_decay"], c1, c2]


# How a rule's row math runs in the primitive where it cannot run as the rule writes it: rows
# are padded to a multiple of 8 columns (a row reduction must divide by the real dim) and the
# SparseCore has no pow. Rule name -> (row update for a table dim, None: jax-tpu-embedding's SGD
# primitive; the primitive's hyperparameter list from the op's). Other rules with element slots
# run their row math as written.
_SPARSECORE_FORMS: dict[str, tuple[Callable[[int], Callable | None], Callable[[dict], list]]] = {
    "sgd": (lambda dim: None, lambda hp: [hp["learning_rate"]]),
    "adagrad": (lambda dim: _adagrad_row, lambda hp: [hp["learning_rate"], hp["eps"]]),
    "rowwise_adagrad": (_rowwise_adagrad_row, lambda hp: [hp["learning_rate"], hp["eps"], hp["weight_decay"]]),
    "adam": (lambda dim: _adam_row, _adam_hyperparameters),
}


def _rule_grad_op(op_name: str) -> Callable:
    """The SparseCore entry point of an update rule's gradient op (the reference's arguments plus
    ``num_sc_per_device``, ``max_ids_per_partition``, ``max_unique_ids_per_partition`` and
    ``sparsecore_layout``)."""
    rule = rule_of(op_name)
    form = _SPARSECORE_FORMS.get(rule.name)
    rowwise = any(s.kind == "row" for s in rule.slots)
    names = rule.hyperparameters

    def grad_op(
        row_pointers,
        embedding_ids,
        sample_ids,
        gains,
        grad_output,
        table,
        *slots,
        num_sc_per_device: int | None = None,
        max_ids_per_partition: int | None = None,
        max_unique_ids_per_partition: int | None = None,
        sparsecore_layout: bool = False,
        **hyperparameters,
    ):
        if len(slots) != len(rule.slots) or set(hyperparameters) != set(names):
            raise TypeError(
                f"{op_name} takes the slots {[s.argument for s in rule.slots]} and the hyperparameters {list(names)}; "
                f"got {len(slots)} slots and {sorted(hyperparameters)}"
            )
        update: Callable | None
        if form is not None:
            update, hps = form[0](table.shape[1]), form[1](hyperparameters)
        elif rowwise:
            raise NotImplementedError(
                f"{op_name} on SparseCores: the rule has per-row slots, which the generic primitive holds full "
                "width and whose row reductions would count the padded columns; run it with "
                "TPUREC_SPARSE_KERNEL=tensorcore, or give the rule element slots"
            )
        else:

            def as_written(g, w, *rest):
                rows, values = rest[: len(slots)], rest[len(slots) :]
                return tuple(rule.rows(g, w, *rows, dtype=jnp.float32, **dict(zip(names, values))))

            update, hps = as_written, [hyperparameters[n] for n in names]
        return _grad_with_optimizer(
            rule.name,
            update,
            (row_pointers, embedding_ids, sample_ids, gains),
            grad_output,
            table,
            slots,
            hps,
            num_sc_per_device=num_sc_per_device,
            max_ids_per_partition=max_ids_per_partition,
            max_unique_ids_per_partition=max_unique_ids_per_partition,
            sparsecore_layout=sparsecore_layout,
            rowwise_slots=rowwise and not sparsecore_layout,
        )

    grad_op.__name__ = grad_op.__qualname__ = op_name
    grad_op.__doc__ = f"{rule.summary} (SparseCore primitives)."
    return grad_op


_RULE_OPS: dict[str, Callable] = {}


def __getattr__(name: str):
    # One entry point per update rule (sparse_dense_matmul_grad_with_<name>), made on first use.
    if name in RULES:
        if name not in _RULE_OPS:
            _RULE_OPS[name] = _rule_grad_op(name)
        return _RULE_OPS[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
