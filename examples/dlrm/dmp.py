"""``train.py --dist dmp``: the DLRM sharded by TorchRec's own DistributedModelParallel, under torchrun.

Beside the ``tpurec.shard`` path (one process driving every device), this is TorchRec's
multi-process way, as ``dlrm_main.py`` runs it on GPUs: one process per tpu device, started by
``torchrun``, the ``"cpu:gloo,tpu:tpu"`` process group, a plan from tpurec's TPU planner (TorchRec's
``EmbeddingShardingPlanner`` with the chip's topology, HBM and SparseCore cost model; or one read
from ``tpurec plan --json`` with ``--plan``), each rank's shards on its own ``tpu:0``
(``on_process_devices``), the sharded tables on TorchRec's ``FUSED`` kernel with the embedding
optimizer applied in the backward (as ``dlrm_main.py``'s ``apply_optimizer_in_backward``; tpurec's
fused kernel on tpu), data-parallel tables and the dense part wrapped in DistributedDataParallel
by DMP, and TorchRec's ``TrainPipelineSparseDist`` running the steps. ``--batch_size`` is per
process (``dlrm_main.py``'s per-rank batch); rank ``r`` trains on the data's batches
``r, r + N, r + 2N, ...``. The held-out metrics are over every rank's samples.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
import time
import warnings
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

# The sharding types this path runs, from the planner or a --plan file (table-row-wise and grid
# plans need torchrun's nodes to be the plan's hosts, which a plan file cannot promise).
SHARDING_TYPES = ("data_parallel", "table_wise", "row_wise", "column_wise")
# The module path of the tables in DLRMTrain (its DLRM's sparse arch).
TABLES_PATH = "model.sparse_arch.embedding_bag_collection"
# torch's deprecation notices of the calls TorchRec makes inside DMP (its DDP wrappers, its
# row-wise collectives): TorchRec's to update, nothing a user of this script can change.
TORCHREC_DEPRECATIONS = (
    r"`broadcast_buffers` is deprecated",
    r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
)


class _NoCachingNote(logging.Filter):
    """Drops TorchRec's note, logged for every data-parallel table, that its caching parameters are
    ignored: this script sets none."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "caching params will be ignored" not in record.getMessage()


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
    refused = {
        "--num_devices": cfg.num_devices != 1,
        "--mode fused/compile": cfg.mode != "eager",
        "--checkpoint_dir": cfg.checkpoint_dir is not None,
        "--profile_dir": cfg.profile_dir is not None,
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


# The FBGEMM optimizer of each --embedding_optimizer, as TorchRec's FUSED kernel takes it.
_FUSED_OPTIMIZERS = {"sgd": "EXACT_SGD", "adagrad": "EXACT_ADAGRAD", "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD",
                     "adam": "ADAM"}  # fmt: skip


def fused_params(cfg: Config) -> dict[str, Any]:
    """The sharded tables' in-backward optimizer, as ``dlrm_main.py`` gives it (``--embedding_optimizer``)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    params: dict[str, Any] = {
        "optimizer": EmbOptimType[_FUSED_OPTIMIZERS[cfg.embedding_optimizer]],
        "learning_rate": cfg.learning_rate,
    }
    if cfg.embedding_optimizer != "sgd":
        params["eps"] = cfg.eps
    return params


def _table_optimizer(cfg: Config, params: Any) -> torch.optim.Optimizer:
    """``--embedding_optimizer`` as a torch optimizer, for the data-parallel tables (dense parameters)."""
    from torchrec.optim import RowWiseAdagrad

    lr, eps = cfg.learning_rate, cfg.eps
    if cfg.embedding_optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=lr, eps=eps)
    if cfg.embedding_optimizer == "rowwise_adagrad":
        return RowWiseAdagrad(params, lr=lr, eps=eps)
    if cfg.embedding_optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, eps=eps)
    return torch.optim.SGD(params, lr=lr)


def _optimizer(cfg: Config, model: nn.Module) -> Any:
    """The sharded tables' fused optimizer, ``--embedding_optimizer`` over the data-parallel tables and
    ``--adagrad`` (else SGD) over the dense part, as one TorchRec ``CombinedOptimizer``."""
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    tables = {id(p) for m in model.modules() if "ShardedEmbeddingBagCollection" in type(m).__name__
              for p in m.parameters()}  # fmt: skip
    # The fused tables are updated in their backward: left out of the torch optimizers.
    named = [(n, p) for n, p in in_backward_optimizer_filter(model.named_parameters()) if p.requires_grad]
    data_parallel = {n: p for n, p in named if id(p) in tables}
    dense = {n: p for n, p in named if id(p) not in tables}

    def dense_optimizer(group: Any) -> torch.optim.Optimizer:
        if cfg.adagrad:
            return torch.optim.Adagrad(group, lr=cfg.learning_rate, eps=cfg.eps)
        return torch.optim.SGD(group, lr=cfg.learning_rate)

    parts: list[tuple[str, Any]] = [("fused", cast(Any, model).fused_optimizer)]
    if data_parallel:
        parts.append(("tables", KeyedOptimizerWrapper(cast(dict[str, Any], data_parallel),
                                                      lambda group: _table_optimizer(cfg, group))))  # fmt: skip
    parts.append(("dense", KeyedOptimizerWrapper(cast(dict[str, Any], dense), dense_optimizer)))
    return CombinedOptimizer(cast(Any, parts))


def _world_topology(cfg: Config, world: int) -> str:
    """The topology the plan is made for: ``--topology`` or the run's chip, one device per process."""
    from tpurec.sparse.planner import TpuTopology
    from tpurec.sparse.sharding.model import planning_topology

    try:
        name = cfg.topology or planning_topology(world)
    except ValueError as e:
        raise ConfigError(f"--dist dmp: {str(e).splitlines()[0]}") from None
    try:
        devices = TpuTopology.from_name(name).world_size
    except ValueError as e:
        raise ConfigError(f"--topology {name}: {str(e).splitlines()[0]}") from None
    if devices != world:
        raise ConfigError(
            f"--topology {name} has {devices} devices but torchrun started {world} processes (one per device); "
            "give a topology of that many devices, or leave --topology out"
        )
    return name


def _planned(cfg: Config, world: int) -> tuple[Any, Any]:
    """tpurec's TPU planner's plan of the tables (TorchRec's planner with the TPU's topology) and its report.

    Rank 0 plans (the search is bounded in time, so two ranks could settle on different plans) and
    hands the plan, or the reason there is none, to every rank; the report is rank 0's.
    """
    from tpurec.sparse.planner import TpuEstimatorConfig, TpuPlannerConfig, plan

    outcome: list[Any] = [None]
    report = None
    if dist.get_rank() == 0:
        config = TpuPlannerConfig(
            estimator=TpuEstimatorConfig(optimizer=cfg.embedding_optimizer), sharding_types=list(SHARDING_TYPES)
        )
        try:
            topology = _world_topology(cfg, world)
            result = plan(model_lib.table_configs(cfg), topology, batch_size=cfg.batch_size * world, config=config)
            outcome[0], report = result.plan, result.report
        except ConfigError as e:
            outcome[0] = str(e)
        except ValueError as e:
            outcome[0] = f"--dist dmp: planning the tables: {str(e).splitlines()[0]}"
    dist.broadcast_object_list(outcome, src=0)
    if isinstance(outcome[0], str):
        raise ConfigError(outcome[0])
    return outcome[0], report


def _read_plan(cfg: Config, world: int) -> Any:
    """The plan of ``--plan FILE``, checked against the tables and the process count."""
    from tpurec.sparse.planner import load_plan, validate_plan

    path = cast(str, cfg.plan)
    try:
        loaded = load_plan(path)
        validate_plan(loaded, {c.name: (c.num_embeddings, c.embedding_dim) for c in model_lib.table_configs(cfg)},
                      world)  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--plan {path}: {str(e).splitlines()[0]}") from None
    for module_plan in loaded.plan.values():
        for name, sharding in module_plan.items():  # pyright: ignore[reportAttributeAccessIssue]
            if sharding.sharding_type not in SHARDING_TYPES:
                raise ConfigError(
                    f"--plan {path}: table {name!r} is {sharding.sharding_type}; --dist dmp runs "
                    f"{', '.join(SHARDING_TYPES)} (plan with `tpurec plan --sharding-types "
                    f"{','.join(SHARDING_TYPES)}`)"
                )
    return loaded


def shard(cfg: Config) -> tuple[nn.Module, Any]:
    """TorchRec's DLRM (and its loss, ``DLRMTrain``) sharded by DMP on this process's tpu device.

    Returns:
        The sharded model and the planner's report (None for a ``--plan`` file).
    """
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, ModuleSharder, ShardingPlan

    from tpurec.dmp.placements import on_process_devices

    world = dist.get_world_size()
    torch.manual_seed(cfg.seed)
    configs = model_lib.table_configs(cfg)
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    train_model = DLRMTrain(cast(Any, model_lib.build_torchrec_model(cfg, ebc)))
    report = None
    if cfg.plan is not None:
        planned = _read_plan(cfg, world)
    else:
        planned, report = _planned(cfg, world)
    # The plan's tables (made for a bare collection) are the DLRM's sparse arch's; each rank's
    # shards on its own tpu:0 (tpurec's planner places them as on a host that sees all its chips).
    tables = {name: sharding for module_plan in planned.plan.values() for name, sharding in module_plan.items()}
    plan = on_process_devices(ShardingPlan({TABLES_PATH: EmbeddingModuleShardingPlan(tables)}))
    sharder = cast(ModuleSharder[nn.Module], EmbeddingBagCollectionSharder(fused_params=fused_params(cfg)))
    model = DistributedModelParallel(train_model, device=torch.device("tpu"), plan=plan, sharders=[sharder])
    return model, report


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
    for message in TORCHREC_DEPRECATIONS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)
    logging.getLogger("torchrec.distributed.utils").addFilter(_NoCachingNote())
    dist.init_process_group("cpu:gloo,tpu:tpu", timeout=datetime.timedelta(seconds=300))
    try:
        loaders = make_loaders(cfg)
        rank, world = dist.get_rank(), dist.get_world_size()
        model, report = shard(cfg)
        optimizer = _optimizer(cfg, model)
        if rank == 0 and cfg.print_sharding_plan:
            print(report if report is not None else f"the plan of {cfg.plan}:\n{model.plan}")
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
