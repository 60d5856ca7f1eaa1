"""One rank of the TorchRec DLRM under DistributedModelParallel tests (``torchrun --nproc-per-node N dmp_dlrm_worker.py OUT PLAN[,PLAN...]``).

The model is TorchRec's own ``torchrec.models.dlrm.DLRM`` over an ``EmbeddingBagCollection`` of
four tables, sharded by TorchRec's own ``DistributedModelParallel`` on the ``tpu`` device with a
plan from TorchRec's ``EmbeddingShardingPlanner``: every table constrained to the sharding type
``PLAN`` names (data-parallel tables on TorchRec's ``DENSE`` kernel, the others on its
``UNFUSED_TPU`` kernel), or a mix of all four types. DMP wraps the unsharded part (the dense and
over arch, and the data-parallel tables) in DistributedDataParallel over the ``"tpu"`` group. The
model starts from the reference's weights (``load_state_dict`` of whole tensors), trains ``STEPS``
steps of ``torch.optim.SGD(model.parameters())`` on this rank's slice of every global batch, and
each rank writes ``OUT.<PLAN>.<rank>.npz``: its local table shards (with their offsets), the dense
parameters and, on rank 0, the global loss of every step. The test assembles the tables and
compares everything with :func:`reference`, the same DLRM trained by TorchRec on CPU in one
process on the whole batch.
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
DENSE_IN = 8
# DLRM wants one embedding dim for every table; 32 lets a column-wise table split into two
# shards of 16 (the UNFUSED_TPU kernel takes multiples of 16).
DIM = 32
TABLES = (("t0", 12), ("t1", 16), ("t2", 10), ("t3", 14))
# Each table's sharding type in the mixed plan: one of each.
MIXED = {"t0": "data_parallel", "t1": "table_wise", "t2": "row_wise", "t3": "column_wise"}
PLANS = ("data_parallel", "table_wise", "row_wise", "column_wise", "mixed")
COLLECTION = "sparse_arch.embedding_bag_collection"
TABLE_PREFIX = f"{COLLECTION}.embedding_bags"


def _dlrm(device: str):
    """TorchRec's DLRM over the four tables; the tables on ``device``, the dense part on the CPU."""
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.models.dlrm import DLRM

    configs = [
        EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=r, feature_names=[f"f{n}"]) for n, r in TABLES
    ]
    return DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=configs, device=torch.device(device)),
        dense_in_features=DENSE_IN,
        dense_arch_layer_sizes=[16, DIM],
        over_arch_layer_sizes=[16, 1],
        dense_device=torch.device("cpu"),
    )


def start_state() -> OrderedDict[str, Any]:
    """The starting weights of every parameter (seeded), as CPU tensors keyed as DLRM's state_dict."""
    import torch

    torch.manual_seed(0)
    model = _dlrm("cpu")
    rng = np.random.default_rng(0)
    with torch.no_grad():
        for name, rows in TABLES:
            table = cast(torch.Tensor, model.sparse_arch.embedding_bag_collection.embedding_bags[name].weight)
            table.copy_(torch.from_numpy(rng.uniform(-0.5, 0.5, (rows, DIM)).astype(np.float32)))
    return OrderedDict((k, v.detach().clone()) for k, v in model.state_dict().items())


def _batches():
    """STEPS global batches: dense features, per feature per sample 0-3 ids, a 0/1 label per sample."""
    rng = np.random.default_rng(1)
    for _ in range(STEPS):
        dense = rng.standard_normal((GLOBAL_BATCH, DENSE_IN)).astype(np.float32)
        ids = {}
        for n, rows in TABLES:
            lengths = rng.integers(0, 4, GLOBAL_BATCH)
            ids[n] = [rng.integers(0, rows, int(k)).tolist() for k in lengths]
        yield dense, ids, rng.integers(0, 2, GLOBAL_BATCH).astype(np.float32)


