"""The plan report: per-chip HBM, per-step estimates, comparisons.

Printed as a table (in the spirit of TorchRec's planner stats) and exported
as JSON. Three per-step embedding times sit side by side: tpurec's SparseCore
model, TorchRec's default estimators on the same TorchRec topology and the
same placement, and the lower bound HBM bandwidth sets. Figures of the
generation that no source gives are listed under ``ASSUMPTIONS`` (from
:attr:`TpuTopology.assumptions`), before any estimate that depends on them.
"""

from __future__ import annotations

import copy
import json
import logging
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

from torchrec.distributed.planner.stats import EmbeddingStats
from torchrec.distributed.planner.types import (
    ParameterConstraints,
    Perf,
    ShardingOption,
    Topology,
)
from torchrec.distributed.types import ShardingType

from tpurec.sparse.sharding_plan.traffic import options_distribution_bytes
from tpurec.sparse.planner.estimators import TpuCostModel, expected_unique
from tpurec.sparse.planner.topology import TpuTopology
from tpurec.sparse.planner.types import TpuPlannerConfig

__all__ = ["TableReport", "StepEstimate", "PlanReport", "RecordedEmbeddingStats", "build_report"]

_GiB = 1024**3

_ROW_SHARDED = (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value)

_SHORT = {
    ShardingType.DATA_PARALLEL.value: "DP",
    ShardingType.TABLE_WISE.value: "TW",
    ShardingType.COLUMN_WISE.value: "CW",
    ShardingType.ROW_WISE.value: "RW",
    ShardingType.TABLE_ROW_WISE.value: "TWRW",
    ShardingType.TABLE_COLUMN_WISE.value: "TWCW",
}


@dataclass
class TableReport:
    """One table in the plan. Times are those of its busiest shard, ms."""

    name: str
    rows: int
    dim: int
    pooling_factor: float
    sharding_type: str
    compute_kernel: str
    num_shards: int
    ranks: List[int]
    slices: List[int]
    hbm_bytes_max_shard: int
    hbm_bytes_total: int
    fwd_compute_ms: float
    bwd_compute_ms: float
    comms_ms: float
    dist_bytes_per_device: float = 0.0


@dataclass
class StepEstimate:
    """Per-step embedding time of the busiest device, ms."""

    source: str
    fwd_compute_ms: float
    bwd_compute_ms: float
    comms_ms: float
    total_ms: float
    critical_rank: Optional[int] = None
    max_hbm_bytes_per_chip: Optional[float] = None
    note: str = ""


