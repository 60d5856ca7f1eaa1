"""SparseCore cost and storage model, and its TorchRec estimator plumbing."""

import pytest
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ShardingType

from tpurec.sparse.planner import (
    TableSpec,
    TpuCostModel,
    TpuEstimatorConfig,
    TpuPerfEstimator,
    TpuStorageEstimator,
    TpuTopology,
    tables_to_module,
    tpu_sharders,
)

RW = ShardingType.ROW_WISE.value
TW = ShardingType.TABLE_WISE.value
TWRW = ShardingType.TABLE_ROW_WISE.value


@pytest.mark.parametrize("dedup", [False, True])
def test_lookup_linear_in_pooling_factor_and_dim(dedup):
    model = TpuCostModel(TpuTopology.from_name("v5p-128"), TpuEstimatorConfig(dedup=dedup))
    rows = 40_000_000
    base = model.lookup_seconds(ids=1000 * 4, dim=64, rows=rows)
    rel = 1e-9 if not dedup else 1e-3  # dedup: ids << rows, nearly linear
    assert model.lookup_seconds(ids=1000 * 8, dim=64, rows=rows) == pytest.approx(2 * base, rel=rel)
    assert model.lookup_seconds(ids=1000 * 12, dim=64, rows=rows) == pytest.approx(3 * base, rel=rel)
    assert model.lookup_seconds(ids=1000 * 4, dim=128, rows=rows) == pytest.approx(2 * base, rel=rel)
    assert model.lookup_seconds(ids=1000 * 4, dim=256, rows=rows) == pytest.approx(4 * base, rel=rel)


def test_lookup_linear_through_shard_perf():
    """The same holds for the forward compute the planner sees (TW, SparseCore)."""
    model = TpuCostModel(TpuTopology.from_name("v5p-128"), TpuEstimatorConfig(dedup=False))
    f = lambda pf, d: model.shard_perf(TW, 55296, [pf], 40_000_000, d).fwd_compute  # noqa: E731
    assert f(8, 128) > f(4, 128) > f(2, 128)
    # Lookup dominates: doubling the pooling factor nearly doubles the forward.
    assert 1.8 < f(8, 128) / f(4, 128) <= 2.0


def test_dedup_caps_hot_small_tables():
    model = TpuCostModel(TpuTopology.from_name("v5p-128"))
    small = model.lookup_seconds(ids=1_000_000, dim=128, rows=100)
    nodedup = TpuCostModel(model.topo, TpuEstimatorConfig(dedup=False)).lookup_seconds(1_000_000, 128, 100)
    assert small < nodedup


def test_dcn_costs_more_than_ici():
    two = TpuCostModel(TpuTopology.from_name("v5p-128", num_slices=2))
    mb = 4 * 1024**2
    assert two.all_to_all_seconds(mb, cross_slice=True) > 2 * two.all_to_all_seconds(mb, cross_slice=False)
    assert two.reduce_scatter_seconds(mb, cross_slice=True) > two.reduce_scatter_seconds(mb, cross_slice=False)
    assert two.all_reduce_seconds(mb, cross_slice=True) > two.all_reduce_seconds(mb, cross_slice=False)
    # A table-wise table's collectives span both slices and pay DCN; the same
    # table on one slice of the same shape stays on ICI.
    one = TpuCostModel(TpuTopology.from_name("v5p-128"))
    p2 = two.shard_perf(TW, 55296, [3.0], 1_000_000, 128)
    p1 = one.shard_perf(TW, 55296, [3.0], 1_000_000, 128)
    assert p2.fwd_comms + p2.bwd_comms > p1.fwd_comms + p1.bwd_comms
    assert p2.fwd_compute == pytest.approx(p1.fwd_compute)


def test_row_group_inside_slice_sends_less_over_dcn():
    """On 2 slices a table-row-wise table occupies one slice; RW loads every device."""
    two = TpuCostModel(TpuTopology.from_name("v6e-256", num_slices=2))
    rw = two.shard_perf(RW, 55296, [27.0], 40_000_000, 128)
    twrw = two.shard_perf(TWRW, 55296, [27.0], 40_000_000, 128)
    # Per shard TWRW does twice the work of RW, but only half the devices hold
    # a shard: device-time summed over the job is no larger.
    assert twrw.total * 256 <= rw.total * 512 * 1.01


