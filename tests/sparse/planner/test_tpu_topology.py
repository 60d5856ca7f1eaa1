"""TpuTopology: names, derived figures, TorchRec conversion, stated assumptions."""

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from tpurec.sparse.planner import TPU_GENERATIONS, TableSpec, TpuTopology, plan
from tpurec.sparse.planner.topology import default_slice_shape, figure_fields


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


# ---- TPU 8t / 8i: published figures, everything else an explicit assumption ---- #

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
_MLPERF = os.path.join(_ROOT, "examples", "planner", "mlperf_dlrm_dcnv2.json")

# The published figures (bytes, bytes/s); every other figure must be an assumption.
_TPU8_PUBLISHED = {
    "tpu8t": {"ici_bw_per_chip": 19.2e12, "dcn_bw_per_chip": 400e9},
    "tpu8i": {"hbm_bytes_per_chip": 288e9, "hbm_bw_per_chip": 8.6e12, "ici_bw_per_chip": 19.2e12},
}


@pytest.mark.parametrize("gen_name", sorted(_TPU8_PUBLISHED))
def test_tpu8_published_figures(gen_name):
    gen = TPU_GENERATIONS[gen_name]
    for figure, value in _TPU8_PUBLISHED[gen_name].items():
        assert getattr(gen, figure) == pytest.approx(value), figure
    assert gen.sources
    # 19.2 TB/s bidirectional per chip: 9.6 TB/s each way, over the chip's links.
    assert gen.ici_link_bw * gen.ici_links_per_chip == pytest.approx(9.6e12)
    assert gen.ici_link_bw == pytest.approx(19.2e12 / 2 / gen.ici_links_per_chip)


def test_tpu8i_hbm_in_torchrec_units():
    t = TpuTopology.from_name("tpu8i-16")
    assert t.num_chips == 8 and t.world_size == 16 and t.name == "tpu8i-16"
    trec = t.to_torchrec()
    # 288 GB per chip over its (assumed) 2 devices; TorchRec's bandwidths are bytes/ms.
    assert trec.devices[0].storage.hbm == 288 * 1000**3 // 2
    assert trec.hbm_mem_bw == pytest.approx(8.6e12 / 2 / 1000)


def test_tpu8t_dcn_in_multislice_comms():
    t = TpuTopology.from_name("2xtpu8t-64")
    assert t.num_slices == 2 and t.world_size == 128 and t.dcn_bw_per_chip == pytest.approx(400e9)
    trec = t.to_torchrec()
    # DCN per device, bytes/ms: 400 GB/s per chip over 2 devices.
    assert trec.inter_host_bw == pytest.approx(400e9 / 2 / 1000)
    assert TpuTopology.from_name("v8t-64") == TpuTopology.from_name("tpu8t-64")


@pytest.mark.parametrize("gen_name", sorted(_TPU8_PUBLISHED))
def test_tpu8_unpublished_figures_are_assumptions(gen_name):
    gen = TPU_GENERATIONS[gen_name]
    assumed = {figure for figure, _ in gen.assumptions}
    unpublished = set(figure_fields()) - set(_TPU8_PUBLISHED[gen_name])
    # Every unpublished figure is listed, with a reason; so is how the published ones are read.
    assert unpublished <= assumed
    assert "ici_bw_per_chip" in assumed  # bytes or bits: the reading is stated
    assert all(why.strip() for _, why in gen.assumptions)
    v7x = TPU_GENERATIONS["v7x"]
    for figure in unpublished:
        assert getattr(gen, figure) == getattr(v7x, figure), figure
    lines = TpuTopology.from_name(f"{gen_name}-16").assumptions
    assert len(lines) == len(gen.assumptions)
    for figure in unpublished:
        assert any(line.startswith(f"{gen_name} {figure} = ") and "v7x" in line for line in lines), figure


def test_assumptions_name_real_figures_and_follow_overrides():
    with pytest.raises(ValueError, match="unknown figure 'hbm_size'"):
        replace(TPU_GENERATIONS["v7x"], assumptions=(("hbm_size", "typo"),))
    # An HBM capacity the user gives is no longer an assumption.
    t = TpuTopology.from_name("tpu8t-16", hbm_bytes_per_chip=256 * 1024**3)
    assert not any("hbm_bytes_per_chip" in a for a in t.assumptions)
    assert any("hbm_bw_per_chip" in a for a in t.assumptions)
    assert t.describe()["assumptions"] == t.assumptions
    # The code's own older assumptions are listed too; v5e's DCN is published.
    assert any("dcn_bw_per_chip" in a for a in TpuTopology.from_name("v4-8").assumptions)
    assert TpuTopology.from_name("v5e-8").assumptions == []


def test_plan_report_lists_assumptions():
    tables = [TableSpec("big", 2_000_000, 128, 8.0), TableSpec("small", 1000, 64, 2.0)]
    tpu = TpuTopology.from_name("tpu8i-16")
    _, report = plan(tables, tpu, batch_size=2048)
    text = str(report)
    assert f"ASSUMPTIONS: {len(tpu.assumptions)} figure(s) of tpu8i" in text
    for line in tpu.assumptions:
        assert f"  - {line}" in text
    assert json.loads(report.to_json())["topology"]["assumptions"] == tpu.assumptions
    _, v5e = plan(tables, "v5e-8", batch_size=2048)
    assert "ASSUMPTIONS" not in str(v5e)


@pytest.mark.parametrize("topology, devices", [("tpu8i-16", 16), ("2xtpu8t-64", 128)])
def test_cli_plans_mlperf_dlrmv2_on_tpu8(tmp_path, topology, devices):
    out = tmp_path / "plan.json"
    cmd = [
        sys.executable,
        "-m",
        "tpurec",
        "plan",
        "--topology",
        topology,
        "--tables",
        _MLPERF,
        "--batch-size",
        "55296",
        "--timeout",
        "10",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    gen = TpuTopology.from_name(topology).gen
    assert f"tpurec sharding plan for {topology}" in proc.stdout
    assert f"ASSUMPTIONS: {len(gen.assumptions)} figure(s) of {gen.name}" in proc.stdout
    doc = json.loads(out.read_text())
    assert len(doc["plan"]["<root>"]) == 26  # every MLPerf DLRMv2 table placed
    assert doc["report"]["topology"]["devices"] == devices
    assert doc["report"]["topology"]["assumptions"] == gen.assumption_lines()
    assert doc["report"]["max_hbm_bytes_per_chip"] <= doc["report"]["hbm_available_per_chip"]
