"""One rank of the fused-optimizer DistributedModelParallel tests (``torchrun ... dmp_fused_worker.py OUT RUN[,RUN...]``).

A run is ``<plan>:<optimizer>[:mean][:fp16]``: TorchRec's own ``EmbeddingBagCollection`` (born on meta; its
tables SUM-pooled, or MEAN-pooled with ``:mean``; FP32, or FP16 with ``:fp16``),
``torchrec.optim.apply_optimizer_in_backward(<optimizer>, ebc.parameters(), {...})`` on it, a plan
from TorchRec's planner with the ``FUSED`` compute kernel (every table sharded as ``<plan>`` says,
or the mix of :data:`MIXED`), sharded by TorchRec's ``DistributedModelParallel`` on the tpu device.
The starting tables are loaded as whole tensors; ``STEPS`` steps of forward and backward (no
optimizer step: the update runs in the backward) on this rank's slice of each global batch. Each
rank writes ``OUT.<plan>.<optimizer>[.mean][.fp16].<rank>.npz``: its table shards and its fused optimizer's
state (TorchRec's ``KeyedOptimizer`` state_dict, from ``model.fused_optimizer``) with their
offsets, and on rank 0 the global losses. :func:`reference` is the same training with FBGEMM's
fused TBE on CPU in one process on the whole batch.

The run ``errors`` checks the refusals instead and writes ``OUT.errors.<rank>`` (one line each).
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
# name, rows, dim, features (t0 is read by two features: one update of their summed gradient).
TABLES = (("t0", 12, 16, 2), ("t1", 16, 16, 1), ("t2", 10, 16, 1), ("t3", 14, 32, 1))
MIXED = {"t0": "table_wise", "t1": "row_wise", "t2": "table_wise", "t3": "column_wise"}
PLANS = ("table_wise", "row_wise", "column_wise", "mixed")
# The user's optimizer (class path, kwargs) and what TorchRec hands FBGEMM for it.
OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "sgd": ("torch.optim.SGD", {"lr": 0.05}),
    "adagrad": ("torch.optim.Adagrad", {"lr": 0.05}),
    "rowwise": ("torchrec.optim.RowWiseAdagrad", {"lr": 0.05}),
    "adam": ("torch.optim.Adam", {"lr": 0.01}),
}
FBGEMM = {"sgd": "EXACT_SGD", "adagrad": "EXACT_ADAGRAD", "rowwise": "EXACT_ROWWISE_ADAGRAD", "adam": "ADAM"}


def features() -> list[tuple[str, str]]:
    """(feature, table) in the collection's order."""
    return [(f"f{n}{'ab'[i]}" if k > 1 else f"f{n}", n) for n, _r, _d, k in TABLES for i in range(k)]


def _resolve(path: str) -> Any:
    import importlib

    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _collection(device: str, mean: bool = False, half: bool = False):
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.modules.embedding_configs import DataType, PoolingType

    configs = [
        EmbeddingBagConfig(
            name=n,
            embedding_dim=d,
            num_embeddings=r,
            feature_names=[f for f, t in features() if t == n],
            pooling=PoolingType.MEAN if mean else PoolingType.SUM,
            data_type=DataType.FP16 if half else DataType.FP32,
        )
        for n, r, d, _k in TABLES
    ]
    return EmbeddingBagCollection(tables=configs, device=torch.device(device))


def weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {n: rng.uniform(-0.5, 0.5, (r, d)).astype(np.float32) for n, r, d, _k in TABLES}


def batches():
    """STEPS global batches: per feature, per sample 0-3 ids (repeats included); a target per sample."""
    rng = np.random.default_rng(1)
    rows = {n: r for n, r, _d, _k in TABLES}
    for _ in range(STEPS):
        ids = {}
        for f, t in features():
            ids[f] = [rng.integers(0, rows[t], int(k)).tolist() for k in rng.integers(0, 4, GLOBAL_BATCH)]
        yield ids, rng.standard_normal(GLOBAL_BATCH).astype(np.float32)


