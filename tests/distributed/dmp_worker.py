"""One rank of the TorchRec DistributedModelParallel tests (``torchrun --nproc-per-node N dmp_worker.py OUT PLAN[,PLAN...]``).

The model is TorchRec's own ``EmbeddingBagCollection``, sharded by TorchRec's own
``DistributedModelParallel`` on the ``tpu`` device with a plan from TorchRec's
``EmbeddingShardingPlanner`` (every table constrained to the sharding type ``PLAN`` names,
or a mix of them) and TorchRec's ``UNFUSED_TPU`` compute kernel. The tables start from the
weights of the reference model (loaded with ``load_state_dict`` as whole tensors), train
``STEPS`` steps of ``torch.optim.SGD(model.parameters())`` on this rank's slice of every global
batch, the trained ``state_dict`` loads into a freshly sharded model (equal tables and lookups),
and each rank writes
``OUT.<PLAN>.<rank>.npz``: its local shards (with their offsets), its first forward's values,
its shards' gradients of the first step and the global loss of every step. The test assembles the tables and compares them with :func:`reference`,
the same model trained by TorchRec on CPU in one process on the whole batch.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import sys
from collections import OrderedDict
from typing import Any, cast

import numpy as np

GLOBAL_BATCH = 8
STEPS = 10
LEARNING_RATE = 0.05
# name, rows, dim (the UNFUSED_TPU kernel takes dims that are multiples of 16; t3 splits
# column-wise into two shards of 16).
TABLES = (("t0", 12, 16), ("t1", 16, 16), ("t2", 10, 16), ("t3", 14, 32))
# Each table's sharding type in the mixed plan.
MIXED = {"t0": "table_wise", "t1": "row_wise", "t2": "table_wise", "t3": "column_wise"}
# "ec_*": an EmbeddingCollection (unpooled lookups; one dim for every table) sharded that way.
# "stacked": column-wise with t3 of dim 64, four column shards of 16, so that on 2 ranks each
# holds several column shards of one table. "table_row_wise" and "grid_shard" need hosts
# (torchrun's nodes): each table's shards are on the ranks of one host (grid: a host per column
# shard).
PLANS = (
    "table_wise", "row_wise", "column_wise", "mixed", "table_row_wise", "grid_shard", "stacked",
    "ec_row_wise", "ec_table_wise",
)  # fmt: skip


def _tables(plan: str) -> tuple[tuple[str, int, int], ...]:
    """The tables of the collection ``plan`` shards (an EmbeddingCollection's all have dim 16)."""
    if plan.startswith("ec_"):
        return tuple((n, r, 16) for n, r, _d in TABLES)
    if plan == "stacked":
        return tuple((n, r, 64 if n == "t3" else d) for n, r, d in TABLES)
    return TABLES


def sharding_types(plan: str) -> dict[str, str]:
    """Each table's sharding type in ``plan``."""
    kind = plan.removeprefix("ec_")
    if kind == "stacked":
        kind = "column_wise"
    return {name: MIXED[name] if kind == "mixed" else kind for name, _r, _d in TABLES}


def _collection(plan: str, device: str):
    """TorchRec's EmbeddingBagCollection (or EmbeddingCollection for "ec_*" plans) of the tables."""
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig

    if plan.startswith("ec_"):
        configs = [
            EmbeddingConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f{n}"])
            for n, r, d in _tables(plan)
        ]
        return EmbeddingCollection(tables=configs, device=torch.device(device))
    bag_configs = [
        EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f{n}"])
        for n, r, d in _tables(plan)
    ]
    return EmbeddingBagCollection(tables=bag_configs, device=torch.device(device))


def _weights(plan: str) -> dict[str, np.ndarray]:
    """The tables' starting values."""
    rng = np.random.default_rng(0)
    return {n: rng.uniform(-0.5, 0.5, (r, d)).astype(np.float32) for n, r, d in _tables(plan)}


def _batches():
    """STEPS global batches: per feature, per sample 0-3 ids; a target per sample."""
    rng = np.random.default_rng(1)
    for _ in range(STEPS):
        ids = {}
        for n, rows, _d in TABLES:
            lengths = rng.integers(0, 4, GLOBAL_BATCH)
            ids[n] = [rng.integers(0, rows, int(k)).tolist() for k in lengths]
        yield ids, rng.standard_normal(GLOBAL_BATCH).astype(np.float32)


def _kjt(ids: dict[str, list[list[int]]], samples: slice):
    import torch
    from torchrec import KeyedJaggedTensor

    keys = [f"f{n}" for n, _r, _d in TABLES]
    lengths = [len(s) for n, _r, _d in TABLES for s in ids[n][samples]]
    values = [v for n, _r, _d in TABLES for s in ids[n][samples] for v in s]
    return KeyedJaggedTensor(
        keys=keys, values=torch.tensor(values, dtype=torch.int64), lengths=torch.tensor(lengths, dtype=torch.int64)
    )


def _pooled(kt):
    """The pooled embeddings in the order of TABLES (a sharded collection orders its keys by shard)."""
    import torch

    by_key = kt.to_dict()
    return torch.cat([by_key[f"f{n}"] for n, _r, _d in TABLES], dim=1)


def _loss(pooled, target, mix):
    """Mean squared error of a fixed projection of the pooled embeddings (no dense parameters)."""
    return ((pooled * mix).sum(1) - target).pow(2).mean()


def _sequence_loss(out, samples: int, mix):
    """An EmbeddingCollection's loss: every looked-up row's squared projection, summed, per sample."""
    import torch

    parts = [
        (((out[f"f{n}"].values() * mix[16 * i : 16 * (i + 1)]).sum(1) - 0.1) ** 2).sum()
        for i, (n, _r, _d) in enumerate(TABLES)
    ]
    return torch.stack(parts).sum() / samples


def _step_loss(plan: str, out, target, mix, samples: int):
    """The loss of one step: the pooled loss for an EmbeddingBagCollection, else the sequence loss."""
    if plan.startswith("ec_"):
        return _sequence_loss(out, samples, mix)
    return _loss(_pooled(out), target, mix)


def _mix(plan: str, device: str = "cpu"):
    import torch

    dims = sum(d for _n, _r, d in _tables(plan))
    return torch.from_numpy(np.random.default_rng(2).uniform(-1, 1, dims).astype(np.float32)).to(device)


def _table_modules(plan: str, collection) -> dict:
    modules = collection.embeddings if plan.startswith("ec_") else collection.embedding_bags
    return {n: modules[n] for n, _r, _d in TABLES}


def _forward_values(plan: str, out) -> np.ndarray:
    """A forward's values in the order of TABLES: the pooled ``[samples, dims]`` of an
    EmbeddingBagCollection, or an EmbeddingCollection's looked-up rows of every feature stacked."""
    import torch

    if plan.startswith("ec_"):
        return torch.cat([out[f"f{n}"].values() for n, _r, _d in TABLES]).detach().cpu().numpy()
    return _pooled(out).detach().cpu().numpy()


def _reference_model(plan: str):
    """TorchRec's collection on CPU with the starting tables; its table modules by name."""
    import torch

    collection = _collection(plan, "cpu")
    tables = _table_modules(plan, collection)
    with torch.no_grad():
        for n, w in _weights(plan).items():
            tables[n].weight.copy_(torch.from_numpy(w))
    return collection, tables


def reference(plan: str = "table_wise") -> tuple[list[float], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The same TorchRec collection on CPU, one process, the whole batch: losses, final tables and
    the tables' gradients of the first step."""
    import torch

    collection, tables = _reference_model(plan)
    optimizer = torch.optim.SGD(collection.parameters(), lr=LEARNING_RATE)
    mix, losses, first_grads = _mix(plan), [], {}
    for ids, target in _batches():
        optimizer.zero_grad()
        loss = _step_loss(plan, collection(_kjt(ids, slice(None))), torch.from_numpy(target), mix, GLOBAL_BATCH)
        loss.backward()
        if not first_grads:
            first_grads = {n: cast(torch.Tensor, tables[n].weight.grad).numpy().copy() for n, _r, _d in TABLES}
        optimizer.step()
        losses.append(loss.item())
    return losses, {n: tables[n].weight.detach().numpy() for n, _r, _d in TABLES}, first_grads


def reference_forward(plan: str, rank: int, ranks: int) -> np.ndarray:
    """The CPU collection's first forward (starting tables) on rank ``rank``'s slice of the first batch."""
    import torch

    collection, _tables_by_name = _reference_model(plan)
    ids, _target = next(iter(_batches()))
    local = GLOBAL_BATCH // ranks
    with torch.no_grad():
        return _forward_values(plan, collection(_kjt(ids, slice(rank * local, (rank + 1) * local))))


def train_sharded(out_path: str, plan_name: str) -> None:
    """Shards the collection with the plan ``plan_name`` names, trains it, writes ``OUT.<plan>.<rank>.npz``."""
    import torch
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torchrec.distributed.comm import get_local_size
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ModuleSharder

    from tpurec.dmp.placements import on_process_devices

    rank, n = dist.get_rank(), dist.get_world_size()

    # TorchRec's planner, for the tpu device; one device per process, so each rank's shards live on
    # its tpu:0 (local_world_size=1 makes the plan's placements say so). Table-row-wise and grid
    # plans place a table on the ranks of a host: the hosts are torchrun's nodes, and
    # on_process_devices points each shard's placement at its rank's tpu:0.
    types = sharding_types(plan_name)
    hosts_matter = plan_name in ("table_row_wise", "grid_shard")
    local_world_size = get_local_size(n) if hosts_matter else 1
    constraints = {
        name: ParameterConstraints(sharding_types=[types[name]], compute_kernels=["unfused_tpu"], min_partition=16)
        for name, _r, _d in TABLES
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=n, compute_device="tpu", local_world_size=local_world_size),
        constraints=constraints,
    )
    ec = plan_name.startswith("ec_")
    sharder = cast(
        ModuleSharder[torch.nn.Module], EmbeddingCollectionSharder() if ec else EmbeddingBagCollectionSharder()
    )
    collection = _collection(plan_name, "meta")
    plan = on_process_devices(planner.collective_plan(collection, [sharder], dist.GroupMember.WORLD))
    got = {name: p.sharding_type for name, p in plan.plan[""].items()}  # pyright: ignore[reportAttributeAccessIssue]
    if got != types:
        raise AssertionError(f"the planner chose {got}, not {types}")

    def shard_it() -> DistributedModelParallel:
        return DistributedModelParallel(
            _collection(plan_name, "meta"), device=torch.device("tpu"), plan=plan, sharders=[sharder]
        )

    model = shard_it()
    prefix = "embeddings" if ec else "embedding_bags"

    # The reference's starting tables, loaded as whole (unsharded) tensors: the sharded module's
    # load_state_dict hook cuts each rank's shards out of them.
    start = _weights(plan_name)
    result = model.load_state_dict(
        OrderedDict((f"{prefix}.{name}.weight", torch.from_numpy(w)) for name, w in start.items())
    )
    if result.missing_keys or result.unexpected_keys:
        raise AssertionError(f"loading the starting tables: {result}")
    state = model.state_dict()
    for name, _r, _d in TABLES:
        table = state[f"{prefix}.{name}.weight"]
        if not isinstance(table, ShardedTensor):
            raise AssertionError(f"{name}: the state_dict holds a {type(table).__name__}, not a ShardedTensor")
        for shard in table.local_shards():
            (r0, c0), (rows, cols) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            if shard.tensor.device.type != "tpu":
                raise AssertionError(f"{name}: a shard lives on {shard.tensor.device}")
            np.testing.assert_array_equal(
                shard.tensor.detach().cpu().numpy(), start[name][r0 : r0 + rows, c0 : c0 + cols], err_msg=name
            )

    # The tables are the model's parameters: each table's parameter (<table>.weight of the
    # sharded module) is one of model.parameters() and holds its local shards, the tensors the
    # lookups read: the shard itself, or several column shards of the table stacked
    # ([shards * rows, cols]). So a plain optimizer over them trains the tables. A table with no
    # shard on this rank is an empty placeholder that gets no gradient.
    parameters = list(model.parameters())
    owners = cast(Any, model.module).embeddings if ec else cast(Any, model.module).embedding_bags
    table_parameters = {name: owners[name].weight for name, _r, _d in TABLES}
    for name, parameter in table_parameters.items():
        if not any(parameter is p for p in parameters):
            raise AssertionError(f"{name}: the table's parameter is not one of model.parameters()")
        local_shards = state[f"{prefix}.{name}.weight"].local_shards()
        if len(local_shards) == 1 and local_shards[0].tensor is not parameter:
            raise AssertionError(f"{name}: the state_dict's local shard is not the table's parameter")
        flat = [shard.tensor.detach().cpu().reshape(-1) for shard in local_shards]
        np.testing.assert_array_equal(
            parameter.detach().cpu().reshape(-1).numpy(), torch.cat(flat).numpy() if flat else np.zeros(0), name
        )
    if any(p.numel() for p in parameters if not any(p is t for t in table_parameters.values())):
        raise AssertionError("model.parameters() holds a non-empty tensor that is no table's parameter")
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    mix, losses = _mix(plan_name, "tpu"), []
    local = GLOBAL_BATCH // n
    shards: dict[str, np.ndarray] = {}
    for step, (ids, target) in enumerate(_batches()):
        optimizer.zero_grad()
        samples = slice(rank * local, (rank + 1) * local)
        out = model(_kjt(ids, samples).to(torch.device("tpu"))).wait()
        loss = _step_loss(plan_name, out, torch.from_numpy(target[samples]).to("tpu"), mix, local)
        loss.backward()
        if step == 0:
            # The first forward's values and the tables' gradients, each local shard's part of its
            # table parameter's gradient (the shards in the state_dict's order, as stacked).
            shards["forward"] = _forward_values(plan_name, out)
            for name, parameter in table_parameters.items():
                local_shards = state[f"{prefix}.{name}.weight"].local_shards()
                if not local_shards:
                    continue
                grad = cast(torch.Tensor, parameter.grad).detach().cpu().reshape(-1).numpy()
                start = 0
                for i, shard in enumerate(local_shards):
                    size = shard.tensor.numel()
                    shards[f"{name}|{i}|grad"] = grad[start : start + size].reshape(shard.tensor.shape)
                    start += size
        optimizer.step()
        loss = loss.detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # equal slices: the mean of the means is the global loss
        losses.append(loss.item())

    # The trained state_dict loads into a freshly sharded model: its tables (and so its
    # lookups) then hold the same values.
    trained = model.state_dict()
    fresh = shard_it()
    result = fresh.load_state_dict(cast("OrderedDict[str, torch.Tensor]", trained))
    if result.missing_keys or result.unexpected_keys:
        raise AssertionError(f"loading the trained state_dict: {result}")
    for name, table in trained.items():
        if not isinstance(table, ShardedTensor):
            continue
        loaded = fresh.state_dict()[name]
        if not isinstance(loaded, ShardedTensor):
            raise AssertionError(f"{name}: the fresh model's state_dict holds a {type(loaded).__name__}")
        for i, (shard, again) in enumerate(zip(table.local_shards(), loaded.local_shards(), strict=True)):
            if again.metadata.shard_offsets != shard.metadata.shard_offsets:
                raise AssertionError(f"{name}: the fresh model's shard {i} is at {again.metadata.shard_offsets}")
            key = f"{name.split('.')[1]}|{i}"
            shards[key + "|offsets"] = np.array(shard.metadata.shard_offsets)
            shards[key] = shard.tensor.detach().cpu().numpy()
            np.testing.assert_array_equal(again.tensor.detach().cpu().numpy(), shards[key], err_msg=f"{name} {i}")
    ids, _target = next(iter(_batches()))
    batch = _kjt(ids, slice(rank * local, (rank + 1) * local)).to(torch.device("tpu"))
    with torch.no_grad():
        before, after = model(batch).wait(), fresh(batch).wait()
    # An EmbeddingCollection returns a dict of JaggedTensors, an EmbeddingBagCollection a KeyedTensor.
    before, after = (out if isinstance(out, dict) else out.to_dict() for out in (before, after))
    if sorted(before) != sorted(after):
        raise AssertionError(f"the fresh model looks up {sorted(after)}, not {sorted(before)}")
    for key, value in before.items():
        got = after[key]
        np.testing.assert_array_equal(
            (got.values() if ec else got).cpu().numpy(), (value.values() if ec else value).cpu().numpy(), err_msg=key
        )
    shards["losses"] = np.array(losses)
    np.savez(f"{out_path}.{plan_name}.{rank}.npz", **cast(dict[str, Any], shards))


def main(out_path: str, plans: list[str]) -> None:
    import torch.distributed as dist

    import tpurec  # noqa: F401 (registers the "tpu" backend)

    dist.init_process_group("cpu:gloo,tpu:tpu", timeout=datetime.timedelta(seconds=60))
    for plan in plans:
        if plan not in PLANS:
            raise ValueError(f"unknown plan {plan!r}: use one of {PLANS}")
        train_sharded(out_path, plan)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    # A hung collective ends this rank with every thread's stack instead of stalling the test.
    faulthandler.dump_traceback_later(float(os.environ.get("TPUREC_TEST_HANG_SECONDS", "150")), exit=True)
    main(sys.argv[1], sys.argv[2].split(","))
