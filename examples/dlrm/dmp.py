"""``train.py --dist dmp``: the DLRM sharded by TorchRec's own DistributedModelParallel, under torchrun.

Beside the ``tpurec.shard`` path (one process driving every device), this is TorchRec's
multi-process way, as ``dlrm_main.py`` runs it on GPUs: one process per tpu device, started by
``torchrun``, the ``"cpu:gloo,tpu:tpu"`` process group, TorchRec's ``EmbeddingShardingPlanner``
with the TPU topology (``Topology(compute_device="tpu", local_world_size=1)``: each process's
shards on its own ``tpu:0``) and TorchRec's ``UNFUSED_TPU`` kernel, the dense part wrapped in
DistributedDataParallel by DMP, and TorchRec's ``TrainPipelineSparseDist`` running the steps.
``--batch_size`` is per process (``dlrm_main.py``'s per-rank batch); rank ``r`` trains on the
data's batches ``r, r + N, r + 2N, ...``. The held-out metrics are over every rank's samples.
"""

from __future__ import annotations

import datetime
import itertools
import os
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection
from torchrec.datasets.utils import Batch
from torchrec.models.dlrm import DLRMTrain

import tpurec
from dlrm import loop
from dlrm import model as model_lib
from dlrm.data import Loader
from dlrm.flags import Config, ConfigError
from dlrm.metrics import EvalResult, HeldOutMetrics

# UNFUSED_TPU's lookups take table dims (and column shards) that are multiples of this.
DIM_MULTIPLE = 16
# The sharding types the planner may choose (the ones tpurec's DMP tests check; table-row-wise and
# grid-wise plans do not run yet).
SHARDING_TYPES = ["table_wise", "row_wise", "column_wise"]
# Plain torch.optim optimizers over the tables' shards (the UNFUSED_TPU kernel has no fused one).
TABLE_OPTIMIZERS = ("sgd", "adagrad")


def check(cfg: Config) -> None:
    """Refuses what the DMP path does not run, with what to do instead.

    Raises:
        ConfigError: a flag the DMP path cannot honour, or not launched by torchrun.
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ConfigError(
            "--dist dmp runs one process per tpu device under torchrun: "
            "torchrun --nproc-per-node N examples/dlrm/train.py --dist dmp ..."
        )
    if cfg.embedding_dim % DIM_MULTIPLE:
        raise ConfigError(
            f"--dist dmp: TorchRec's UNFUSED_TPU kernel needs --embedding_dim a multiple of {DIM_MULTIPLE}, "
            f"got {cfg.embedding_dim}"
        )
    if cfg.embedding_optimizer not in TABLE_OPTIMIZERS:
        raise ConfigError(
            f"--dist dmp trains the tables with torch.optim ({', '.join(TABLE_OPTIMIZERS)}); "
            f"--embedding_optimizer {cfg.embedding_optimizer} is the tpurec path's (drop --dist dmp)"
        )
    refused = {
        "--num_devices": cfg.num_devices != 1,
        "--mode fused/compile": cfg.mode != "eager",
        "--checkpoint_dir": cfg.checkpoint_dir is not None,
        "--profile_dir": cfg.profile_dir is not None,
        "--print_sharding_plan": cfg.print_sharding_plan,
        "--validation_freq_within_epoch": cfg.validation_freq_within_epoch is not None,
        "--tensorboard_dir": cfg.tensorboard_dir is not None,
        "--metrics_file": cfg.metrics_file is not None,
    }
    given = [flag for flag, on in refused.items() if on]
    if given:
        raise ConfigError(
            f"--dist dmp does not take {', '.join(given)} (one tpu device per process, eager ops, a validation "
            "pass per epoch); drop them, or drop --dist dmp for the tpurec path"
        )


def _optimizer(cfg: Config, model: nn.Module) -> Any:
    """``--embedding_optimizer`` over the tables, ``--adagrad`` (else SGD) over the dense part."""
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

    tables = {id(p) for m in model.modules() if "ShardedEmbeddingBagCollection" in type(m).__name__
              for p in m.parameters()}  # fmt: skip
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = {
        "tables": ({n: p for n, p in named if id(p) in tables}, cfg.embedding_optimizer == "adagrad"),
        "dense": ({n: p for n, p in named if id(p) not in tables}, cfg.adagrad),
    }
    parts = []
    for key, (params, adagrad) in groups.items():

        def make(group: Any, adagrad: bool = adagrad) -> torch.optim.Optimizer:
            if adagrad:
                return torch.optim.Adagrad(group, lr=cfg.learning_rate, eps=cfg.eps)
            return torch.optim.SGD(group, lr=cfg.learning_rate)

        parts.append((key, KeyedOptimizerWrapper(cast(dict[str, Any], params), make)))
    return CombinedOptimizer(parts)


def shard(cfg: Config) -> nn.Module:
    """TorchRec's DLRM (and its loss, ``DLRMTrain``) sharded by DMP on this process's tpu device."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ModuleSharder

    torch.manual_seed(cfg.seed)
    configs = model_lib.table_configs(cfg)
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    train_model = DLRMTrain(cast(Any, model_lib.build_torchrec_model(cfg, ebc)))
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=dist.get_world_size(), compute_device="tpu", local_world_size=1),
        batch_size=cfg.batch_size,
        constraints={
            c.name: ParameterConstraints(
                sharding_types=SHARDING_TYPES, compute_kernels=["unfused_tpu"], min_partition=DIM_MULTIPLE
            )
            for c in configs
        },  # fmt: skip
    )
    sharder = cast(ModuleSharder[nn.Module], EmbeddingBagCollectionSharder())
    plan = planner.collective_plan(train_model, [sharder], dist.GroupMember.WORLD)
    return DistributedModelParallel(train_model, device=torch.device("tpu"), plan=plan, sharders=[sharder])