def _kjt(ids: dict[str, list[list[int]]], samples: slice):
    import torch
    from torchrec import KeyedJaggedTensor

    keys = [f"f{n}" for n, _r in TABLES]
    lengths = [len(s) for n, _r in TABLES for s in ids[n][samples]]
    values = [v for n, _r in TABLES for s in ids[n][samples] for v in s]
    return KeyedJaggedTensor(
        keys=keys, values=torch.tensor(values, dtype=torch.int64), lengths=torch.tensor(lengths, dtype=torch.int64)
    )


def _loss(logits, labels):
    import torch

    return torch.nn.functional.binary_cross_entropy_with_logits(logits.squeeze(-1), labels)


def reference() -> tuple[list[float], dict[str, np.ndarray]]:
    """The same DLRM on CPU, one process, the whole batch: losses and every parameter after training."""
    import torch

    model = _dlrm("cpu")
    model.load_state_dict(start_state())
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    losses = []
    for dense, ids, labels in _batches():
        optimizer.zero_grad()
        loss = _loss(model(torch.from_numpy(dense), _kjt(ids, slice(None))), torch.from_numpy(labels))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def _plan_types(plan_name: str) -> dict[str, str]:
    return {name: MIXED[name] if plan_name == "mixed" else plan_name for name, _r in TABLES}


def _submodules(module):
    """Every module below ``module``, a sharded collection's lookups included (a list, not submodules)."""
    yield module
    for child in [*module._modules.values(), *getattr(module, "_lookups", ())]:
        if child is not None:
            yield from _submodules(child)


def _plan(plan_name: str, sharder):
    """The plan: TorchRec's planner for one sharding type; for the mixed plan, TorchRec's
    ``construct_module_sharding_plan`` with the ranks given (the planner, balancing by its cost
    model, may put both column shards of t3 on one rank, which the UNFUSED_TPU kernel refuses)."""
    import torch.distributed as dist
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.sharding_plan import (
        column_wise,
        construct_module_sharding_plan,
        data_parallel,
        row_wise,
        table_wise,
    )
    from torchrec.distributed.types import ShardingPlan

    n = dist.get_world_size()
    if plan_name == "mixed":
        collection = _dlrm("meta").sparse_arch.embedding_bag_collection
        kernel = "unfused_tpu"
        per_table = {
            "t0": data_parallel(),
            "t1": table_wise(rank=n - 1, compute_kernel=kernel),
            "t2": row_wise(compute_kernel=kernel),
            "t3": column_wise(ranks=[0, 1], compute_kernel=kernel),
        }
        module_plan = construct_module_sharding_plan(
            collection, per_table, sharder=sharder, local_size=1, world_size=n, device_type="tpu"
        )
        return ShardingPlan({COLLECTION: module_plan})
    # One device per process: local_world_size=1 places each rank's shards on its tpu:0.
    constraints = {
        name: ParameterConstraints(
            sharding_types=[plan_name],
            compute_kernels=["dense" if plan_name == "data_parallel" else "unfused_tpu"],
            min_partition=16,
        )
        for name, _r in TABLES
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=n, compute_device="tpu", local_world_size=1), constraints=constraints
    )
    return planner.collective_plan(_dlrm("meta"), [sharder], dist.GroupMember.WORLD)