@dataclass
class PlanReport:
    """What the chosen plan costs. ``str(report)`` is the table; ``to_json()`` the export.

    Example::

        _, report = plan(tables, "v5p-128", batch_size=55296)
        print(report)
        open("plan.json", "w").write(report.to_json())
    """

    topology: Dict[str, Any]
    batch_size: int
    local_batch_size: int
    optimizer: str
    tables: List[TableReport]
    hbm_bytes_per_chip: List[float]
    hbm_capacity_per_chip: float
    hbm_available_per_chip: float
    estimate: StepEstimate
    hbm_bound: StepEstimate
    torchrec_default: Optional[StepEstimate]
    sharding_types: Dict[str, int]
    planning_seconds: float
    num_proposals: int
    notes: List[str] = field(default_factory=list)
    collective_latency_ms: float = 0.0
    distribution_bytes: Dict[str, float] = field(default_factory=dict)
    torchrec_stats: List[str] = field(default_factory=list)

    @property
    def max_hbm_per_chip(self) -> float:
        return max(self.hbm_bytes_per_chip) if self.hbm_bytes_per_chip else 0.0

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["max_hbm_bytes_per_chip"] = self.max_hbm_per_chip
        return d

    def to_json(self, indent: int = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def __str__(self) -> str:
        return self.to_table()

    def to_table(self) -> str:
        t = self.topology
        lines: List[str] = []
        shape = "x".join(str(d) for d in t["slice_shape"])
        lines.append(
            f"tpurec sharding plan for {t['name']}: {t['generation']} {shape} x {t['num_slices']} slice(s), "
            f"{t['chips']} chips, {t['devices']} devices, {t['hosts']} hosts, "
            f"{t['sparsecores_per_device']} SparseCores/device"
        )
        if t.get("sparsecore_note"):
            lines.append(f"NOTE: {t['sparsecore_note']}")
        assumed = t.get("assumptions") or []
        if assumed:
            # Before any figure that depends on them, so no estimate reads as published.
            lines.append(
                f"ASSUMPTIONS: {len(assumed)} figure(s) of {t['generation']} used here are not published "
                f"(or read one of two ways); the plan depends on them:"
            )
            lines.extend(f"  - {a}" for a in assumed)
        lines.append(
            f"global batch {self.batch_size} ({self.local_batch_size}/device), optimizer "
            f"{self.optimizer}, planned in {self.planning_seconds:.1f} s ({self.num_proposals} proposals)"
        )
        lines.append("")
        hdr = (
            f"{'table':<14}{'rows':>12}{'dim':>5}{'pf':>6} {'type':<5}{'shards':>7} {'ranks':<16}"
            f"{'HBM/shard':>11}{'fwd ms':>9}{'bwd ms':>9}{'comm ms':>9}{'dist/dev':>10}"
        )
        lines.append(hdr)
        lines.append("-" * len(hdr))
        for r in self.tables:
            lines.append(
                f"{r.name[:13]:<14}{r.rows:>12}{r.dim:>5}{r.pooling_factor:>6.1f} "
                f"{_SHORT.get(r.sharding_type, r.sharding_type):<5}{r.num_shards:>7} "
                f"{_ranks_repr(r.ranks, r.slices):<16}{_gib(r.hbm_bytes_max_shard):>11}"
                f"{r.fwd_compute_ms:>9.3f}{r.bwd_compute_ms:>9.3f}{r.comms_ms:>9.3f}"
                f"{_bytes(r.dist_bytes_per_device):>10}"
            )
        lines.append("")
        hbm = self.hbm_bytes_per_chip
        lines.append(
            f"HBM per chip: max {self.max_hbm_per_chip / _GiB:.2f} GiB, mean "
            f"{sum(hbm) / len(hbm) / _GiB:.2f}, min {min(hbm) / _GiB:.2f}; available "
            f"{self.hbm_available_per_chip / _GiB:.2f} of {self.hbm_capacity_per_chip / _GiB:.2f} GiB"
        )
        lines.append(
            "sharding types: " + ", ".join(f"{_SHORT.get(k, k)} {v}" for k, v in sorted(self.sharding_types.items()))
        )
        d = self.distribution_bytes
        if d:
            lines.append(
                "bytes one device sends per step (busiest device; input all_to_all, output "
                "all_to_all/psum_scatter, output grads; DP: all-gather of entries and gradients): "
                f"ids {_bytes(d['input_ids'])}, outputs {_bytes(d['output'])}, "
                f"output grads {_bytes(d['output_grad'])}, all distribution "
                f"{_bytes(d['distribution_max_per_device'])}; DP grads {_bytes(d['dense_grad'])}"
            )
        lines.append("")
        lines.append("per-step embedding time, busiest device (ms):")
        lines.append(f"  {'':<34}{'fwd comp':>10}{'bwd comp':>10}{'comms':>10}{'total':>10}{'  HBM/chip':>11}")
        rows = [self.estimate, self.torchrec_default, self.hbm_bound]
        for e in rows:
            if e is None:
                continue
            hb = _gib(e.max_hbm_bytes_per_chip) if e.max_hbm_bytes_per_chip is not None else "-"
            lines.append(
                f"  {e.source:<34}{e.fwd_compute_ms:>10.3f}{e.bwd_compute_ms:>10.3f}"
                f"{e.comms_ms:>10.3f}{e.total_ms:>10.3f}{hb:>11}"
            )
        if self.hbm_bound.total_ms > 0:
            lines.append(f"  tpurec estimate / HBM bound = {self.estimate.total_ms / self.hbm_bound.total_ms:.1f}x")
        if self.collective_latency_ms:
            lines.append(
                f"  comms include {self.collective_latency_ms:.3f} ms collective start-up, once per "
                f"collective of each sharding group"
            )
        for n in self.notes:
            lines.append(f"  note: {n}")
        if self.torchrec_stats:
            lines.append("")
            lines.append(
                "TorchRec's planner stats (EmbeddingStats), same plan, tpurec's estimates "
                "(consecutive ranks with the same figures on one row):"
            )
            lines.extend(collapse_rank_rows(self.torchrec_stats))
        return "\n".join(lines)


# A row of EmbeddingStats' per-rank table: "#", the rank right-aligned, then that rank's figures.
_RANK_ROW = re.compile(r"^#(\s+)(\d+)(\s.*)$")


def collapse_rank_rows(lines: List[str]) -> List[str]:
    """TorchRec's stats table with each run of consecutive ranks whose figures are equal on one row.

    TorchRec prints one row per rank: 256 rows on a v5e-256 plan, most of them alike. A run of
    ranks ``a`` to ``b`` with the same figures becomes one row whose rank column reads ``a-b``
    (right-aligned where the rank stood; the figures keep their columns). Rows of other tables,
    and rank rows whose figures differ from their neighbours', are kept as TorchRec prints them.

    Args:
        lines: the lines :class:`RecordedEmbeddingStats` recorded.

    Returns:
        The lines with the runs collapsed.

    Example::

        collapse_rank_rows(["#      Rank   HBM #", "#         0   0.5 #", "#         1   0.5 #"])
        # ["#      Rank   HBM #", "#       0-1   0.5 #"]
    """
    out: List[str] = []
    in_rank_table = False
    run: List[re.Match[str]] = []

    def flush() -> None:
        first, last = run[0] if run else None, run[-1] if run else None
        if first is not None and last is not None and len(run) > 1:
            ranks = f"{first.group(2)}-{last.group(2)}"
            width = len(first.group(1)) + len(first.group(2))
            if len(ranks) < width:  # room for the range where the rank stood
                out.append(f"#{ranks:>{width}}{first.group(3)}")
                run.clear()
        out.extend(m.string for m in run)
        run.clear()

    for line in lines:
        if "Rank" in line and "HBM" in line:
            in_rank_table = True
            out.append(line)
            continue
        row = _RANK_ROW.match(line) if in_rank_table else None
        if row is None:
            flush()
            if in_rank_table and not line.strip("# -"):
                in_rank_table = bool(out) and "Rank" in out[-1]  # the dashes under the header keep it open
            out.append(line)
            continue
        if run and (row.group(3) != run[-1].group(3) or int(row.group(2)) != int(run[-1].group(2)) + 1):
            flush()
        run.append(row)
    flush()
    return out


def _gib(b: Optional[float]) -> str:
    if b is None:
        return "-"
    if b >= _GiB / 10:
        return f"{b / _GiB:.2f}G"
    return f"{b / 1024**2:.1f}M"


def _bytes(b: float) -> str:
    """Bytes with a binary unit that keeps 3-4 digits."""
    for unit, size in (("G", 1024**3), ("M", 1024**2), ("K", 1024)):
        if b >= size:
            return f"{b / size:.1f}{unit}"
    return f"{b:.0f}B"


def _ranks_repr(ranks: List[int], slices: List[int]) -> str:
    if not ranks:
        return "all (DP)"
    lo, hi = min(ranks), max(ranks)
    s = str(lo) if lo == hi else f"{lo}-{hi}" if len(set(ranks)) == hi - lo + 1 else f"{len(set(ranks))} ranks"
    if len(set(slices)) == 1 and max(slices) > 0:
        s += f" (s{slices[0]})"
    return s


def _per_rank(options: List[ShardingOption], world: int, perf_attr: str = "perf") -> List[Perf]:
    perfs = [Perf(0.0, 0.0, 0.0, 0.0) for _ in range(world)]
    for o in options:
        for s in o.shards:
            p = getattr(s, perf_attr)
            if s.rank is not None and s.rank >= 0 and p is not None:
                perfs[s.rank] = perfs[s.rank] + p
    return perfs


def _step(
    source: str,
    perfs: List[Perf],
    hbm_per_chip: Optional[float] = None,
    note: str = "",
    latency_ms: float = 0.0,
) -> StepEstimate:
    """The busiest rank's step; ``latency_ms`` (paid by every rank) is added to its comms."""
    totals = [p.fwd_compute + p.bwd_compute + p.fwd_comms + p.bwd_comms for p in perfs]
    r = max(range(len(totals)), key=lambda i: totals[i])
    p = perfs[r]
    return StepEstimate(
        source=source,
        fwd_compute_ms=p.fwd_compute,
        bwd_compute_ms=p.bwd_compute,
        comms_ms=p.fwd_comms + p.bwd_comms + latency_ms,
        total_ms=totals[r] + latency_ms,
        critical_rank=r,
        max_hbm_bytes_per_chip=hbm_per_chip,
        note=note,
    )


def _hbm_bound(options: List[ShardingOption], tpu: TpuTopology, batch: int, model: TpuCostModel) -> StepEstimate:
    """Least HBM traffic of a step over the whole job's HBM bandwidth.

    Every distinct row the global batch touches is read once in the forward,
    and read and written once with its optimizer slots in the backward;
    perfectly balanced over all chips at peak bandwidth.
    """
    fwd_bytes = 0.0
    bwd_bytes = 0.0
    for o in options:
        rows, dim = o.tensor.shape[0], o.tensor.shape[1]
        ids = batch * sum(o.input_lengths)
        uniq = expected_unique(ids, rows) if model.config.dedup else ids
        row = model.padded_dim(dim) * o.tensor.element_size()
        slots = model.slot_elems_per_row(dim) * 4
        fwd_bytes += uniq * row
        bwd_bytes += uniq * 2 * (row + slots)
    bw = tpu.gen.hbm_bw_per_chip * tpu.num_chips
    f, b = fwd_bytes / bw * 1000.0, bwd_bytes / bw * 1000.0
    return StepEstimate("HBM-bandwidth bound (all chips)", f, b, 0.0, f + b)


def _torchrec_default(
    options: List[ShardingOption],
    trec_topology: Topology,
    constraints: Dict[str, ParameterConstraints],
    sharders: List[Any],
    tpu: TpuTopology,
) -> StepEstimate:
    """The same placement, estimated by TorchRec's default estimators."""
    from torchrec.distributed.planner.shard_estimators import (
        EmbeddingPerfEstimator,
        EmbeddingStorageEstimator,
    )
    from torchrec.distributed.planner.utils import build_sharder_data_map, sharder_name

    opts = copy.deepcopy(options)
    data_map = build_sharder_data_map({sharder_name(s.module_type): s for s in sharders})
    EmbeddingPerfEstimator(trec_topology, constraints).estimate(opts, sharder_data_map=data_map)
    EmbeddingStorageEstimator(trec_topology, constraints).estimate(opts, sharder_data_map=data_map)
    chip_hbm = [0.0] * tpu.num_chips
    for o in opts:
        for s in o.shards:
            if s.rank is not None and s.storage is not None:
                chip_hbm[tpu.chip_of(s.rank)] += s.storage.hbm
    return _step(
        "TorchRec default estimators",
        _per_rank(opts, trec_topology.world_size),
        max(chip_hbm),
        note="TorchRec's storage estimator counts no HBM for compute_device='tpu'" if max(chip_hbm) == 0 else "",
    )


def build_report(
    options: List[ShardingOption],
    tpu: TpuTopology,
    trec_topology: Topology,
    batch_size: int,
    local_batch: int,
    constraints: Dict[str, ParameterConstraints],
    config: TpuPlannerConfig,
    sharders: List[Any],
    available_hbm_per_chip: float,
    planning_seconds: float,
    num_proposals: int,
    torchrec_stats: Optional[List[str]] = None,
) -> PlanReport:
    """Assemble a :class:`PlanReport` from the chosen sharding options.

    Args:
        options: chosen options, shards with ranks, perf and storage.
        tpu: the TPU job.
        trec_topology: the TorchRec topology planned on.
        batch_size: global batch.
        local_batch: per-device batch.
        constraints: the constraints planned with.
        config: planner settings.
        sharders: sharders planned with.
        available_hbm_per_chip: HBM per chip left for embeddings.
        planning_seconds: wall time of planning.
        num_proposals: proposals the planner evaluated.
        torchrec_stats: lines of TorchRec's ``EmbeddingStats`` table.

    Returns:
        The report.
    """
    model = TpuCostModel(tpu, config.estimator)
    world = tpu.world_size
    dist = options_distribution_bytes(
        options,
        world,
        float(local_batch * world),
        id_bytes=config.estimator.id_bytes,
        grad_bytes=config.estimator.grad_bytes,
        row_wise_output=config.estimator.row_wise_output,
    )
    tables: List[TableReport] = []
    chip_hbm = [0.0] * tpu.num_chips
    kinds: Dict[str, int] = {}
    for o in options:
        kinds[o.sharding_type] = kinds.get(o.sharding_type, 0) + 1
        ranks = [s.rank for s in o.shards if s.rank is not None]
        for s in o.shards:
            if s.rank is not None and s.storage is not None:
                chip_hbm[tpu.chip_of(s.rank)] += s.storage.hbm
        perfs = [s.perf for s in o.shards if s.perf is not None]
        busiest = max(perfs, key=lambda p: p.total) if perfs else Perf(0, 0, 0, 0)
        storages = [s.storage.hbm for s in o.shards if s.storage is not None]
        tables.append(
            TableReport(
                name=o.name,
                rows=int(o.tensor.shape[0]),
                dim=int(o.tensor.shape[1]),
                pooling_factor=float(sum(o.input_lengths)),
                sharding_type=o.sharding_type,
                compute_kernel=o.compute_kernel,
                num_shards=o.num_shards,
                ranks=[int(r) for r in ranks],
                slices=sorted({tpu.slice_of(r) for r in ranks}),
                hbm_bytes_max_shard=max(storages) if storages else 0,
                hbm_bytes_total=sum(storages),
                fwd_compute_ms=busiest.fwd_compute,
                bwd_compute_ms=busiest.bwd_compute,
                comms_ms=busiest.fwd_comms + busiest.bwd_comms,
                dist_bytes_per_device=dist.tables[o.name].max_per_device,
            )
        )
    label = "tpurec SparseCore model" if tpu.sparsecores_per_device else "tpurec model (TensorCore gather)"
    latency_ms = model.collective_latency_seconds(o.sharding_type for o in options) * 1000.0
    estimate = _step(label, _per_rank(options, world), max(chip_hbm), latency_ms=latency_ms)
    bound = _hbm_bound(options, tpu, local_batch * world, model)
    notes: List[str] = []
    if any(o.sharding_type in _ROW_SHARDED for o in options):
        # The other way of returning row-wise outputs, for comparison.
        other = "psum_scatter" if config.estimator.row_wise_output == "sparse" else "sparse"
        alt = options_distribution_bytes(
            options,
            world,
            float(local_batch * world),
            id_bytes=config.estimator.id_bytes,
            grad_bytes=config.estimator.grad_bytes,
            row_wise_output=other,
        )
        notes.append(
            f"row-wise outputs are estimated as {config.estimator.row_wise_output!r}: the busiest device "
            f"sends {_bytes(dist.total.summary()['output'])} of outputs per step; as {other!r} it would "
            f"send {_bytes(alt.total.summary()['output'])} (tpurec.shard runs 'psum_scatter'; "
            f"--row-wise-output chooses)"
        )
    if any(o.sharding_type == ShardingType.DATA_PARALLEL.value for o in options):
        dp_options = [o for o in options if o.sharding_type == ShardingType.DATA_PARALLEL.value]
        volumes = {
            mode: options_distribution_bytes(
                dp_options,
                world,
                float(local_batch * world),
                id_bytes=config.estimator.id_bytes,
                grad_bytes=config.estimator.grad_bytes,
                data_parallel_grad=mode,
            ).total.summary()["dense_grad"]
            for mode in ("all_reduce", "all_gather")
        }
        notes.append(
            f"data-parallel gradients are estimated as {config.estimator.data_parallel_grad!r}; per device "
            f"per step a dense all-reduce sends {_bytes(volumes['all_reduce'])}, tpurec.shard's all-gather "
            f"of entries and gradients {_bytes(volumes['all_gather'])} (--data-parallel-grad chooses)"
        )
    if tpu.sparsecore_note:
        notes.append(
            f"{tpu.sparsecore_note}; gathers are modelled at "
            f"{config.estimator.tensorcore_gather_efficiency:.0%} of HBM bandwidth"
        )
    trec: Optional[StepEstimate] = None
    if config.compare_torchrec_default:
        try:
            trec = _torchrec_default(options, trec_topology, constraints, sharders, tpu)
            if trec.note:
                notes.append(trec.note)
        except Exception as e:  # the comparison must never sink a good plan
            notes.append(f"TorchRec default estimators failed: {type(e).__name__}: {e}")
    return PlanReport(
        topology=tpu.describe(),
        batch_size=batch_size,
        local_batch_size=local_batch,
        optimizer=config.estimator.optimizer,
        tables=tables,
        hbm_bytes_per_chip=chip_hbm,
        hbm_capacity_per_chip=float(tpu.hbm_per_chip),
        hbm_available_per_chip=float(available_hbm_per_chip),
        estimate=estimate,
        hbm_bound=bound,
        torchrec_default=trec,
        sharding_types=kinds,
        planning_seconds=planning_seconds,
        num_proposals=num_proposals,
        notes=notes,
        collective_latency_ms=latency_ms,
        distribution_bytes=dist.total.summary(),
        torchrec_stats=list(torchrec_stats or []),
    )


class RecordedEmbeddingStats(EmbeddingStats):
    """TorchRec's ``EmbeddingStats`` that keeps the table it logs.

    TorchRec writes its per-rank stats table (HBM, perf, input/output sizes,
    shards per rank) to a logger; this records those lines in ``lines`` so
    the plan report can print them next to tpurec's own figures.

    Example::

        stats = RecordedEmbeddingStats()
        EmbeddingShardingPlanner(..., stats=[stats]).plan(module, sharders)
        print("\n".join(stats.lines))
    """

    def __init__(self) -> None:
        super().__init__()
        self.lines: List[str] = []

    def log(self, *args: Any, **kwargs: Any) -> None:
        """Runs TorchRec's ``log`` and records the lines it emits."""
        records: List[str] = []

        class _Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                records.append(record.getMessage())

        stats_logger = logging.getLogger(EmbeddingStats.__module__)
        handler = _Keep(level=logging.INFO)
        old_level, old_propagate = stats_logger.level, stats_logger.propagate
        stats_logger.addHandler(handler)
        # Record at INFO without echoing to the root logger.
        stats_logger.setLevel(logging.INFO)
        stats_logger.propagate = False
        try:
            super().log(*args, **kwargs)
        finally:
            stats_logger.removeHandler(handler)
            stats_logger.setLevel(old_level)
            stats_logger.propagate = old_propagate
        self.lines = records