def _my_batches(loader: Loader, epoch: int) -> Iterator[Batch]:
    """This rank's batches of ``loader``'s epoch (every rank the same number of them)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = len(loader) // world
    if per_rank == 0:
        raise ConfigError(f"{loader.name}: {len(loader)} batch(es) for {world} processes; give each one at least one")
    return itertools.islice(loader.epoch_batches(epoch), rank, per_rank * world, world)


def evaluate(model: nn.Module, loader: Loader, stage: str) -> EvalResult:
    """AUC and normalized entropy over every rank's share of ``loader`` (gathered on each rank)."""
    model.eval()
    logits, labels = [], []
    try:
        with torch.no_grad():
            for batch in _my_batches(loader, 0):
                _loss, (_detached, out, _labels) = model(batch.to(torch.device("tpu")))
                logits.append(out.cpu())
                labels.append(batch.labels)
    finally:
        model.train()
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (torch.cat(logits), torch.cat(labels)))
    metrics = HeldOutMetrics()
    for rank_logits, rank_labels in everyone:
        metrics.update(rank_logits, rank_labels)
    if metrics.samples == 0:
        raise ConfigError(f"the {stage} set is empty: check the data and --limit_{stage}_batches")
    return metrics.compute()


def run(cfg: Config, make_loaders: Callable[[Config], dict[str, Loader]]) -> loop.RunResult:
    """Trains ``--epochs`` epochs with TrainPipelineSparseDist, a validation pass per epoch, then the test set.

    Args:
        cfg: the run's config.
        make_loaders: builds the train, val and test loaders (called once the process group is up:
            the group's start must precede the process's first use of the devices).
    """
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    check(cfg)
    dist.init_process_group("cpu:gloo,tpu:tpu", timeout=datetime.timedelta(seconds=300))
    try:
        loaders = make_loaders(cfg)
        rank, world = dist.get_rank(), dist.get_world_size()
        model = shard(cfg)
        optimizer = _optimizer(cfg, model)
        if rank == 0:
            print(
                f"{cfg.interaction_type} DLRM sharded by TorchRec's DistributedModelParallel on {world} processes "
                f"(tpu, XLA:{tpurec.platform().upper()}): {len(cfg.table_rows)} tables x dim {cfg.embedding_dim}, "
                f"batch {cfg.batch_size} per process, {cfg.embedding_optimizer} tables / "
                f"{'adagrad' if cfg.adagrad else 'sgd'} dense at lr {cfg.learning_rate}"
            )
        history, steps, seconds = loop.History(), 0, 0.0
        for epoch in range(cfg.epochs):
            batches, losses = _my_batches(loaders["train"], epoch), []
            # One pipeline per epoch: it rewrites the sharded collection's forward to take the input
            # it distributed ahead, and detach() gives the plain model back for the held-out pass.
            pipeline = TrainPipelineSparseDist(model, optimizer, torch.device("tpu"))
            began = time.perf_counter()
            while True:
                # The tables' optimizer is a plain torch.optim one here (UNFUSED_TPU), so both parts
                # take the schedule's rate of this step.
                lr = cfg.lr_policy.at_step(steps + len(losses))
                for group in optimizer.param_groups:
                    group["lr"] = lr
                try:
                    loss, _logits, _labels = pipeline.progress(batches)  # DLRMTrain's detached output
                except StopIteration:
                    break
                if cfg.print_lr and rank == 0:
                    for i, group in enumerate(optimizer.param_groups):
                        print(f"lr: {len(losses)} {i} {group['lr']:.6f}")
                losses.append(loss.detach())
            steps += len(losses)
            mean = torch.stack(losses).cpu()  # waits for the epoch's steps
            seconds += time.perf_counter() - began  # the epoch's steps, done (validation left out)
            pipeline.detach()
            dist.all_reduce(mean, op=dist.ReduceOp.AVG)  # equal per-rank batches: the global mean loss
            history.losses.extend(float(v) for v in mean.cpu())
            val = evaluate(model, loaders["val"], "val")
            history.val.append({"step": steps, **val.summary()})
            if rank == 0:
                print(f"AUROC over val set: {val.line()} (epoch {epoch}).")
        final = evaluate(model, loaders["test"], "test")
        history.test = {"step": steps, **final.summary()}
        if rank == 0:
            print(f"AUROC over test set: {final.line()}, {final.samples} samples.")
        rate = steps * cfg.batch_size * world / seconds if seconds > 0 else float("nan")
        if rank == 0:
            print(
                f"held-out AUC {final.auc:.4f}, normalized entropy {final.normalized_entropy:.4f} "
                f"({final.samples} test samples); {steps} steps per process, last loss {history.losses[-1]:.4f}; "
                f"{rate:,.0f} samples/s over all processes (every step timed, the first steps' compilations included)"
            )
        multi_hot = loaders["train"].multi_hot
        if cfg.collect_multi_hot_freqs_stats and multi_hot is not None:
            paths = multi_hot.save_freqs_stats(rank=rank)
            print(f"rank {rank} wrote {', '.join(paths)}")
        dist.barrier()
        return loop.RunResult(
            history=history,
            samples_per_second=rate,
            timed_steps=steps,
            steps_run=steps,
            compilations_after_warmup=None,
            final=final,
        )
    finally:
        dist.destroy_process_group()
