"""A DLRM training step written in plain JAX, the way a JAX user would: the performance peer.

The same model and optimizers as ``bench dlrm`` (torchrec's ``DLRMTrain``: dense arch,
pooled embeddings, pairwise dot interaction, over arch, BCE loss; row-wise Adagrad on the
tables, Adagrad on the dense part), as one ``jax.jit`` step with donated buffers: tables
stacked into one array, rows gathered and summed per bag, the row gradients sorted by id
and summed per unique id, row-wise Adagrad applied to those rows only. Its own random
initialisation (its losses are not compared); its time per step includes moving the batch
to the device and reading the loss, as a tpurec step's does.

Example::

    peer = PlainJaxDlrm(tables=26, rows=100_000, dim=64, dense_in=13, dense_sizes=[512, 256, 64],
                        over_sizes=[512, 256, 1], ids_per_bag=4, batch=2048)
    loss = peer.step(dense, ids, labels)   # ids: [batch, tables, ids_per_bag] rows of each table
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["PlainJaxDlrm", "plain_jax_lookup", "plain_jax_rowwise_adagrad"]


def _mlp_params(key, sizes: Sequence[int]) -> list[tuple[jax.Array, jax.Array]]:
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        key, sub = jax.random.split(key)
        bound = 1.0 / np.sqrt(fan_in)
        params.append(
            (
                jax.random.uniform(sub, (fan_in, fan_out), jnp.float32, -bound, bound),
                jnp.zeros((fan_out,), jnp.float32),
            )
        )
    return params


def _mlp(params, x, last_relu: bool):
    for i, (w, b) in enumerate(params):
        x = x @ w + b
        if i < len(params) - 1 or last_relu:
            x = jax.nn.relu(x)
    return x


class PlainJaxDlrm:
    """The peer's model state and its jitted training step.

    Args:
        tables, rows, dim: embedding tables (each ``rows x dim``), stacked into one array.
        dense_in, dense_sizes, over_sizes: torchrec DLRM's arch sizes (``dense_sizes[-1] == dim``).
        ids_per_bag, batch: the batch's shape (fixed: one compiled step).
        sparse_lr, dense_lr, eps: row-wise Adagrad and Adagrad settings.
    """

    def __init__(
        self,
        tables: int,
        rows: int,
        dim: int,
        dense_in: int,
        dense_sizes: Sequence[int],
        over_sizes: Sequence[int],
        ids_per_bag: int,
        batch: int,
        sparse_lr: float = 0.05,
        dense_lr: float = 0.005,
        eps: float = 1e-8,
        seed: int = 0,
    ) -> None:
        self.tables, self.rows = tables, rows
        key = jax.random.PRNGKey(seed)
        k_table, k_dense, k_over = jax.random.split(key, 3)
        features = tables + 1
        interaction = dim + features * (features - 1) // 2
        bound = 1.0 / np.sqrt(rows)
        self.table = jax.random.uniform(k_table, (tables * rows, dim), jnp.float32, -bound, bound)
        self.accumulator = jnp.zeros((tables * rows,), jnp.float32)
        self.params = {
            "dense": _mlp_params(k_dense, [dense_in, *dense_sizes]),
            "over": _mlp_params(k_over, [interaction, *over_sizes]),
        }
        self.dense_state = jax.tree.map(jnp.zeros_like, self.params)
        offsets = (np.arange(tables, dtype=np.int32) * rows)[None, :, None]
        self._offsets = jnp.asarray(offsets)
        n = batch * tables * ids_per_bag

        def loss_fn(params, pooled, dense, labels):
            d = _mlp(params["dense"], dense, last_relu=True)  # [B, dim]
            combined = jnp.concatenate([d[:, None, :], pooled], axis=1)  # [B, F, dim]
            dots = jnp.einsum("bfd,bgd->bfg", combined, combined)
            rows_i, cols_i = np.triu_indices(features, k=1)
            logits = _mlp(params["over"], jnp.concatenate([d, dots[:, rows_i, cols_i]], axis=1), last_relu=False)
            logits = logits[:, 0]
            return jnp.mean(jnp.maximum(logits, 0) - logits * labels + jnp.log1p(jnp.exp(-jnp.abs(logits))))

        def step(params, dense_state, table, accumulator, dense, ids, labels):
            flat = (ids + self._offsets).reshape(-1)  # stacked rows
            pooled = jnp.take(table, flat, axis=0).reshape(batch, tables, ids_per_bag, dim).sum(axis=2)
            loss, (g_params, g_pooled) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, pooled, dense, labels)
            # Sparse update: the rows' gradients sorted by id, summed per unique id.
            g_rows = jnp.broadcast_to(g_pooled[:, :, None, :], (batch, tables, ids_per_bag, dim)).reshape(n, dim)
            order = jnp.argsort(flat)
            sorted_ids = flat[order]
            first = jnp.concatenate([jnp.ones((1,), bool), sorted_ids[1:] != sorted_ids[:-1]])
            segment = jnp.cumsum(first) - 1
            g_unique = jax.ops.segment_sum(g_rows[order], segment, num_segments=n, indices_are_sorted=True)
            unique_ids = jnp.full((n,), tables * rows, jnp.int32).at[segment].set(sorted_ids)
            m = accumulator.at[unique_ids].get(mode="fill", fill_value=0) + jnp.mean(g_unique**2, axis=1)
            w = table.at[unique_ids].get(mode="fill", fill_value=0)
            w = w - (sparse_lr / (jnp.sqrt(m) + eps))[:, None] * g_unique
            table = table.at[unique_ids].set(w, mode="drop")
            accumulator = accumulator.at[unique_ids].set(m, mode="drop")
            # Dense Adagrad.
            dense_state = jax.tree.map(lambda s, g: s + g * g, dense_state, g_params)
            params = jax.tree.map(
                lambda p, g, s: p - dense_lr * g / (jnp.sqrt(s) + 1e-10), params, g_params, dense_state
            )
            return params, dense_state, table, accumulator, loss

        self._step = jax.jit(step, donate_argnums=(0, 1, 2, 3))

    def step(self, dense: np.ndarray, ids: np.ndarray, labels: np.ndarray) -> jax.Array:
        """One training step on a host batch; returns the loss (a device scalar)."""
        batch = jax.device_put((dense, ids.astype(np.int32), labels))
        self.params, self.dense_state, self.table, self.accumulator, loss = self._step(
            self.params, self.dense_state, self.table, self.accumulator, *batch
        )
        return loss


def plain_jax_lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
    """Pooled lookup as a JAX user writes it: ``ids`` ``[bags, ids_per_bag]`` rows of ``table``, summed per bag."""
    return jnp.take(table, ids, axis=0).sum(axis=1)


def plain_jax_rowwise_adagrad(
    table: jax.Array, accumulator: jax.Array, ids: jax.Array, grad: jax.Array, *, learning_rate: float, eps: float
) -> tuple[jax.Array, jax.Array]:
    """Row-wise Adagrad on the rows ``ids`` touched, from the pooled gradient ``grad`` ``[bags, dim]``:
    the ids sorted, gradients summed per unique id, the update applied to those rows only."""
    n, dim = ids.size, table.shape[1]
    flat = ids.reshape(-1)
    g_rows = jnp.broadcast_to(grad[:, None, :], (*ids.shape, dim)).reshape(n, dim)
    order = jnp.argsort(flat)
    sorted_ids = flat[order]
    first = jnp.concatenate([jnp.ones((1,), bool), sorted_ids[1:] != sorted_ids[:-1]])
    segment = jnp.cumsum(first) - 1
    g_unique = jax.ops.segment_sum(g_rows[order], segment, num_segments=n, indices_are_sorted=True)
    unique_ids = jnp.full((n,), table.shape[0], flat.dtype).at[segment].set(sorted_ids)
    m = accumulator.at[unique_ids].get(mode="fill", fill_value=0) + jnp.mean(g_unique**2, axis=1)
    w = table.at[unique_ids].get(mode="fill", fill_value=0) - (learning_rate / (jnp.sqrt(m) + eps))[:, None] * g_unique
    return table.at[unique_ids].set(w, mode="drop"), accumulator.at[unique_ids].set(m, mode="drop")
