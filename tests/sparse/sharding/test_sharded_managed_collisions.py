"""Managed-collision collections sharded by ``tpurec.shard`` (8 host devices) train as TorchRec's sharded ones.

Reference: TorchRec's own ``ShardedManagedCollisionEmbeddingBagCollection`` and
``ShardedManagedCollisionEmbeddingCollection`` (its managed-collision sharders, row-wise plan,
in-backward Adagrad, FBGEMM's CPU kernels) on 8 ranks run as threads of the test process
(``threaded_torchrec.py``); each rank gets its 2 of the 16 samples of a step. Not TorchRec's unsharded module: sharded, each row-wise
shard remaps its own block of the id space into its own rows and evicted rows are reset to
``init_fn``, so the remapped ids, the evictions and the tables differ from the unsharded module's.

The batches force what can differ: the first one is small (each shard's history buffer is
sized from it, so later steps overflow it and the order ids reach a shard matters), the ids
drift so the LFU policy admits and evicts every 2 steps (rows trained in earlier steps among them,
their accumulators not zero), and ``init_fn`` is a constant (TorchRec's
ranks draw a random ``init_fn`` from their own generators: a deterministic one compares exactly).

Trained with Adagrad and with row-wise Adagrad. With row-wise Adagrad TorchRec's eviction also
calls FBGEMM's ``reset_weight_momentum``, which zeroes the evicted rows' weights and row-wise
accumulators; the op has a CUDA kernel only, so the reference gets a CPU implementation of it here
(the ``fbgemm_reset_weight_momentum_on_cpu`` fixture).

Compared after each of 5 steps: the remapped ids and the evicted rows (exactly), the pooled
output or the sequence embeddings (float32 sums: 1e-5 relative, 1e-6 absolute), the tables and Adagrad accumulators
(float32 Adagrad updates of the same gradients: 1e-5 relative, 1e-6 absolute); at the end every
MCH buffer of every shard, through the state dict (exactly).
"""

from __future__ import annotations

import copy
import functools
from typing import Any, cast

import numpy as np
import pytest
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen
import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection as TorchrecEBC
from torchrec import EmbeddingBagConfig, EmbeddingCollection as TorchrecEC, KeyedJaggedTensor
from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import LazyAwaitable, ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection as TorchrecMCEBC
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection as TorchrecMCEC
from torchrec.modules.mc_modules import LFU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule
from torchrec.optim import RowWiseAdagrad as TorchrecRowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import tpurec
import tpurec.sparse as sp
from threaded_torchrec import run_ranks
from tpurec.sparse.sharding import ShardedEmbeddingBagCollection
from tpurec.sparse.sharding.managed import (
    ShardedManagedCollisionEmbeddingBagCollection,
    ShardedManagedCollisionEmbeddingCollection,
)

WORLD = 8
BATCH = 16
STEPS = 5
INPUT_HASH_SIZE = 1000
TOLERANCE: dict[str, Any] = {"rtol": 1e-5, "atol": 1e-6}
MC = "sparse._managed_collision_collection._managed_collision_modules."
RESET_VALUE = 0.5
# eps given: TorchRec's sharded module hands FBGEMM only the given settings (FBGEMM's eps 1e-8), while
# tpurec's sharded collection, like TorchRec's unsharded module, takes torch's (1e-10) for the rest.
ADAGRAD = {"lr": 0.1, "eps": 1e-8}
OPTIMIZERS: dict[str, type] = {"adagrad": torch.optim.Adagrad, "rowwise_adagrad": TorchrecRowWiseAdagrad}
# Each table's features. TorchRec's sharded module hands FBGEMM's reset_weight_momentum a table's
# position among its TBE's tables where the op reads the position of the table's first feature
# (weights_offsets, D_offsets and momentum1_offsets are per feature); they agree when no table with
# several features comes before another one in the TBE, as in ROWWISE_FEATURES (the row-wise Adagrad
# runs: see test_torchrec_resets_the_rows_of_another_table_after_a_table_of_several_features).
FEATURES = (("f0", "f1"), ("f2",))
ROWWISE_FEATURES = (("f0",), ("f1", "f2"))
KINDS = ("bags", "sequence")  # a ManagedCollisionEmbeddingBagCollection, a ManagedCollisionEmbeddingCollection
# The fused kernel: the managed-collision sharder's kernels (FBGEMM's dense kernel cannot reset rows).
ROW_WISE = {"t0": row_wise(compute_kernel="fused"), "t1": row_wise(compute_kernel="fused")}


def _dims(kind: str) -> tuple[int, int]:
    return (4, 8) if kind == "bags" else (4, 4)


def _tables(kind: str = "bags", features: tuple[tuple[str, ...], ...] = FEATURES) -> list[Any]:
    # t1's 23 rows split unevenly (3 per device, 2 on the last), as TorchRec's row_wise() splits them.
    init = functools.partial(torch.nn.init.constant_, val=RESET_VALUE)
    config, dims = (EmbeddingBagConfig if kind == "bags" else EmbeddingConfig), _dims(kind)
    return [
        config(name="t0", embedding_dim=dims[0], num_embeddings=32, feature_names=list(features[0]), init_fn=init),
        config(name="t1", embedding_dim=dims[1], num_embeddings=23, feature_names=list(features[1]), init_fn=init),
    ]


class _Sparse(nn.Module):
    """A model holding a managed-collision collection."""

    sparse: Any

    def __init__(self, sparse: nn.Module) -> None:
        super().__init__()
        self.sparse = sparse

    def forward(self, kjt: KeyedJaggedTensor):
        return self.sparse(kjt)


def _hash(ids: torch.Tensor, size: int) -> torch.Tensor:
    """An ``input_hash_func``: ids are hashed before the shards' blocks are cut (TorchRec's input dist)."""
    return (ids * 7919 + 13) % size


