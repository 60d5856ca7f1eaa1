"""Every change ``import tpurec`` makes to torch, JAX and the process, in one list.

Each :class:`Patch` says what it changes, why, and the attributes it relies on.
:func:`install` (called by ``tpurec/__init__.py``) applies them in order, once; the
implementations stay beside the code they serve. Before a patch is applied its
``requires`` are looked up: one that is missing (a torch or JAX release renamed it)
raises a ``RuntimeError`` naming the patch, instead of a failure somewhere later.
Patches of private attributes were written for one torch/JAX release
(``written_for``); with another one installed, :func:`install` warns once, naming them.

All of them are made at import, but those marked ``after_import``: ``import tpurec`` does
not import Dynamo (``torch._dynamo``), so its patches wait on ``sys.meta_path`` (a finder
that only wraps that one module's import) and are applied the moment anything imports it
(``torch.compile``, TorchRec, the user); if it is imported already, at once. What
``import tpurec`` leaves for later makes no process-wide change of its own: the op runtime (``tpurec.core.dispatch`` and the layers
it needs) is imported by the first tpu op, through the kernels and hooks that
``privateuse1_kernels`` and ``tpurec.core.entry`` install, and the compiler
(``tpurec.compile``) by the first ``torch.compile(backend="tpu")`` call, through the
backend that ``dynamo_backend`` registers (``tests/core/test_global_state.py`` checks both).

This module imports nothing at module level beyond the standard library, so that
``tests/core/test_global_state.py`` can read the list in a process without tpurec.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["PATCHES", "Patch", "check_versions", "install", "installed", "waiting"]

# The releases the private-API patches below were written against (the lock files' versions).
TORCH_SERIES = "2.13"
JAX_SERIES = "0.10"


@dataclasses.dataclass(frozen=True)
class Patch:
    """One process-wide change.

    Attributes:
        name: a short identifier.
        changes: what it changes, as the user would look it up.
        reason: why tpurec needs it.
        apply: makes the change (idempotent).
        requires: dotted names that must exist before it is applied (the version guard).
        library: ``"torch"``, ``"jax"`` or ``"process"``.
        private: it relies on private attributes (underscore names), so it is checked
            against the release it was written for.
        targets: dotted names of the attributes it replaces or mutates (checked by the
            global-state test).
        dispatcher: ``(operator, dispatch key)`` kernel registrations it adds outside tpu's
            own keys.
        after_import: a module ``import tpurec`` does not import itself (``"torch._dynamo"``,
            over a second to import): while it is not imported, :func:`install` leaves the
            patch waiting, and applies it (its ``requires`` checked then) as that module's
            import completes, before any code can use the module.
    """

    name: str
    changes: str
    reason: str
    apply: Callable[[], Any]
    requires: tuple[str, ...] = ()
    library: str = "torch"
    private: bool = False
    targets: tuple[str, ...] = ()
    dispatcher: tuple[tuple[str, str], ...] = ()
    after_import: str = ""


def _tune_malloc() -> None:
    from tpurec.native import host_allocator

    host_allocator.tune()


def _enable_x64() -> None:
    import jax

    jax.config.update("jax_enable_x64", True)


def _listen_to_jax() -> None:
    from tpurec.core import listen_to_jax

    listen_to_jax()


def _serialization() -> None:
    from tpurec.core import install_serialization

    install_serialization()


def _register_device() -> None:
    from tpurec.core import register_device

    register_device()


def _calling_thread_backward() -> None:
    from tpurec.core import run_backward_on_calling_thread

    run_backward_on_calling_thread()


def _keep_parameters() -> None:
    from tpurec.core import install_module_conversion

    install_module_conversion()  # module.to("tpu") keeps Parameter objects, as on CUDA


def _register_factories() -> None:
    from tpurec.core import register_factories

    register_factories()


def _register_pinning() -> None:
    from tpurec.core import register_pinning

    register_pinning()


def _register_autocast() -> None:
    from tpurec.amp import register

    register()


def _grouped_mm_fake_rule() -> None:
    from tpurec.dense.grouped_mm import register_fake_rule

    register_fake_rule()


def _compile_patch(name: str) -> Callable[[], None]:
    def apply() -> None:
        from tpurec.compile import dynamo

        getattr(dynamo, name)()

    return apply


def _register_compile_backend() -> None:
    from tpurec.compile.dynamo import register

    register()


def _register_c10d_backend() -> None:
    from tpurec.distributed import register_c10d_backend

    register_c10d_backend()


def _fsdp_storage() -> None:
    from tpurec.distributed import fsdp

    fsdp.install()


def _disk_cache() -> None:
    from tpurec.core import enable_disk_cache

    enable_disk_cache()


def _disk_cache_every_process() -> None:
    from tpurec.cache import every_process_writes_its_programs

    every_process_writes_its_programs()


def _memory_api() -> None:
    from tpurec.core import TpuModule, install_memory_api

    install_memory_api(TpuModule)  # torch.tpu.memory_allocated() and friends


def _graph_api() -> None:
    from tpurec.core import TpuGraph, TpuModule, graph

    # As torch.cuda.CUDAGraph / torch.cuda.graph: code written for CUDA graphs changes only the device name.
    TpuModule.TpuGraph = TpuGraph  # pyright: ignore[reportAttributeAccessIssue]
    TpuModule.graph = staticmethod(graph)  # pyright: ignore[reportAttributeAccessIssue]


def _torchrec_tpu_tables() -> None:
    importlib.import_module("tpurec.dmp.unfused_tables").install()


def _torchrec_tpu_kernels() -> None:
    importlib.import_module("tpurec.dmp.grouped_lookups").install()


def _sharded_tensor_device() -> None:
    importlib.import_module("tpurec.distributed.sharded_tensor").install()


def _old_module_paths() -> None:
    importlib.import_module("tpurec._old_paths").install()


def _foreach_optimizers() -> None:
    optimizer = importlib.import_module("torch.optim.optimizer")

    from tpurec.core import TpuTensor

    if TpuTensor not in optimizer._foreach_supported_types:
        optimizer._foreach_supported_types.append(TpuTensor)


PATCHES: tuple[Patch, ...] = (
    Patch(
        "glibc_malloc",
        "glibc mallopt: one arena, no trimming, no mmap (TPUREC_TUNE_MALLOC=0 leaves glibc alone)",
        "XLA:CPU mallocs each run's buffers; glibc unmapped them on free and the next run faulted the pages in "
        "again (40 ms of a 165 ms DLRM step). Applied before JAX starts its CPU runtime threads.",
        _tune_malloc,
        library="process",
    ),
    Patch(
        "jax_x64",
        "jax_enable_x64 = True, for every JAX program in the process",
        "torch int64/float64 values must round-trip exactly.",
        _enable_x64,
        requires=("jax.config.jax_enable_x64",),
        library="jax",
        targets=("jax.config.jax_enable_x64",),
    ),
    Patch(
        "jax_monitoring",
        "two JAX monitoring listeners (compile and disk-cache events)",
        "tpurec.stats() counts XLA compilations and persistent-cache hits.",
        _listen_to_jax,
        requires=("jax.monitoring.register_event_listener", "jax.monitoring.register_event_duration_secs_listener"),
        library="jax",
        targets=("jax.monitoring event listeners", "jax.monitoring duration listeners"),
    ),
    Patch(
        "torch_serialization",
        "torch._utils._get_restore_location, torch.serialization's location handlers and weights_only allowlist",
        "torch.load honours a callable map_location for tpu tensors, keeps their CPU values on the host, and "
        "loads checkpoints written by older tpurec releases under weights_only=True.",
        _serialization,
        requires=(
            "torch._utils._get_restore_location",
            "torch.serialization._serialization_tls",
            "torch.serialization.register_package",
            "torch.serialization.add_safe_globals",
        ),
        private=True,
        targets=(
            "torch._utils._get_restore_location",
            "torch.serialization._package_registry",
            "torch.serialization.get_safe_globals()",
        ),
    ),
    Patch(
        "privateuse1_tpu",
        "PrivateUse1 renamed to 'tpu': hooks (C++ ones from tpurec/native/privateuse1_hooks.cc, with pinned "
        "host memory; the Python ones where that library cannot be built), device guard, the torch.tpu module, "
        "and the methods PyTorch generates for a renamed backend (Tensor.tpu(), Tensor.is_tpu, Module.tpu())",
        'The device is a real PyTorch device: torch.device("tpu"), .to("tpu"), torch.tpu.*.',
        _register_device,
        requires=(
            "torch.utils.backend_registration._setup_privateuseone_for_python_backend",
            "torch._C._acc.PrivateUse1Hooks",
        ),
        private=True,
        targets=(
            "torch.tpu",
            "torch._C._get_privateuse1_backend_name()",
            "torch.Tensor.tpu",
            "torch.Tensor.is_tpu",
            "torch.nn.Module.tpu",
        ),
    ),
    Patch(
        "autograd_calling_thread",
        "torch.autograd.variable.Variable._execution_engine wrapped: backward passes run on the calling thread",
        "The engine sizes its per-device worker queues once, from the guards registered then; a Python backend's "
        "guard reports one device, so a backward reaching tpu:1 (or run before import tpurec) failed an assert.",
        _calling_thread_backward,
        requires=("torch.autograd.variable.Variable._execution_engine", "torch.autograd.set_multithreading_enabled"),
        private=True,
        targets=("torch.autograd.variable.Variable._execution_engine",),
    ),
    Patch(
        "module_apply",
        "torch.nn.Module._apply wrapped",
        'module.to("tpu") / .cpu() keep each Parameter object (ties, attributes, hooks), as on CUDA.',
        _keep_parameters,
        requires=("torch.nn.Module._apply",),
        private=True,
        targets=("torch.nn.Module._apply",),
    ),
    Patch(
        "privateuse1_kernels",
        "PrivateUse1 kernels of ATen factories and copies (empty, zeros, _copy_from, ...); the first one "
        "called imports the op runtime (tpurec.core.dispatch)",
        'torch.zeros(..., device="tpu") and copies with Python dispatch excluded reach tpurec.',
        _register_factories,
        requires=("torch.library.Library",),
    ),
    Patch(
        "cpu_pin_memory",
        "the CPU kernel of aten::_pin_memory: without the C++ hooks pinning for tpu is a contiguous copy",
        "In a process with tpurec the current accelerator is tpu, and PyTorch asks it for a pinned host "
        "allocator, which a Python backend cannot provide (DataLoader(pin_memory=True) failed). Pinning for "
        "any other device runs PyTorch's own kernel.",
        _register_pinning,
        requires=("torch.accelerator.current_accelerator", "torch._C.DispatchKey.CompositeExplicitAutograd"),
        private=True,
        dispatcher=(("aten::_pin_memory", "CPU"),),
    ),
    Patch(
        "autocast_tpu",
        "AutocastPrivateUse1 kernels (CUDA's autocast lists) and its fallthrough",
        'torch.autocast("tpu") casts as torch.autocast("cuda") does.',
        _register_autocast,
        requires=("torch.library.fallthrough_kernel",),
    ),
    Patch(
        "grouped_mm_fake_rule",
        "a fake-tensor rule for aten._grouped_mm on tpu tensors (other devices keep the meta kernel)",
        "PyTorch's meta kernel states CUDA's limits, so torch.compile refused float32 MoE layers that run eagerly.",
        _grouped_mm_fake_rule,
        requires=("torch._subclasses.fake_impls.register_op_impl", "torch.ops.aten._grouped_mm"),
        private=True,
        targets=("torch._subclasses.fake_impls.op_implementations_checks",),
    ),
    Patch(
        "dynamo_wrap_tpu_tensors",
        "torch._dynamo.variables.builder.VariableBuilder._wrap wrapped (when torch._dynamo is imported)",
        "Dynamo wraps tpu tensors as tensors, not as __torch_function__ subclasses it cannot rebuild.",
        _compile_patch("wrap_tpu_tensors_as_tensors"),
        requires=("torch._dynamo.variables.builder.VariableBuilder._wrap",),
        private=True,
        targets=("torch._dynamo.variables.builder.VariableBuilder._wrap",),
        after_import="torch._dynamo",
    ),
    Patch(
        "dynamo_subclass_type",
        "torch._dynamo.variables.builder.infer_subclass_type wrapped (when torch._dynamo is imported)",
        "A tpu tensor is a plain tensor to Dynamo.",
        _compile_patch("not_a_subclass_for_dynamo"),
        requires=("torch._dynamo.variables.builder.infer_subclass_type",),
        private=True,
        targets=("torch._dynamo.variables.builder.infer_subclass_type",),
        after_import="torch._dynamo",
    ),
    Patch(
        "fake_mode_avoid_device_init",
        "torch._subclasses.fake_tensor.FakeTensorMode.avoid_device_init is always True",
        "Fake tensor mode never holds a real tpu tensor (PyTorch does the same on machines without CUDA).",
        _compile_patch("fake_mode_leaves_tpu_data_alone"),
        requires=("torch._subclasses.fake_tensor.FakeTensorMode.avoid_device_init",),
        private=True,
        targets=("torch._subclasses.fake_tensor.FakeTensorMode.avoid_device_init",),
    ),
    Patch(
        "dynamo_skip_runtime",
        "Dynamo's skip list: jax, jaxlib, ml_dtypes, opt_einsum, tpurec.compile, tpurec.core, tpurec.dense "
        "(when torch._dynamo is imported)",
        "Dynamo never traces the runtime core or JAX: after a graph break, eager tpu ops run untraced.",
        _compile_patch("skip_runtime_modules"),
        requires=("torch._dynamo.trace_rules.add",),
        private=True,
        targets=("torch._dynamo.trace_rules.SKIP_DIRS",),
        after_import="torch._dynamo",
    ),
    Patch(
        "dynamo_backend",
        'torch.compile backend "tpu" registered (when torch._dynamo is imported); its first call imports the '
        "compiler (tpurec.compile)",
        'torch.compile(model, backend="tpu").',
        _register_compile_backend,
        requires=("torch._dynamo.backends.registry.register_backend",),
        targets=("torch._dynamo.list_backends()",),
        after_import="torch._dynamo",
    ),
    Patch(
        "c10d_backend",
        'torch.distributed backend "tpu" registered (torch.distributed.Backend.TPU)',
        'torch.distributed.init_process_group("tpu") (or "cpu:gloo,tpu:tpu") runs collectives on tpu tensors.',
        _register_c10d_backend,
        requires=("torch.distributed.Backend.register_backend", "torch.distributed.Backend.backend_list"),
        targets=("torch.distributed.Backend.TPU", "torch.distributed.Backend.backend_list"),
    ),
    Patch(
        "fsdp2_storage",
        "FSDP2's free_storage / alloc_storage (torch.distributed.fsdp._fully_shard) free and re-allocate the "
        "jax.Array of tpu tensors; other devices keep torch's code (when FSDP2 is imported)",
        "fully_shard frees unsharded parameters with untyped_storage().resize_(0), which a tpu tensor's storage "
        "(a jax.Array) cannot do.",
        _fsdp_storage,
        requires=(
            "torch.distributed.fsdp._fully_shard._fsdp_param.free_storage",
            "torch.distributed.fsdp._fully_shard._fsdp_param.alloc_storage",
            "torch.distributed.fsdp._fully_shard._fsdp_param_group.alloc_storage",
        ),
        private=True,
        targets=(
            "torch.distributed.fsdp._fully_shard._fsdp_param.alloc_storage",
            "torch.distributed.fsdp._fully_shard._fsdp_param.free_storage",
            "torch.distributed.fsdp._fully_shard._fsdp_param_group.alloc_storage",
        ),
        # FSDP2's import costs seconds (it loads DTensor and more): waits for the user's.
        after_import="torch.distributed.fsdp._fully_shard._fsdp_param_group",
    ),
    Patch(
        "xla_disk_cache",
        "JAX's persistent compilation cache on (xla/ under TPUREC_CACHE_DIR), for every program of size > 0",
        "Eager mode compiles many small programs; each is cheap but they are numerous, so all are kept. "
        "XLA:GPU's autotune cache stays off: it would put the folder's path into every key (a moved cache would miss).",
        _disk_cache,
        requires=("jax.config.jax_compilation_cache_dir", "jax.config.jax_persistent_cache_min_compile_time_secs"),
        library="jax",
        targets=(
            "jax.config.jax_compilation_cache_dir",
            "jax.config.jax_persistent_cache_min_compile_time_secs",
            "jax.config.jax_persistent_cache_min_entry_size_bytes",
            "jax.config.jax_persistent_cache_enable_xla_caches",
        ),
    ),
    Patch(
        "xla_disk_cache_every_process",
        "every process of a multi-process job writes the programs of its own devices to JAX's persistent cache",
        "JAX writes cache entries from process 0 only; a program on one process's devices is keyed by them, so "
        "every other process compiled all its programs again in every run. Programs spanning processes keep "
        "JAX's rule (one writer).",
        _disk_cache_every_process,
        requires=(
            "jax._src.compiler._compile_and_write_cache",
            "jax._src.compiler.backend_compile_and_load",
            "jax._src.compilation_cache.put_executable_and_time",
            "jax._src.distributed.global_state",
        ),
        library="jax",
        private=True,
        targets=("jax._src.compiler._compile_and_write_cache",),
    ),
    Patch(
        "torch_tpu_memory",
        "torch.tpu.memory_allocated() and friends",
        "The memory API of torch.cuda, for the tpu device.",
        _memory_api,
    ),
    Patch(
        "torch_tpu_graphs",
        "torch.tpu.TpuGraph and torch.tpu.graph",
        "Captured steps (tpurec.TpuGraph, tpurec.graph) where torch.cuda has CUDAGraph and graph.",
        _graph_api,
    ),
    Patch(
        "optim_foreach",
        "torch.optim.optimizer._foreach_supported_types gets TpuTensor",
        "torch.optim picks its foreach (multi-tensor) path only for listed tensor types, as on CUDA.",
        _foreach_optimizers,
        requires=("torch.optim.optimizer._foreach_supported_types",),
        private=True,
        targets=("torch.optim.optimizer._foreach_supported_types",),
    ),
    Patch(
        "torchrec_tpu_tables",
        "named_parameters_by_table of TorchRec's UNFUSED_TPU kernels (BatchedTPUEmbeddingBag, BatchedTPUEmbedding in "
        "torchrec.distributed.batched_embedding_kernel) yields each table's parameter, and their __init__ stacks "
        "several column shards of one table into one parameter; BatchedTPUEmbeddingBag.forward refuses per-sample "
        "weights (when that module is imported)",
        "TorchRec 1.9.2's TPU kernels yield no tables there, so its sharded collections register empty CPU "
        "placeholders as the tables' parameters: an optimizer over DistributedModelParallel.parameters() trains "
        "nothing and load_state_dict fails with a size mismatch; the sharded module keeps one parameter per table, "
        "a rank's column shards of it stacked, where the kernel keeps one per shard; the pooled kernel's forward "
        "would drop a weighted collection's per-sample weights (see tpurec/dmp/unfused_tables.py).",
        _torchrec_tpu_tables,
        requires=(
            "torchrec.distributed.batched_embedding_kernel.BatchedTPUEmbeddingBag.named_parameters_by_table",
            "torchrec.distributed.batched_embedding_kernel.BatchedTPUEmbedding.named_parameters_by_table",
        ),
        targets=(
            "torchrec.distributed.batched_embedding_kernel.BatchedTPUEmbedding.__init__",
            "torchrec.distributed.batched_embedding_kernel.BatchedTPUEmbedding.named_parameters_by_table",
            "torchrec.distributed.batched_embedding_kernel.BatchedTPUEmbeddingBag.__init__",
            "torchrec.distributed.batched_embedding_kernel.BatchedTPUEmbeddingBag.forward",
            "torchrec.distributed.batched_embedding_kernel.BatchedTPUEmbeddingBag.named_parameters_by_table",
        ),
        # TorchRec's distributed modules take seconds to import: waits for the user's import.
        after_import="torchrec.distributed.batched_embedding_kernel",
    ),
    Patch(
        "torchrec_tpu_kernels",
        "_create_embedding_kernel of TorchRec's grouped lookups (GroupedPooledEmbeddingsLookup, GroupedEmbeddingsLookup "
        "in torchrec.distributed.embedding_lookup) refuses a tpu group whose shards are placed on another tpu device "
        "than the process's, builds a DENSE-kernel group (data-parallel, or sharded with no kernel named) on tpu with "
        "tpurec's dense tpu kernel (TorchRec's BatchedTPUEmbeddingBag / BatchedTPUEmbedding taking tables of any "
        "width) instead of FBGEMM's dense kernel, and a FUSED group with tpurec's fused kernel (pooled or, for an "
        "EmbeddingCollection, unpooled; when that module is imported)",
        "TorchRec's FUSED kernel (the planner's pick on tpu, and what apply_optimizer_in_backward trains through) builds "
        "FBGEMM's TBE, which fails on tpu, and its UNFUSED_TPU kernel ignores an in-backward optimizer, so the tables "
        "would not train: the FUSED group runs tpurec's sparse ops with the same optimizer, UNFUSED_TPU with an "
        "in-backward optimizer raises. Without CUDA TorchRec builds FBGEMM's dense kernel on the CPU, and its "
        "DistributedDataParallel wrapper then refuses a CPU module for a tpu device; the kernel's "
        "TableBatchedEmbeddingSlice tables cannot be tpu tensors either; TorchRec's tpu kernel takes widths of "
        "multiples of 16 only and hands the sharded module tables that require grad where it declares a DENSE table's "
        "ShardedTensor without. A shard on another device would fail later with PyTorch's message on one rank while "
        "the others wait (see tpurec/dmp/grouped_lookups.py, fused_kernel.py, fused_sequence_kernel.py, "
        "dense_kernel.py).",
        _torchrec_tpu_kernels,
        requires=(
            "torchrec.distributed.embedding_lookup.GroupedPooledEmbeddingsLookup._create_embedding_kernel",
            "torchrec.distributed.embedding_lookup.GroupedEmbeddingsLookup._create_embedding_kernel",
            "torchrec.distributed.batched_embedding_kernel.BatchedTPUEmbeddingBag",
            "torchrec.distributed.batched_embedding_kernel.BatchedTPUEmbedding",
        ),
        private=True,
        targets=(
            "torchrec.distributed.embedding_lookup.GroupedPooledEmbeddingsLookup._create_embedding_kernel",
            "torchrec.distributed.embedding_lookup.GroupedEmbeddingsLookup._create_embedding_kernel",
        ),
        after_import="torchrec.distributed.embedding_lookup",
    ),
    Patch(
        "sharded_tensor_device",
        "the ShardedTensor.device rule (torch.distributed._shard.sharded_tensor.api._SHARDED_OPS) answers tpu for "
        'a tensor with no local shard in a "tpu" process group (when that module is imported)',
        "PyTorch answers torch.cuda.current_device() for such a tensor in any group but gloo, so "
        "torch.distributed.checkpoint.load of a DMP model failed on a rank holding no shard of some table "
        "(see tpurec/distributed/sharded_tensor.py).",
        _sharded_tensor_device,
        requires=("torch.distributed._shard.sharded_tensor.api._SHARDED_OPS",),
        private=True,
        targets=("torch.distributed._shard.sharded_tensor.api._SHARDED_OPS",),
        # ShardedTensor's package registers its rules as its import completes (its _ops last).
        after_import="torch.distributed._shard.sharded_tensor",
    ),
    Patch(
        "old_module_paths",
        "a finder first on sys.meta_path for the module paths of older releases (tpurec.tensor, "
        "tpurec.sparse.spec, ...)",
        "pickle resolves the names older checkpoints hold (tpurec.tensor._rebuild_tpu_tensor) by importing "
        "them, and code of older releases imports modules that moved; only those paths are found, and only "
        "when imported (see tpurec/_old_paths.py).",
        _old_module_paths,
        library="process",
    ),
)

_installed: list[str] = []
_complete = False
# module -> the patches waiting for its import to complete, in list order.
_waiting: dict[str, list[Patch]] = {}


def resolve(dotted: str) -> Any:
    """The object named ``dotted`` (``"torch.nn.Module._apply"``): the longest importable module, then attributes.

    Raises:
        AttributeError: some part does not exist.
    """
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise AttributeError(f"no module in {dotted!r} can be imported")


def _series(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def check_versions() -> list[str]:
    """Names of the private-API patches whose library is not the release they were written for."""
    import jax
    import torch

    mismatched = {"torch": _series(torch.__version__) != TORCH_SERIES, "jax": _series(jax.__version__) != JAX_SERIES}
    return [p.name for p in PATCHES if p.private and mismatched.get(p.library, False)]


def _apply(patch: Patch) -> None:
    """Checks ``patch``'s ``requires``, then applies it.

    Raises:
        RuntimeError: a ``requires`` is missing from the installed torch/JAX.
    """
    for dotted in patch.requires:
        try:
            resolve(dotted)
        except AttributeError as error:
            import jax
            import torch

            raise RuntimeError(
                f"tpurec cannot apply its patch {patch.name!r} ({patch.changes}): {dotted} does not exist in "
                f"torch {torch.__version__} / jax {jax.__version__} ({error}); tpurec was written for torch "
                f"{TORCH_SERIES} and jax {JAX_SERIES}. Install those versions (requirements.lock)."
            ) from None
    patch.apply()
    _installed.append(patch.name)


class _ThenPatch(importlib.abc.Loader):
    """The loader of a module patches wait for: the module's own loader, then the patches."""

    def __init__(self, loader: importlib.abc.Loader, name: str) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        # The module sees its own loader (inspect, linecache, importlib.resources ask it).
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _apply_waiting(self._name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of a module that patches wait for."""

    def find_spec(
        self, fullname: str, path: Any, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _waiting:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _ThenPatch(spec.loader, fullname)
                return spec
        return None


_finder = _AfterImport()


def _apply_waiting(module: str) -> None:
    for patch in _waiting.pop(module, []):
        _apply(patch)
    if not _waiting and _finder in sys.meta_path:
        sys.meta_path.remove(_finder)


def waiting() -> tuple[str, ...]:
    """The names of the patches waiting for a module's import (``after_import``), in order."""
    return tuple(p.name for patches in _waiting.values() for p in patches)


def install() -> None:
    """Applies every patch of :data:`PATCHES` in order (once); one whose ``after_import``
    module is not imported yet is applied when that import completes.

    Raises:
        RuntimeError: a patch's ``requires`` is missing from the installed torch/JAX.
    """
    global _complete
    if _complete:
        return
    for patch in PATCHES:
        if patch.name in _installed or patch.name in waiting():  # a failed import of tpurec got this far
            continue
        if patch.after_import and patch.after_import not in sys.modules:
            _waiting.setdefault(patch.after_import, []).append(patch)
            if _finder not in sys.meta_path:
                sys.meta_path.insert(0, _finder)  # before the finders that would load the module
            continue
        _apply(patch)
    _complete = True
    mismatched = check_versions()
    if mismatched:
        import jax
        import torch

        warnings.warn(
            f"tpurec was written for torch {TORCH_SERIES} and jax {JAX_SERIES}; with torch {torch.__version__} and "
            f"jax {jax.__version__} these patches of private APIs may misbehave: {', '.join(mismatched)}",
            RuntimeWarning,
            stacklevel=3,
        )


def installed() -> tuple[str, ...]:
    """The names of the patches applied so far, in order."""
    return tuple(_installed)
