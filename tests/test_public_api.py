"""The curated public surface: ``__all__`` lists it, nothing internal leaks into it."""

from __future__ import annotations

import inspect
import json
import os
import pathlib
import subprocess
import sys
import types

import pytest
import torch

import tpurec
from tpurec import sparse

ROOT = pathlib.Path(tpurec.__file__).resolve().parents[1]
# The only modules tpurec.__all__ may name: subpackages meant for users.
PUBLIC_SUBPACKAGES = {"tpurec.sparse", "tpurec.config", "tpurec.distributed", "tpurec.library", "tpurec.debug"}
PREPROCESSING_INTERNALS = {
    "tpurec.sparse.preprocess": ("preprocess_kjt", "read_kjt", "stack_tables"),
    "tpurec.sparse.types": ("PAD_ID", "FeatureSlot", "SparseCoreInput", "StackedCsr", "StackedTable", "TableInStack"),
}


def _run(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("package", [tpurec, sparse], ids=lambda m: m.__name__)
def test_every_name_in_all_exists(package):
    missing = [name for name in package.__all__ if not hasattr(package, name)]
    assert missing == [] and len(set(package.__all__)) == len(package.__all__)


def test_no_internal_module_is_in_the_public_api():
    modules = {getattr(tpurec, n).__name__ for n in tpurec.__all__ if isinstance(getattr(tpurec, n), types.ModuleType)}
    assert modules <= PUBLIC_SUBPACKAGES, modules - PUBLIC_SUBPACKAGES
    sparse_modules = {n for n in sparse.__all__ if isinstance(getattr(sparse, n), types.ModuleType)}
    assert sparse_modules == {"checkpoint"}


def test_preprocessing_internals_are_out_of_all_but_importable_from_their_modules():
    import importlib

    for module, names in PREPROCESSING_INTERNALS.items():
        for name in names:
            assert name not in sparse.__all__, name
            assert getattr(importlib.import_module(module), name) is not None
    assert {"Capacity", "CapacityError", "suggest_capacities"} <= set(sparse.__all__)  # what users size and catch


def test_import_tpurec_leaves_sparse_unloaded_and_no_aliases_behind():
    out = json.loads(
        _run(
            "import json, sys, tpurec\n"
            "ns = {}\n"
            "exec('from tpurec import *', ns)\n"
            "old = ('device', 'dispatch', 'errors', 'fused', 'memory', 'modes', 'recompiles', 'rng', 'runtime',"
            " 'tensor', 'views', 'jax')\n"
            "print(json.dumps({'sparse': sorted(m for m in sys.modules if m.startswith('tpurec.sparse')),"
            " 'attributes': [n for n in old if hasattr(tpurec, n)],"
            " 'modules': [n for n in old if 'tpurec.' + n in sys.modules],"
            " 'star': sorted(n for n in ns if n != '__builtins__'), 'all': sorted(tpurec.__all__)}))\n"
        )
    )
    assert out["sparse"] == []  # tpurec.shard imports the sharding stack on its first call only
    assert out["attributes"] == [] and out["modules"] == []
    assert out["star"] == out["all"]


def test_shard_has_the_implementations_signature():
    from tpurec.sparse.sharding import shard as implementation

    assert inspect.signature(tpurec.shard) == inspect.signature(implementation)
    doc = inspect.getdoc(tpurec.shard)
    assert all(section in doc for section in ("Args:", "Returns:", "Example::"))
    for name in inspect.signature(implementation).parameters:
        assert f"{name}:" in doc, name


def test_flush_runs_the_recorded_ops_as_one_program_without_a_wait():
    x = torch.arange(6.0).reshape(2, 3)
    with tpurec.mode("fused"):
        y = torch.arange(6.0, device="tpu").reshape(2, 3)
        z = (y * 2 + 1).sum(0)
        tpurec.reset_stats()
        assert tpurec.core.fused.pending_ops() > 0
        tpurec.flush("step")
        assert tpurec.core.fused.pending_ops() == 0
        stats = tpurec.stats()
        assert stats["sync_points"] == {"step": 1} and stats["fused_graphs"] == 1, stats
        tpurec.flush()  # nothing recorded: nothing to run, nothing counted
        assert tpurec.stats()["sync_points"] == {"step": 1}
    torch.testing.assert_close(z.cpu(), (x * 2 + 1).sum(0), rtol=0, atol=0)


def test_flush_rejects_a_reason_that_is_not_a_label_and_keeps_the_window():
    with tpurec.mode("fused"):
        y = torch.ones(3, device="tpu") + 1
        pending = tpurec.core.fused.pending_ops()
        assert pending > 0
        with pytest.raises(TypeError, match="non-empty string"):
            tpurec.flush(3)
        assert tpurec.core.fused.pending_ops() == pending  # nothing ran
    torch.testing.assert_close(y.cpu(), torch.full((3,), 2.0), rtol=0, atol=0)
