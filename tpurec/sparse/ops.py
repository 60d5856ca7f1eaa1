"""The tpurec sparse op set: ``torch.ops.tpurec.sparse_dense_matmul`` and its
fused-optimizer gradients (docs/design.md, contract 4).

Each op has

* a schema (``float`` hyperparameters, so under the lowering-table convention
  they are traced scalars: a new learning rate never recompiles);
* a fake kernel, so the ops trace under ``torch.compile`` / FakeTensor;
* its JAX kernel registered in the lowering table (``tpurec.dense.registry``),
  which is what the ``tpu`` device runs;
* a CPU kernel for plain CPU tensors: the same JAX kernel under ``jax.jit``
  (one cached jitted function per op: shapes are static, so a new batch within
  capacity reuses the compiled program).

The gradient ops are functional: they return the updated table and slots;
the embedding modules write them back in place.

Tables may be float16 or bfloat16 (FBGEMM's ``weights_precision``): the lookup
then returns float32 (pooled in float32) and the gradient ops update in float32
and round the new rows back as FBGEMM's CPU kernels do (see
:mod:`tpurec.sparse.kernels.reference`). Optimizer slots stay float32.

Example::

    import tpurec.sparse  # registers the ops
    out = torch.ops.tpurec.sparse_dense_matmul(rp, ids, samples, gains, table, batch_size=64)
    table2 = torch.ops.tpurec.sparse_dense_matmul_grad_with_sgd(
        rp, ids, samples, gains, grad_out, table, learning_rate=0.1)
"""

from __future__ import annotations

import warnings
from typing import Callable

import jax
import jax.numpy as jnp
import torch

from tpurec.dense.registry import lower, to_jax_dtype
from tpurec.sparse.kernels import native, reference, tensorcore, tpu
from tpurec.sparse.update_rules import RULES, UpdateRule, on_register, rule_of

__all__ = [
    "OP_NAMES",
    "SCHEMAS",
    "check_arguments",
    "jitted_kernel",
    "KERNELS",
    "kernel_family",
    "kernel_for",
    "output_dtype",
    "touched_rows_update_cpu",
]

_CSR = "Tensor row_pointers, Tensor embedding_ids, Tensor sample_ids, Tensor gains"

SCHEMAS: dict[str, str] = {
    "sparse_dense_matmul": f"({_CSR}, Tensor table, *, int batch_size) -> Tensor",
    **{name: rule.schema() for name, rule in RULES.items()},
}
"""Op name -> its torch schema; a gradient op's comes from its update rule (:mod:`tpurec.sparse.update_rules`)."""
OP_NAMES: list[str] = list(SCHEMAS)

# Arguments baked into the compiled program (everything else is traced).
_STATIC = {"sparse_dense_matmul": ("batch_size",)}

_lib = torch.library.Library("tpurec", "FRAGMENT")
_JITTED: dict[tuple[str, Callable], Callable] = {}


def jitted_kernel(name: str, table_dtype: torch.dtype = torch.float32) -> Callable:
    """The cached ``jax.jit`` of op ``name``'s XLA:CPU kernel (for CPU tensors)."""
    kernel = kernel_for(name, "cpu", to_jax_dtype(table_dtype))
    fn = _JITTED.get((name, kernel))
    if fn is None:
        fn = _JITTED[(name, kernel)] = jax.jit(kernel, static_argnames=_STATIC.get(name, ()))
    return fn


def _to_jax(t: torch.Tensor) -> jax.Array:
    # DLPack: zero-copy on CPU (tables are large; a copy per step would dominate).
    return jax.dlpack.from_dlpack(t.detach().contiguous())


def _to_torch(a: jax.Array, like: torch.Tensor) -> torch.Tensor:
    # Zero-copy too: XLA never aliases an output to a (non-donated) input, so the
    # result shares memory with no argument of the op.
    return torch.from_dlpack(a).to(like.dtype)


_ROWS_JIT = jax.jit(reference.touched_rows_update, static_argnames=("op_name",))