def _model(
    kind: str = "bags",
    hashed: bool = False,
    features: tuple[tuple[str, ...], ...] = FEATURES,
    return_remapped_features: bool = True,
) -> _Sparse:
    torch.manual_seed(0)
    tables = _tables(kind, features)
    mcc = ManagedCollisionCollection(
        {
            t.name: MCHManagedCollisionModule(
                zch_size=t.num_embeddings,
                device=torch.device("cpu"),
                eviction_policy=LFU_EvictionPolicy(),
                eviction_interval=2,
                input_hash_size=INPUT_HASH_SIZE,
                input_hash_func=_hash if hashed else None,
            )
            for t in tables
        },
        tables,
    )
    if kind == "bags":
        model = _Sparse(TorchrecMCEBC(TorchrecEBC(tables), mcc, return_remapped_features=return_remapped_features))
    else:
        model = _Sparse(TorchrecMCEC(TorchrecEC(tables), mcc, return_remapped_features=return_remapped_features))
    with torch.no_grad():  # random rows (the config's init_fn is the constant used for resets)
        for p in model.parameters():
            p.uniform_(-0.3, 0.3)
    return model


def _sharder(kind: str) -> Any:
    return (
        ManagedCollisionEmbeddingBagCollectionSharder()
        if kind == "bags"
        else ManagedCollisionEmbeddingCollectionSharder()
    )


def _plan(model: _Sparse, generators: dict, kind: str = "bags") -> ShardingPlan:
    module_plan = construct_module_sharding_plan(
        model.sparse, generators, local_size=WORLD, world_size=WORLD, device_type="cpu", sharder=_sharder(kind)
    )
    return ShardingPlan({"sparse": module_plan})


def _batches(
    kind: str = "bags", features: tuple[tuple[str, ...], ...] = FEATURES
) -> list[tuple[KeyedJaggedTensor, dict[str, torch.Tensor]]]:
    """One id per bag in the first step (small history buffers), then up to 5 from a drifting skewed pool;
    the loss's weights: per sample (pooled) or per id (sequence)."""
    rng = np.random.default_rng(3)
    pooled_width = sum(len(names) * dim for names, dim in zip(features, _dims(kind)))
    out = []
    for step in range(STEPS):
        lengths = np.ones(3 * BATCH, np.int64) if step == 0 else rng.integers(0, 6, 3 * BATCH)
        if step == 0:
            ids = rng.integers(0, INPUT_HASH_SIZE, int(lengths.sum()))
        else:
            ids = (rng.geometric(0.15, int(lengths.sum())) + 30 * step) * 37 % INPUT_HASH_SIZE
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=["f0", "f1", "f2"], values=torch.from_numpy(ids).long(), lengths=torch.from_numpy(lengths).long()
        )
        if kind == "bags":
            target = {"pooled": torch.from_numpy(rng.normal(size=(BATCH, pooled_width)).astype(np.float32))}
        else:
            sizes = {f: int(kjt[f].lengths().sum()) for f in kjt.keys()}
            target = {f: torch.from_numpy(rng.normal(size=(n, 4)).astype(np.float32)) for f, n in sizes.items()}
        out.append((kjt, target))
    return out


def _samples(kjt: KeyedJaggedTensor, start: int, stop: int) -> KeyedJaggedTensor:
    """Samples ``[start, stop)`` of ``kjt`` (a rank's part of the global batch)."""
    values = [kjt[k].values()[_ids_of(kjt, k, start, stop)] for k in kjt.keys()]
    lengths = [kjt[k].lengths()[start:stop] for k in kjt.keys()]
    return KeyedJaggedTensor.from_lengths_sync(
        keys=list(kjt.keys()), values=torch.cat(values), lengths=torch.cat(lengths)
    )


def _ids_of(kjt: KeyedJaggedTensor, feature: str, start: int, stop: int) -> slice:
    """Where samples ``[start, stop)`` of ``feature`` are among its ids."""
    offsets = kjt[feature].offsets()
    return slice(int(offsets[start]), int(offsets[stop]))


