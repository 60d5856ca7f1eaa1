"""``plan()``: TorchRec's ``EmbeddingShardingPlanner`` with the TPU parts.

The planner itself is TorchRec's; tpurec supplies the topology
(:class:`TpuTopology` -> TorchRec ``Topology``), the estimators
(:mod:`tpurec.sparse.planner.estimators`), the sharders
(:mod:`tpurec.sparse.planner.sharder`), a storage reservation for the dense
model, and a small proposer set with a time budget so that plans for
hundreds of devices finish in seconds.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.partitioners import GreedyPerfPartitioner
from torchrec.distributed.planner.planners import EmbeddingShardingPlanner
from torchrec.distributed.planner.proposers import (
    DynamicProgrammingProposer,
    GreedyProposer,
    GridSearchProposer,
    UniformProposer,
)
from torchrec.distributed.planner.storage_reservations import (
    FixedPercentageStorageReservation,
)
from torchrec.distributed.planner.types import (
    ParameterConstraints,
    PlannerError,
    Proposer,
    ShardingOption,
)
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from tpurec.sparse.planner.estimators import TpuPerfEstimator, TpuPerfModel, TpuStorageEstimator
from tpurec.sparse.planner.report import PlanReport, RecordedEmbeddingStats, build_report
from tpurec.sparse.planner.sharder import tpu_sharders
from tpurec.sparse.planner.topology import TpuTopology
from tpurec.sparse.planner.types import TpuPlannerConfig, TpuPlanningError
from tpurec.sparse.sharding_plan.tables import DTYPES, TableSpec, as_table_spec

__all__ = ["PlanResult", "plan", "load_tables", "tables_to_module"]

_DTYPES = DTYPES
_GiB = 1024**3

TablesOrModule = Union[nn.Module, Sequence[Union[TableSpec, EmbeddingBagConfig, Dict[str, Any]]]]


@dataclass
class PlanResult:
    """A TorchRec ``ShardingPlan`` and its report. Unpacks as ``plan, report``.

    Args:
        plan: TorchRec plan: module path -> table -> ``ParameterSharding``.
        report: estimates of the plan.
        options: the chosen TorchRec sharding options (shards with ranks,
            perf and storage).
    """

    plan: ShardingPlan
    report: PlanReport
    options: List[ShardingOption]

    def __iter__(self) -> Iterator[Any]:
        return iter((self.plan, self.report))


def load_tables(path_or_obj: Union[str, Dict[str, Any], List[Any]]) -> List[TableSpec]:
    """Table specs from a JSON file or an already-parsed JSON object.

    The format is ``{"embedding_dim": 128, "tables": [{"name": ..,
    "num_embeddings": .., "pooling_factor": .., "embedding_dim": ..,
    "feature_names": [..]}, ...]}``; top-level keys other than ``tables`` are
    defaults for every table. A bare list of tables is accepted too.

    Args:
        path_or_obj: file path, dict or list.

    Returns:
        Table specs.

    Example::

        tables = load_tables("examples/planner/mlperf_dlrm_dcnv2.json")
    """
    obj: Any = path_or_obj
    if isinstance(path_or_obj, str):
        with open(path_or_obj) as f:
            obj = json.load(f)
    defaults: Dict[str, Any] = {}
    if isinstance(obj, dict):
        defaults = {k: v for k, v in obj.items() if k in TableSpec.__dataclass_fields__}
        obj = obj["tables"]
    specs = []
    for i, t in enumerate(obj):
        fields = {**defaults, **t}
        fields.setdefault("name", f"t_{i}")
        unknown = set(fields) - set(TableSpec.__dataclass_fields__)
        if unknown:
            raise ValueError(f"table {fields['name']}: unknown keys {sorted(unknown)}")
        specs.append(TableSpec(**fields))
    return specs


_as_spec = as_table_spec


def tables_to_module(tables: Sequence[TableSpec]) -> EmbeddingBagCollection:
    """An ``EmbeddingBagCollection`` on the meta device (no memory) for planning.

    Args:
        tables: table specs.

    Returns:
        The module.

    Example::

        ebc = tables_to_module([TableSpec("t", 1000, 64)])
    """
    configs = [
        EmbeddingBagConfig(
            name=t.name,
            num_embeddings=t.num_embeddings,
            embedding_dim=t.embedding_dim,
            feature_names=t.features(),
            data_type=_DTYPES[t.data_type],
        )
        for t in tables
    ]
    return EmbeddingBagCollection(tables=configs, device=torch.device("meta"))


def _merge_constraints(
    specs: Optional[List[TableSpec]],
    module: nn.Module,
    constraints: Optional[Dict[str, ParameterConstraints]],
    cw_min_dim: Optional[int],
) -> Dict[str, ParameterConstraints]:
    merged: Dict[str, ParameterConstraints] = {k: copy.deepcopy(v) for k, v in (constraints or {}).items()}
    for spec in specs or []:
        if spec.name not in merged:
            merged[spec.name] = ParameterConstraints(
                pooling_factors=[float(spec.pooling_factor)] * len(spec.features())
            )
    # Column-wise shards narrower than TorchRec's 128 default let wide tables
    # spread over small-HBM chips; the SparseCore wants multiples of 8.
    if cw_min_dim:
        for name, p in module.named_parameters():
            table = name.split(".")[-2] if name.endswith(".weight") else name
            dim = p.shape[1] if p.dim() == 2 else 0
            if dim > cw_min_dim and dim % cw_min_dim == 0 and cw_min_dim % 8 == 0:
                c = merged.setdefault(table, ParameterConstraints())
                if c.min_partition is None:
                    c.min_partition = cw_min_dim
    return merged


def _proposers(names: List[str]) -> List[Proposer]:
    made: List[Proposer] = []
    for n in names:
        if n == "greedy":
            made.append(GreedyProposer())
        elif n == "greedy_nodepth":
            made.append(GreedyProposer(use_depth=False))
        elif n == "uniform":
            made.append(UniformProposer())
        elif n == "grid":
            made.append(GridSearchProposer())
        elif n == "dp":
            made.append(DynamicProgrammingProposer())
        else:
            raise ValueError(f"Unknown proposer {n!r}")
    return made


class _DropDataParallelSpecWarnings(logging.Filter):
    """TorchRec warns for every data-parallel table that it has no sharding spec: by design."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Sharding spec not found")