def touched_rows_update_cpu(
    op_name: str, tensors: list[torch.Tensor], hyperparameters: dict[str, float]
) -> list[torch.Tensor]:
    """Gradient op ``op_name`` on CPU tensors, returning only the touched rows.

    ``tensors`` are the op's tensor arguments (CSR, grad_output, table, slots).
    Returns ``[row_ids, table_rows, *slot_rows]``: the caller scatters them in
    place, which on CPU saves allocating and copying whole tables each step.
    """
    out = _ROWS_JIT(*(_to_jax(t) for t in tensors), op_name=op_name, **hyperparameters)
    return [torch.from_dlpack(o) for o in out]


def _state_arguments(name: str) -> tuple[tuple[str, str], ...]:
    """Tensor arguments of op ``name`` after the four CSR arrays, and the shape each must have:
    ``"table"`` = the table's shape, ``"rows"`` = ``[table rows]``, ``"grad"`` = ``[batch, table dim]``."""
    if name == "sparse_dense_matmul":
        return (("table", "table"),)
    rule = rule_of(name)
    slots = tuple((s.argument, "rows" if s.kind == "row" else "table") for s in rule.slots)
    return (("grad_output", "grad"), ("table", "table"), *slots)


_FLOAT_NAMES = ("float16", "bfloat16", "float32", "float64")
_HALF_NAMES = ("float16", "bfloat16")


def _dtype_name(x) -> str:
    """``"int32"``, ``"float32"``, ... for a torch tensor, a numpy/JAX array or a tracer."""
    dtype = x.dtype
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    return str(jnp.dtype(dtype))


def check_arguments(name: str, tensors, kwargs) -> None:
    """Checks the dtypes, ranks and sizes of a call of ``torch.ops.tpurec.<name>``.

    Runs on torch tensors (CPU and fake kernels) and on JAX arrays or tracers
    (the lowering), so every platform refuses the same calls with the same
    words. Only metadata is read: nothing waits for device data. Ids are never
    cast: an int64 id of ``2**32 + 1`` must not silently read row 1.

    Args:
        name: the op name (a key of :data:`SCHEMAS`).
        tensors: the tensor arguments, in schema order.
        kwargs: the keyword arguments (``batch_size`` is checked).

    Raises:
        TypeError: a tensor has the wrong dtype.
        ValueError: a tensor has the wrong rank or size, or ``batch_size`` < 0.
    """
    from tpurec.core import ArgumentTypeError, ArgumentValueError

    op = f"torch.ops.tpurec.{name}"
    arguments = _state_arguments(name)
    expected = 4 + len(arguments)
    if len(tensors) != expected:
        raise ArgumentValueError(f"{op} takes {expected} tensor arguments, got {len(tensors)}")
    row_pointers, embedding_ids, sample_ids, gains = tensors[:4]
    state = dict(zip((n for n, _ in arguments), tensors[4:]))
    csr_dtypes = (("row_pointers", "int32"), ("embedding_ids", "int32"), ("sample_ids", "int32"), ("gains", "float32"))
    for (arg, want), x in zip(csr_dtypes, tensors[:4]):
        if _dtype_name(x) != want:
            hint = (
                "; ids are rows of the stacked table, below 2**31 - 1: convert with .to(torch.int32) after checking "
                "they fit (preprocess_kjt builds valid CSR input)"
                if want == "int32"
                else "; convert with .to(torch.float32)"
            )
            raise ArgumentTypeError(f"{op}: {arg} must be {want}, got {_dtype_name(x)}{hint}")
        if len(x.shape) != 1:
            raise ArgumentValueError(f"{op}: {arg} must be 1-D, got shape {tuple(x.shape)}")
    partitions, entries = row_pointers.shape[0], embedding_ids.shape[0]
    if partitions < 1:
        raise ArgumentValueError(f"{op}: row_pointers needs one entry per partition (at least 1), got 0")
    if entries % partitions:
        raise ArgumentValueError(
            f"{op}: embedding_ids has {entries} entries, not a multiple of the {partitions} partitions of row_pointers"
        )
    for arg, x in (("sample_ids", sample_ids), ("gains", gains)):
        if x.shape[0] != entries:
            raise ArgumentValueError(
                f"{op}: {arg} has {x.shape[0]} entries, embedding_ids has {entries}; they must match"
            )
    table = state["table"]
    for arg, x in state.items():
        if _dtype_name(x) not in _FLOAT_NAMES:
            raise ArgumentTypeError(f"{op}: {arg} must be a floating point tensor, got {_dtype_name(x)}")
    if len(table.shape) != 2:
        raise ArgumentValueError(f"{op}: table must be 2-D [rows, dim], got shape {tuple(table.shape)}")
    if name in RULES and not RULES[name].half_tables and _dtype_name(table) in _HALF_NAMES:
        half_ok = [r.name for r in RULES.values() if r.half_tables]
        raise ArgumentTypeError(
            f"{op}: a {_dtype_name(table)} table has no FBGEMM CPU {RULES[name].name} update to follow (FBGEMM's "
            f"GPU kernels round stochastically); use a float32 table, or one of the optimizers {half_ok}"
        )
    rows, dim = table.shape
    for arg, kind in arguments:
        x = state[arg]
        if kind == "table" and tuple(x.shape) != (rows, dim):
            raise ArgumentValueError(f"{op}: {arg} must have the table's shape {(rows, dim)}, got {tuple(x.shape)}")
        if kind == "rows" and tuple(x.shape) != (rows,):
            raise ArgumentValueError(
                f"{op}: {arg} must be [rows] = {(rows,)} (one entry per table row), got {tuple(x.shape)}"
            )
        if kind == "grad" and (len(x.shape) != 2 or x.shape[1] != dim):
            raise ArgumentValueError(
                f"{op}: {arg} must be [batch, {dim}] (the table's dim), got shape {tuple(x.shape)}"
            )
    batch_size = kwargs.get("batch_size")
    if batch_size is not None and batch_size < 0:
        raise ArgumentValueError(f"{op}: batch_size must be >= 0, got {batch_size}")