def train_sharded(out_path: str, plan_name: str) -> None:
    """Shards the DLRM with the plan ``plan_name`` names, trains it, writes ``OUT.<plan>.<rank>.npz``."""
    import torch
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torch.nn.parallel import DistributedDataParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ModuleSharder

    rank, n = dist.get_rank(), dist.get_world_size()
    types = _plan_types(plan_name)
    sharder = cast(ModuleSharder[torch.nn.Module], EmbeddingBagCollectionSharder())
    plan = _plan(plan_name, sharder)
    got = {name: p.sharding_type for name, p in plan.plan[COLLECTION].items()}  # pyright: ignore[reportAttributeAccessIssue]
    kernels = {name: p.compute_kernel for name, p in plan.plan[COLLECTION].items()}  # pyright: ignore[reportAttributeAccessIssue]
    want_kernels = {name: "dense" if kind == "data_parallel" else "unfused_tpu" for name, kind in types.items()}
    if got != types or kernels != want_kernels:
        raise AssertionError(f"the plan holds {got} on {kernels}, not {types} on {want_kernels}")

    model = DistributedModelParallel(_dlrm("meta"), device=torch.device("tpu"), plan=plan, sharders=[sharder])
    wrapped = model._dmp_wrapped_module  # pyright: ignore[reportPrivateUsage] (model.module unwraps DDP)
    if not isinstance(wrapped, DistributedDataParallel):
        raise AssertionError(f"DMP wrapped the dense part in a {type(wrapped).__name__}, not DDP")

    # The reference's starting weights, whole tensors: the sharded tables' load_state_dict hook
    # cuts each rank's shards out of them; the dense part and data-parallel tables take them as is.
    start = start_state()
    result = model.load_state_dict(start)
    if result.missing_keys or result.unexpected_keys:
        raise AssertionError(f"loading the starting weights: {result}")
    for name, value in model.state_dict().items():
        tensors = [s.tensor for s in value.local_shards()] if isinstance(value, ShardedTensor) else [value]
        if any(t.device.type != "tpu" for t in tensors):
            raise AssertionError(f"{name} lives on {[str(t.device) for t in tensors]}")

    # Every parameter, data-parallel tables included, is a tpu tensor (DDP over the "tpu" group
    # refuses anything else); the data-parallel tables run tpurec's DENSE tpu kernel.
    if any(p.device.type != "tpu" for p in model.parameters()):
        raise AssertionError(
            f"parameters off tpu: {[n for n, p in model.named_parameters() if p.device.type != 'tpu']}"
        )
    dp_kernels = {type(m).__name__ for m in _submodules(model) if type(m).__name__.startswith("DenseTPU")}
    if ("data_parallel" in types.values()) != bool(dp_kernels):
        raise AssertionError(f"data-parallel kernels {dp_kernels} for the plan {types}")

    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    losses = []
    local = GLOBAL_BATCH // n
    samples = slice(rank * local, (rank + 1) * local)
    for dense, ids, labels in _batches():
        optimizer.zero_grad()
        logits = model(torch.from_numpy(dense[samples]).to("tpu"), _kjt(ids, samples).to(torch.device("tpu")))
        loss = _loss(logits, torch.from_numpy(labels[samples]).to("tpu"))
        loss.backward()
        optimizer.step()
        loss = loss.detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)  # equal slices: the mean of the means is the global loss
        losses.append(loss.item())

    out: dict[str, np.ndarray] = {"losses": np.array(losses)}
    for name, value in model.state_dict().items():
        key = name.removeprefix("_dmp_wrapped_module.").removeprefix("module.")
        if isinstance(value, ShardedTensor):
            for i, shard in enumerate(value.local_shards()):
                out[f"{key}|{i}|offsets"] = np.array(shard.metadata.shard_offsets)
                out[f"{key}|{i}"] = shard.tensor.detach().cpu().numpy()
        else:
            out[key] = value.detach().cpu().numpy()
    np.savez(f"{out_path}.{plan_name}.{rank}.npz", **cast(dict[str, Any], out))


# An EmbeddingCollection's data-parallel tables (unpooled lookups): the first two tables' features.
SEQUENCE_TABLES = TABLES[:2]
SEQUENCE_DIM = 16


def _sequence_collection(device: str):
    import torch
    from torchrec import EmbeddingCollection, EmbeddingConfig

    configs = [
        EmbeddingConfig(name=n, embedding_dim=SEQUENCE_DIM, num_embeddings=r, feature_names=[f"f{n}"])
        for n, r in SEQUENCE_TABLES
    ]
    return EmbeddingCollection(tables=configs, device=torch.device(device))


