"""Top-level functions of the ``tpurec`` namespace that are not a re-export of one module's.

``shard`` keeps the sharding stack (``tpurec.sparse``, the planner) unloaded until its
first call, so ``import tpurec`` stays as light as a dense model needs; its signature
is the implementation's, written out so that editors and type checkers see it
(``tests/test_public_api.py`` checks that the two match).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from tpurec.core import flush as _flush

if TYPE_CHECKING:
    from jax.sharding import Mesh
    from torch import nn

    from tpurec.sparse.optimizers import EmbeddingOptimizer

__all__ = ["flush", "shard"]


def flush(reason: str = "flush") -> None:
    """Runs the ops recorded in fused mode now, as one program, without waiting for it.

    ``torch.tpu.synchronize()`` does the same and then waits for the device;
    ``flush`` only dispatches (XLA runs programs asynchronously), so the host can
    prepare the next step while the device runs this one. Call it at a step
    boundary so every step is the same cached program even if no value is read.
    Nothing happens in eager and debug modes, or when nothing is recorded.

    Args:
        reason: the label this flush is counted under in
            ``tpurec.stats()["sync_points"]`` (e.g. ``"step"``).

    Raises:
        TypeError: ``reason`` is not a non-empty string.

    Example::

        with tpurec.mode("fused"):
            for batch in loader:
                loss = model(batch).sum()
                loss.backward()
                optimizer.step()
                tpurec.flush("step")
    """
    if not isinstance(reason, str) or not reason:
        raise TypeError(f"flush(reason) takes a non-empty string (the stats label), got {reason!r}")
    _flush(reason)


def shard(
    model: nn.Module,
    plan: Any = None,
    mesh: Mesh | None = None,
    *,
    optimizer: EmbeddingOptimizer | type | None = None,
    optimizer_kwargs: dict[str, Any] | None = None,
    capacity: int | None = None,
    overflow: Literal["error", "drop"] = "error",
    planner_batch_size: int = 4096,
    seed: int = 0,
) -> nn.Module:
    """Shards ``model``'s embedding tables by ``plan`` over ``mesh`` and makes its dense part data-parallel.

    Embedding tables and their optimizer slots become sharded arrays laid out as
    the plan says; every other parameter and buffer is replicated on the mesh,
    and tensor arguments of ``model``'s forward are split over the mesh along
    their first (batch) dim. The first call imports the sharding stack.

    Args:
        model: a model on ``tpu`` holding tpurec ``EmbeddingBagCollection`` s or
            sequence ``EmbeddingCollection`` s (e.g. from
            ``tpurec.sparse.from_torchrec(...).to("tpu")``), or one such collection.
            Their tables may be on ``meta`` (e.g. ``from_torchrec(model, device="meta")``):
            then each shard is created on its device and the rest of the model is
            moved to ``tpu`` from the host.
        plan: a torchrec ``ShardingPlan`` (module path -> table plans), or one
            module's table plan. None asks the TPU planner.
        mesh: a ``jax.sharding.Mesh``; plan rank ``r`` is ``mesh.devices.flat[r]``.
            Default: every device, ordered by process.
        optimizer: a fused embedding optimizer replacing the collections' own.
        optimizer_kwargs: its keyword arguments when ``optimizer`` is a torch class.
        capacity: entries a device may send one shard per step (None: grow on demand).
        overflow: ``"error"`` or ``"drop"`` when a batch exceeds ``capacity``.
        planner_batch_size: global batch size the planner assumes (``plan=None``).
        seed: for collections whose tables are on ``meta``: every shard is born
            on its own device from ``(seed, table name, row, column)``, so no
            process holds a whole table and the same seed gives the same tables
            under any plan or mesh (the config's distribution, see
            :mod:`tpurec.sparse.table_init`); optimizer slots start at zero. Every
            process must pass the same seed. Unused for tables with values.

    Returns:
        ``model`` with its collections replaced by sharded ones (the sharded
        collection itself when ``model`` is one).

    Raises:
        ValueError, TypeError: a bad plan or mesh; raised before anything changes.
        NotImplementedError: a table on ``meta`` whose ``init_fn`` cannot be applied
            shard by shard; raised before anything changes.

    Example::

        plan = construct_module_sharding_plan(torchrec_ebc, {"t0": table_wise(rank=0), "t1": row_wise()},
                                              local_size=8, world_size=8, device_type="tpu")
        sharded = tpurec.shard(model, {"sparse_arch.embedding_bag_collection": plan})

    See :func:`tpurec.sparse.sharding.shard` for the full description.
    """
    from tpurec.sparse.sharding import shard as _shard  # on first use: import tpurec stays dense-only

    return _shard(
        model,
        plan,
        mesh,
        optimizer=optimizer,
        optimizer_kwargs=optimizer_kwargs,
        capacity=capacity,
        overflow=overflow,
        planner_batch_size=planner_batch_size,
        seed=seed,
    )