def _kjt(ids: dict[str, list[list[int]]], samples: slice):
    import torch
    from torchrec import KeyedJaggedTensor

    keys = [f for f, _t in features()]
    lengths = [len(s) for f in keys for s in ids[f][samples]]
    values = [v for f in keys for s in ids[f][samples] for v in s]
    return KeyedJaggedTensor(
        keys=keys, values=torch.tensor(values, dtype=torch.int64), lengths=torch.tensor(lengths, dtype=torch.int64)
    )


def _mix(device: str = "cpu", dyadic: bool = False):
    """The loss's weight of each pooled column; ``dyadic``: multiples of 1/8 in [-1/2, 1/2], so that every
    gradient of the linear loss is exact in float32 whatever order its terms are added in."""
    import torch

    dims = {n: d for n, _r, d, _k in TABLES}
    total = sum(dims[t] for _f, t in features())
    rng = np.random.default_rng(2)
    values = rng.integers(-4, 5, total) / 8 if dyadic else rng.uniform(-1, 1, total)
    return torch.from_numpy(values.astype(np.float32)).to(device)


def _loss(pooled, target, mix, linear: bool = False):
    """The squared error of the weighted pooled sums, or with ``linear`` their mean (FP16 runs: their tables'
    gradients are then exact, so the float16 rounding of an update cannot depend on an order of addition)."""
    if linear:
        return (pooled * mix).sum(1).mean()
    return ((pooled * mix).sum(1) - target).pow(2).mean()


def reference(
    plan: str, optimizer: str, mean: bool = False, half: bool = False
) -> tuple[list[float], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """FBGEMM's fused TBE on CPU, one process, the whole batch: losses, tables, optimizer state.

    The TBE is built as TorchRec's FUSED kernel builds it (``optimizer`` and ``learning_rate`` from
    the in-backward optimizer, every other argument at FBGEMM's default). A column-wise table is
    its column shards, each a table of its own (TorchRec's FUSED kernel keeps one per shard, and a
    row-wise optimizer state is then per shard). ``mean``: FBGEMM's MEAN pooling (each bag's sum over
    its length), the unsharded collection's. ``half``: FP16 tables (``weights_precision``, as TorchRec's
    kernel passes a table's data_type; FBGEMM's CPU kernels round to nearest).
    """
    if optimizer == "adam":
        if mean or half:
            raise ValueError("the Adam reference pools with SUM only, over FP32 tables")
        return _reference_adam()
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    start = weights()
    kinds = {n: MIXED[n] if plan == "mixed" else plan for n, _r, _d, _k in TABLES}
    # (table, column block) of each TBE table: the column-wise table t3 (dim 32) is two shards of 16.
    blocks = [
        (n, slice(c, c + 16)) if kinds[n] == "column_wise" and d == 32 else (n, slice(0, d))
        for n, _r, d, _k in TABLES
        for c in ((0, 16) if kinds[n] == "column_wise" and d == 32 else (0,))
    ]
    rows = {n: r for n, r, _d, _k in TABLES}
    specs = [(rows[n], cols.stop - cols.start, EmbeddingLocation.HOST, ComputeDevice.CPU) for n, cols in blocks]
    # TBE features: each collection feature once per block of its table, in the collection's output order.
    tbe_features = [(f, i) for f, t in features() for i, (n, _c) in enumerate(blocks) if n == t]
    kwargs = OPTIMIZERS[optimizer][1]
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=specs,
        feature_table_map=[i for _f, i in tbe_features],
        optimizer=EmbOptimType[FBGEMM[optimizer]],
        learning_rate=kwargs["lr"],
        pooling_mode=PoolingMode.MEAN if mean else PoolingMode.SUM,
        weights_precision=SparseType.FP16 if half else SparseType.FP32,
    )
    with torch.no_grad():
        for (n, cols), w in zip(blocks, tbe.split_embedding_weights(), strict=True):
            w.copy_(torch.from_numpy(start[n][:, cols]))
    mix, losses = _mix(dyadic=half), []
    for ids, target in batches():
        lengths = [len(s) for f, _i in tbe_features for s in ids[f]]
        values = [v for f, _i in tbe_features for s in ids[f] for v in s]
        offsets = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64)
        pooled = tbe(torch.tensor(values, dtype=torch.int64), offsets)
        loss = _loss(pooled, torch.from_numpy(target), mix, linear=half)
        loss.backward()
        losses.append(loss.item())
    tables = {n: np.zeros_like(w) for n, w in start.items()}
    states: dict[str, np.ndarray] = {}
    split_states = tbe.split_optimizer_states() or [[] for _ in blocks]  # EXACT_SGD keeps none
    for (n, cols), w, slots in zip(blocks, tbe.split_embedding_weights(), split_states, strict=True):
        tables[n][:, cols] = w.detach().float().numpy()
        for j, slot in enumerate(slots):
            key = f"{n}|{j}|{cols.start}"
            states[key] = slot.detach().numpy().reshape(rows[n], -1)
    return losses, tables, states


