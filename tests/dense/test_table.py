"""The one lowering table: every entry says its kind; families and the calling convention are explicit."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

import tpurec  # noqa: F401 (the device kernels and compiled-graph entries register on import)
import tpurec.compile.backend  # noqa: F401 (the compiler: its graph entries)
from tpurec.dense import calling, registry
from tpurec.dense.registry import LOWERINGS, TABLE, Kind, entry, get_lowering, lower

aten = torch.ops.aten


def test_each_entry_says_the_kind_it_is_filed_under():
    for kind, entries in TABLE.items():
        for op, found in entries.items():
            assert found.kind is kind and found.op is op, (kind, op)
            assert callable(found.fn), (kind, op)
    assert LOWERINGS is TABLE[Kind.JAX]


def test_every_kind_has_entries_from_its_layer():
    assert entry(aten._to_copy.default, Kind.KERNEL) is not None  # tpurec.core's kernel
    assert get_lowering(aten._to_copy.default) is not None  # and its lowering for compiled graphs
    assert entry(aten.view.default, Kind.VIEW) is not None  # tpurec.compile.views
    assert entry(aten.empty_like.default, Kind.GRAPH) is not None
    assert entry(aten.sym_size.int, Kind.SIZE_QUERY) is not None
    assert entry(aten._native_multi_head_attention.default, Kind.COMPOSITE) is not None  # tpurec.dense.composites
    assert entry(aten._pack_padded_sequence.default, Kind.COMPOSITE) is not None  # a family's own
    assert entry(aten.nonzero.default, Kind.DATA_DEPENDENT) is not None
    assert entry(aten.zeros.default, Kind.FACTORY) is not None
    assert entry(aten.add.Tensor, Kind.KERNEL) is None


def test_a_second_entry_of_one_kind_is_refused_and_the_table_is_unchanged():
    before = dict(TABLE[Kind.VIEW])
    with pytest.raises(ValueError, match="two view entries"):
        lower(aten.view.default, kind=Kind.VIEW)(lambda x, size: x)
    with pytest.raises(ValueError, match="needs a function"):
        registry.mark(aten.relu.default, kind=Kind.KERNEL)
    with pytest.raises(ValueError, match="holds no function"):
        lower(aten.relu.default, kind=Kind.FACTORY)
    with pytest.raises(TypeError, match="holds no function to run"):
        entry(aten.nonzero.default, Kind.DATA_DEPENDENT)()
    assert TABLE[Kind.VIEW] == before


def test_the_family_list_names_every_module_that_registers_lowerings():
    dense = pathlib.Path(registry.__file__).parent
    registering = {
        path.stem
        for path in dense.glob("*.py")
        if path.stem not in ("registry", "calling") and re.search(r"^@?lower\(", path.read_text(), re.M)
    }
    listed = set(registry.FAMILIES) | set(registry.DEFERRED.values())
    # A deferred family may load sibling modules of its namespace (fbgemm's jagged -> pooled_permutes).
    loaded_with_deferred = {
        name
        for family in registry.DEFERRED.values()
        for name in re.findall(r"^from tpurec\.dense import (\w+)", (dense / f"{family}.py").read_text(), re.M)
    }
    assert registering == listed | (loaded_with_deferred & registering)
    assert "pooled_permutes" in loaded_with_deferred


@pytest.mark.parametrize(
    ("kind", "value", "spec", "inputs"),
    [
        (calling.DYNAMIC, 0.5, ("d", float), [0.5]),
        (calling.TENSOR, 2, ("d", int), [2]),  # a wrapped number
        (calling.DYNAMIC, True, ("c", True, bool), []),  # bools are static
        (calling.DYNAMIC_LIST, [1, 2.0], ("dl", (int, float)), [1, 2.0]),
        (calling.STATIC, [3, 4], ("c", (3, 4), (int, int)), []),
        (calling.STATIC, 3.0, ("c", 3.0, float), []),  # not the key of 3: arange(3.0) is not arange(3)
        (calling.STATIC, torch.device("cpu"), ("c", "cpu", torch.device), []),
        (calling.TENSOR, None, ("none",), []),
    ],
)
def test_split_and_rebuild_are_inverse(kind, value, spec, inputs):
    recorded: list = []
    got = calling.split(kind, value, recorded, lambda t: ("t",))
    assert got == spec and recorded == inputs
    rebuilt = calling.rebuild(got, iter(recorded), lambda s, it: next(it))
    expected = list(value) if isinstance(value, list) else value
    assert rebuilt == (str(value) if isinstance(value, torch.device) else expected)


def test_tensors_travel_through_the_callbacks():
    t = torch.ones(2)
    recorded: list = []
    spec = calling.split(calling.TENSOR_LIST, [t, None], recorded, lambda x: (recorded.append(x) or "t",))
    assert spec == ("list", (("t",), ("none",))) and recorded == [t]
    assert calling.rebuild(spec, iter(recorded), lambda s, it: next(it)) == [t, None]