def _rank_target(kjt: KeyedJaggedTensor, target: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    per_rank = BATCH // WORLD
    start, stop = rank * per_rank, (rank + 1) * per_rank
    if "pooled" in target:
        return {"pooled": target["pooled"][start:stop]}
    return {f: w[_ids_of(kjt, f, start, stop)] for f, w in target.items()}


def _outputs(out: Any) -> dict[str, torch.Tensor]:
    """The pooled rows (``{"pooled": ...}``) or each feature's embeddings."""
    if hasattr(out, "to_dict") and not isinstance(out, dict):
        return {"pooled": out.values()}
    return {f: jt.values() for f, jt in out.items()}


def _loss(out: Any, target: dict[str, torch.Tensor], device: str = "tpu", ranks: int = WORLD) -> torch.Tensor:
    """Weighted sum of the outputs, over ``ranks``: TorchRec divides the embedding gradients by the world
    size (its comm ops' gradient division, matching DDP's averaged dense gradients), so the loss here is
    the mean of the ranks' losses."""
    values = _outputs(out)
    return torch.stack([(values[k] * w.to(device)).sum() for k, w in target.items()]).sum() / ranks


def _local_state(module: nn.Module) -> dict[str, Any]:
    """A rank's state dict: each sharded tensor as (its rows' offset, a copy of its local rows)."""
    out: dict[str, Any] = {}
    for key, value in module.state_dict().items():
        if hasattr(value, "local_shards"):
            (shard,) = value.local_shards()
            out[key] = (shard.metadata.shard_offsets[0], shard.tensor.detach().clone(), tuple(value.size()))
        else:
            out[key] = value.detach().clone()
    return out


def _table_key(kind: str, table: str) -> str:
    return f"_embedding_module.{'embedding_bags' if kind == 'bags' else 'embeddings'}.{table}.weight"


def _reset_weight_momentum_cpu(
    dev_weights: torch.Tensor,
    other_weights: torch.Tensor,
    weights_placements: torch.Tensor,
    weights_offsets: torch.Tensor,
    momentum1_dev: torch.Tensor,
    momentum1_other: torch.Tensor,
    momentum1_placements: torch.Tensor,
    momentum1_offsets: torch.Tensor,
    D_offsets: torch.Tensor,
    pruned_indices: torch.Tensor,
    pruned_indices_offsets: torch.Tensor,
    logical_table_ids: torch.Tensor,
    buffer_ids: torch.Tensor,
) -> None:
    """FBGEMM's ``reset_weight_momentum`` (fbgemm_gpu/src/split_embeddings_cache/reset_weight_momentum.cu,
    a CUDA kernel only) on CPU tensors, with the kernel's indexing and without its cache (a CPU TBE has none).

    For each ``(logical_id, buffer_id)`` of ``logical_table_ids`` and ``buffer_ids``: the rows
    ``pruned_indices[pruned_indices_offsets[buffer_id]:pruned_indices_offsets[buffer_id + 1]]`` of the
    table at ``weights_offsets[logical_id]`` (``D_offsets[logical_id + 1] - D_offsets[logical_id]``
    wide; placement ``DEVICE`` in the device buffer, any other in the other one) get weights 0 (their
    first ``D // 4 * 4`` columns: the kernel writes 4-wide chunks) and their row-wise momentum
    (``momentum1_offsets[logical_id] + row``, placed alike) 0.
    """
    device = EmbeddingLocation.DEVICE.value
    for logical_id, buffer_id in zip(logical_table_ids.tolist(), buffer_ids.tolist()):
        start, stop = pruned_indices_offsets[buffer_id : buffer_id + 2].tolist()
        rows = pruned_indices[start:stop].long()
        if rows.numel() == 0:
            continue
        D = int(D_offsets[logical_id + 1] - D_offsets[logical_id])
        weights = dev_weights if int(weights_placements[logical_id]) == device else other_weights
        momentum1 = momentum1_dev if int(momentum1_placements[logical_id]) == device else momentum1_other
        momentum1[int(momentum1_offsets[logical_id]) + rows] = 0
        columns = torch.arange(D // 4 * 4)
        weights[int(weights_offsets[logical_id]) + rows[:, None] * D + columns] = 0


@pytest.fixture
def fbgemm_reset_weight_momentum_on_cpu(monkeypatch) -> list[dict[str, Any]]:
    """TorchRec's reference on CPU resets rows on an eviction with row-wise Adagrad, as on GPU.

    TorchRec's sharded managed-collision module calls its TBE's ``reset_embedding_weight_momentum``
    for each table's evicted rows; for EXACT_ROWWISE_ADAGRAD that calls ``fbgemm::reset_weight_momentum``,
    which has a CUDA kernel only (on CPU the call fails), and passes it the TBE's device and UVM
    buffers, while a CPU TBE keeps its tables and state in its host buffers (placement HOST). For the
    test only (monkeypatch restores the method after it), the method runs
    :func:`_reset_weight_momentum_cpu` on the host buffers, otherwise as FBGEMM's method does (an error
    without an optimizer, nothing for optimizers other than row-wise Adagrad).

    Returns:
        The calls that reset rows: per call, how many rows (filled as the test runs).
    """
    calls: list[dict[str, Any]] = []

    def reset_embedding_weight_momentum(
        self: Any,
        pruned_indices: torch.Tensor,
        pruned_indices_offsets: torch.Tensor,
        logical_table_ids: torch.Tensor,
        buffer_ids: torch.Tensor,
    ) -> None:
        if self.optimizer == EmbOptimType.NONE:
            raise NotImplementedError(f"Resetting embedding weight momentum is not supported for {self.optimizer}")
        if self.optimizer != EmbOptimType.EXACT_ROWWISE_ADAGRAD:
            return
        assert self.use_cpu and int(self.total_cache_hash_size) == 0  # (no cache to look the rows up in)
        calls.append({"rows": int(pruned_indices_offsets[-1] - pruned_indices_offsets[0])})
        with torch.no_grad():
            _reset_weight_momentum_cpu(
                self.weights_dev,
                self.weights_host,
                self.weights_placements,
                self.weights_offsets,
                self.momentum1_dev,
                self.momentum1_host,
                self.momentum1_placements,
                self.momentum1_offsets,
                self.D_offsets,
                pruned_indices,
                pruned_indices_offsets,
                logical_table_ids,
                buffer_ids,
            )

    monkeypatch.setattr(
        SplitTableBatchedEmbeddingBagsCodegen, "reset_embedding_weight_momentum", reset_embedding_weight_momentum
    )
    return calls


def _torchrec_sharded(
    model: _Sparse,
    plan: ShardingPlan,
    batches,
    kind: str,
    optimizer: str = "adagrad",
    rank_batches: list[list[KeyedJaggedTensor]] | None = None,
) -> list[list[dict[str, Any]]]:
    """TorchRec's sharded managed-collision module on 8 thread ranks: per rank, per step what it computed.

    Each rank takes its samples of the step's batch, or ``rank_batches[step][rank]`` where given."""
    copies = [copy.deepcopy(model) for _ in range(WORLD)]  # (before the threads: no random op in a rank)
    per_rank = BATCH // WORLD

    def rank_fn(rank: int) -> list[dict[str, Any]]:
        unsharded = copies[rank].sparse
        apply_optimizer_in_backward(OPTIMIZERS[optimizer], unsharded._embedding_module.parameters(), dict(ADAGRAD))
        env = ShardingEnv.from_process_group(cast(Any, dist.group.WORLD))
        sharded: Any = _sharder(kind).shard(unsharded, cast(Any, plan.plan["sparse"]), env, torch.device("cpu"))
        # TorchRec's sharded tables start from its own init: give them the unsharded rows.
        state = sharded.state_dict()
        unsharded_state = unsharded.state_dict()
        with torch.no_grad():
            for t in ("t0", "t1"):
                (shard,) = state[_table_key(kind, t)].local_shards()
                offset, rows = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
                shard.tensor.copy_(unsharded_state[_table_key(kind, t)][offset : offset + rows])
        evicted: list[dict[str, Any]] = []
        evict = sharded._evict

        def recording_evict(evictions):
            evicted.append({t: None if v is None else v.clone() for t, v in evictions.items()})
            return evict(evictions)

        sharded._evict = recording_evict
        steps = []
        for step, (kjt, target) in enumerate(batches):
            features = (
                rank_batches[step][rank]
                if rank_batches is not None
                else _samples(kjt, rank * per_rank, (rank + 1) * per_rank)
            )
            out, remapped = sharded(features)
            out = out.wait() if isinstance(out, LazyAwaitable) else out
            remapped = remapped.wait() if isinstance(remapped, LazyAwaitable) else remapped
            if remapped is not None and not isinstance(remapped, KeyedJaggedTensor):
                remapped = remapped.wait()  # (without remapped features: a NoWait of None)
            _loss(out, _rank_target(kjt, target, rank), "cpu", ranks=1).backward()
            optimizer_state = sharded._embedding_module.fused_optimizer.state_dict()["state"]
            momentum = {}
            for key, slots in optimizer_state.items():
                table = key.split(".")[1]
                (shard,) = slots[f"{table}.momentum1"].local_shards()
                momentum[table] = (shard.metadata.shard_offsets[0], shard.tensor.clone())
            steps.append(
                {
                    "out": {k: v.detach().clone() for k, v in _outputs(out).items()},
                    "remapped": {} if remapped is None else {f: remapped[f] for f in remapped.keys()},
                    "state": _local_state(sharded),
                    "momentum": momentum,
                }
            )
        for step, record in zip(steps, evicted):
            step["evicted"] = record
        return steps

    return run_ranks(WORLD, rank_fn)


def _gathered(per_rank: list[tuple[int, torch.Tensor, tuple[int, ...]]]) -> torch.Tensor:
    """The whole tensor of a sharded state-dict entry from each rank's (offset, rows, size)."""
    whole = torch.zeros(per_rank[0][2], dtype=per_rank[0][1].dtype)
    for offset, rows, _ in per_rank:
        whole[offset : offset + rows.shape[0]] = rows
    return whole


def _tpurec_sharded(model: _Sparse, plan: ShardingPlan, optimizer: str = "adagrad") -> Any:
    ours = copy.deepcopy(model)
    apply_optimizer_in_backward(OPTIMIZERS[optimizer], ours.sparse._embedding_module.parameters(), dict(ADAGRAD))
    ours = sp.from_torchrec(ours).to("tpu")
    return tpurec.shard(ours, plan, capacity=64)


def _history_overflows(batches, hashed: bool, table_features: tuple[tuple[str, ...], ...] = FEATURES) -> int:
    """Shards (table, device) whose ids of one eviction window exceed their history buffer, which
    TorchRec sizes from the first batch (ids x eviction_interval x 1.25): then the order matters."""
    block = -(-INPUT_HASH_SIZE // WORLD)
    overflows = 0
    for features in table_features:
        counts = np.array(
            [np.bincount(_ids(kjt, list(features), hashed).numpy() // block, minlength=WORLD)
             for kjt, _ in batches]
        )  # fmt: skip
        buffer = (counts[0] * 2 * 1.25).astype(int)
        overflows += int(((counts[0] + counts[1] > buffer) | (counts[2] + counts[3] > buffer)).sum())
    return overflows


def _ids(kjt: KeyedJaggedTensor, features: list[str], hashed: bool) -> torch.Tensor:
    ids = torch.cat([kjt[f].values() for f in features])
    return _hash(ids, INPUT_HASH_SIZE) if hashed else ids


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("kind, hashed", [(kind, False) for kind in KINDS] + [("bags", True)])
def test_sharded_mc_collection_trains_as_torchrec_sharded_with_evictions(
    kind, hashed, optimizer, fbgemm_reset_weight_momentum_on_cpu
):
    features = ROWWISE_FEATURES if optimizer == "rowwise_adagrad" else FEATURES
    model = _model(kind, hashed, features)
    plan = _plan(model, ROW_WISE, kind)
    batches = _batches(kind, features)
    theirs = _torchrec_sharded(model, plan, batches, kind, optimizer)
    ours = _tpurec_sharded(model, plan, optimizer)
    sharded_mc = ours.sparse
    expected = (
        ShardedManagedCollisionEmbeddingBagCollection if kind == "bags" else ShardedManagedCollisionEmbeddingCollection
    )
    assert isinstance(sharded_mc, expected)
    bags = sharded_mc._bags[0]
    assert isinstance(bags, ShardedEmbeddingBagCollection)
    our_evictions: list[dict[str, Any]] = []
    evict = sharded_mc._managed_collision_collection.evict

    def recording_evict():
        our_evictions.append(evict())
        return our_evictions[-1]

    sharded_mc._managed_collision_collection.evict = recording_evict
    evicted_rows = trained_evicted_rows = 0
    accumulators: dict[str, torch.Tensor] = {}  # TorchRec's after the previous step
    for step, (kjt, target) in enumerate(batches):
        out, remapped = ours(kjt)
        _loss(out, target).backward()
        ranks = [rank_steps[step] for rank_steps in theirs]
        when = f"step {step}"
        # The remapped ids: each feature's global rows, the ranks' samples in rank order.
        assert remapped.keys() == ["f0", "f1", "f2"], when
        for f in remapped.keys():
            want = torch.cat([r["remapped"][f].values() for r in ranks])
            want_lengths = torch.cat([r["remapped"][f].lengths() for r in ranks])
            assert torch.equal(remapped[f].values(), want), f"{when}, {f}: {remapped[f].values()} != {want}"
            assert torch.equal(remapped[f].lengths(), want_lengths), when
        # The evicted rows (TorchRec's are each rank's local rows: made global by its shard's offset).
        for table in ("t0", "t1"):
            want_rows = []
            for r in ranks:
                local = r["evicted"][table]
                if local is not None:
                    want_rows.append(local + r["state"][_table_key(kind, table)][0])
            got_rows = our_evictions[step][table]
            want_set = sorted(torch.cat(want_rows).tolist()) if want_rows else []
            assert sorted([] if got_rows is None else got_rows.tolist()) == want_set, f"{when}: evictions of {table}"
            evicted_rows += len(want_set)
            if table in accumulators:  # (rows reset with state a step had given them)
                trained = accumulators[table][want_set] != 0
                trained_evicted_rows += int((trained if trained.dim() == 1 else trained.any(dim=1)).sum())
        for key, value in _outputs(out).items():
            torch.testing.assert_close(
                value.cpu(),
                torch.cat([r["out"][key] for r in ranks]),
                **TOLERANCE,
                msg=lambda m: f"{when}: {key}: {m}",
            )
        tables, slots = bags.full_tables()
        for table in ("t0", "t1"):
            torch.testing.assert_close(
                torch.from_numpy(tables[table]),
                _gathered([r["state"][_table_key(kind, table)] for r in ranks]),
                **TOLERANCE,
                msg=lambda m: f"{when}: {table}: {m}",
            )
            momentum = [(*r["momentum"][table], slots[table]["momentum1"].shape) for r in ranks]
            accumulators[table] = _gathered(momentum)
            torch.testing.assert_close(
                torch.from_numpy(slots[table]["momentum1"]),
                accumulators[table],
                **TOLERANCE,
                msg=lambda m: f"{when}: {table} accumulators: {m}",
            )
    # Every MCH buffer of every shard: the state dict has TorchRec's keys, whole (shards in rank order).
    state = ours.state_dict()
    final = [rank_steps[-1]["state"] for rank_steps in theirs]
    mc_keys = [k for k in final[0] if k.startswith("_managed_collision_collection.")]
    assert {f"sparse.{k}" for k in mc_keys} == {k for k in state if k.startswith(MC)}
    for key in mc_keys:
        want = final[0][key] if isinstance(final[0][key], torch.Tensor) else _gathered([s[key] for s in final])
        assert torch.equal(state[f"sparse.{key}"], want), key
    # The test means something: rows were evicted and reset (some with non-zero accumulators), and
    # history buffers overflowed.
    assert evicted_rows > 0
    assert trained_evicted_rows > 0
    assert _history_overflows(batches, hashed, features) > 0
    if optimizer == "rowwise_adagrad":  # TorchRec reset rows through FBGEMM's op on every rank that evicted
        assert len(fbgemm_reset_weight_momentum_on_cpu) > 0
        assert sum(int(call["rows"]) for call in fbgemm_reset_weight_momentum_on_cpu) == evicted_rows


def test_sharded_mc_ebc_state_dict_round_trip_and_eval():
    model = _model()
    plan = _plan(model, ROW_WISE)
    ours = _tpurec_sharded(model, plan)
    for kjt, target in _batches()[:3]:
        out, _ = ours(kjt)
        _loss(out, target).backward()
    saved = {k: v.clone() for k, v in ours.state_dict().items()}
    other = _tpurec_sharded(model, plan)
    other.load_state_dict(saved)
    for key, value in other.state_dict().items():
        assert torch.equal(value, saved[key]), key
    # Loaded, the remap is the same: in eval mode (no profiling, no eviction) both give the same rows.
    ours.eval()
    other.eval()
    kjt = _batches()[4][0]
    (a, remapped_a), (b, remapped_b) = ours(kjt), other(kjt)
    assert torch.equal(remapped_a.values(), remapped_b.values())
    torch.testing.assert_close(a.values().cpu(), b.values().cpu(), rtol=0, atol=0)
    assert int(saved[f"{MC}t0._current_iter_tensor"]) == 3
    assert torch.equal(ours.state_dict()[f"{MC}t0._current_iter_tensor"], saved[f"{MC}t0._current_iter_tensor"])


def test_without_a_plan_the_tpu_planner_shards_the_tables_row_wise():
    model = _model()
    ours = _converted(model)
    sharded: Any = tpurec.shard(ours)
    assert isinstance(sharded.sparse, ShardedManagedCollisionEmbeddingBagCollection)
    shardings = sharded.sparse._embedding_bag_collection.layout.shardings
    assert {t: s.sharding_type for t, s in shardings.items()} == {"t0": "row_wise", "t1": "row_wise"}
    kjt, target = _batches()[1]
    pooled, remapped = sharded(kjt)
    _loss(pooled, target).backward()
    assert remapped.values().shape == kjt.values().shape


class _WithHead(nn.Module):
    """A managed-collision EBC and a dense head; TrainPipeline's convention: ``(loss, output)``."""

    sparse: Any

    def __init__(self, sparse: nn.Module) -> None:
        super().__init__()
        self.sparse = sparse
        self.head = nn.Linear(16, 1)

    def forward(self, batch: tuple[KeyedJaggedTensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        kjt, labels = batch
        pooled, _ = self.sparse(kjt)
        loss = (self.head(pooled.values()).squeeze(1) - labels.to(pooled.values().device)).pow(2).mean()
        return loss, loss.detach()


@pytest.mark.parametrize("mode", ["eager", "fused"])
def test_train_pipeline_remaps_in_the_step_as_direct_steps_do(mode):
    # TrainPipeline prepares no batch of remapped features ahead (the remap, and its evictions,
    # belong to the step): its steps equal direct steps, in eager and in fused mode.
    torch.manual_seed(0)
    base = _WithHead(_model().sparse)
    plan = _plan(_Sparse(base.sparse), ROW_WISE)
    models, optimizers = [], []
    for _ in range(2):
        model = copy.deepcopy(base)
        apply_optimizer_in_backward(torch.optim.Adagrad, model.sparse._embedding_module.parameters(), dict(ADAGRAD))
        model: Any = tpurec.shard(sp.from_torchrec(model).to("tpu"), plan, capacity=64)
        models.append(model)
        optimizers.append(torch.optim.SGD(model.head.parameters(), lr=0.05))
    labels = torch.linspace(-1.0, 1.0, BATCH)
    batches = [(kjt, labels) for kjt, _ in _batches()[:4]]
    direct = []
    with tpurec.mode(mode):
        for batch in batches:
            optimizers[0].zero_grad()
            loss, _ = models[0](batch)
            loss.backward()
            optimizers[0].step()
            direct.append(float(loss))
        pipeline = sp.TrainPipeline(models[1], optimizers[1], "tpu")
        it = iter(batches)
        piped = [float(pipeline.progress(it)) for _ in batches]
        pipeline.close()
    np.testing.assert_allclose(piped, direct, rtol=1e-6, atol=1e-7)
    mine, theirs = models[1].state_dict(), models[0].state_dict()
    for key, value in theirs.items():
        torch.testing.assert_close(mine[key].cpu(), value.cpu(), rtol=1e-6, atol=1e-7, msg=key)
    assert int(theirs[f"{MC}t0._current_iter_tensor"]) == 4


def test_sharding_starts_each_shard_remap_empty_and_says_so_when_ids_were_admitted():
    # As TorchRec's sharded module: each shard's MCH module is built fresh (the unsharded remap
    # does not split by shard), with a warning when the unsharded one had admitted ids.
    model = _model()
    ours = _converted(model)
    for kjt, target in _batches()[:2]:
        out, _ = ours(kjt)
        _loss(out, target).backward()
    assert (ours.sparse._managed_collision_collection._managed_collision_modules["t0"]._mch_sorted_raw_ids < 1000).any()
    with pytest.warns(UserWarning, match=r"tables \['t0', 't1'\] had admitted ids"):
        sharded = tpurec.shard(ours, _plan(model, ROW_WISE))
    state = sharded.state_dict()
    assert (state[f"{MC}t0._mch_sorted_raw_ids"] == torch.iinfo(torch.int64).max).all()
    assert int(state[f"{MC}t0._current_iter_tensor"]) == 0


def test_torchrec_resets_the_rows_of_another_table_after_a_table_of_several_features(
    fbgemm_reset_weight_momentum_on_cpu,
):
    # TorchRec's sharded module passes reset_weight_momentum each table's position among its TBE's
    # tables (t1: 1) where the op reads per-feature offsets (feature 1 is t0's second feature): with
    # FEATURES, t1's evicted rows zero the same local rows of t0 and leave t1's accumulators. tpurec
    # resets the evicted table's own rows (what the op does for the position of the table's first
    # feature, as TorchRec's ITEP module passes it), so the row-wise Adagrad runs use ROWWISE_FEATURES.
    model = _model("bags", features=FEATURES)
    plan = _plan(model, ROW_WISE)
    copies = [copy.deepcopy(model) for _ in range(WORLD)]

    def rank_fn(rank: int) -> dict[str, Any]:
        unsharded = copies[rank].sparse
        apply_optimizer_in_backward(TorchrecRowWiseAdagrad, unsharded._embedding_module.parameters(), dict(ADAGRAD))
        env = ShardingEnv.from_process_group(cast(Any, dist.group.WORLD))
        sharded: Any = _sharder("bags").shard(unsharded, cast(Any, plan.plan["sparse"]), env, torch.device("cpu"))
        tbe, _ = sharded._table_to_tbe_and_index["t1"]
        assert tbe is sharded._table_to_tbe_and_index["t0"][0] and tbe.feature_table_map == [0, 0, 1]
        with torch.no_grad():
            tbe.momentum1_host.fill_(1.0)
        before = _local_state(sharded)
        sharded._evict({"t0": None, "t1": torch.tensor([0])})  # local row 0 of t1
        after = _local_state(sharded)
        momentum = sharded._embedding_module.fused_optimizer.state_dict()["state"]
        return {
            "before": {t: before[_table_key("bags", t)][1] for t in ("t0", "t1")},
            "after": {t: after[_table_key("bags", t)][1] for t in ("t0", "t1")},
            "momentum": {
                t: momentum[f"embedding_bags.{t}.weight"][f"{t}.momentum1"].local_shards()[0].tensor
                for t in ("t0", "t1")
            },
        }

    for rank in run_ranks(WORLD, rank_fn):
        before, after, momentum = rank["before"], rank["after"], rank["momentum"]
        assert (after["t0"][0] == 0).all() and momentum["t0"][0] == 0  # t0's row 0: zeroed
        assert torch.equal(after["t0"][1:], before["t0"][1:]) and (momentum["t0"][1:] == 1).all()
        assert (after["t1"][0] == RESET_VALUE).all() and (momentum["t1"] == 1).all()  # t1's kept
        assert (before["t0"][0] != 0).all()
    assert len(fbgemm_reset_weight_momentum_on_cpu) == WORLD

    # tpurec (the optimizer given to tpurec.shard): t1's row reset, its accumulator zeroed, t0 untouched.
    ours: Any = tpurec.shard(_converted(model), plan, capacity=64, optimizer=sp.RowWiseAdagrad(learning_rate=0.1))
    for kjt, target in _batches()[:2]:
        out, _ = ours(kjt)
        _loss(out, target).backward()
    bags = ours.sparse._bags[0]
    tables, slots = bags.full_tables()
    row = int(np.flatnonzero(slots["t1"]["momentum1"])[0])
    ours.sparse._reset_evicted({"t0": None, "t1": np.array([row])})
    after_tables, after_slots = bags.full_tables()
    assert (after_tables["t1"][row] == RESET_VALUE).all() and after_slots["t1"]["momentum1"][row] == 0
    others = np.arange(23) != row
    np.testing.assert_array_equal(after_tables["t1"][others], tables["t1"][others])
    np.testing.assert_array_equal(after_slots["t1"]["momentum1"][others], slots["t1"]["momentum1"][others])
    np.testing.assert_array_equal(after_tables["t0"], tables["t0"])
    np.testing.assert_array_equal(after_slots["t0"]["momentum1"], slots["t0"]["momentum1"])


# --- what stays refused -----------------------------------------------------------------------------


def _converted(model: _Sparse, optimizer: type = torch.optim.Adagrad) -> Any:
    ours = copy.deepcopy(model)
    apply_optimizer_in_backward(optimizer, ours.sparse._embedding_module.parameters(), {"lr": 0.1})
    return sp.from_torchrec(ours).to("tpu")


def test_a_plan_other_than_row_wise_is_refused_as_torchrec_refuses_it():
    model = _model()
    meta = TorchrecEBC(_tables(), device=torch.device("meta"))
    module_plan = construct_module_sharding_plan(
        meta, {"t0": row_wise(), "t1": table_wise(rank=3)}, local_size=WORLD, world_size=WORLD, device_type="cpu"
    )
    ours = _converted(model)
    with pytest.raises(
        ValueError, match=r"row-wise only.*\{'t1': 'table_wise'\}|\{'t1': 'table_wise'\}.*row-wise only"
    ):
        tpurec.shard(ours, ShardingPlan({"sparse": module_plan}))
    assert isinstance(ours.sparse._embedding_module, sp.EmbeddingBagCollection)  # left as it was


def test_a_table_with_an_empty_row_wise_shard_is_refused():
    tables = [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=5, feature_names=["f0"])]
    mcc = ManagedCollisionCollection(
        {"t0": MCHManagedCollisionModule(5, torch.device("cpu"), LFU_EvictionPolicy(), 2, INPUT_HASH_SIZE)}, tables
    )
    model = _Sparse(TorchrecMCEBC(TorchrecEBC(tables), mcc))
    plan = _plan(model, {"t0": row_wise(compute_kernel="fused")})
    with pytest.raises(ValueError, match="one shard of at least one row on each of the 8 devices"):
        tpurec.shard(_converted(model), plan)


def test_sharded_checkpoints_refuse_the_remap_state_they_do_not_hold(tmp_path):
    from tpurec.sparse.checkpoint import sharded as sharded_checkpoint

    model = _model()
    ours = _tpurec_sharded(model, _plan(model, ROW_WISE))
    with pytest.raises(NotImplementedError, match="model.state_dict"):
        sharded_checkpoint.save(ours, tmp_path / "ckpt")
    with pytest.raises(NotImplementedError, match="model.state_dict"):
        sharded_checkpoint.load(ours, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_a_weighted_collection_is_refused():
    mcc = _model().sparse._managed_collision_collection
    model = _Sparse(TorchrecMCEBC(TorchrecEBC(list(mcc.embedding_configs()), is_weighted=True), mcc))
    with pytest.raises(NotImplementedError, match="weighted managed-collision collection 'sparse'"):
        tpurec.shard(_converted(model), _plan(model, ROW_WISE))


def test_a_standalone_collection_and_vbe_batches_of_a_sequence_collection_are_refused():
    model = _model()
    standalone = nn.ModuleDict(
        {
            "mcc": cast(nn.Module, copy.deepcopy(model.sparse._managed_collision_collection)),
            "ebc": TorchrecEBC(_tables()),
        }
    )
    converted = sp.from_torchrec(standalone).to("tpu")
    plan = ShardingPlan(
        {
            "ebc": construct_module_sharding_plan(
                TorchrecEBC(_tables(), device=torch.device("meta")),
                ROW_WISE,
                local_size=WORLD,
                world_size=WORLD,
                device_type="cpu",
            )
        }
    )
    with pytest.raises(NotImplementedError, match="on their own"):
        tpurec.shard(converted, plan)
    # A sequence collection's VBE batch (TorchRec's sharded one pads it; not compared here).
    sequence = _model("sequence")
    ours = _tpurec_sharded(sequence, _plan(sequence, ROW_WISE, "sequence"))
    vbe = KeyedJaggedTensor(
        keys=["f0", "f1", "f2"],
        values=torch.arange(6),
        lengths=torch.tensor([1, 1, 1, 1, 1, 1]),
        stride_per_key_per_rank=[[2], [1], [3]],
    )
    with pytest.raises(NotImplementedError, match="one batch size"):
        ours(vbe)


def _vbe_batches() -> tuple[list[tuple[KeyedJaggedTensor, dict[str, torch.Tensor]]], list[list[KeyedJaggedTensor]]]:
    """Batches with a variable batch per feature (VBE): each rank's features have 1 or 2 bags for its 2 samples,
    which ``inverse_indices`` pick; the global batch (tpurec's one process) holds each feature's bags rank by
    rank, as TorchRec's ranks send them. Returns the global batches with the pooled loss weights, and per step
    each rank's batch."""
    rng = np.random.default_rng(5)
    keys = ["f0", "f1", "f2"]
    per_rank = BATCH // WORLD
    pooled_width = sum(len(names) * dim for names, dim in zip(ROWWISE_FEATURES, _dims("bags")))
    batches, rank_batches = [], []
    for step in range(STEPS):
        bags = rng.integers(1, per_rank + 1, (WORLD, len(keys)))
        lengths = [[np.ones(b, np.int64) if step == 0 else rng.integers(0, 6, b) for b in row] for row in bags]
        ids = [
            [
                rng.integers(0, INPUT_HASH_SIZE, int(n.sum()))
                if step == 0
                else (rng.geometric(0.15, int(n.sum())) + 30 * step) * 37 % INPUT_HASH_SIZE
                for n in row
            ]
            for row in lengths
        ]
        inverse = [np.stack([rng.integers(0, b, per_rank) for b in row]) for row in bags]
        ranks = []
        for r in range(WORLD):
            ranks.append(
                KeyedJaggedTensor(
                    keys=keys,
                    values=torch.from_numpy(np.concatenate(ids[r])).long(),
                    lengths=torch.from_numpy(np.concatenate(lengths[r])).long(),
                    stride_per_key_per_rank=[[int(b)] for b in bags[r]],
                    inverse_indices=(keys, torch.from_numpy(inverse[r]).long()),
                )
            )
        starts = np.concatenate([np.zeros((1, len(keys)), np.int64), np.cumsum(bags, axis=0)[:-1]])
        whole = KeyedJaggedTensor(
            keys=keys,
            values=torch.from_numpy(np.concatenate([ids[r][f] for f in range(len(keys)) for r in range(WORLD)])).long(),
            lengths=torch.from_numpy(
                np.concatenate([lengths[r][f] for f in range(len(keys)) for r in range(WORLD)])
            ).long(),
            stride_per_key_per_rank=[[int(bags[r][f]) for r in range(WORLD)] for f in range(len(keys))],
            inverse_indices=(
                keys,
                torch.from_numpy(
                    np.concatenate([inverse[r] + starts[r][:, None] for r in range(WORLD)], axis=1)
                ).long(),
            ),
        )
        target = {"pooled": torch.from_numpy(rng.normal(size=(BATCH, pooled_width)).astype(np.float32))}
        batches.append((whole, target))
        rank_batches.append(ranks)
    return batches, rank_batches


def test_sharded_mc_ebc_takes_vbe_batches_as_torchrec_sharded(fbgemm_reset_weight_momentum_on_cpu):
    # TorchRec's sharded managed-collision EBC remaps each feature's own bags (an id once per bag) and expands the
    # pooled bags to the output samples by inverse_indices; tpurec's was refused (NotImplementedError). TorchRec
    # refuses VBE with return_remapped_features=True, and so does tpurec. (FBGEMM's TBE takes VBE batches with
    # row-wise Adagrad, SGD and Adam only: row-wise Adagrad here, its table layout as in the other row-wise runs.)
    batches, rank_batches = _vbe_batches()
    with_remapped = _model(features=ROWWISE_FEATURES)
    with pytest.raises(NotImplementedError, match="return_remapped_features=True"):
        _tpurec_sharded(with_remapped, _plan(with_remapped, ROW_WISE), "rowwise_adagrad")(batches[0][0])
    model = _model(features=ROWWISE_FEATURES, return_remapped_features=False)
    plan = _plan(model, ROW_WISE)
    theirs = _torchrec_sharded(model, plan, batches, "bags", "rowwise_adagrad", rank_batches=rank_batches)
    ours = _tpurec_sharded(model, plan, "rowwise_adagrad")
    sharded_mc = ours.sparse
    bags = sharded_mc._bags[0]
    evict = sharded_mc._managed_collision_collection.evict
    our_evictions: list[dict[str, Any]] = []

    def recording_evict():
        our_evictions.append(evict())
        return our_evictions[-1]

    sharded_mc._managed_collision_collection.evict = recording_evict
    evicted_rows = 0
    for step, (kjt, target) in enumerate(batches):
        out, remapped = ours(kjt)
        assert remapped is None
        _loss(out, target).backward()
        ranks = [rank_steps[step] for rank_steps in theirs]
        when = f"step {step}"
        for table in ("t0", "t1"):
            want_rows = [
                r["evicted"][table] + r["state"][_table_key("bags", table)][0]
                for r in ranks
                if r["evicted"][table] is not None
            ]
            got_rows = our_evictions[step][table]
            want_set = sorted(torch.cat(want_rows).tolist()) if want_rows else []
            assert sorted([] if got_rows is None else got_rows.tolist()) == want_set, f"{when}: evictions of {table}"
            evicted_rows += len(want_set)
        torch.testing.assert_close(
            out.values().cpu(), torch.cat([r["out"]["pooled"] for r in ranks]), **TOLERANCE, msg=when
        )
        tables, slots = bags.full_tables()
        for table in ("t0", "t1"):
            torch.testing.assert_close(
                torch.from_numpy(tables[table]),
                _gathered([r["state"][_table_key("bags", table)] for r in ranks]),
                **TOLERANCE,
                msg=lambda m: f"{when}: {table}: {m}",
            )
            momentum = [(*r["momentum"][table], slots[table]["momentum1"].shape) for r in ranks]
            torch.testing.assert_close(
                torch.from_numpy(slots[table]["momentum1"]), _gathered(momentum), **TOLERANCE, msg=when
            )
    assert evicted_rows > 0
