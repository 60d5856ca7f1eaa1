"""TpuTopology: names, derived figures, TorchRec conversion."""

import pytest

from tpurec.sparse.planner import TPU_GENERATIONS, TpuTopology
from tpurec.sparse.planner.topology import default_slice_shape


@pytest.mark.parametrize(
    "name, chips, shape, devices, scs",
    [
        ("v5p-128", 64, (4, 4, 4), 64, 4),
        ("v6e-256", 256, (16, 16), 256, 2),
        ("v7x-64", 32, (2, 4, 4), 64, 2),
        ("v4-32", 16, (2, 2, 4), 16, 4),
        ("v5e-16", 16, (4, 4), 16, 0),
    ],
)
def test_from_name(name, chips, shape, devices, scs):
    t = TpuTopology.from_name(name)
    assert t.num_chips == chips
    assert t.slice_shape == shape
    assert t.world_size == devices
    assert t.sparsecores_per_device == scs
    assert t.name == name


def test_fields_and_multislice():
    t = TpuTopology("v5p", (4, 4, 8))
    assert t.num_chips == 128 and t.name == "v5p-256" and t.num_hosts == 32
    two = TpuTopology.from_name("2xv6e-256")
    assert two.num_slices == 2 and two.world_size == 512 and two.devices_per_slice == 256
    assert two.slice_of(255) == 0 and two.slice_of(256) == 1
    assert TpuTopology.from_name("v6e-256", num_slices=2) == two


def test_bad_inputs():
    with pytest.raises(ValueError):
        TpuTopology.from_name("v9-8")
    with pytest.raises(ValueError):
        TpuTopology.from_name("v5p-127")
    with pytest.raises(ValueError):
        TpuTopology("v6e", (4, 4, 4))  # v6e is a 2D torus
    with pytest.raises(ValueError):
        default_slice_shape("v5p", 12)


def test_generation_table_has_sources():
    for gen in TPU_GENERATIONS.values():
        assert gen.sources, gen.name
        assert gen.hbm_bytes_per_chip > 0 and gen.hbm_bw_per_chip > 0
        assert gen.sparsecores_per_chip % gen.devices_per_chip == 0


def test_ici_figures():
    v5p = TpuTopology.from_name("v5p-128")
    assert v5p.gen.ici_link_bw == pytest.approx(100e9)
    assert v5p.wraparound == (True, True, True)
    # 4x4x4 torus: 16 rings cut twice.
    assert v5p.bisection_bw == pytest.approx(16 * 2 * 100e9)
    mesh = TpuTopology("v5p", (2, 2, 2))
    assert mesh.wraparound == (False, False, False)
    assert mesh.bisection_bw == pytest.approx(4 * 1 * 100e9)
    # Bigger slices have more bisection but a lower per-chip all-to-all rate.
    big = TpuTopology("v5p", (8, 8, 8))
    assert big.bisection_bw > v5p.bisection_bw
    assert big.all_to_all_bw_per_chip < v5p.all_to_all_bw_per_chip
    assert v5p.dcn_bw_per_chip < v5p.ici_injection_bw


def test_to_torchrec():
    t = TpuTopology.from_name("v7x-64")
    trec = t.to_torchrec()
    assert trec.compute_device == "tpu"
    assert trec.world_size == 64
    assert trec.intra_group_size == 64  # row-wise group: the slice
    assert trec.local_world_size == 8  # a host: 4 chips x 2 devices
    assert trec.devices[0].storage.hbm == t.hbm_per_device == 96 * 1024**3
    assert trec.hbm_mem_bw == pytest.approx(7380e9 / 2 / 1000)
    two = TpuTopology.from_name("v6e-256", num_slices=2).to_torchrec()
    assert two.world_size == 512 and two.intra_group_size == 256
    assert two.inter_host_bw < two.intra_host_bw


def test_published_v5p_slice_limit():
    """cloud.google.com/tpu/docs/v5p: largest schedulable slice 6144 chips, 16x16x24."""
    t = TpuTopology.from_name("v5p-12288")
    assert t.num_chips == 6144 and t.slice_shape == (16, 16, 24) and t.name == "v5p-12288"
    with pytest.raises(ValueError, match="at most 6144"):
        TpuTopology("v5p", (16, 16, 32))


def test_published_dcn_figures():
    # v5e docs: 6.4 Tbps DCN per 256-chip pod = 25 Gb/s per chip; v5p docs: 50 Gb/s per chip.
    assert TPU_GENERATIONS["v5e"].dcn_bw_per_chip == pytest.approx(6.4e12 / 256 / 8)
    assert TPU_GENERATIONS["v5p"].dcn_bw_per_chip == pytest.approx(50e9 / 8)


def test_no_sparsecore_statement():
    v5e = TpuTopology.from_name("v5e-16")
    assert "v5e has no SparseCore" in v5e.sparsecore_note
    assert v5e.describe()["sparsecore_note"] == v5e.sparsecore_note
    assert TpuTopology.from_name("v5p-16").sparsecore_note is None
