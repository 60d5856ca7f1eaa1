"""The SPMD programs of a sharded EmbeddingBagCollection (TorchRec's compute and output distribution).

* :func:`forward` (``shard_map`` over the mesh): ``all_to_all`` moves the packed
  entries to their owners, each device runs the lookup kernel (the native XLA:CPU
  kernel on CPU, SparseCore on TPU) on its local stack, and pooled rows return to
  the batch owners (``all_to_all``; ``psum_scatter`` for row-wise tables);
  data-parallel tables are looked up locally;
* :func:`backward`: the same collectives reversed bring each shard the gradients
  of its pooled rows, and every shard applies the fused optimizer to its rows
  (buffers donated). Data-parallel replicas all-gather the batch's entries and
  gradients and apply the same update;
* :func:`id_weight_gradient`: the per-id weights' gradient, back in KJT order.

The entries come from ``routing.py``; the tables and slots from the module (``ebc.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from tpurec.core import Program
from tpurec.sparse.sharding_plan.layout import Layout
from tpurec.sparse.types import PAD_ID

__all__ = ["backward", "forward", "id_weight_gradient", "make_programs", "summed_backward"]


def forward(
    layout: Layout,
    mesh: Mesh,
    lookup: Callable[..., jax.Array] | Sequence[Callable[..., jax.Array]],
    weights: list[jax.Array],
    dp_weights: list[jax.Array],
    groups: list[tuple[jax.Array, jax.Array, jax.Array]],
    dp: list[tuple[jax.Array, jax.Array, jax.Array]],
    b: int,
    with_rows: bool = False,
    rank_ordered_sums: bool = False,
) -> tuple[jax.Array, list[tuple[jax.Array, ...]], list[jax.Array]]:
    """The forward program: ids to owners, lookups, pooled rows back to batch owners.

    Args:
        layout: where every table piece lives.
        mesh: the device mesh (its axes together are the one device axis).
        lookup: the lookup kernel (``kernel_for("sparse_dense_matmul")`` or a stand-in), or one
            kernel per group (sharded groups, then data-parallel ones).
        weights: per sharded group, the ``[devices * rows per device, width]`` stack.
        dp_weights: per data-parallel group, the replicated table stack.
        groups, dp: the packed entries (``InputRouter.pack``'s ``groups`` and ``dp``).
        b: samples per device.
        with_rows: also return, per group, every received entry's table row as it
            is now (kept on its shard for the backward's per-id weight gradients).
        rank_ordered_sums: row-wise partial sums reach their batch owner by ``all_to_all`` and are
            added there one device after another, in mesh order, each sum rounded to the output
            dtype (FBGEMM's ``sum_reduce_to_one``, which TorchRec's sharded inference uses), instead
            of one ``psum_scatter`` in XLA's order.

    Returns:
        ``(out, received, kept)``: the batch-sharded ``[batch, total dim]`` pooled
        rows, each group's entries as their shards received them, and the kept rows.
    """
    L, D, axis = layout, layout.num_devices, tuple(mesh.axis_names)
    dest = jnp.asarray(L.dest_columns, jnp.int32)
    n_groups = len(L.groups) + len(L.dp_groups)
    lookups = list(lookup) if isinstance(lookup, Sequence) else [lookup] * n_groups
    if len(lookups) != n_groups:
        raise ValueError(f"forward: {len(lookups)} lookup kernels for {n_groups} groups")

    def entry_rows(table, rows):
        return table[jnp.where(rows == PAD_ID, 0, rows)]

    def body(weights, dp_weights, groups, dp):
        received, flats, kept = [], [], []
        for grp, lookup, table, (rows, samples, gains) in zip(L.groups, lookups, weights, groups):
            K, K2 = grp.num_slots, grp.num_a2a
            # [1, dest, C] -> [source, 1, C]: every device gets the entries of its shards.
            rows, samples, gains = (
                jax.lax.all_to_all(x, axis, 1, 0, tiled=True).reshape(-1) for x in (rows, samples, gains)
            )
            received.append((rows, samples, gains))
            if with_rows:
                kept.append(entry_rows(table, rows))
            rp = jnp.full((1,), rows.shape[0], jnp.int32)
            pooled = lookup(rp, rows, samples, gains, table, batch_size=D * K * b).reshape(D, K, b, grp.width)
            if K2:
                back = jax.lax.all_to_all(pooled[:, :K2], axis, 0, 0, tiled=True)
                flats.append(back.transpose(2, 0, 1, 3).reshape(b, -1))
            if K > K2 and rank_ordered_sums:
                # [destination, ...] -> [source, ...]: every device's partial sums, in mesh order.
                parts = jax.lax.all_to_all(pooled[:, K2:], axis, 0, 0, tiled=True)
                summed = parts[0]
                for part in parts[1:]:
                    summed = summed + part
                flats.append(summed.transpose(1, 0, 2).reshape(b, -1))
            elif K > K2:
                summed = jax.lax.psum_scatter(pooled[:, K2:], axis, scatter_dimension=0, tiled=True)
                flats.append(summed[0].transpose(1, 0, 2).reshape(b, -1))
        me = jax.lax.axis_index(axis)
        for dg, lookup, table, (rows, samples, gains) in zip(L.dp_groups, lookups[len(L.groups) :], dp_weights, dp):
            K = len(dg.slots)
            rows, samples, gains = rows.reshape(-1), samples.reshape(-1), gains.reshape(-1)
            local = jnp.where(rows == PAD_ID, PAD_ID, samples - me * K * b)
            rp = jnp.full((1,), rows.shape[0], jnp.int32)
            pooled = lookup(rp, rows, local, gains, table, batch_size=K * b).reshape(K, b, dg.width)
            flats.append(pooled.transpose(1, 0, 2).reshape(b, -1))
            if with_rows:
                kept.append(entry_rows(table, rows))
        values = jnp.concatenate(flats, axis=1)
        out = jnp.zeros((b, L.total_dim + 1), values.dtype).at[:, dest].add(values)[:, : L.total_dim]
        return out, received, kept

    spec = P(axis)
    n_kept = len(groups) + len(dp) if with_rows else 0
    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=([spec] * len(weights), [P()] * len(dp_weights), [(spec,) * 3] * len(groups), [(spec,) * 3] * len(dp)),
        out_specs=(spec, [(spec,) * 3] * len(groups), [spec] * n_kept),
        check_vma=False,
    )
    return fn(weights, dp_weights, groups, dp)


def backward(
    layout: Layout,
    mesh: Mesh,
    update: Callable[..., Any],
    grad: jax.Array,
    weights: list[jax.Array],
    slots: list[list[jax.Array]],
    dp_weights: list[jax.Array],
    dp_slots: list[list[jax.Array]],
    received: list[tuple[jax.Array, ...]],
    dp: list[tuple[jax.Array, ...]],
    kept: list[jax.Array],
    hyper: dict[str, Any],
    b: int,
) -> tuple[list[jax.Array], list[list[jax.Array]], list[jax.Array], list[list[jax.Array]], list[jax.Array]]:
    """The backward program: gradients back to the shards, fused optimizer on each.

    Args:
        layout, mesh: as :func:`forward`.
        update: the fused optimizer kernel (``kernel_for(optimizer.op_name)`` or a stand-in).
        grad: the gradient of :func:`forward`'s ``out``.
        weights, slots, dp_weights, dp_slots: the tables and optimizer slots (donated).
        received, dp, kept: what :func:`forward` returned and was given.
        hyper: the optimizer's hyperparameters for this step.
        b: samples per device.

    Returns:
        ``(weights, slots, dp_weights, dp_slots, dots)``: the updated tables and
        slots and, with ``kept`` (the forward's entry rows, ``with_rows``), each
        entry's ``row . gradient of its bag``, the gradient of its gain (TorchRec's
        gradient of a per-id weight with SUM pooling), back on the entry's source
        device: ``[source, destination, C]`` per sharded group, ``[device, C]`` per
        data-parallel group.
    """
    L, D, axis = layout, layout.num_devices, tuple(mesh.axis_names)

    def entry_dots(rows_of_entries, rows, samples, g):
        """Each entry's row . its bag's gradient (0 for padding entries)."""
        bag = g[jnp.where(rows == PAD_ID, 0, samples)]
        return jnp.where(rows == PAD_ID, 0.0, jnp.sum(rows_of_entries * bag, axis=-1))

    def body(grad, weights, slots, dp_weights, dp_slots, received, dp, kept, hyper):
        group_grads, dp_grads = _shard_gradients(L, axis, grad, b)
        it = iter(dp_grads)
        kept_rows = iter(kept)
        new_w, new_s, dots = [], [], []
        for g, table, table_slots, (rows, samples, gains) in zip(group_grads, weights, slots, received):
            if kept:
                # [source * C] on the owner -> [1, destination, C] back on each source.
                d = entry_dots(next(kept_rows), rows, samples, g).reshape(D, 1, -1)
                dots.append(jax.lax.all_to_all(d, axis, 0, 1, tiled=True))
            rp = jnp.full((1,), rows.shape[0], jnp.int32)
            out = update(rp, rows, samples, gains, g, table, *table_slots, **hyper)
            out = out if isinstance(out, (tuple, list)) else (out,)
            new_w.append(out[0])
            new_s.append(list(out[1:]))
        new_dw, new_ds = [], []
        for dg, table, table_slots, (rows, samples, gains) in zip(L.dp_groups, dp_weights, dp_slots, dp):
            K, w = len(dg.slots), dg.width
            mine = next(it)
            if kept:
                me = jax.lax.axis_index(axis)
                flat_rows, flat_samples = rows.reshape(-1), samples.reshape(-1)
                local = jnp.where(flat_rows == PAD_ID, 0, flat_samples - me * K * b)
                dots.append(entry_dots(next(kept_rows), flat_rows, local, mine.reshape(K * b, w)).reshape(1, -1))
            # Every replica sees the whole batch's entries and gradients: the same update everywhere.
            g = jax.lax.all_gather(mine, axis, axis=0, tiled=True).reshape(D * K * b, w)
            rows, samples, gains = (
                jax.lax.all_gather(x.reshape(-1), axis, axis=0, tiled=True) for x in (rows, samples, gains)
            )
            rp = jnp.full((1,), rows.shape[0], jnp.int32)
            out = update(rp, rows, samples, gains, g, table, *table_slots, **hyper)
            out = out if isinstance(out, (tuple, list)) else (out,)
            new_dw.append(out[0])
            new_ds.append(list(out[1:]))
        return new_w, new_s, new_dw, new_ds, dots

    spec = P(axis)
    n_slots = len(slots[0]) if slots else len(dp_slots[0]) if dp_slots else 0
    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(
            spec,
            [spec] * len(weights),
            [[spec] * n_slots] * len(slots),
            [P()] * len(dp_weights),
            [[P()] * n_slots] * len(dp_slots),
            [(spec,) * 3] * len(received),
            [(spec,) * 3] * len(dp),
            [spec] * len(kept),
            {k: P() for k in hyper},
        ),
        out_specs=(
            [spec] * len(weights),
            [[spec] * n_slots] * len(slots),
            [P()] * len(dp_weights),
            [[P()] * n_slots] * len(dp_slots),
            [spec] * len(kept),
        ),
        check_vma=False,
    )
    return fn(grad, weights, slots, dp_weights, dp_slots, received, dp, kept, hyper)


def _shard_gradients(layout: Layout, axis: tuple, grad: jax.Array, b: int) -> tuple[list[Any], list[Any]]:
    """Inside :func:`backward`'s ``shard_map``: the gradient of each pooled row, where its entries are.

    Returns:
        ``(groups, dp)``: per sharded group ``[devices * slots * b, width]``, row ``s`` the gradient of
        the bag that the received entries of sample ``s`` pool into; per data-parallel group this
        device's ``[slots, b, width]``.
    """
    L, D = layout, layout.num_devices
    dest = jnp.asarray(L.dest_columns, jnp.int32)
    segments = np.cumsum(L.segments)[:-1].tolist()
    extended = jnp.concatenate([grad, jnp.zeros((b, 1), grad.dtype)], axis=1)
    it = iter(jnp.split(extended[:, dest], segments, axis=1) if segments else [extended[:, dest]])
    groups = []
    for grp in L.groups:
        K, K2, w = grp.num_slots, grp.num_a2a, grp.width
        a2a, rs = next(it), next(it)
        blocks = []
        if K2:
            sent = a2a.reshape(b, D, K2, w).transpose(1, 2, 0, 3)
            blocks.append(jax.lax.all_to_all(sent, axis, 0, 0, tiled=True))
        if K > K2:
            mine = rs.reshape(b, K - K2, w).transpose(1, 0, 2)
            blocks.append(jax.lax.all_gather(mine, axis, axis=0, tiled=False))
        groups.append(jnp.concatenate(blocks, axis=1).reshape(D * K * b, w))
    dp = [next(it).reshape(b, len(dg.slots), dg.width).transpose(1, 0, 2) for dg in L.dp_groups]
    return groups, dp


def summed_backward(
    layout: Layout,
    mesh: Mesh,
    update: Callable[..., Any],
    lookups: Sequence[tuple[jax.Array, list[tuple[jax.Array, ...]], list[tuple[jax.Array, ...]]]],
    weights: list[jax.Array],
    slots: list[list[jax.Array]],
    dp_weights: list[jax.Array],
    dp_slots: list[list[jax.Array]],
    hyper: dict[str, Any],
    bs: Sequence[int],
) -> tuple[list[jax.Array], list[list[jax.Array]], list[jax.Array], list[list[jax.Array]]]:
    """One optimizer update on the summed gradient of several lookups (``apply_optimizer_in_backward``'s).

    Each lookup's gradients reach its entries as in :func:`backward`; then, per group, the entries of
    all lookups go to the update kernel together, a lookup's samples shifted past the bags of the
    lookups before it (as if the lookups were one batch). The kernels sum a row's gradient over all
    its entries before they update it: one update on the summed gradient.

    Args:
        layout, mesh, update, weights, slots, dp_weights, dp_slots, hyper: as :func:`backward`.
        lookups: per lookup, ``(grad, received, dp)``: the gradient of its forward's ``out``, the
            entries its shards received and its data-parallel entries.
        bs: per lookup, its samples per device (none 0).

    Returns:
        ``(weights, slots, dp_weights, dp_slots)``, updated.
    """
    L, D, axis = layout, layout.num_devices, tuple(mesh.axis_names)

    def shifted(samples, rows, offset):
        return jnp.where(rows == PAD_ID, samples, samples + offset)

    def updated(parts, table, table_slots, hyper):
        # The lookups' entries as one CSR input (samples already shifted per lookup), one update.
        rows, samples, gains, g = (jnp.concatenate(x) for x in zip(*parts))
        rp = jnp.full((1,), rows.shape[0], jnp.int32)
        out = update(rp, rows, samples, gains, g, table, *table_slots, **hyper)
        out = out if isinstance(out, (tuple, list)) else (out,)
        return out[0], list(out[1:])

    def body(grads, receiveds, dps, weights, slots, dp_weights, dp_slots, hyper):
        per_lookup = [_shard_gradients(L, axis, grad, b) for grad, b in zip(grads, bs)]
        new_w, new_s = [], []
        for k, (grp, table, table_slots) in enumerate(zip(L.groups, weights, slots)):
            K, offset, parts = grp.num_slots, 0, []
            for (groups, _), received, b in zip(per_lookup, receiveds, bs):
                rows, samples, gains = received[k]
                parts.append((rows, shifted(samples, rows, offset), gains, groups[k]))
                offset += D * K * b
            w, ss = updated(parts, table, table_slots, hyper)
            new_w.append(w)
            new_s.append(ss)
        new_dw, new_ds = [], []
        for k, (dg, table, table_slots) in enumerate(zip(L.dp_groups, dp_weights, dp_slots)):
            K, offset, parts = len(dg.slots), 0, []
            for (_, dp_grads), dp, b in zip(per_lookup, dps, bs):
                # Every replica sees the whole batch's entries and gradients: the same update everywhere.
                g = jax.lax.all_gather(dp_grads[k], axis, axis=0, tiled=True).reshape(D * K * b, dg.width)
                rows, samples, gains = (jax.lax.all_gather(x.reshape(-1), axis, axis=0, tiled=True) for x in dp[k])
                parts.append((rows, shifted(samples, rows, offset), gains, g))
                offset += D * K * b
            w, ss = updated(parts, table, table_slots, hyper)
            new_dw.append(w)
            new_ds.append(ss)
        return new_w, new_s, new_dw, new_ds

    spec = P(axis)
    n_slots = len(slots[0]) if slots else len(dp_slots[0]) if dp_slots else 0
    n = len(lookups)
    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(
            [spec] * n,
            [[(spec,) * 3] * len(L.groups)] * n,
            [[(spec,) * 3] * len(L.dp_groups)] * n,
            [spec] * len(weights),
            [[spec] * n_slots] * len(slots),
            [P()] * len(dp_weights),
            [[P()] * n_slots] * len(dp_slots),
            {k: P() for k in hyper},
        ),
        out_specs=(
            [spec] * len(weights),
            [[spec] * n_slots] * len(slots),
            [P()] * len(dp_weights),
            [[P()] * n_slots] * len(dp_slots),
        ),
        check_vma=False,
    )
    grads = [grad for grad, _, _ in lookups]
    receiveds = [list(received) for _, received, _ in lookups]
    dps = [list(dp) for _, _, dp in lookups]
    return fn(grads, receiveds, dps, weights, slots, dp_weights, dp_slots, hyper)


def make_programs(
    forward_fn: Callable[..., Any], backward_fn: Callable[..., Any], b: int, with_rows: bool
) -> tuple[Program, Program]:
    """The compiled forward and backward pair for ``b`` samples per device.

    Args:
        forward_fn: ``forward`` with the layout, mesh and kernel bound (``(*arrays, b, with_rows)``).
        backward_fn: ``backward`` bound the same way (``(*arrays, b)``).
        b: samples per device.
        with_rows: the pair that also gives per-id weights their gradient.
    """
    return (
        Program(lambda *a: forward_fn(*a, b=b, with_rows=with_rows)),
        # The tables and slots are updated in place: their buffers are donated.
        Program(lambda *a: backward_fn(*a, b=b), donate_argnums=(1, 2, 3, 4)),
    )


def id_weight_gradient(
    dots: Sequence[jax.Array], origins: Sequence[tuple[np.ndarray, np.ndarray]], num_ids: int
) -> np.ndarray:
    """The gradient of this process's KJT weights (KJT value order) from :func:`backward`'s ``dots``.

    Args:
        dots: per group, each entry's gradient of its gain, ``[source device, ...]``.
        origins: per group, ``(flat entry position, KJT value index)`` of this
            process's kept entries (``InputRouter.pack``'s ``origins``).
        num_ids: ids in this process's KJT.
    """
    id_grad = np.zeros(num_ids, np.float64)
    for (flat, origin), group_dots in zip(origins, dots):
        # This process's rows of the [source device, ...] array: its own entries, in the
        # flat order the router numbered them. A column-wise id adds one term per column block.
        shards = sorted(group_dots.addressable_shards, key=lambda shard: shard.index[0].start or 0)
        local = np.concatenate([np.asarray(shard.data) for shard in shards])
        np.add.at(id_grad, origin, local.reshape(-1)[flat].astype(np.float64))
    return id_grad.astype(np.float32)
