"""Train TorchRec's DLRM (original, DCN or projection) on the "tpu" device.

The flags are TorchRec's ``dlrm_main.py``'s (a command line written for it
runs here with only the script name changed) plus tpurec's own; see
``--help`` and docs/dlrm_training.md. Without a data path it trains on
synthetic click data with a learnable rule.

    .venv/bin/python examples/dlrm/train.py --interaction_type dcn --adagrad --learning_rate 0.05

With ``--dist dmp`` and torchrun (one process per tpu device), TorchRec's own
DistributedModelParallel shards the tables instead of ``tpurec.shard``, with a plan from tpurec's
planner or ``--plan FILE`` from ``tpurec plan --json`` (see dlrm/dmp.py):

    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 examples/dlrm/train.py --dist dmp \
        --adagrad --learning_rate 0.05 --batch_size 128 --limit_train_batches 200

Bad input (missing or malformed data, ids outside their tables, inconsistent
layer sizes, unknown flags) prints one line and exits with status 2; a training
loss that is not finite (nan, inf) prints one line naming its step and exits
with status 1.
"""

from __future__ import annotations

import logging
import os
import sys

# The script's modules live next to it, in the ``dlrm`` package of examples/.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# torchrec's KeyedJaggedTensor asks torch.fx whether it is tracing, and torch warns
# about that question on every first use: noise for the user of a training script.
logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)

import tpurec  # noqa: E402
from dlrm import data, flags, loop  # noqa: E402
from dlrm import model as model_lib  # noqa: E402

PROG = "train.py"


def print_sharding_plan(cfg: flags.Config) -> None:
    """Prints tpurec's TPU sharding plan for the tables (TorchRec's planner), for the run's embedding optimizer."""
    from tpurec.sparse.planner import TpuEstimatorConfig, TpuPlannerConfig, plan

    from tpurec.sparse.sharding.model import planning_topology

    config = TpuPlannerConfig(estimator=TpuEstimatorConfig(optimizer=cfg.embedding_optimizer))
    try:
        # By default the chip this run is on (v5p for a run on the host), with --num_devices of them.
        topology = cfg.topology or planning_topology(cfg.num_devices)
        _, report = plan(
            model_lib.table_configs(cfg), topology, batch_size=cfg.batch_size * cfg.num_devices, config=config
        )
    except ValueError as e:
        raise flags.ConfigError(f"--print_sharding_plan: {str(e).splitlines()[0]}") from None
    print(report)


def throughput_line(result: loop.RunResult) -> str:
    """The summary's throughput: over the steps after the warm-up, or why there is none."""
    if result.samples_per_second is None:
        if result.steps_run == 0:
            return "throughput not measured: no training step was left to run"
        return (
            f"throughput not measured: this run trained {result.steps_run} step(s), all within the "
            f"{result.warmup_steps} warm-up steps"
        )
    return (
        f"{result.samples_per_second:,.0f} samples/s over the {result.timed_steps} steps after "
        f"{result.warmup_steps} warm-up steps; {result.compilations_after_warmup} compilations after warm-up"
    )


def launches_line(cfg: flags.Config, result: loop.RunResult) -> str:
    """``--steps_per_call``: how many steps ran in launches of several steps."""
    if cfg.steps_per_call == 1:
        return ""
    return (
        f"; {result.launched_steps} of {result.steps_run} steps in {result.launches} launches of up to "
        f"{cfg.steps_per_call} steps"
    )


def run(argv: list[str] | None = None) -> loop.RunResult:
    """Parses ``argv``, builds data and model, trains, and prints the results."""
    cfg = flags.parse_args(argv)
    if cfg.dist == "dmp":
        from dlrm import dmp

        return dmp.run(cfg, data.make_loaders)
    loaders = data.make_loaders(cfg)
    multi_hot_source = getattr(loaders["train"].source, "sparse", None)
    ids_per_sample = sum(c.shape[1] for c in multi_hot_source) if isinstance(multi_hot_source, list) else None
    if cfg.print_sharding_plan:
        print_sharding_plan(cfg)
    model = model_lib.build_model(cfg, "tpu", max_ids_per_sample=ids_per_sample)
    model = loop.place_model(model, cfg)
    optimizer = model_lib.dense_optimizer(cfg, model)
    rows = sum(cfg.table_rows)
    print(
        f"{cfg.interaction_type} DLRM on tpu (XLA:{tpurec.platform().upper()}), mode {cfg.mode}: "
        f"{len(cfg.table_rows)} tables, {rows:,} rows x dim {cfg.embedding_dim}, batch {cfg.batch_size}, "
        f"{cfg.embedding_optimizer} embeddings / {'adagrad' if cfg.adagrad else 'sgd'} dense at lr {cfg.learning_rate}"
    )
    result = loop.train(cfg, model, optimizer, loaders)
    multi_hot = loaders["train"].multi_hot
    if cfg.collect_multi_hot_freqs_stats and multi_hot is not None:
        print(f"wrote {', '.join(multi_hot.save_freqs_stats())}")
    final = result.final
    print(
        f"held-out AUC {final.auc:.4f}, normalized entropy {final.normalized_entropy:.4f} ({final.samples} test samples); "
        f"{len(result.history.losses)} steps, last loss {result.history.losses[-1]:.4f}; {throughput_line(result)}"
        f"{launches_line(cfg, result)}"
    )
    return result


def main() -> None:
    """Entry point: bad input exits with status 2 and one line, like argparse."""
    try:
        run(sys.argv[1:])
    except flags.ConfigError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except loop.NonFiniteLoss as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