def _reference_adam(
    lr: float = 0.01, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8
) -> tuple[list[float], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """FBGEMM's ADAM (its defaults but the learning rate) in numpy, float64, one process, the whole batch.

    FBGEMM's CPU TBE refuses ADAM ("not supported in CPU mode"), so this is its update written out
    (as tests/sparse/test_modules.py checks it): the rows a batch looks up (their gradient, the sum
    over every feature and repeat, from TorchRec's collection on CPU) move, the others keep their
    moments. Adam is element-wise, so a column-wise table's shards follow the whole table's update.
    """
    import torch

    start = weights()
    collection = _collection("cpu")
    tables = {n: cast(torch.Tensor, collection.embedding_bags[n].weight) for n, _r, _d, _k in TABLES}
    with torch.no_grad():
        for n, w in start.items():
            tables[n].copy_(torch.from_numpy(w))
    w = {n: v.astype(np.float64) for n, v in start.items()}
    m1 = {n: np.zeros_like(v) for n, v in w.items()}
    m2 = {n: np.zeros_like(v) for n, v in w.items()}
    mix, losses = _mix(), []
    for step, (ids, target) in enumerate(batches(), start=1):
        collection.zero_grad()
        kt = collection(_kjt(ids, slice(None))).to_dict()
        loss = _loss(torch.cat([kt[f] for f, _t in features()], dim=1), torch.from_numpy(target), mix)
        loss.backward()
        losses.append(loss.item())
        for n in w:
            touched = np.unique([v for f, t in features() if t == n for bag in ids[f] for v in bag]).astype(np.int64)
            grad = cast(torch.Tensor, tables[n].grad).double().numpy()[touched]
            m1[n][touched] = b1 * m1[n][touched] + (1 - b1) * grad
            m2[n][touched] = b2 * m2[n][touched] + (1 - b2) * grad * grad
            m_hat, v_hat = m1[n][touched] / (1 - b1**step), m2[n][touched] / (1 - b2**step)
            w[n][touched] -= lr * m_hat / (np.sqrt(v_hat) + eps)
        with torch.no_grad():  # the next step's lookups read the updated tables
            for n, v in w.items():
                tables[n].copy_(torch.from_numpy(v.astype(np.float32)))
    states = {f"{n}|{j}|0": m for n in w for j, m in enumerate((m1[n], m2[n]))}
    return losses, w, states


def train_sharded(out_path: str, plan_name: str, optimizer: str, mean: bool = False, half: bool = False) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ModuleSharder
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    rank, n = dist.get_rank(), dist.get_world_size()
    types = {name: MIXED[name] if plan_name == "mixed" else plan_name for name, _r, _d, _k in TABLES}
    constraints = {
        name: ParameterConstraints(sharding_types=[types[name]], compute_kernels=["fused"], min_partition=16)
        for name in types
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=n, compute_device="tpu", local_world_size=1), constraints=constraints
    )
    sharder = cast(ModuleSharder[torch.nn.Module], EmbeddingBagCollectionSharder())
    cls, kwargs = OPTIMIZERS[optimizer]

    def shard_it() -> DistributedModelParallel:
        collection = _collection("meta", mean, half)
        apply_optimizer_in_backward(_resolve(cls), collection.parameters(), dict(kwargs))
        plan = planner.collective_plan(collection, [sharder], dist.GroupMember.WORLD)
        got = {name: (p.sharding_type, p.compute_kernel) for name, p in plan.plan[""].items()}  # pyright: ignore
        if got != {name: (t, "fused") for name, t in types.items()}:
            raise AssertionError(f"the planner chose {got}")
        return DistributedModelParallel(collection, device=torch.device("tpu"), plan=plan, sharders=[sharder])

    model = shard_it()
    start = weights()
    result = model.load_state_dict(
        OrderedDict((f"embedding_bags.{name}.weight", torch.from_numpy(w)) for name, w in start.items())
    )
    if result.missing_keys or result.unexpected_keys:
        raise AssertionError(f"loading the starting tables: {result}")
    # The tables are updated in the backward: TorchRec marks them so that a dense optimizer built over
    # in_backward_optimizer_filter(model.named_parameters()) leaves them out.
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    if list(in_backward_optimizer_filter(model.named_parameters())):
        raise AssertionError("a table is left to a dense optimizer")
    mix, losses = _mix("tpu", dyadic=half), []
    local = GLOBAL_BATCH // n
    for ids, target in batches():
        samples = slice(rank * local, (rank + 1) * local)
        kt = model(_kjt(ids, samples).to(torch.device("tpu"))).wait()
        by_key = kt.to_dict()
        pooled = torch.cat([by_key[f] for f, _t in features()], dim=1)
        loss = _loss(pooled, torch.from_numpy(target[samples]).to("tpu"), mix, linear=half)
        loss.backward()
        model.fused_optimizer.step()  # passes the learning rate on, as TorchRec's fused optimizers do
        loss = loss.detach()
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())

    out: dict[str, np.ndarray] = {"losses": np.array(losses)}
    state = model.state_dict()
    offsets: dict[str, tuple[int, int]] = {}
    for name, _r, _d, _k in TABLES:
        table = state[f"embedding_bags.{name}.weight"]
        if not isinstance(table, ShardedTensor):
            raise AssertionError(f"{name}: the state_dict holds a {type(table).__name__}")
        for shard in table.local_shards():
            r0, c0 = shard.metadata.shard_offsets
            offsets[name] = (r0, c0)
            out[f"table|{name}|{r0}|{c0}"] = shard.tensor.detach().cpu().float().numpy()
    # The fused optimizer's state as TorchRec's KeyedOptimizer gives it: keyed by parameter name,
    # each table's slots under TorchRec's names.
    optim_state = model.fused_optimizer.state_dict()["state"]
    want_keys = {"sgd": [], "adagrad": ["momentum1"], "rowwise": ["momentum1"], "adam": ["momentum1", "exp_avg_sq"]}
    for name in offsets:
        slots = optim_state[f"embedding_bags.{name}.weight"]
        if sorted(slots) != sorted(f"{name}.{k}" for k in want_keys[optimizer]):
            raise AssertionError(f"{name}: fused optimizer state keys {sorted(slots)}")
        for j, key in enumerate(want_keys[optimizer]):
            r0, c0 = offsets[name]
            value = slots[f"{name}.{key}"]
            out[f"state|{name}|{j}|{r0}|{c0}"] = value.detach().cpu().numpy().reshape(value.shape[0], -1)
    name = f"{plan_name}.{optimizer}{'.mean' if mean else ''}{'.fp16' if half else ''}"
    np.savez(f"{out_path}.{name}.{rank}.npz", **cast(dict[str, Any], out))