def _rw_shard_hbm(shape, table_rows=40_000_000, dim=128, batch=55296):
    topo = TpuTopology("v5p", shape)
    model = TpuCostModel(topo)
    g = topo.world_size
    return model.shard_hbm_bytes(RW, batch, [3.0], table_rows, -(-table_rows // g), dim)


def test_doubling_slice_halves_rw_storage_per_chip():
    small = _rw_shard_hbm((4, 4, 4))
    big = _rw_shard_hbm((4, 4, 8))
    assert big / small == pytest.approx(0.5, rel=0.01)


def test_storage_counts_optimizer_slots_and_padding():
    topo = TpuTopology.from_name("v5p-128")
    sgd = TpuCostModel(topo, TpuEstimatorConfig(optimizer="sgd", capacity_factor=0, input_buffers=0))
    ada = TpuCostModel(topo, TpuEstimatorConfig(optimizer="adagrad", capacity_factor=0, input_buffers=0))
    rwa = TpuCostModel(topo, TpuEstimatorConfig(optimizer="rowwise_adagrad", capacity_factor=0, input_buffers=0))
    args = (TW, 0, [1.0], 1000, 1000, 128)
    w = sgd.shard_hbm_bytes(*args)
    assert w == sgd.padded_rows(1000) * 128 * 4
    assert sgd.padded_rows(1000) % (8 * topo.sparsecores_per_device) == 0
    assert sgd.padded_rows(1000) >= 1000
    assert ada.shard_hbm_bytes(*args) == 2 * w
    assert rwa.shard_hbm_bytes(*args) == w + sgd.padded_rows(1000) * 4
    # Dims pad to multiples of 8.
    assert sgd.padded_dim(20) == 24
    # Buffers grow with the batch.
    assert ada.shard_hbm_bytes(TW, 10000, [1.0], 1000, 1000, 128) > ada.shard_hbm_bytes(*args)


def test_estimators_plug_into_torchrec_enumerator():
    tpu = TpuTopology.from_name("v5p-16")
    trec = tpu.to_torchrec()
    tables = [TableSpec("big", 1_000_000, 64, 4.0), TableSpec("small", 100, 64, 1.0)]
    module = tables_to_module(tables)
    constraints = {t.name: ParameterConstraints(pooling_factors=[t.pooling_factor]) for t in tables}
    est = [
        TpuPerfEstimator(trec, constraints, tpu_topology=tpu),
        TpuStorageEstimator(trec, constraints, tpu_topology=tpu),
    ]
    enumerator = EmbeddingEnumerator(trec, batch_size=128, constraints=constraints, estimator=est)
    options = enumerator.enumerate(module, tpu_sharders(tpu))
    kinds = {o.sharding_type for o in options}
    assert kinds == {"data_parallel", "table_wise", "column_wise", "row_wise"}
    for o in options:
        for s in o.shards:
            assert s.perf is not None and s.perf.total > 0
            assert s.storage is not None and s.storage.hbm > 0 and s.storage.ddr == 0
    rw = next(o for o in options if o.name == "big" and o.sharding_type == RW)
    tw = next(o for o in options if o.name == "big" and o.sharding_type == TW)
    assert rw.num_shards == tpu.world_size
    assert max(s.storage.hbm for s in rw.shards) < tw.shards[0].storage.hbm / 4


def test_estimators_need_tpu_topology():
    trec = TpuTopology.from_name("v5p-16").to_torchrec()
    with pytest.raises(ValueError):
        TpuPerfEstimator(trec)


def test_unknown_optimizer_rejected():
    with pytest.raises(ValueError):
        TpuEstimatorConfig(optimizer="adadelta")


def test_row_wise_output_rows_are_per_shard_once():
    """v5p-128, global batch 55296, one id per sample: 1/64 of the samples hit each shard = 864 rows."""
    model = TpuCostModel(TpuTopology.from_name("v5p-128"))
    wk = model.work(RW, 55296, [1.0], 40_000_000, 128)
    assert wk.group == 64
    assert wk.out_rows == pytest.approx(864.0)


def test_row_wise_output_rows_match_simulated_mod_sharding():
    """Samples whose ids hit shard 0 under id % g, counted on random ids, vs the model."""
    import torch

    g, batch, pfs = 8, 20000, [3, 1, 12]
    model = TpuCostModel(TpuTopology.from_name("v5p-16"))
    wk = model.work(RW, batch, [float(x) for x in pfs], 1_000_000, 64)
    gen = torch.Generator().manual_seed(0)
    hits = sum(int(((torch.randint(0, 1_000_000, (batch, pf), generator=gen) % g) == 0).any(dim=1).sum()) for pf in pfs)
    assert wk.out_rows == pytest.approx(hits, rel=0.03)


def test_shard_comms_carry_no_per_table_latency():
    """A 1-byte transfer costs bandwidth only; start-up is counted once per group elsewhere."""
    model = TpuCostModel(TpuTopology.from_name("v6e-64"))
    assert model.all_to_all_seconds(1.0, False, latency=False) < 1e-9
    assert model.all_to_all_seconds(1.0, False) == pytest.approx(model.config.ici_latency_s, rel=1e-3)
    tiny = model.shard_perf(TW, 64, [1.0], 10, 8)
    # Before: three 5 us start-ups per table (15 us); now well under one.
    assert tiny.fwd_comms + tiny.bwd_comms < 0.1 * model.config.ici_latency_s * 1000


def test_collective_latency_once_per_sharding_group():
    one = TpuCostModel(TpuTopology.from_name("v6e-64"))
    lat = one.config.ici_latency_s
    assert one.collective_latency_seconds([TW] * 20) == pytest.approx(3 * lat)
    assert one.collective_latency_seconds([TW, RW, "data_parallel", TW]) == pytest.approx(7 * lat)
    two = TpuCostModel(TpuTopology.from_name("v6e-64", num_slices=2))
    dcn = two.config.dcn_latency_s
    assert two.collective_latency_seconds([TWRW]) == pytest.approx(3 * lat + 2 * dcn)
    assert two.collective_latency_seconds([TW]) == pytest.approx(3 * lat + 3 * dcn)


def test_perf_model_adds_latency_once_per_group():
    from tpurec.sparse.planner import TpuPerfModel

    tpu = TpuTopology.from_name("v5p-16")
    trec = tpu.to_torchrec()
    tables = [TableSpec(f"t{i}", 1000, 16, 1.0) for i in range(6)]
    cons = {t.name: ParameterConstraints(pooling_factors=[1.0], sharding_types=[TW]) for t in tables}
    est = [TpuPerfEstimator(trec, cons, tpu_topology=tpu), TpuStorageEstimator(trec, cons, tpu_topology=tpu)]
    options = EmbeddingEnumerator(trec, batch_size=64, constraints=cons, estimator=est).enumerate(
        tables_to_module(tables), tpu_sharders(tpu)
    )
    for i, o in enumerate(options):
        o.shards[0].rank = 0  # all on one device: its perf sums
    busiest = sum(o.shards[0].perf.total for o in options)
    rate = TpuPerfModel(trec, tpu).rate(options)
    assert rate == pytest.approx(busiest + 3 * TpuEstimatorConfig().ici_latency_s * 1000)


def test_psum_scatter_row_wise_output_costs_a_dense_reduce_scatter():
    topo = TpuTopology.from_name("v6e-64")
    sparse = TpuCostModel(topo)
    dense = TpuCostModel(topo, TpuEstimatorConfig(row_wise_output="psum_scatter"))
    assert dense.work(RW, 55296, [1.0, 3.0], 40_000_000, 128).out_rows == 2 * 55296
    ps, pd = sparse.shard_perf(RW, 55296, [1.0], 40_000_000, 128), dense.shard_perf(RW, 55296, [1.0], 40_000_000, 128)
    # 63/64 of a 55296 x 128 fp32 buffer at the ring rate, vs 864 sparse rows.
    expected = 63 / 64 * 55296 * 128 * 4 / topo.ring_bw_per_chip * 1000
    assert pd.bwd_comms == pytest.approx(expected, rel=1e-6)
    assert pd.bwd_comms > 5 * ps.bwd_comms
    with pytest.raises(ValueError, match="row_wise_output"):
        TpuEstimatorConfig(row_wise_output="dense")


def test_data_parallel_all_gather_prices_what_tpurec_shard_runs():
    topo = TpuTopology.from_name("v6e-64")
    reduce_ = TpuCostModel(topo)
    gather = TpuCostModel(topo, TpuEstimatorConfig(data_parallel_grad="all_gather"))
    dp = "data_parallel"
    # A 3-row table in a 55296 batch: gathering every entry costs far more than all-reducing 3 rows.
    tiny_r, tiny_g = reduce_.shard_perf(dp, 55296, [1.0], 3, 128), gather.shard_perf(dp, 55296, [1.0], 3, 128)
    assert tiny_g.bwd_comms > 100 * tiny_r.bwd_comms
    # Every device sends (P-1) x (its 864 entries x 12 B + 864 pooled gradients x 128 x 4 B).
    sent = 63 * (864 * 12 + 864 * 128 * 4)
    assert tiny_g.bwd_comms == pytest.approx(sent / topo.ring_bw_per_chip * 1000, rel=1e-6)
    # A 1M-row table with one id per sample: the dense all-reduce is the costly one.
    big_r, big_g = (
        reduce_.shard_perf(dp, 55296, [1.0], 1_000_000, 128),
        gather.shard_perf(dp, 55296, [1.0], 1_000_000, 128),
    )
    assert big_g.bwd_comms < big_r.bwd_comms / 10
    assert gather.collectives_per_step(dp) == (4, 0) and reduce_.collectives_per_step(dp) == (1, 0)
    with pytest.raises(ValueError, match="data_parallel_grad"):
        TpuEstimatorConfig(data_parallel_grad="ring")
