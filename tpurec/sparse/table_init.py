"""Initial table values that do not depend on how a table is sharded.

A table whose module was built on ``meta`` has no values; :func:`tpurec.shard`
creates each shard where it lives, so no process ever holds a whole table. For
the same seed to give the same table whatever the plan, mesh or process count,
every value is a function of ``(seed, table name, row, column)`` only: the
counter-based Threefry-2x32 generator (JAX's ``threefry2x32_p``) keyed by
``(seed, crc32(table name))`` at counter ``(row, column)``, turned into the
table config's distribution:

* ``init_fn=None`` (TorchRec's default): uniform on
  ``[config.get_weight_init_min(), config.get_weight_init_max())``, by default
  ``[-sqrt(1 / num_embeddings), sqrt(1 / num_embeddings))`` as in TorchRec;
* ``functools.partial(torch.nn.init.uniform_, a=..., b=...)`` (or plain
  ``uniform_``: ``[0, 1)``): uniform on ``[a, b)``;
* ``functools.partial(torch.nn.init.normal_, mean=..., std=...)`` (or plain
  ``normal_``): normal, by Box-Muller on the counter's two outputs;
* ``torch.nn.init.zeros_``, ``ones_``, ``partial(constant_, val=...)``.

These are the distributions TorchRec would draw from, not torch's generator's
numbers: a table born sharded differs value by value from one initialised by
``init_fn`` on the host with ``torch.manual_seed``. :func:`table_values` gives
the same numbers on the host (for a reference model, or to materialise a table
unsharded). Any other ``init_fn`` cannot be applied piece by piece with this
guarantee and is refused (:func:`table_init` raises), never replaced by
something close.

Example::

    rows = table_values(config, seed=0, start=0, stop=1000)  # the first 1000 rows, as tpurec.shard makes them
"""

from __future__ import annotations

import dataclasses
import functools
import math
import zlib
from typing import Any, Literal, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.extend.random import threefry2x32_p
from torchrec.modules.embedding_configs import EmbeddingBagConfig

__all__ = [
    "KINDS",
    "TableInit",
    "check_rows_fit",
    "element_values",
    "local_stack_values",
    "table_init",
    "table_key",
    "table_values",
]

KINDS: tuple[str, ...] = ("uniform", "normal", "constant")
"""The distributions a table can be born with; their index is the code :func:`element_values` takes."""


@dataclasses.dataclass(frozen=True)
class TableInit:
    """One table's initial distribution.

    Attributes:
        kind: ``"uniform"`` (on ``[a, b)``), ``"normal"`` (mean ``a``, std ``b``) or
            ``"constant"`` (every value ``a``).
        a: low bound, mean or the constant.
        b: high bound or std (unused for a constant).
    """

    kind: Literal["uniform", "normal", "constant"]
    a: float
    b: float = 0.0

    @property
    def code(self) -> int:
        return KINDS.index(self.kind)


def _call_arguments(init_fn: Any) -> tuple[Any, dict[str, Any]]:
    """``(function, keyword arguments)`` of a plain function or a ``functools.partial`` of one."""
    if isinstance(init_fn, functools.partial):
        import inspect

        try:
            bound = inspect.signature(init_fn.func).bind_partial(None, *init_fn.args, **init_fn.keywords)
        except TypeError:
            return init_fn.func, {"<unbindable>": True}
        arguments = dict(bound.arguments)
        arguments.pop(next(iter(arguments)))  # the tensor
        return init_fn.func, arguments
    return init_fn, {}


