"""The sharded programs lower for platform "tpu": SparseCore custom calls on each shard's local stack.

Checked on CPU with ``jax.export`` as the single-device kernels are
(tests/sparse/test_tpu_kernel.py): the per-shard lookups and optimizer updates
must be the jax-tpu-embedding primitives on the device-local CSR and table
shapes, next to the all_to_all / reduce_scatter / all_gather collectives.
"""

from __future__ import annotations

import functools
import re

import jax
import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagCollection as TorchrecEBC
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingPlan

import tpurec
import tpurec.sparse as sp
from helpers import make_tables, random_kjt

pytest.importorskip("jax_tpu_embedding.sparsecore.lib.nn.embedding")
from tpurec.sparse.kernels import tpu  # noqa: E402

NUM_SC = 4
DISABLED = [jax.export.DisabledSafetyCheck.custom_call(t) for t in tpu.CUSTOM_CALL_TARGETS]
TABLES = make_tables(dims=(8, 8, 16, 8), rows=(40, 23, 17, 30), features=(("f0", "f1"), ("f2",), ("f3",), ("f4",)))


def _sharded():
    torch.manual_seed(0)
    ebc = sp.EmbeddingBagCollection(TABLES, optimizer=sp.Adagrad(learning_rate=0.1), device="tpu")
    meta = TorchrecEBC(tables=TABLES, device=torch.device("meta"))
    plan = construct_module_sharding_plan(
        meta,
        {"t0": table_wise(rank=3), "t1": row_wise(), "t2": column_wise(ranks=[1, 6]), "t3": data_parallel()},
        local_size=8,
        world_size=8,
        device_type="cpu",
    )
    sharded = tpurec.shard(ebc, ShardingPlan({"": plan}))
    # What kernel_for picks on a TPU, with the SparseCore count given (there is no TPU here).
    sharded._kernel = lambda name: functools.partial(getattr(tpu, name), num_sc_per_device=NUM_SC)
    return sharded


def _calls(text: str, target: str) -> list[str]:
    return [line for line in text.splitlines() if f"stablehlo.custom_call @{target}(" in line]


@pytest.mark.parametrize("with_rows", [False, True], ids=["plain", "per_id_weight_gradients"])
def test_sharded_forward_and_backward_export_for_tpu(with_rows):
    sharded = _sharded()
    L = sharded.layout
    batch = sharded.distribute_input(random_kjt(TABLES, 16, np.random.default_rng(0)))
    b = batch["per_device"]
    weights, slots = sharded._arrays("shard", len(L.groups))
    dp_weights, dp_slots = sharded._arrays("dp", len(L.dp_groups))
    forward = jax.export.export(
        jax.jit(lambda *a: sharded._forward_fn(*a, b=b, with_rows=with_rows)),
        platforms=["tpu"],
        disabled_checks=DISABLED,
    )(weights, dp_weights, batch["groups"], batch["dp"])
    text = forward.mlir_module()
    lookups = _calls(text, "SparseDenseMatmulOp")
    assert len(lookups) == len(L.groups) + len(L.dp_groups) == 2  # one stack of width 8 (t2 splits 8 + 8), one DP
    # Each shard's lookup reads its device-local stack (rows padded to 8 * SparseCores), not the global array.
    for grp in L.groups:
        rows = -(-grp.rows_per_device // (8 * NUM_SC)) * 8 * NUM_SC
        assert any(f"tensor<{rows}x{grp.width}xf32>" in call for call in lookups), (grp.rows_per_device, grp.width)
    assert "all_to_all" in text and "reduce_scatter" in text

    out_shape = (16, L.total_dim)
    grad = jax.ShapeDtypeStruct(
        out_shape,
        np.float32,
        sharding=jax.sharding.NamedSharding(sharded.mesh, jax.sharding.PartitionSpec(sharded.axis)),
    )
    _, received, kept = jax.eval_shape(
        lambda *a: sharded._forward_fn(*a, b=b, with_rows=with_rows), weights, dp_weights, batch["groups"], batch["dp"]
    )
    received = [
        tuple(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s.sharding) for x, s in zip(r, g))
        for r, g in zip(received, batch["groups"])
    ]
    kept = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=grad.sharding) for x in kept]
    assert len(kept) == (len(L.groups) + len(L.dp_groups) if with_rows else 0)
    hyper = {k: jax.ShapeDtypeStruct((), np.float32) for k in sharded.optimizer.hyperparameters(1)}
    backward = jax.export.export(
        jax.jit(lambda *a: sharded._backward_fn(*a, b=b)), platforms=["tpu"], disabled_checks=DISABLED
    )(grad, weights, slots, dp_weights, dp_slots, received, batch["dp"], kept, hyper)
    text = backward.mlir_module()
    updates = _calls(text, "SparseDenseMatmulGradOpWithOptimizerUpdate")
    assert len(updates) == len(L.groups) + len(L.dp_groups)
    assert all(re.search(r"num_slot_variables\\22: 1", call) for call in updates)
    assert "all_to_all" in text and "all_gather" in text