@contextlib.contextmanager
def _quiet_torchrec() -> Iterator[None]:
    root = logging.getLogger()
    f = _DropDataParallelSpecWarnings()
    root.addFilter(f)
    try:
        yield
    finally:
        root.removeFilter(f)


def _min_storage_per_chip(search_space: List[ShardingOption], topology: TpuTopology) -> Tuple[float, Dict[str, int]]:
    """Least HBM per chip any plan needs: the cheapest option of every table, spread evenly."""
    best: Dict[str, int] = {}
    for o in search_space:
        total = sum(s.storage.hbm for s in o.shards if s.storage is not None)
        if o.fqn not in best or total < best[o.fqn]:
            best[o.fqn] = total
    return sum(best.values()) / topology.num_chips, best


def plan(
    tables_or_module: TablesOrModule,
    topology: Union[TpuTopology, str],
    batch_size: int,
    constraints: Optional[Dict[str, ParameterConstraints]] = None,
    config: Optional[TpuPlannerConfig] = None,
) -> PlanResult:
    """Shard embedding tables over a TPU topology with TorchRec's planner.

    Args:
        tables_or_module: table specs (:class:`TableSpec`, TorchRec
            ``EmbeddingBagConfig`` or dicts), or a module holding
            ``EmbeddingBagCollection`` / ``EmbeddingCollection`` s.
        topology: a :class:`TpuTopology` or a name such as ``"v5p-128"``.
        batch_size: GLOBAL batch size (samples per step over all devices);
            TorchRec gets ``ceil(batch_size / world_size)`` per rank.
        constraints: TorchRec ``ParameterConstraints`` per table (override
            the pooling factors of the specs, restrict sharding types, ...).
        config: search and model settings.

    Returns:
        :class:`PlanResult` (unpacks as ``sharding_plan, report``).

    Raises:
        TpuPlanningError: no plan fits; the message states needed and
            available HBM per chip.

    Example::

        from tpurec.sparse.planner import plan, load_tables
        sharding_plan, report = plan(load_tables("examples/planner/mlperf_dlrm_dcnv2.json"),
                                     "v5p-128", batch_size=55296)
        print(report)
    """
    t0 = time.perf_counter()
    cfg = config or TpuPlannerConfig()
    tpu = TpuTopology.from_name(topology) if isinstance(topology, str) else topology
    if isinstance(tables_or_module, nn.Module):
        specs: Optional[List[TableSpec]] = None
        module = tables_or_module
    else:
        specs = [_as_spec(t) for t in tables_or_module]
        module = tables_to_module(specs)
    merged = _merge_constraints(specs, module, constraints, cfg.cw_min_dim)
    local_batch = max(1, math.ceil(batch_size / tpu.world_size))

    trec_topology = tpu.to_torchrec()
    estimators = [
        TpuPerfEstimator(trec_topology, merged, tpu_topology=tpu, config=cfg.estimator),
        TpuStorageEstimator(trec_topology, merged, tpu_topology=tpu, config=cfg.estimator),
    ]
    enumerator = EmbeddingEnumerator(
        topology=trec_topology, batch_size=local_batch, constraints=merged, estimator=estimators
    )
    sharders = tpu_sharders(
        tpu,
        cfg.sharding_types,
        cfg.allow_cross_slice_row_wise,
    )
    reservation = FixedPercentageStorageReservation(cfg.reserved_hbm_fraction)
    available_per_chip = tpu.hbm_per_chip * (1.0 - cfg.reserved_hbm_fraction)

    # Enumerate once up front (the planner reuses the cached search space) to
    # fail early, with numbers, when no plan can fit.
    search_space = enumerator.enumerate(module, sharders)
    needed_per_chip, _ = _min_storage_per_chip(search_space, tpu)
    if needed_per_chip > available_per_chip:
        raise TpuPlanningError(
            f"Embedding tables do not fit on {tpu.name}: even the smallest plan needs "
            f"{needed_per_chip / _GiB:.2f} GiB HBM per chip (tables + {cfg.estimator.optimizer} "
            f"optimizer slots + padding + buffers), but each chip has "
            f"{available_per_chip / _GiB:.2f} GiB available "
            f"({tpu.hbm_per_chip / _GiB:.2f} GiB minus {cfg.reserved_hbm_fraction:.0%} reserved "
            f"for the dense model). Use more chips or slices, a smaller optimizer state, "
            f"or smaller tables.",
            needed_bytes_per_chip=needed_per_chip,
            available_bytes_per_chip=available_per_chip,
        )

    torchrec_stats = RecordedEmbeddingStats()
    planner = EmbeddingShardingPlanner(
        topology=trec_topology,
        batch_size=local_batch,
        enumerator=enumerator,
        storage_reservation=reservation,
        proposer=_proposers(cfg.proposers),
        partitioner=GreedyPerfPartitioner(),
        performance_model=TpuPerfModel(trec_topology, tpu, cfg.estimator),
        stats=[torchrec_stats],
        constraints=merged,
        debug=False,
        timeout_seconds=cfg.timeout_seconds,
    )
    try:
        with _quiet_torchrec():
            sharding_plan = planner.plan(module, sharders)
    except PlannerError as e:
        raise TpuPlanningError(
            f"No plan for {tpu.name} found: the smallest plan needs {needed_per_chip / _GiB:.2f} GiB "
            f"HBM per chip on average, {available_per_chip / _GiB:.2f} GiB are available per chip, "
            f"but the shards could not be packed. TorchRec said: {str(e).splitlines()[0]}",
            needed_bytes_per_chip=needed_per_chip,
            available_bytes_per_chip=available_per_chip,
        ) from e
    options = planner.get_selected_options()
    elapsed = time.perf_counter() - t0
    report = build_report(
        options=options,
        tpu=tpu,
        trec_topology=trec_topology,
        batch_size=batch_size,
        local_batch=local_batch,
        constraints=merged,
        config=cfg,
        sharders=sharders,
        available_hbm_per_chip=available_per_chip,
        planning_seconds=elapsed,
        num_proposals=planner._num_proposals,
        torchrec_stats=torchrec_stats.lines,
    )
    return PlanResult(sharding_plan, report, options)