def errors(out_path: str) -> None:
    """What tpurec refuses, each on a freshly built model: one line per case, ``<case> <error type>: <text>``."""
    import torch
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ModuleSharder
    from torchrec.modules.embedding_configs import DataType, PoolingType
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    def attempt(
        kernel: str, fused_params: dict | None = None, in_backward: tuple | None = None, pooling=None, data_type=None
    ) -> str:
        config = EmbeddingBagConfig(
            name="e",
            embedding_dim=16,
            num_embeddings=12,
            feature_names=["fe"],
            pooling=pooling or PoolingType.SUM,
            data_type=data_type or DataType.FP32,
        )
        collection = EmbeddingBagCollection(tables=[config], device=torch.device("meta"))
        if in_backward is not None:
            apply_optimizer_in_backward(in_backward[0], collection.parameters(), in_backward[1])
        sharder = cast(ModuleSharder[torch.nn.Module], EmbeddingBagCollectionSharder(fused_params=fused_params))
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=dist.get_world_size(), compute_device="tpu", local_world_size=1),
            constraints={"e": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=[kernel])},
        )
        plan = planner.collective_plan(collection, [sharder], dist.GroupMember.WORLD)
        try:
            DistributedModelParallel(collection, device=torch.device("tpu"), plan=plan, sharders=[sharder])
        except NotImplementedError as error:
            return f"NotImplementedError: {error}"
        return "sharded without an error"

    def learning_rate() -> str:
        """``model.fused_optimizer``'s learning rate, set in its param_groups, reaches the update at ``step()``."""
        from torchrec import KeyedJaggedTensor

        config = EmbeddingBagConfig(name="e", embedding_dim=16, num_embeddings=12, feature_names=["fe"])
        collection = EmbeddingBagCollection(tables=[config], device=torch.device("meta"))
        apply_optimizer_in_backward(torch.optim.SGD, collection.parameters(), {"lr": 0.1})
        sharder = cast(ModuleSharder[torch.nn.Module], EmbeddingBagCollectionSharder())
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=dist.get_world_size(), compute_device="tpu", local_world_size=1),
            constraints={"e": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"])},
        )
        plan = planner.collective_plan(collection, [sharder], dist.GroupMember.WORLD)
        model = DistributedModelParallel(collection, device=torch.device("tpu"), plan=plan, sharders=[sharder])
        kjt = KeyedJaggedTensor(keys=["fe"], values=torch.tensor([1, 2, 2]), lengths=torch.tensor([2, 1]))

        def table() -> np.ndarray:
            return model.state_dict()["embedding_bags.e.weight"].local_shards()[0].tensor.cpu().numpy().copy()

        seen = []
        for lr in (0.0, 0.1):
            (group,) = list(model.fused_optimizer.param_groups)
            cast(dict[str, Any], group)["lr"] = lr
            model.fused_optimizer.step()
            before = table()
            model(kjt.to(torch.device("tpu"))).wait().values().sum().backward()
            after = table()
            rows = sorted({int(r) for r in np.nonzero((after != before).any(1))[0]})
            seen.append(f"lr={lr} rows={rows} delta={float(np.abs(after - before).max()):.4f}")
        return "; ".join(seen)

    cases = {
        "learning_rate": learning_rate(),
        "unfused_in_backward": attempt("unfused_tpu", in_backward=(torch.optim.SGD, {"lr": 0.1})),
        "lamb": attempt("fused", fused_params={"optimizer": EmbOptimType.LAMB, "learning_rate": 0.1}),
        "weight_decay": attempt("fused", in_backward=(torch.optim.Adagrad, {"lr": 0.1, "weight_decay": 0.01})),
        "clipping": attempt("fused", fused_params={"gradient_clipping": True}),
        "adam_fp16": attempt("fused", in_backward=(torch.optim.Adam, {"lr": 0.1}), data_type=DataType.FP16),
        "int8": attempt("fused", in_backward=(torch.optim.SGD, {"lr": 0.1}), data_type=DataType.INT8),
    }
    with open(f"{out_path}.errors.{dist.get_rank()}", "w") as f:
        f.write("".join(f"{case} {text}\n".replace("\n", " ").rstrip() + "\n" for case, text in cases.items()))


def main(out_path: str, runs: list[str]) -> None:
    import torch.distributed as dist

    import tpurec  # noqa: F401 (registers the "tpu" backend)

    dist.init_process_group("cpu:gloo,tpu:tpu", timeout=datetime.timedelta(seconds=60))
    for run in runs:
        if run == "errors":
            errors(out_path)
            continue
        plan, optimizer, *options = run.split(":")
        if plan not in PLANS or optimizer not in OPTIMIZERS or not set(options) <= {"mean", "fp16"}:
            raise ValueError(
                f"unknown run {run!r}: use <plan>:<optimizer>[:mean][:fp16], plan in {PLANS}, optimizer in {OPTIMIZERS}"
            )
        train_sharded(out_path, plan, optimizer, mean="mean" in options, half="fp16" in options)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    faulthandler.dump_traceback_later(float(os.environ.get("TPUREC_TEST_HANG_SECONDS", "150")), exit=True)
    main(sys.argv[1], sys.argv[2].split(","))