def table_init(config: EmbeddingBagConfig) -> TableInit:
    """The distribution a table on ``meta`` is born with (see the module docs).

    Args:
        config: the table's config (its ``init_fn``, ``weight_init_min/max`` and
            ``num_embeddings`` decide).

    Raises:
        NotImplementedError: ``init_fn`` is not one of the supported initialisers
            (the message names the table and what to do).
    """
    if config.init_fn is None:
        return TableInit("uniform", float(config.get_weight_init_min()), float(config.get_weight_init_max()))
    fn, kwargs = _call_arguments(config.init_fn)
    init = torch.nn.init
    known: dict[Any, tuple[str, dict[str, float]]] = {
        init.uniform_: ("uniform", {"a": 0.0, "b": 1.0}),
        init.normal_: ("normal", {"mean": 0.0, "std": 1.0}),
        init.constant_: ("constant", {"val": math.nan}),
        init.zeros_: ("constant", {}),
        init.ones_: ("constant", {}),
    }
    entry = known.get(fn)
    # A generator= argument asks for torch's own numbers; those depend on the shard layout.
    extra = set(kwargs) - set(entry[1]) if entry is not None else set()
    if entry is None or extra or (fn is init.constant_ and "val" not in kwargs):
        raise NotImplementedError(
            f"table {config.name!r} has init_fn={config.init_fn!r}, which tpurec cannot apply shard by shard to a "
            "table built on 'meta' (each shard is created on its own device, and the values must not depend on the "
            "plan). Supported: init_fn=None (uniform on [weight_init_min, weight_init_max), TorchRec's default), "
            "functools.partial(torch.nn.init.uniform_, a=, b=), partial(normal_, mean=, std=), "
            "partial(constant_, val=), zeros_, ones_. Use one of them, or build the table on the host (not 'meta') "
            "so init_fn runs on the whole table."
        )
    kind, defaults = entry
    values = {**defaults, **{k: float(v) for k, v in kwargs.items()}}
    if fn is init.uniform_:
        return TableInit("uniform", values["a"], values["b"])
    if fn is init.normal_:
        return TableInit("normal", values["mean"], values["std"])
    if fn is init.zeros_:
        return TableInit("constant", 0.0)
    if fn is init.ones_:
        return TableInit("constant", 1.0)
    return TableInit("constant", values["val"])


def table_key(seed: int, name: str) -> tuple[int, int]:
    """The Threefry key of table ``name`` under ``seed``: ``(seed, crc32(name))``.

    Raises:
        ValueError: ``seed`` is not an int in ``[0, 2**32)``.
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) < 2**32:
        raise ValueError(f"seed must be an int in [0, 2**32) (the tables' initialisation seed), got {seed!r}")
    return int(seed), zlib.crc32(name.encode("utf-8"))


def element_values(
    kind: jax.Array, a: jax.Array, b: jax.Array, k1: jax.Array, k2: jax.Array, rows: jax.Array, cols: jax.Array
) -> jax.Array:
    """Float32 initial values at ``(rows, cols)`` (all arguments broadcast together).

    Args:
        kind: code of the distribution (index in :data:`KINDS`).
        a, b: its parameters (see :class:`TableInit`).
        k1, k2: the table's key (:func:`table_key`), uint32.
        rows, cols: the element's row and column in its table, uint32.
    """
    shape = jnp.broadcast_shapes(*(jnp.shape(x) for x in (kind, a, b, k1, k2, rows, cols)))
    u32 = lambda x: jnp.broadcast_to(jnp.asarray(x, jnp.uint32), shape)  # noqa: E731
    bits0, bits1 = threefry2x32_p.bind(u32(k1), u32(k2), u32(rows), u32(cols))

    def unit(bits: jax.Array) -> jax.Array:
        # 23 random mantissa bits: a float32 in [1, 2), minus one: [0, 1) (as jax.random.uniform).
        return jax.lax.bitcast_convert_type((bits >> 9) | jnp.uint32(0x3F800000), jnp.float32) - 1.0

    u0, u1 = unit(bits0), unit(bits1)
    a = jnp.broadcast_to(jnp.asarray(a, jnp.float32), shape)
    b = jnp.broadcast_to(jnp.asarray(b, jnp.float32), shape)
    uniform = a + u0 * (b - a)
    # Box-Muller: 1 - u0 is in (0, 1], so the log is finite.
    normal = a + b * (jnp.sqrt(-2.0 * jnp.log(1.0 - u0)) * jnp.cos(jnp.float32(2 * math.pi) * u1))
    kind = jnp.broadcast_to(jnp.asarray(kind, jnp.int32), shape)
    return jnp.where(kind == 0, uniform, jnp.where(kind == 1, normal, a))


@functools.partial(jax.jit, static_argnames=("num_rows", "num_cols"))
def _rows_values(kind, a, b, k1, k2, row0, num_rows: int, num_cols: int):
    rows = row0 + jnp.arange(num_rows, dtype=jnp.uint32)
    return element_values(kind, a, b, k1, k2, rows[:, None], jnp.arange(num_cols, dtype=jnp.uint32)[None, :])


def table_values(config: EmbeddingBagConfig, seed: int, start: int = 0, stop: int | None = None) -> np.ndarray:
    """Rows ``[start, stop)`` of the table ``config`` describes, as :func:`tpurec.shard` makes it from ``meta``.

    Computed on this process's default JAX device and copied to the host.

    Args:
        config: the table's config.
        seed: the seed given to :func:`tpurec.shard`.
        start, stop: the rows (default: all).

    Returns:
        A float32 ``[stop - start, embedding_dim]`` array.

    Raises:
        NotImplementedError: the config's ``init_fn`` is not supported (see :func:`table_init`).
        ValueError: a bad seed or row range.
    """
    init = table_init(config)
    k1, k2 = table_key(seed, config.name)
    stop = config.num_embeddings if stop is None else stop
    if not 0 <= start <= stop <= config.num_embeddings:
        raise ValueError(f"rows [{start}, {stop}) are not inside table {config.name!r} of {config.num_embeddings} rows")
    out = _rows_values(
        np.int32(init.code),
        np.float32(init.a),
        np.float32(init.b),
        np.uint32(k1),
        np.uint32(k2),
        np.uint32(start),
        num_rows=stop - start,
        num_cols=config.embedding_dim,
    )
    return np.array(out)  # a writable copy


def check_rows_fit(configs: Sequence[EmbeddingBagConfig]) -> None:
    """Raises for a table whose row or column index does not fit the generator's 32-bit counter."""
    for cfg in configs:
        if cfg.num_embeddings > 2**32 or cfg.embedding_dim > 2**32:
            raise ValueError(
                f"table {cfg.name!r} has {cfg.num_embeddings} rows x {cfg.embedding_dim} columns; tables born on "
                "'meta' are initialised by a generator counting rows and columns in 32 bits. Split the table."
            )


