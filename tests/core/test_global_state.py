"""Importing tpurec must not change what other backends see."""

import subprocess
import sys

import pytest
from fresh_cache import fresh_cache


def test_import_leaves_torch_decomposition_table_alone():
    # A decomposition added to torch's global table makes inductor refuse to
    # start under CI=1 ("a decomposition exists, we should switch to it").
    code = (
        "import torch\n"
        "from torch._decomp import decomposition_table\n"
        "before = set(decomposition_table)\n"
        "import tpurec\n"
        "from tpurec.dense.registry import _load_families\n"
        "_load_families()\n"
        "(torch.ones(2, device='tpu') * 2).cpu()\n"
        "added = set(decomposition_table) - before\n"
        "assert not added, sorted(map(str, added))\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# What import tpurec changes, observed from outside: attributes of the torch and JAX namespaces
# that tpurec patches or might, plus containers and registries it may add to. Run in a fresh
# process with tpurec/_patches.py loaded from its file (the package is not imported yet).
_OBSERVE = r"""
import importlib.util, json, sys, types

spec = importlib.util.spec_from_file_location("patch_list", sys.argv[1])
patch_list = sys.modules["patch_list"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(patch_list)
assert "tpurec" not in sys.modules

import jax, jax._src.compiler as jax_compiler, jax._src.monitoring as monitoring, torch, torch._dynamo, torch._dynamo.trace_rules
import torch._subclasses.fake_impls, torch._subclasses.fake_tensor, torch.autograd.variable, torch.optim.optimizer
import torch._dynamo.variables.builder as builder
fsdp_param = importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_param")
fsdp_param_group = importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_param_group")
tbe_kernel = importlib.import_module("torchrec.distributed.batched_embedding_kernel")
grouped_lookup = importlib.import_module("torchrec.distributed.embedding_lookup")
sharded_tensor_api = importlib.import_module("torch.distributed._shard.sharded_tensor.api")
optimizer = importlib.import_module("torch.optim.optimizer")
variable = importlib.import_module("torch.autograd.variable")

NAMESPACES = {
    "jax._src.compiler": jax_compiler, "torch": torch, "torch.Tensor": torch.Tensor, "torch.nn.Module": torch.nn.Module, "torch._utils": torch._utils,
    "torch.serialization": torch.serialization, "torch.optim.optimizer": optimizer,
    "torch.autograd.variable.Variable": variable.Variable, "torch.library": torch.library,
    "torch._dynamo.variables.builder": builder, "torch._dynamo.variables.builder.VariableBuilder": builder.VariableBuilder,
    "torch._subclasses.fake_tensor.FakeTensorMode": torch._subclasses.fake_tensor.FakeTensorMode,
    "torch.utils.data.DataLoader": torch.utils.data.DataLoader, "torch.accelerator": torch.accelerator,
    "torch.distributed.Backend": torch.distributed.Backend,
    "torch.distributed.fsdp._fully_shard._fsdp_param": fsdp_param,
    "torch.distributed.fsdp._fully_shard._fsdp_param_group": fsdp_param_group,
    "torchrec.distributed.batched_embedding_kernel.BatchedTPUEmbeddingBag": tbe_kernel.BatchedTPUEmbeddingBag,
    "torchrec.distributed.batched_embedding_kernel.BatchedTPUEmbedding": tbe_kernel.BatchedTPUEmbedding,
    "torchrec.distributed.embedding_lookup.GroupedPooledEmbeddingsLookup": grouped_lookup.GroupedPooledEmbeddingsLookup,
    "torchrec.distributed.embedding_lookup.GroupedEmbeddingsLookup": grouped_lookup.GroupedEmbeddingsLookup,
}
KEYS = ("CPU", "CUDA", "Meta", "CompositeExplicitAutograd", "CompositeImplicitAutograd", "Autograd", "AutogradCPU")

def snapshot():
    seen = {}
    for prefix, space in NAMESPACES.items():
        for name, value in list(vars(space).items()):
            if not isinstance(value, types.ModuleType):  # importing a submodule is not a patch
                seen[f"{prefix}.{name}"] = repr(id(value))
    seen.update({f"jax.config.{k}": repr(v) for k, v in jax.config.values.items()})
    seen["jax.monitoring event listeners"] = repr(len(monitoring.get_event_listeners()))
    seen["jax.monitoring duration listeners"] = repr(len(monitoring.get_event_duration_listeners()))
    seen["torch.serialization._package_registry"] = repr(len(torch.serialization._package_registry))
    seen["torch.serialization.get_safe_globals()"] = repr(len(torch.serialization.get_safe_globals()))
    seen["torch.optim.optimizer._foreach_supported_types"] = repr(list(map(id, optimizer._foreach_supported_types)))
    seen["torch._dynamo.trace_rules.SKIP_DIRS"] = repr(len(torch._dynamo.trace_rules.SKIP_DIRS))
    seen["torch._subclasses.fake_impls.op_implementations_checks"] = repr(len(torch._subclasses.fake_impls.op_implementations_checks))
    seen["torch._dynamo.list_backends()"] = repr(sorted(torch._dynamo.list_backends(exclude_tags=())))
    seen["torch.distributed._shard.sharded_tensor.api._SHARDED_OPS"] = repr(sorted(map(id, sharded_tensor_api._SHARDED_OPS.values())))
    seen["torch.distributed.Backend.backend_list"] = repr(list(torch.distributed.Backend.backend_list))
    seen["torch._C._get_privateuse1_backend_name()"] = torch._C._get_privateuse1_backend_name()
    regs = {k: set(torch._C._dispatch_get_registrations_for_dispatch_key(k)) for k in KEYS}
    return seen, regs

before, regs_before = snapshot()
import tpurec
after, regs_after = snapshot()
changed = sorted(k for k in after if before.get(k) != after[k])
added = sorted([op, key] for key in KEYS for op in regs_after[key] - regs_before[key])
loaded_at_import = tpurec.core.entry.loaded()
# The op runtime loads on the first tpu op, the compiler on the first torch.compile: neither
# may change anything more (every process-wide change is made by import, from the list).
(torch.ones(2, device="tpu") * 2).cpu()
import tpurec.compile.backend
later, regs_later = snapshot()
changed_later = sorted(k for k in later if after.get(k) != later[k])
added_later = sorted([op, key] for key in KEYS for op in regs_later[key] - regs_after[key])
from tpurec.native import host_allocator
print(json.dumps({
    "changed": changed, "added": added, "installed": list(tpurec._patches.installed()),
    "loaded_at_import": loaded_at_import, "changed_later": changed_later, "added_later": added_later,
    "listed": [p.name for p in patch_list.PATCHES],
    "targets": sorted({t for p in patch_list.PATCHES for t in p.targets}),
    "dispatcher": sorted([op, key] for p in patch_list.PATCHES for op, key in p.dispatcher),
    "malloc_tuned": host_allocator.tuned(),
}))
"""


def test_the_patch_list_is_what_import_changes(tmp_path):
    """Every change ``import tpurec`` makes to the observed torch/JAX state is a listed patch's
    target, every listed target changes, and import applies the whole list, in order; the first
    tpu op and the compiler's import (which load the rest of tpurec) change nothing more."""
    import json
    import os
    import pathlib

    import tpurec._patches

    env = {
        **os.environ,
        "TPUREC_CACHE_DIR": str(fresh_cache(tmp_path / "cache")),
        "PYTHONPATH": str(pathlib.Path(tpurec.__file__).parent.parent),
    }
    env.pop("TPUREC_TUNE_MALLOC", None)
    out = subprocess.run(
        [sys.executable, "-c", _OBSERVE, tpurec._patches.__file__],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["installed"] == seen["listed"]
    assert seen["changed"] == seen["targets"], "changed by import but not listed / listed but not changed"
    assert seen["added"] == seen["dispatcher"]
    assert seen["loaded_at_import"] is False  # import tpurec leaves the op runtime for the first tpu op
    assert seen["changed_later"] == [] and seen["added_later"] == []
    assert seen["malloc_tuned"] == (sys.platform == "linux")


_DYNAMO_LATER = r"""
import json, sys
import torch, tpurec
from tpurec import _patches
state = {
    "dynamo_at_import": "torch._dynamo" in sys.modules,
    "waiting": list(_patches.waiting()),
    "marked": [p.name for p in _patches.PATCHES if p.after_import],
    "modules": sorted({p.after_import for p in _patches.PATCHES if p.after_import}),
}
import torch._dynamo  # what torch.compile, TorchRec or the user does first
from torch.distributed.fsdp import fully_shard  # FSDP2
import torchrec.distributed.batched_embedding_kernel  # TorchRec's sharded kernels (and ShardedTensor)
import torchrec.distributed.embedding_lookup  # TorchRec's grouped lookups (which build those kernels)
from torch._dynamo.variables import builder
state.update(
    waiting_after=list(_patches.waiting()),
    installed=sorted(_patches.installed()),
    listed=sorted(p.name for p in _patches.PATCHES),
    finder_left=[type(f).__name__ for f in sys.meta_path if type(f).__module__ == "tpurec._patches"],
    wrap=builder.VariableBuilder._wrap.__module__,
    backend="tpu" in torch._dynamo.list_backends(),
)
print(json.dumps(state))
"""


def test_dynamos_patches_wait_for_its_import(tmp_path):
    """``import tpurec`` imports neither Dynamo, FSDP2, ShardedTensor nor TorchRec's sharded kernels and lookups; their
    patches are applied as their imports complete."""
    import json
    import os
    import pathlib

    import tpurec

    env = {
        **os.environ,
        "TPUREC_CACHE_DIR": str(fresh_cache(tmp_path / "cache")),
        "PYTHONPATH": str(pathlib.Path(tpurec.__file__).parent.parent),
    }
    out = subprocess.run(
        [sys.executable, "-c", _DYNAMO_LATER], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["dynamo_at_import"] is False
    assert seen["modules"] == [
        "torch._dynamo",
        "torch.distributed._shard.sharded_tensor",
        "torch.distributed.fsdp._fully_shard._fsdp_param_group",
        "torchrec.distributed.batched_embedding_kernel",
        "torchrec.distributed.embedding_lookup",
    ]
    assert seen["waiting"] == seen["marked"] and seen["marked"], seen
    assert seen["waiting_after"] == [] and seen["installed"] == seen["listed"]
    assert seen["finder_left"] == []  # the import hook is gone once nothing waits
    assert seen["wrap"] == "tpurec.compile.dynamo" and seen["backend"] is True


def test_every_patch_says_why_and_what_it_relies_on():
    from tpurec import _patches

    names = [p.name for p in _patches.PATCHES]
    assert len(set(names)) == len(names)
    for p in _patches.PATCHES:
        assert p.changes and p.reason and p.library in ("torch", "jax", "process"), p.name
        for dotted in p.requires:
            _patches.resolve(dotted)  # the version guard holds on the installed torch/JAX
        if p.private:
            assert p.requires, f"{p.name} patches private attributes but checks none"
    assert _patches.check_versions() == []  # the lock's torch and JAX are the ones the patches were written for


def test_a_missing_attribute_stops_install_with_the_patch_named(monkeypatch):
    from tpurec import _patches

    broken = _patches.Patch(
        "probe", "nothing", "a test", lambda: None, requires=("torch.nn.Module._no_such_attribute",)
    )
    monkeypatch.setattr(_patches, "PATCHES", (broken,))
    monkeypatch.setattr(_patches, "_installed", [])
    monkeypatch.setattr(_patches, "_complete", False)
    with pytest.raises(
        RuntimeError, match=r"patch 'probe' \(nothing\): torch.nn.Module._no_such_attribute does not exist"
    ):
        _patches.install()
    assert _patches.installed() == ()
