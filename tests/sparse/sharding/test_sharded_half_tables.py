"""tpurec.shard on 8 CPU devices: FP16/BF16 tables train as the unsharded collection trains them.

The sharded stacks are global arrays of the tables' dtype with float32 optimizer slots; each
step's row math is float32 and the new weights are rounded back once (FBGEMM's CPU kernels,
which the unsharded collection's own tests follow). Tables, slots and pooled outputs are
compared bit for bit with the unsharded collection trained on the same batches.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import torch
from jax.sharding import Mesh
from torchrec import EmbeddingBagCollection as TorchrecEBC
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import DataType

import tpurec
import tpurec.sparse as sp
from helpers import make_tables, random_kjt
from tpurec.sparse.sharding import ShardedEmbeddingBagCollection

# Three tables of the half dtype (two of one dim share a stack unsharded) and an FP32 table of
# the same dim, which must not share the half tables' stack.
BASE = make_tables(dims=(8, 8, 4, 8), rows=(40, 23, 17, 30), features=(("f0", "f1"), ("f2",), ("f3",), ("f4",)))

GENERATORS = {
    "table_wise": lambda i: table_wise(rank=(3 * i + 1) % 8),
    "row_wise": lambda i: row_wise(),
    "column_wise": lambda i: column_wise(ranks=[i % 8, (i + 5) % 8]),
    "data_parallel": lambda i: data_parallel(),
}

OPTIMIZERS = {
    "sgd": lambda: sp.SGD(learning_rate=0.1),
    "adagrad": lambda: sp.Adagrad(learning_rate=0.1),
    "rowwise_adagrad": lambda: sp.RowWiseAdagrad(learning_rate=0.1, weight_decay=0.01),
}

# Column shards of a row-wise Adagrad table keep one accumulator per shard (as TorchRec's): not the
# unsharded collection's, in any dtype.
CASES = [
    (dtype, kind, opt)
    for dtype in ("FP16", "BF16")
    for kind in GENERATORS
    for opt in OPTIMIZERS
    if not (kind == "column_wise" and opt == "rowwise_adagrad")
]


HALF = 2 * 8 + 8 + 4
"""Output columns of the half tables (t0's two features, t1, t2); the FP32 table's follow."""

FP32_ATOL = 1e-6
"""The FP32 table (float32 sums in another order), as test_sharded_training.py compares its tables."""


def _close(got, want, err_msg=""):
    np.testing.assert_allclose(got, want, atol=FP32_ATOL, rtol=0, err_msg=err_msg)


def _tables(dtype: DataType):
    return [dataclasses.replace(t, data_type=dtype if i < 3 else DataType.FP32) for i, t in enumerate(BASE)]


def _plan(tables, kind: str) -> ShardingPlan:
    meta = TorchrecEBC(tables=tables, device=torch.device("meta"))
    generators = {t.name: GENERATORS[kind](i) for i, t in enumerate(tables)}
    return ShardingPlan(
        {"": construct_module_sharding_plan(meta, generators, local_size=8, world_size=8, device_type="cpu")}
    )


def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().to(torch.float32).numpy()


@pytest.mark.parametrize("dtype, kind, opt", CASES)
def test_half_tables_train_bit_equal_to_unsharded(dtype, kind, opt):
    tables = _tables(DataType[dtype])
    torch.manual_seed(0)
    reference = sp.EmbeddingBagCollection(tables, optimizer=OPTIMIZERS[opt](), device="tpu")
    source = sp.EmbeddingBagCollection(tables, optimizer=OPTIMIZERS[opt](), device="tpu")
    source.load_state_dict(reference.state_dict())
    sharded = tpurec.shard(source, _plan(tables, kind))
    assert isinstance(sharded, ShardedEmbeddingBagCollection)
    torch_dtype = {"FP16": torch.float16, "BF16": torch.bfloat16}[dtype]
    assert {p.dtype for p in sharded.parameters()} == {torch_dtype, torch.float32}
    assert {b.dtype for b in sharded.buffers()} == ({torch.float32} if opt != "sgd" else set())
    start = {t.name: _host(reference.table_weight(t.name)) for t in tables}
    rng = np.random.default_rng(7)
    for step in range(5):
        kjt = random_kjt(tables, 16, rng)
        want, got = reference(kjt).values(), sharded(kjt).values()
        got_host, want_host = _host(got), _host(want)
        np.testing.assert_array_equal(got_host[:, :HALF], want_host[:, :HALF], err_msg=f"output of step {step}")
        np.testing.assert_allclose(got_host[:, HALF:], want_host[:, HALF:], atol=FP32_ATOL, rtol=0)
        (want * want).sum().backward()
        (got * got).sum().backward()
    got_tables, got_slots = sharded.full_tables()
    want_slots = reference.optimizer_state_dict()["state"]
    for t in tables:
        want_table = _host(reference.table_weight(t.name))
        # The FP32 table: the native kernels of either side add a bag's rows in their own order.
        equal = np.testing.assert_array_equal if t.data_type != DataType.FP32 else _close
        equal(got_tables[t.name], want_table, err_msg=t.name)
        for name, value in got_slots[t.name].items():
            equal(value, _host(want_slots[f"embedding_bags.{t.name}.weight"][name]), err_msg=f"{t.name} {name}")
        assert not np.array_equal(want_table, start[t.name]), f"{t.name} did not train"
    # The state dict has the unsharded collection's keys, dtypes and values.
    want_state, got_state = reference.state_dict(), sharded.state_dict()
    assert set(got_state) == set(want_state)
    for key, value in want_state.items():
        assert got_state[key].dtype == value.dtype, key
        atol = FP32_ATOL if value.dtype == torch.float32 else 0
        torch.testing.assert_close(got_state[key], value.cpu(), atol=atol, rtol=0)


def test_adam_is_refused_for_half_tables():
    tables = _tables(DataType.FP16)
    ebc = sp.EmbeddingBagCollection(tables, optimizer=sp.SGD(learning_rate=0.1), device="tpu")
    with pytest.raises(ValueError, match="FP16/BF16 and the optimizer is Adam"):
        tpurec.shard(ebc, _plan(tables, "row_wise"), optimizer=sp.Adam(learning_rate=0.1))


# --- sharded checkpoints keep the tables' dtype ------------------------------------------------------


def _sharded(tables, plan: dict, devices: int, seed: int):
    torch.manual_seed(seed)
    ebc = sp.EmbeddingBagCollection(tables, optimizer=sp.Adagrad(learning_rate=0.1), device="tpu")
    meta = TorchrecEBC(tables=tables, device=torch.device("meta"))
    module_plan = construct_module_sharding_plan(meta, plan, local_size=devices, world_size=devices, device_type="cpu")
    mesh = Mesh(np.array(jax.devices()[:devices]), ("devices",))
    sharded = tpurec.shard(ebc, ShardingPlan({"": module_plan}), mesh)
    assert isinstance(sharded, ShardedEmbeddingBagCollection)
    return sharded


@pytest.mark.parametrize("dtype", ["FP16", "BF16"])
def test_sharded_checkpoint_of_half_tables_loads_on_another_plan_bit_identical(tmp_path, dtype):
    from tpurec.sparse.checkpoint import sharded as checkpoint

    tables = _tables(DataType[dtype])
    saved = _sharded(
        tables, {"t0": table_wise(rank=5), "t1": row_wise(), "t2": table_wise(rank=2), "t3": row_wise()}, 8, 0
    )
    rng = np.random.default_rng(3)
    for _ in range(2):
        out = saved(random_kjt(tables, 16, rng)).values()
        (out * out).sum().backward()
    checkpoint.save(saved, tmp_path / "ckpt")
    loaded = _sharded(
        tables, {"t0": row_wise(), "t1": column_wise(ranks=[0, 3]), "t2": row_wise(), "t3": table_wise(rank=1)}, 4, 1
    )
    checkpoint.load(loaded, tmp_path / "ckpt")
    want_tables, want_slots = saved.full_tables()
    got_tables, got_slots = loaded.full_tables()
    for name in want_tables:
        np.testing.assert_array_equal(got_tables[name], want_tables[name])
        np.testing.assert_array_equal(got_slots[name]["momentum1"], want_slots[name]["momentum1"])
    torch_dtype = {"FP16": torch.float16, "BF16": torch.bfloat16}[dtype]
    assert {p.dtype for p in loaded.parameters()} == {torch_dtype, torch.float32}
    # A model whose tables are of another dtype refuses the checkpoint.
    other = _sharded(
        _tables(DataType.FP16 if dtype == "BF16" else DataType.BF16), {t.name: row_wise() for t in tables}, 8, 0
    )
    with pytest.raises(ValueError, match="has dtype"):
        checkpoint.load(other, tmp_path / "ckpt")