def _sequence_start() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {n: rng.uniform(-0.5, 0.5, (r, SEQUENCE_DIM)).astype(np.float32) for n, r in SEQUENCE_TABLES}


def _sequence_kjt(ids: dict[str, list[list[int]]], samples: slice):
    import torch
    from torchrec import KeyedJaggedTensor

    lengths = [len(s) for n, _r in SEQUENCE_TABLES for s in ids[n][samples]]
    values = [v for n, _r in SEQUENCE_TABLES for s in ids[n][samples] for v in s]
    return KeyedJaggedTensor(
        keys=[f"f{n}" for n, _r in SEQUENCE_TABLES],
        values=torch.tensor(values, dtype=torch.int64),
        lengths=torch.tensor(lengths, dtype=torch.int64),
    )


def _sequence_loss(out, samples: int):
    """Every looked-up row's squared distance of its sum from 0.1, summed, per sample."""
    import torch

    parts = [((out[f"f{n}"].values().sum(1) - 0.1) ** 2).sum() for n, _r in SEQUENCE_TABLES]
    return torch.stack(parts).sum() / samples


def sequence_reference() -> tuple[list[float], dict[str, np.ndarray]]:
    """The EmbeddingCollection on CPU, one process, the whole batch: losses and final tables."""
    import torch

    collection = _sequence_collection("cpu")
    weights = {n: cast(torch.Tensor, collection.embeddings[n].weight) for n, _r in SEQUENCE_TABLES}
    with torch.no_grad():
        for n, w in _sequence_start().items():
            weights[n].copy_(torch.from_numpy(w))
    optimizer = torch.optim.SGD(collection.parameters(), lr=LEARNING_RATE)
    losses = []
    for _dense, ids, _labels in _batches():
        optimizer.zero_grad()
        loss = _sequence_loss(collection(_sequence_kjt(ids, slice(None))), GLOBAL_BATCH)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {n: w.detach().numpy().copy() for n, w in weights.items()}


def sequence_data_parallel(out_path: str) -> None:
    """An EmbeddingCollection's tables data-parallel on tpu (TorchRec's BatchedTPUEmbedding), trained
    like :func:`sequence_reference`; writes ``OUT.sequence.<rank>.npz`` (tables, losses)."""
    import torch
    import torch.distributed as dist
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, data_parallel
    from torchrec.distributed.types import ModuleSharder, ShardingPlan

    rank, n = dist.get_rank(), dist.get_world_size()
    sharder = cast(ModuleSharder[torch.nn.Module], EmbeddingCollectionSharder())
    collection = _sequence_collection("meta")
    module_plan = construct_module_sharding_plan(
        collection, {name: data_parallel() for name, _r in SEQUENCE_TABLES}, sharder=sharder, local_size=1,
        world_size=n, device_type="tpu",
    )  # fmt: skip
    model = DistributedModelParallel(
        collection, device=torch.device("tpu"), plan=ShardingPlan({"": module_plan}), sharders=[sharder]
    )
    kernels = {type(m).__name__ for m in _submodules(model)}
    if "DenseTPUEmbedding" not in kernels:
        raise AssertionError(f"no data-parallel tpu kernel among {sorted(kernels)}")
    result = model.load_state_dict(
        OrderedDict((f"embeddings.{name}.weight", torch.from_numpy(w)) for name, w in _sequence_start().items())
    )
    if result.missing_keys or result.unexpected_keys:
        raise AssertionError(f"loading the starting tables: {result}")
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    local = GLOBAL_BATCH // n
    samples = slice(rank * local, (rank + 1) * local)
    losses = []
    for _dense, ids, _labels in _batches():
        optimizer.zero_grad()
        loss = _sequence_loss(model(_sequence_kjt(ids, samples).to(torch.device("tpu"))), local)
        loss.backward()
        optimizer.step()
        loss = loss.detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    state = model.state_dict()
    out = {name: state[f"embeddings.{name}.weight"].detach().cpu().numpy() for name, _r in SEQUENCE_TABLES}
    np.savez(f"{out_path}.sequence.{rank}.npz", losses=np.array(losses), **out)


