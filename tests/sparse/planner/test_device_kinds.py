"""One table of chips: every device kind JAX reports for a known generation maps to it, for the
planner's automatic topology (tpurec.shard without a plan) and for the sparse kernels alike."""

from __future__ import annotations

import types
import warnings

import pytest

from tpurec.sparse.planner.topology import DEVICE_KINDS, TPU_GENERATIONS, TpuTopology, generation_of_device_kind
from tpurec.sparse.sharding.model import planning_generation, planning_topology

# Kinds as JAX reports them on Cloud TPU VMs (and "TPU v5p" under pathways).
EXPECTED = {
    "TPU v4": "v4",
    "TPU v5 lite": "v5e",
    "TPU v5": "v5p",
    "TPU v5p": "v5p",
    "TPU v6 lite": "v6e",
    "TPU7x": "v7x",
}


def _device(kind: str, platform: str = "tpu"):
    return types.SimpleNamespace(device_kind=kind, platform=platform)


@pytest.mark.parametrize("kind,generation", sorted(EXPECTED.items()))
def test_known_kinds_map_to_their_generation(kind, generation):
    assert DEVICE_KINDS[kind] == generation
    assert generation_of_device_kind(kind) is TPU_GENERATIONS[generation]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert planning_generation(_device(kind)) == generation


@pytest.mark.parametrize("kind,generation", sorted(EXPECTED.items()))
def test_automatic_plans_are_for_the_kinds_generation_and_the_runs_device_count(kind, generation):
    # What tpurec.shard without a plan and train.py --print_sharding_plan plan for: a topology of the
    # run's chip with as many JAX devices as the run has (whole chips: v7x shows two devices a chip).
    per_chip = TPU_GENERATIONS[generation].devices_per_chip
    for devices in (per_chip, 4, 8, 64):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            name = planning_topology(devices, _device(kind))
        topology = TpuTopology.from_name(name)
        assert (topology.generation, topology.world_size) == (generation, devices), (kind, devices, name)


@pytest.mark.parametrize("devices", [1, 3])
def test_devices_that_are_not_whole_chips_are_refused_naming_the_kind(devices):
    # A v7x chip shows two JAX devices: no v7x topology has an odd number of them.
    with pytest.raises(ValueError, match=rf"^{devices} device\(s\) of 'TPU7x' are not whole chips: a v7x chip shows 2"):
        planning_topology(devices, _device("TPU7x"))


def test_an_unknown_kind_plans_a_v5p_topology_of_the_runs_devices_with_a_warning():
    with pytest.warns(UserWarning, match="'TPU v99'"):
        name = planning_topology(8, _device("TPU v99"))
    topology = TpuTopology.from_name(name)
    assert (topology.generation, topology.world_size) == ("v5p", 8), name


def test_every_table_kind_names_a_generation():
    assert set(DEVICE_KINDS.values()) <= set(TPU_GENERATIONS)


def test_sparsecore_primitives_only_where_jax_tpu_embedding_drives_them():
    from jax_tpu_embedding.sparsecore.utils.utils import NUM_SC_PER_DEVICE_MAP

    driven = {DEVICE_KINDS[k] for k in NUM_SC_PER_DEVICE_MAP}
    assert driven == {name for name, g in TPU_GENERATIONS.items() if g.sparsecore_primitives}
    assert TPU_GENERATIONS["v5e"].sparsecores_per_chip == 0


def test_unknown_tpu_kind_plans_with_a_warning_naming_it():
    assert generation_of_device_kind("TPU v99") is None
    with pytest.warns(UserWarning, match="'TPU v99'"):
        assert planning_generation(_device("TPU v99")) == "v5p"


def test_a_host_device_plans_as_v5p_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert planning_generation(_device("cpu", "cpu")) == "v5p"
