"""``python -m tpurec.sparse.planner``: plan embedding tables for a TPU topology.

Example::

    python -m tpurec.sparse.planner --topology v5p-128 \\
        --tables examples/planner/mlperf_dlrm_dcnv2.json --batch-size 55296 --json plan.json
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from tpurec.sparse.planner.plan_io import save_plan
from tpurec.sparse.planner.planner import load_tables, plan
from tpurec.sparse.planner.topology import TpuTopology
from tpurec.sparse.planner.types import (
    OPTIMIZER_SLOTS,
    TpuEstimatorConfig,
    TpuPlannerConfig,
    TpuPlanningError,
)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tpurec.sparse.planner",
        description="Shard embedding tables over a TPU topology with TorchRec's planner.",
    )
    p.add_argument("--topology", required=True, help="accelerator type, e.g. v5p-128, v6e-256, 2xv6e-256")
    p.add_argument("--slices", type=int, default=1, help="number of slices (multislice over DCN)")
    p.add_argument("--slice-shape", default=None, help="override the slice shape, e.g. 4x4x8")
    p.add_argument("--tables", required=True, help="JSON table list (see examples/planner/)")
    p.add_argument("--batch-size", type=int, required=True, help="GLOBAL batch size")
    p.add_argument("--optimizer", default="adagrad", choices=sorted(OPTIMIZER_SLOTS))
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
    p.add_argument("--reserved-hbm", type=float, default=0.1, help="HBM fraction kept for the dense model")
    p.add_argument("--timeout", type=int, default=45, help="search budget, seconds")
    p.add_argument("--sharding-types", default=None, help="comma-separated TorchRec sharding types to allow")
    p.add_argument("--json", dest="json_out", default=None, help="write report + plan JSON here (load_plan() reads it back)")
    p.add_argument("--no-torchrec-compare", action="store_true", help="skip TorchRec's default estimators")
    args = p.parse_args(argv)

    shape = tuple(int(x) for x in args.slice_shape.split("x")) if args.slice_shape else None
    topo = TpuTopology.from_name(args.topology, num_slices=args.slices, slice_shape=shape)
    cfg = TpuPlannerConfig(
        estimator=TpuEstimatorConfig(
            optimizer=args.optimizer,
            row_wise_output=args.row_wise_output,
            data_parallel_grad=args.data_parallel_grad,
        ),
        sharding_types=args.sharding_types.split(",") if args.sharding_types else None,
        reserved_hbm_fraction=args.reserved_hbm,
        timeout_seconds=args.timeout,
        compare_torchrec_default=not args.no_torchrec_compare,
    )
    try:
        result = plan(load_tables(args.tables), topo, args.batch_size, config=cfg)
    except TpuPlanningError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(result.report)
    if args.json_out:
        # Read back with tpurec.sparse.planner.load_plan(path).
        save_plan(result.plan, args.json_out, report=result.report)
        print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