def output_dtype(table_dtype: torch.dtype) -> torch.dtype:
    """The dtype ``sparse_dense_matmul`` returns for a table of ``table_dtype``:
    float32 for float16/bfloat16/float32 tables (they are pooled in float32)."""
    return torch.promote_types(table_dtype, torch.float32)


def _make_cpu_kernel(name: str) -> Callable:
    def cpu_kernel(*tensors: torch.Tensor, **kwargs):
        check_arguments(name, tensors, kwargs)
        table = _table_of(name, tensors)
        out = jitted_kernel(name, table.dtype)(*(_to_jax(t) for t in tensors), **kwargs)
        if isinstance(out, tuple):
            return tuple(_to_torch(o, t) for o, t in zip(out, tensors[5:]))
        if name == "sparse_dense_matmul":
            return torch.from_dlpack(out).to(output_dtype(table.dtype))
        return _to_torch(out, table)

    cpu_kernel.__name__ = f"{name}_cpu"
    return cpu_kernel


def _make_fake_kernel(name: str) -> Callable:
    def fake_kernel(*tensors: torch.Tensor, **kwargs):
        check_arguments(name, tensors, kwargs)
        if name == "sparse_dense_matmul":
            table = tensors[4]
            return table.new_empty((kwargs["batch_size"], table.shape[1]), dtype=output_dtype(table.dtype))
        outs = tuple(torch.empty_like(t) for t in tensors[5:])
        return outs if len(outs) > 1 else outs[0]

    fake_kernel.__name__ = f"{name}_fake"
    return fake_kernel


KERNELS = ("sparsecore", "tensorcore", "native", "reference")
"""The kernel families of the op set (``TPUREC_SPARSE_KERNEL`` forces one)."""

_warned_kinds: set[str] = set()


