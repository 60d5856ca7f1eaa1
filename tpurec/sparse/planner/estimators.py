"""SparseCore-aware shard estimators for TorchRec's ``EmbeddingEnumerator``.

:class:`TpuCostModel` holds the formulas (seconds, bytes); the two
``ShardEstimator`` subclasses apply them to TorchRec ``ShardingOption`` s:

* :class:`TpuPerfEstimator` fills ``shard.perf`` (TorchRec ``Perf``, in ms):
  SparseCore lookups (ids per partition, dimension, dedup), the all-to-all of
  ids and of pooled (partial) embeddings on the ICI torus, bounded by
  injection and bisection bandwidth, DCN stages when a collective leaves a
  slice, and the backward with the fused optimizer's extra reads and writes.
* :class:`TpuStorageEstimator` fills ``shard.storage``: the table and its
  optimizer slots, padded to SparseCore layout (rows to multiples of
  8 x SparseCores, dims to multiples of 8), plus the static-capacity input
  buffers and the activation/gradient buffers.

Sharding types are modelled as SparseCores run them: row-wise means MOD
sharding (``id % num_partitions``), where each device sends back only the
partial sums of samples that hit its rows, not a dense reduce-scatter
(``TpuEstimatorConfig(row_wise_output="psum_scatter")`` models the dense
reduce-scatter ``tpurec.shard`` runs instead).

Shard estimates hold bandwidth and compute only: the fixed start-up cost of a
collective is paid once per sharding group per step (one collective carries
all tables of the group), added by :class:`TpuPerfModel` when the planner
rates a plan and by the report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

from torchrec.distributed.planner.types import (
    ParameterConstraints,
    Perf,
    PerfModel,
    SharderDataMap,
    ShardEstimator,
    ShardingOption,
    Storage,
    Topology,
)
from torchrec.distributed.types import ShardingType

from tpurec.sparse.planner.topology import TpuTopology
from tpurec.sparse.planner.types import OPTIMIZER_SLOTS, TpuEstimatorConfig

__all__ = [
    "ShardWork",
    "TpuCostModel",
    "TpuPerfEstimator",
    "TpuPerfModel",
    "TpuStorageEstimator",
    "expected_unique",
]

_MS = 1000.0  # seconds -> milliseconds (TorchRec's Perf unit)


def expected_unique(draws: float, rows: int) -> float:
    """Expected distinct rows among ``draws`` uniform draws from ``rows`` rows."""
    if rows <= 0 or draws <= 0:
        return 0.0
    return rows * -math.expm1(-draws / rows)


def _round_up(x: float, m: int) -> int:
    return int(math.ceil(x / m) * m) if m > 1 else int(math.ceil(x))


@dataclass
class ShardWork:
    """What one shard does per training step, on its device.

    Args:
        ids: ids the shard looks up.
        rows: rows the shard holds.
        dim: columns the shard holds.
        out_rows: pooled (or partial-sum) rows it writes and sends.
        in_ids_comm: ids it receives over the network.
        group: devices sharing the table's rows (1 unless row-wise).
        cross_slice: whether its collectives leave the slice.
    """

    ids: float
    rows: int
    dim: int
    out_rows: float
    in_ids_comm: float
    group: int
    cross_slice: bool


class TpuCostModel:
    """Per-step cost formulas for embedding shards on a TPU topology.

    Args:
        topology: the TPU job.
        config: model knobs.

    Example::

        model = TpuCostModel(TpuTopology.from_name("v5p-128"))
        model.lookup_seconds(ids=55296 * 3, dim=128, rows=40_000_000)
    """

    def __init__(self, topology: TpuTopology, config: Optional[TpuEstimatorConfig] = None) -> None:
        self.topo = topology
        self.config = config or TpuEstimatorConfig()

    # ---- memory layout ------------------------------------------------- #

    def padded_rows(self, rows: int) -> int:
        """Rows after padding to ``row_pad`` x SparseCores of the device."""
        scs = max(1, self.topo.sparsecores_per_device)
        return _round_up(rows, self.config.row_pad * scs)

    def padded_dim(self, dim: int) -> int:
        return _round_up(dim, self.config.dim_pad)

    def slot_elems_per_row(self, dim: int) -> int:
        per_dim, per_row = OPTIMIZER_SLOTS[self.config.optimizer]
        return per_dim * self.padded_dim(dim) + per_row

    def row_read_bytes(self, dim: int, elem_bytes: int) -> int:
        """Bytes one row gather moves from HBM (rounded to the access granule)."""
        return _round_up(self.padded_dim(dim) * elem_bytes, self.config.hbm_access_granule)

    # ---- compute ------------------------------------------------------- #

    def _gather_bw(self) -> float:
        eff = (
            self.config.sc_hbm_efficiency
            if self.topo.sparsecores_per_device
            else self.config.tensorcore_gather_efficiency
        )
        return self.topo.hbm_bw_per_device * eff

    def _sc_vector_seconds(self, ids: float, dim: int) -> float:
        """SparseCore vector work: each id's row accumulates in ``dim/lanes`` steps.

        The fullest partition (SparseCore) sets the time; tiles run in parallel.
        """
        scs = self.topo.sparsecores_per_device
        if not scs:
            return 0.0
        gen = self.topo.gen
        ids_per_sc = ids / scs * self.config.partition_skew
        steps = math.ceil(self.padded_dim(dim) / gen.sc_lanes)
        return ids_per_sc * steps / gen.sc_tiles / gen.sc_clock_hz

    def unique_rows(self, ids: float, rows: int) -> float:
        return expected_unique(ids, rows) if self.config.dedup else ids

    def lookup_seconds(self, ids: float, dim: int, rows: int, elem_bytes: int = 4) -> float:
        """SparseCore lookup of ``ids`` ids into a ``rows`` x ``dim`` shard.

        Gathers of the distinct rows from HBM overlap the SparseCore's vector
        accumulation; the slower of the two sets the time. Both scale with
        ids x dim (exactly so without dedup, or when ids << rows).
        """
        hbm = self.unique_rows(ids, rows) * self.row_read_bytes(dim, elem_bytes)
        return max(hbm / self._gather_bw(), self._sc_vector_seconds(ids, dim))

    def csr_seconds(self, ids: float) -> float:
        """Reading the CSR input (ids, sample ids, gains) from HBM."""
        return ids * self.config.id_bytes / self.topo.hbm_bw_per_device

    def output_seconds(self, out_rows: float, dim: int) -> float:
        """Writing (or, in the backward, reading) pooled rows."""
        return out_rows * self.padded_dim(dim) * self.config.grad_bytes / self.topo.hbm_bw_per_device

    def backward_seconds(self, ids: float, dim: int, rows: int, out_rows: float, elem_bytes: int = 4) -> float:
        """Gradient scatter with the fused optimizer update.

        Reads the output gradients and the CSR input again, accumulates per
        distinct row, then reads and writes each touched row and its optimizer
        slots once.
        """
        uniq = self.unique_rows(ids, rows)
        row = self.row_read_bytes(dim, elem_bytes)
        slots = (
            _round_up(self.slot_elems_per_row(dim) * 4, self.config.hbm_access_granule)
            if self.slot_elems_per_row(dim)
            else 0
        )
        hbm = uniq * 2 * (row + slots)
        update = hbm / self._gather_bw()
        return (
            self.output_seconds(out_rows, dim)
            + self.csr_seconds(ids)
            + max(update, self._sc_vector_seconds(ids, dim) + self._sc_vector_seconds(uniq, dim))
        )

    def dense_update_seconds(self, rows: int, dim: int, elem_bytes: int = 4) -> float:
        """Dense optimizer step over a whole replicated (data-parallel) table."""
        n = rows * self.padded_dim(dim)
        slots = rows * self.slot_elems_per_row(dim)
        bytes_moved = n * (2 * elem_bytes + self.config.grad_bytes) + 2 * slots * 4
        return bytes_moved / self.topo.hbm_bw_per_device

    # ---- collectives --------------------------------------------------- #

    def all_to_all_seconds(self, bytes_per_device: float, cross_slice: bool, latency: bool = True) -> float:
        """All-to-all where each device sends (or receives) ``bytes_per_device``.

        Inside a slice the rate is the torus' per-chip all-to-all bandwidth
        (injection- or bisection-bound). Across ``S`` slices, (S-1)/S of the
        bytes also cross DCN at the chip's DCN bandwidth.

        Args:
            bytes_per_device: bytes each device sends.
            cross_slice: whether the collective spans slices (adds DCN).
            latency: add the fixed start-up cost of one collective. Shard
                estimates leave it out: one collective carries every table of
                a sharding group, so :meth:`collective_latency_seconds` adds it
                once per plan instead of once per table.

        Returns:
            Seconds.
        """
        if bytes_per_device <= 0:
            return 0.0
        dpc = self.topo.devices_per_chip
        t = self.config.ici_latency_s if latency else 0.0
        if self.topo.chips_per_slice > 1:
            t += bytes_per_device * dpc / self.topo.all_to_all_bw_per_chip
        s = self.topo.num_slices
        if cross_slice and s > 1:
            t += self.config.dcn_latency_s if latency else 0.0
            t += bytes_per_device * dpc * (s - 1) / s / self.topo.dcn_bw_per_chip
        return t

    def reduce_scatter_seconds(self, bytes_per_device: float, cross_slice: bool, latency: bool = True) -> float:
        """Reduce-scatter of a ``bytes_per_device`` buffer over all devices.

        Hierarchical: a ring reduce-scatter over ICI inside the slice, then one
        over DCN on the 1/devices_per_slice piece each device is left with.

        Args:
            bytes_per_device: bytes of the buffer each device contributes.
            cross_slice: whether the collective spans slices (adds DCN).
            latency: add the fixed start-up cost (see :meth:`all_to_all_seconds`).

        Returns:
            Seconds.
        """
        if bytes_per_device <= 0:
            return 0.0
        dpc = self.topo.devices_per_chip
        p = self.topo.devices_per_slice
        t = self.config.ici_latency_s if latency else 0.0
        if self.topo.chips_per_slice > 1:
            t += bytes_per_device * dpc * (p - 1) / p / self.topo.ring_bw_per_chip
        s = self.topo.num_slices
        if cross_slice and s > 1:
            t += self.config.dcn_latency_s if latency else 0.0
            t += bytes_per_device / p * dpc * (s - 1) / s / self.topo.dcn_bw_per_chip
        return t

    def all_reduce_seconds(self, bytes_per_device: float, cross_slice: bool, latency: bool = True) -> float:
        """All-reduce = reduce-scatter + all-gather (same cost each way)."""
        return 2.0 * self.reduce_scatter_seconds(bytes_per_device, cross_slice, latency)

    def collectives_per_step(self, sharding_type: str) -> Tuple[int, int]:
        """Collectives one sharding group runs per training step: (ICI, DCN).

        TorchRec (and ``tpurec.shard``) give every sharding type of a module
        one input distribution and one output distribution that carry all of
        its tables. Sharded groups run the ids all-to-all and the pooled
        output collective forward, and the output-gradient collective
        backward (3); data-parallel tables share one gradient all-reduce (1).
        Collectives leave the slice on multislice jobs (row groups of
        table-row-wise tables stay inside it, so only their output
        combination crosses DCN).

        Args:
            sharding_type: TorchRec sharding type value.

        Returns:
            (collectives on ICI, collectives that also cross DCN).
        """
        multislice = self.topo.num_slices > 1
        if sharding_type == ShardingType.DATA_PARALLEL.value:
            # all_gather mode gathers ids, sample ids, gains and gradients: 4.
            n = 4 if self.config.data_parallel_grad == "all_gather" else 1
            return n, n if multislice else 0
        if sharding_type == ShardingType.TABLE_ROW_WISE.value:
            return 3, 2 if multislice else 0
        return 3, 3 if multislice else 0

    def collective_latency_seconds(self, sharding_types: Iterable[str]) -> float:
        """Fixed start-up cost of a plan's collectives, once per sharding group.

        Args:
            sharding_types: sharding types present in the plan (repeats are
                one group).

        Returns:
            Seconds every device waits on collective start-up per step.
        """
        t = 0.0
        for st in set(sharding_types):
            ici, dcn = self.collectives_per_step(st)
            t += ici * self.config.ici_latency_s + dcn * self.config.dcn_latency_s
        return t

    # ---- per sharding type --------------------------------------------- #

    def work(
        self,
        sharding_type: str,
        global_batch: float,
        pooling_factors: List[float],
        rows: int,
        dim: int,
        is_pooled: bool = True,
    ) -> ShardWork:
        """What one shard of a table does per step.

        Args:
            sharding_type: TorchRec sharding type value.
            global_batch: samples per step over all devices.
            pooling_factors: ids per sample of each feature of the table.
            rows: rows of the (unsharded) table.
            dim: columns of this shard.
            is_pooled: pooled (EmbeddingBag) or sequence output.

        Returns:
            The shard's work.
        """
        topo = self.topo
        w = topo.world_size
        ids_total = global_batch * sum(pooling_factors)
        bags = global_batch * len(pooling_factors)
        multislice = topo.num_slices > 1
        if sharding_type == ShardingType.DATA_PARALLEL.value:
            local = ids_total / w
            return ShardWork(local, rows, dim, bags / w if is_pooled else local, 0.0, 1, False)
        if sharding_type in (
            ShardingType.TABLE_WISE.value,
            ShardingType.COLUMN_WISE.value,
            ShardingType.TABLE_COLUMN_WISE.value,
        ):
            out = bags if is_pooled else ids_total
            return ShardWork(ids_total, rows, dim, out, ids_total * (w - 1) / w, 1, multislice)
        if sharding_type in (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value):
            g = w if sharding_type == ShardingType.ROW_WISE.value else topo.devices_per_slice
            ids = ids_total / g
            if is_pooled and self.config.row_wise_output == "psum_scatter":
                # Dense reduce-scatter: every shard holds a partial sum for
                # every (sample, feature) of the global batch.
                out = float(bags)
            elif is_pooled:
                # MOD sharding: a sample sends one partial sum per partition it hits.
                # A shard holds 1/g of the rows, so a sample with ``pf`` ids
                # hits it with probability 1 - (1 - 1/g)^pf; that expectation
                # over the global batch is already per shard (no further /g).
                out = sum(
                    global_batch * -math.expm1(pf * math.log1p(-1.0 / g)) if g > 1 else global_batch
                    for pf in pooling_factors
                )
            else:
                out = ids
            return ShardWork(ids, math.ceil(rows / g), dim, out, ids * (w - 1) / w, g, multislice)
        raise ValueError(f"TPU cost model does not support sharding type {sharding_type!r}")

    def shard_perf(
        self,
        sharding_type: str,
        global_batch: float,
        pooling_factors: List[float],
        rows: int,
        dim: int,
        elem_bytes: int = 4,
        is_pooled: bool = True,
    ) -> Perf:
        """TorchRec ``Perf`` (ms) of one shard.

        Args:
            sharding_type: TorchRec sharding type value.
            global_batch: samples per step over all devices.
            pooling_factors: ids per sample of each feature of the table.
            rows: rows of the unsharded table.
            dim: columns of this shard.
            elem_bytes: bytes per weight.
            is_pooled: pooled or sequence output.

        Returns:
            The shard's forward/backward compute and communication, ms.
        """
        wk = self.work(sharding_type, global_batch, pooling_factors, rows, dim, is_pooled)
        cfg = self.config
        fwd = (
            self.lookup_seconds(wk.ids, dim, wk.rows, elem_bytes)
            + self.csr_seconds(wk.ids)
            + self.output_seconds(wk.out_rows, dim)
        )
        if sharding_type == ShardingType.DATA_PARALLEL.value and cfg.data_parallel_grad == "all_gather":
            # tpurec.shard: every replica all-gathers the batch's entries and
            # pooled gradients, then applies the whole batch's sparse update.
            gathered = self.topo.world_size * (
                wk.ids * cfg.id_bytes + wk.out_rows * self.padded_dim(dim) * cfg.grad_bytes
            )
            bwd = self.backward_seconds(
                wk.ids * self.topo.world_size, dim, rows, wk.out_rows * self.topo.world_size, elem_bytes
            )
            return Perf(
                fwd_compute=fwd * _MS,
                fwd_comms=0.0,
                bwd_compute=bwd * _MS,
                # An all-gather sends what a reduce-scatter of its result does.
                bwd_comms=self.reduce_scatter_seconds(gathered, self.topo.num_slices > 1, latency=False) * _MS,
            )
        if sharding_type == ShardingType.DATA_PARALLEL.value:
            table_bytes = rows * self.padded_dim(dim) * cfg.grad_bytes
            bwd = self.backward_seconds(wk.ids, dim, rows, wk.out_rows, elem_bytes)
            bwd += self.dense_update_seconds(rows, dim, elem_bytes)
            return Perf(
                fwd_compute=fwd * _MS,
                fwd_comms=0.0,
                bwd_compute=bwd * _MS,
                bwd_comms=self.all_reduce_seconds(table_bytes, self.topo.num_slices > 1, latency=False) * _MS,
            )
        dense_rs = wk.group > 1 and is_pooled and cfg.row_wise_output == "psum_scatter"
        out_bytes = wk.out_rows * (self.padded_dim(dim) * cfg.grad_bytes + (4 if wk.group > 1 and not dense_rs else 0))
        if wk.group > 1 and self.topo.num_slices > 1:
            # Partial sums combine inside the slice (ICI); only one row per
            # sample leaves it over DCN, spread over the group's devices.
            if dense_rs:
                ici = self.reduce_scatter_seconds(out_bytes, cross_slice=False, latency=False)
            else:
                ici = self.all_to_all_seconds(out_bytes, cross_slice=False, latency=False)
            dcn_bytes = global_batch * len(pooling_factors) * self.padded_dim(dim) * cfg.grad_bytes / wk.group
            if not is_pooled:
                dcn_bytes = wk.out_rows * self.padded_dim(dim) * cfg.grad_bytes
            out_comm = ici + self._dcn_seconds(dcn_bytes)
        elif dense_rs:
            out_comm = self.reduce_scatter_seconds(out_bytes, wk.cross_slice, latency=False)
        else:
            out_comm = self.all_to_all_seconds(out_bytes, wk.cross_slice, latency=False)
        ids_comm = self.all_to_all_seconds(wk.in_ids_comm * cfg.id_bytes, wk.cross_slice, latency=False)
        bwd = self.backward_seconds(wk.ids, dim, wk.rows, wk.out_rows, elem_bytes)
        return Perf(
            fwd_compute=fwd * _MS,
            fwd_comms=(ids_comm + out_comm) * _MS,
            bwd_compute=bwd * _MS,
            bwd_comms=out_comm * _MS,
        )

    def _dcn_seconds(self, bytes_per_device: float) -> float:
        s = self.topo.num_slices
        if s <= 1 or bytes_per_device <= 0:
            return 0.0
        # No start-up latency: collective_latency_seconds counts it per group.
        return bytes_per_device * self.topo.devices_per_chip * (s - 1) / s / self.topo.dcn_bw_per_chip

    def shard_hbm_bytes(
        self,
        sharding_type: str,
        global_batch: float,
        pooling_factors: List[float],
        table_rows: int,
        shard_rows: int,
        shard_dim: int,
        elem_bytes: int = 4,
        is_pooled: bool = True,
    ) -> int:
        """HBM one shard occupies: weights, optimizer slots, buffers.

        Args:
            sharding_type: TorchRec sharding type value.
            global_batch: samples per step over all devices.
            pooling_factors: ids per sample of each feature of the table.
            table_rows: rows of the unsharded table.
            shard_rows: rows of this shard.
            shard_dim: columns of this shard.
            elem_bytes: bytes per weight.
            is_pooled: pooled or sequence output.

        Returns:
            Bytes.
        """
        cfg = self.config
        rows = self.padded_rows(shard_rows)
        dim = self.padded_dim(shard_dim)
        weights = rows * dim * elem_bytes
        slots = rows * self.slot_elems_per_row(shard_dim) * 4
        wk = self.work(sharding_type, global_batch, pooling_factors, table_rows, shard_dim, is_pooled)
        # Static-capacity CSR buffers (padded to fixed size so batches never
        # recompile), in flight ``input_buffers`` at a time.
        csr = wk.ids * cfg.capacity_factor * cfg.id_bytes * cfg.input_buffers
        # Pooled (partial-sum) outputs and their gradients.
        acts = 2 * wk.out_rows * dim * cfg.grad_bytes
        dense_grad = 0
        if sharding_type == ShardingType.DATA_PARALLEL.value and cfg.data_parallel_grad == "all_reduce":
            dense_grad = rows * dim * cfg.grad_bytes
        return int(weights + slots + csr + acts + dense_grad)


# ---- TorchRec estimators -------------------------------------------------- #


def _option_inputs(
    option: ShardingOption,
    constraints: Optional[Dict[str, ParameterConstraints]],
    world_size: int,
) -> Tuple[float, List[float]]:
    """(global batch, pooling factors) of a sharding option.

    TorchRec's ``batch_size`` is per rank; the SparseCore model works on the
    global batch.
    """
    c = constraints.get(option.name) if constraints else None
    if c is not None and c.batch_sizes:
        batch = float(sum(c.batch_sizes) / len(c.batch_sizes))
    else:
        batch = float(option.batch_size)
    return batch * world_size, [float(x) for x in option.input_lengths]


class _TpuShardEstimator(ShardEstimator):
    """What both TPU estimators share: the cost model and the walk over shards."""

    def __init__(
        self,
        topology: Topology,
        constraints: Optional[Dict[str, ParameterConstraints]] = None,
        tpu_topology: Optional[TpuTopology] = None,
        config: Optional[TpuEstimatorConfig] = None,
    ) -> None:
        if tpu_topology is None:
            raise ValueError(f"{type(self).__name__} needs the TpuTopology (tpu_topology=...)")
        self._topology = topology
        self._constraints = constraints
        self.model = TpuCostModel(tpu_topology, config)

    def estimate(
        self,
        sharding_options: List[ShardingOption],
        sharder_data_map: Optional[SharderDataMap] = None,
    ) -> None:
        """Sets the estimate on every shard of every option, in place."""
        w = self._topology.world_size
        for option in sharding_options:
            batch, pfs = _option_inputs(option, self._constraints, w)
            for shard in option.shards:
                self._fill(shard, option, batch, pfs)

    def _fill(self, shard, option: ShardingOption, batch: float, pfs: List[float]) -> None:
        raise NotImplementedError


class TpuPerfEstimator(_TpuShardEstimator):
    """Fills ``shard.perf`` (ms) of sharding options from :class:`TpuCostModel`.

    Args:
        topology: TorchRec topology (from :meth:`TpuTopology.to_torchrec`).
        constraints: TorchRec parameter constraints (batch sizes).
        tpu_topology: the TPU job the topology came from.
        config: cost model knobs.

    Example::

        tpu = TpuTopology.from_name("v5p-128")
        est = TpuPerfEstimator(tpu.to_torchrec(), tpu_topology=tpu)
        enumerator = EmbeddingEnumerator(tpu.to_torchrec(), batch_size=432,
                                         estimator=[est, TpuStorageEstimator(...)])
    """

    def _fill(self, shard, option: ShardingOption, batch: float, pfs: List[float]) -> None:
        shard.perf = self.model.shard_perf(
            option.sharding_type,
            batch,
            pfs,
            option.tensor.shape[0],
            shard.size[1],
            option.tensor.element_size(),
            option.is_pooled,
        )


class TpuStorageEstimator(_TpuShardEstimator):
    """Fills ``shard.storage`` (HBM bytes) from :class:`TpuCostModel`.

    Args:
        topology: TorchRec topology (from :meth:`TpuTopology.to_torchrec`).
        constraints: TorchRec parameter constraints (batch sizes).
        tpu_topology: the TPU job the topology came from.
        config: storage model knobs (optimizer, padding, capacities).

    Example::

        tpu = TpuTopology.from_name("v6e-256")
        est = TpuStorageEstimator(tpu.to_torchrec(), tpu_topology=tpu)
    """

    def _fill(self, shard, option: ShardingOption, batch: float, pfs: List[float]) -> None:
        hbm = self.model.shard_hbm_bytes(
            option.sharding_type,
            batch,
            pfs,
            option.tensor.shape[0],
            shard.size[0],
            shard.size[1],
            option.tensor.element_size(),
            option.is_pooled,
        )
        shard.storage = Storage(hbm=hbm, ddr=0, ssd=0)


class TpuPerfModel(PerfModel):
    """Rates a whole plan for TorchRec's planner: busiest device + collective start-up.

    Shard estimates carry only bandwidth and compute; the fixed start-up cost
    of each collective is paid once per sharding group present in the plan
    (:meth:`TpuCostModel.collective_latency_seconds`), so a plan that adds a
    sharding group pays for its collectives once, not once per table.

    Args:
        topology: TorchRec topology (from :meth:`TpuTopology.to_torchrec`).
        tpu_topology: the TPU job the topology came from.
        config: cost model knobs.

    Example::

        tpu = TpuTopology.from_name("v6e-64")
        perf_model = TpuPerfModel(tpu.to_torchrec(), tpu)
        EmbeddingShardingPlanner(..., performance_model=perf_model)
    """

    def __init__(
        self,
        topology: Topology,
        tpu_topology: TpuTopology,
        config: Optional[TpuEstimatorConfig] = None,
    ) -> None:
        self._topology = topology
        self.model = TpuCostModel(tpu_topology, config)

    def rate(self, plan: List[ShardingOption]) -> float:
        """Estimated step time of ``plan``'s embeddings, ms."""
        perfs = [0.0] * self._topology.world_size
        for option in plan:
            for shard in option.shards:
                if shard.rank is not None and shard.perf is not None:
                    perfs[shard.rank] += shard.perf.total
        latency = self.model.collective_latency_seconds(o.sharding_type for o in plan)
        return max(perfs) + latency * _MS