def local_stack_values(
    starts: jax.Array,
    counts: jax.Array,
    tables: jax.Array,
    row_offsets: jax.Array,
    col_offsets: jax.Array,
    params: tuple[jax.Array, jax.Array, jax.Array, jax.Array],
    k1: int,
    num_rows: int,
    width: int,
) -> jax.Array:
    """One device's ``[num_rows, width]`` stack of shards, born with their tables' values (traceable).

    The stack holds pieces ``j`` (sorted by ``starts``): rows ``starts[j] ..
    starts[j] + counts[j]`` are rows ``row_offsets[j] ..`` and columns
    ``col_offsets[j] .. + width`` of table ``tables[j]``; rows in no piece
    (padding) are zeros. Every value depends only on its table, row and column.

    Args:
        starts, counts, tables, row_offsets, col_offsets: ``[pieces]`` int arrays
            (padding pieces: ``counts`` 0).
        params: per table index: (kind codes, a, b, k2) arrays (see :class:`TableInit`).
        k1: the seed (first key word, the same for every table).
        num_rows, width: the stack's shape.
    """
    kinds, a, b, k2 = (jnp.asarray(x) for x in params)
    # Blocks of rows, written into the stack in place: the generator's temporaries stay a
    # block's size, not the stack's (the last block is shifted back to end at num_rows; its
    # rows overlap the previous block's and get the same values again).
    block = min(num_rows, _BLOCK_ROWS)

    def values_at(first: jax.Array) -> jax.Array:
        r = first + jnp.arange(block, dtype=jnp.int32)
        j = jnp.clip(jnp.searchsorted(starts, r, side="right") - 1, 0, starts.shape[0] - 1)
        local = r - starts[j]
        inside = (local >= 0) & (local < counts[j])
        t = tables[j]
        rows = row_offsets[j].astype(jnp.uint32) + local.astype(jnp.uint32)
        cols = col_offsets[j].astype(jnp.uint32)[:, None] + jnp.arange(width, dtype=jnp.uint32)[None, :]
        values = element_values(
            kinds[t][:, None], a[t][:, None], b[t][:, None], jnp.uint32(k1), k2[t][:, None], rows[:, None], cols
        )
        return jnp.where(inside[:, None], values, jnp.float32(0))

    def body(i: jax.Array, stack: jax.Array) -> jax.Array:
        first = jnp.minimum(i * block, num_rows - block)
        return jax.lax.dynamic_update_slice(stack, values_at(first), (first, 0))

    blocks = -(-num_rows // block) if block else 0
    return jax.lax.fori_loop(0, blocks, body, jnp.zeros((num_rows, width), jnp.float32))


_BLOCK_ROWS = 2048
"""Rows :func:`local_stack_values` generates at once."""
