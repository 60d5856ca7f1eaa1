"""``tpurec plan`` (or ``python -m tpurec.sparse.planner``): plan embedding tables for a TPU topology.

Bad input (an unknown topology, an unreadable table file, a plan that cannot fit) ends in one
``error:`` line and exit status 2.

Example::

    python -m tpurec.sparse.planner --topology v5p-128 \\
        --tables examples/planner/mlperf_dlrm_dcnv2.json --batch-size 55296 --json plan.json
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Tuple

from tpurec.cli import HelpFormatter, error, positive_int
from tpurec.sparse.planner.plan_io import save_plan
from tpurec.sparse.planner.planner import load_tables, plan
from tpurec.sparse.planner.sharder import tpu_sharding_types
from tpurec.sparse.planner.topology import TpuTopology
from tpurec.sparse.planner.types import (
    OPTIMIZER_SLOTS,
    TpuEstimatorConfig,
    TpuPlannerConfig,
    TpuPlanningError,
)


def main(argv: Optional[List[str]] = None, prog: str = "python -m tpurec.sparse.planner") -> int:
    """Plans the tables of ``--tables`` for ``--topology``, prints the report; returns the exit status.

    Args:
        argv: the command line after ``prog`` (default: the process's arguments).
        prog: the command as the user typed it, for help and errors.

    Raises:
        SystemExit: 0 after ``--help``; 2 for flags argparse rejects.

    Returns:
        0, or 2 after one error line for input that fails later checks (topology, tables, plan).
    """
    p = argparse.ArgumentParser(
        prog=prog,
        description="Shard embedding tables over a TPU topology with TorchRec's planner.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--topology", required=True, help="accelerator type, e.g. v5p-128, v6e-256, 2xv6e-256")
    p.add_argument("--slices", type=positive_int, default=1, help="number of slices (multislice over DCN)")
    p.add_argument("--slice-shape", type=_slice_shape, default=None, help="override the slice shape, e.g. 4x4x8")
    p.add_argument("--tables", required=True, help="JSON table list (see examples/planner/)")
    p.add_argument(
        "--batch-size",
        type=positive_int,
        required=True,
        help="GLOBAL batch size (samples per step over all devices; a multiple of the number of devices)",
    )
    p.add_argument(
        "--optimizer", default="adagrad", choices=sorted(OPTIMIZER_SLOTS), help="embedding optimizer (sizes its slots)"
    )
    p.add_argument(
        "--row-wise-output",
        default="sparse",
        choices=["sparse", "psum_scatter"],
        help="row-wise outputs as SparseCore partial sums (sparse) or a dense reduce-scatter "
        "(psum_scatter, what tpurec.shard runs)",
    )
    p.add_argument(
        "--data-parallel-grad",
        default="all_reduce",
        choices=["all_reduce", "all_gather"],
        help="data-parallel gradients as a dense all-reduce (TorchRec) or an all-gather of the batch's "
        "entries and gradients (what tpurec.shard runs)",
    )
    p.add_argument("--reserved-hbm", type=_fraction, default=0.1, help="HBM fraction kept for the dense model")
    p.add_argument("--timeout", type=positive_int, default=45, help="search budget, seconds")
    p.add_argument("--sharding-types", default=None, help="comma-separated TorchRec sharding types to allow")
    p.add_argument(
        "--json", dest="json_out", default=None, help="write report + plan JSON here (load_plan() reads it back)"
    )
    p.add_argument("--no-torchrec-compare", action="store_true", help="skip TorchRec's default estimators")
    args = p.parse_args(argv)

    try:
        topo = TpuTopology.from_name(args.topology, num_slices=args.slices, slice_shape=args.slice_shape)
    except ValueError as e:
        return error(prog, f"--topology {args.topology}: {e}")
    problem = _batch_size_problem(args.batch_size, topo.world_size, args.topology)
    if problem:
        return error(prog, problem)
    try:
        tables = load_tables(args.tables)
    except (OSError, ValueError, KeyError, TypeError) as e:  # unreadable file, bad JSON, bad table fields
        return error(prog, f"--tables {args.tables}: {type(e).__name__}: {e}")
    sharding_types = args.sharding_types.split(",") if args.sharding_types else None
    try:
        tpu_sharding_types(topo, sharding_types)  # the check plan() makes, before the search starts
    except ValueError as e:
        return error(prog, f"--sharding-types {args.sharding_types}: {e}")
    cfg = TpuPlannerConfig(
        estimator=TpuEstimatorConfig(
            optimizer=args.optimizer,
            row_wise_output=args.row_wise_output,
            data_parallel_grad=args.data_parallel_grad,
        ),
        sharding_types=sharding_types,
        reserved_hbm_fraction=args.reserved_hbm,
        timeout_seconds=args.timeout,
        compare_torchrec_default=not args.no_torchrec_compare,
    )
    try:
        result = plan(tables, topo, args.batch_size, config=cfg)
    except TpuPlanningError as e:
        return error(prog, str(e))
    print(result.report)
    if args.json_out:
        # Read back with tpurec.sparse.planner.load_plan(path).
        try:
            save_plan(result.plan, args.json_out, report=result.report)
        except OSError as e:
            return error(prog, f"--json {args.json_out}: {e}")
        print(f"wrote {args.json_out}")
    return 0


def _batch_size_problem(batch_size: int, devices: int, topology: str) -> str | None:
    """Why ``batch_size`` cannot be split evenly over ``devices`` data-parallel devices, or None."""
    if batch_size < devices:
        return (
            f"--batch-size {batch_size} is smaller than the {devices} devices of {topology}: each device "
            f"trains on at least one sample of the global batch; give at least {devices}"
        )
    if batch_size % devices:
        lower, upper = batch_size // devices * devices, (batch_size // devices + 1) * devices
        return (
            f"--batch-size {batch_size} does not split evenly over the {devices} devices of {topology} "
            f"({batch_size / devices:g} samples each); give a multiple of {devices}, e.g. {lower} or {upper}"
        )
    return None


def _slice_shape(text: str) -> Tuple[int, ...]:
    """An argparse ``type``: a slice shape such as ``4x4x8``."""
    try:
        shape = tuple(int(x) for x in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected chips per axis joined by 'x' (e.g. 4x4x8), got {text!r}") from None
    if min(shape) < 1:
        raise argparse.ArgumentTypeError(f"every axis must be at least 1, got {text!r}")
    return shape


def _fraction(text: str) -> float:
    """An argparse ``type``: a number in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text!r}")
    return value


if __name__ == "__main__":
    sys.exit(main())