def kernel_family(platform: str | None = None, table_dtype=jnp.float32, device_kind: str | None = None) -> str:
    """Which kernel family runs the sparse ops for an XLA platform and table dtype.

    On a TPU the chip decides, from the planner's table of chips
    (:data:`tpurec.sparse.planner.topology.DEVICE_KINDS`): ``"sparsecore"`` where
    jax-tpu-embedding's primitives drive its SparseCores (v5p, v6e, v7x; float32 tables),
    ``"tensorcore"`` on every other TPU (v5e and v4, and a kind not in the table, with one
    warning). On XLA:CPU ``"native"`` (float32 tables); elsewhere ``"reference"``.
    ``TPUREC_SPARSE_KERNEL`` overrides the choice.

    Args:
        platform: the XLA platform (default: the one in use).
        table_dtype: the table's dtype (the SparseCore and native kernels hold float32 rows only).
        device_kind: the TPU's ``device_kind`` (default: the first device's).

    Raises:
        ValueError: ``TPUREC_SPARSE_KERNEL=sparsecore`` on a chip whose SparseCores the primitives
            do not drive, or ``native`` off XLA:CPU.
    """
    from tpurec import config
    from tpurec.sparse.planner.topology import generation_of_device_kind

    platform = platform or jax.default_backend()
    float32 = jnp.dtype(table_dtype) == jnp.float32
    forced = config.get("TPUREC_SPARSE_KERNEL")
    if forced != "auto":
        if forced == "native" and platform != "cpu":
            raise ValueError(f"TPUREC_SPARSE_KERNEL=native runs on XLA:CPU only (the platform is {platform!r})")
        if forced in ("native", "sparsecore") and not float32:
            return "reference"  # their rows are float32; FBGEMM's rounding of half tables is the reference's
        if forced == "sparsecore" and platform != "tpu":
            raise ValueError(f"TPUREC_SPARSE_KERNEL=sparsecore needs a TPU (the platform is {platform!r})")
        return forced
    if platform == "tpu":
        kind = device_kind if device_kind is not None else str(jax.devices()[0].device_kind)
        generation = generation_of_device_kind(kind)
        if generation is None and kind not in _warned_kinds:
            _warned_kinds.add(kind)
            warnings.warn(
                f"tpurec.sparse: the TPU device kind {kind!r} is not in tpurec's table of chips "
                "(tpurec.sparse.planner.topology.DEVICE_KINDS); embedding lookups use the TensorCore kernel",
                stacklevel=2,
            )
        if generation is not None and generation.sparsecore_primitives and float32:
            return "sparsecore"
        return "tensorcore"
    if platform == "cpu" and float32:
        return "native"
    return "reference"


def kernel_for(
    name: str, platform: str | None = None, table_dtype=jnp.float32, device_kind: str | None = None
) -> Callable:
    """The JAX kernel of op ``name`` for an XLA platform (default: the one in use).

    The family comes from :func:`kernel_family`: jax-tpu-embedding's SparseCore primitives
    (:mod:`~tpurec.sparse.kernels.tpu`), the TensorCore kernels
    (:mod:`~tpurec.sparse.kernels.tensorcore`), the native XLA:CPU FFI kernels or the plain-JAX
    reference. float16/bfloat16 tables never take the SparseCore or native kernels (they hold
    float32 rows only, and widening a table per call would round its update once where FBGEMM
    rounds twice).
    """
    family = kernel_family(platform, table_dtype, device_kind)
    module = {"sparsecore": tpu, "tensorcore": tensorcore, "native": native, "reference": reference}[family]
    return getattr(module, name)


def _table_of(name: str, args: tuple):
    return args[4] if name == "sparse_dense_matmul" else args[5]


def _platform_lowering(name: str) -> Callable:
    def lowering(*args, **kwargs):
        check_arguments(name, args, kwargs)
        # Picked at trace time: a program is compiled for one platform.
        return kernel_for(name, table_dtype=_table_of(name, args).dtype)(*args, **kwargs)

    lowering.__name__ = name
    return lowering


def _define(name: str, schema: str) -> None:
    _lib.define(name + schema)
    _lib.impl(name, _make_cpu_kernel(name), "CPU")
    torch.library.register_fake(f"tpurec::{name}", _make_fake_kernel(name), lib=_lib)
    lower(getattr(torch.ops.tpurec, name).default)(_platform_lowering(name))


def _define_rule(rule: UpdateRule) -> None:
    # An update rule registered after import: its gradient op joins the set.
    SCHEMAS[rule.op_name] = rule.schema()
    OP_NAMES.append(rule.op_name)
    _define(rule.op_name, SCHEMAS[rule.op_name])


for _name, _schema in SCHEMAS.items():
    _define(_name, _schema)
on_register(_define_rule)