def weighted_data_parallel(out_path: str) -> None:
    """A weighted collection's table on tpu, data-parallel (tpurec's DENSE tpu kernel) and row-wise
    (TorchRec's UNFUSED_TPU kernel): the data-parallel lookup pools with the per-sample weights as
    TorchRec does on CPU (within 1e-6), the UNFUSED_TPU one refuses them (TorchRec's tpu kernel would
    drop them). (Both put a shard on every rank, so every rank reaches the same point and the next
    case starts in step.) Writes ``OUT.weighted.<rank>``: ``<sharding type> <outcome>`` per line."""
    import torch
    import torch.distributed as dist
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, data_parallel, row_wise
    from torchrec.distributed.types import ModuleSharder, ShardingPlan

    configs = [EmbeddingBagConfig(name="w", embedding_dim=16, num_embeddings=8, feature_names=["fw"])]
    table = torch.from_numpy(np.random.default_rng(4).uniform(-1, 1, (8, 16)).astype(np.float32))
    kjt = KeyedJaggedTensor(
        keys=["fw"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1]), weights=torch.tensor([0.5, 2.0, 1.0])
    )
    reference = EmbeddingBagCollection(tables=configs, is_weighted=True, device=torch.device("cpu"))
    reference.load_state_dict(OrderedDict([("embedding_bags.w.weight", table)]))
    want = reference(kjt).to_dict()["fw"].detach().numpy()
    lines = []
    for kind, sharding in (
        ("data_parallel", data_parallel()),
        ("row_wise", row_wise(compute_kernel="unfused_tpu")),
    ):
        collection = EmbeddingBagCollection(tables=configs, is_weighted=True, device=torch.device("meta"))
        sharder = cast(ModuleSharder[torch.nn.Module], EmbeddingBagCollectionSharder())
        module_plan = construct_module_sharding_plan(
            collection, {"w": sharding}, sharder=sharder, local_size=1, world_size=dist.get_world_size(),
            device_type="tpu",
        )  # fmt: skip
        model = DistributedModelParallel(
            collection, device=torch.device("tpu"), plan=ShardingPlan({"": module_plan}), sharders=[sharder]
        )
        model.load_state_dict(OrderedDict([("embedding_bags.w.weight", table)]))
        try:
            got = model(kjt.to(torch.device("tpu"))).wait().to_dict()["fw"].detach().cpu().numpy()
            error = float(np.abs(got - want).max())
            outcome = f"looked up, {'matching' if error <= 1e-6 else 'differing from'} CPU (max error {error:.3g})"
        except NotImplementedError as e:
            outcome = f"NotImplementedError: {e}"
        lines.append(f"{kind} {outcome}".replace("\n", " "))
    with open(f"{out_path}.weighted.{dist.get_rank()}", "w") as f:
        f.write("\n".join(lines) + "\n")


def main(out_path: str, plans: list[str]) -> None:
    import torch.distributed as dist

    import tpurec  # noqa: F401 (registers the "tpu" backend)

    dist.init_process_group("cpu:gloo,tpu:tpu", timeout=datetime.timedelta(seconds=60))
    for plan in plans:
        if plan == "weighted":
            weighted_data_parallel(out_path)
            continue
        if plan == "sequence":
            sequence_data_parallel(out_path)
            continue
        if plan not in PLANS:
            raise ValueError(f"unknown plan {plan!r}: use one of {PLANS}")
        train_sharded(out_path, plan)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    # A hung collective ends this rank with every thread's stack instead of stalling the test.
    faulthandler.dump_traceback_later(float(os.environ.get("TPUREC_TEST_HANG_SECONDS", "150")), exit=True)
    main(sys.argv[1], sys.argv[2].split(","))
