"""The runtime core of the ``tpu`` device, in layers: each module imports only the ones below it.

Lowest first (``LAYERS``):

==============  ===========================================================================
``errors``      the errors users see (unsupported op, failed lowering, bad arguments)
``views``       strided views over a storage array, as pure JAX functions
``rng``         the device's random state (seed and counter)
``profiler``    ``record_function`` ranges in ``torch.profiler`` traces (the hooks only;
                ``tpurec.profile`` lives above the core, in ``tpurec/profiler.py``)
``accounting``  the counters (``stats``) and the accounting of compilations by JAX's reports
``sync``        sync points: ``synchronize`` and the slot where the fused window plugs in
``headroom``    memory-mapping headroom: compiled programs dropped before the kernel
                refuses the process more mappings
``stubs``       stubbed execution: programs that compute nothing (a step's host cost)
``runtime``     compiled programs (``Program``), their cache, programs over mesh arrays,
                XLA's persistent cache on disk
``recompiles``  why a warm program compiled again (wraps each program's first run)
``device``      JAX devices behind ``tpu:N`` and the ``torch.tpu`` module, PrivateUse1 renamed
``memory``      live-buffer accounting and ``torch.tpu.memory_allocated()`` and friends
``tensor``      ``TpuTensor`` and its ``Storage`` (a jax.Array), host <-> device copies
``conversion``  ``module.to("tpu")`` and back keep each ``Parameter`` object (ties, attributes)
``fused``       the fused mode's deferred window, run as one program at a sync point
``modes``       eager / fused / debug, and the environment switches
``graphs``      captured steps (``tpurec.graph``): one step's program replayed with no Python
``mirrors``     host copies of small integer tensors' values (reads without a sync point)
``programs``    running (or recording) an eager program; reading a tensor's values
``calls``       one op call -> a cached program (the calling convention's split of the
                arguments); composites and decompositions for ops without a lowering
``view_ops``    eager views: new tensors over the same storage
``kernels``     the device kernels (copies, casts, allocations, ``resize_``, ...)
``mutating``    in-place and ``out=`` ops through their functional variant
``host``        data-dependent ops on the host; index tensors on another device
``dispatch``    one ATen op on tpu tensors -> a cached program (or a recorded node); the
                factory kernels
``entry``       where torch enters the device: the PrivateUse1 kernels of factories and
                copies, and the loaders of the op runtime
==============  ===========================================================================

Importing this package (``import tpurec``) imports the layers up to ``graphs``
(``EAGER_LAYERS``: devices, tensors, counters, modes) and ``entry``. The op runtime,
``mirrors`` to ``dispatch`` (``LAZY_LAYERS``), is imported on the first tpu op, by
``entry.load_runtime()`` (or by importing ``tpurec.core.dispatch``, or reading it as an
attribute of this package), so a process that only plans sharding, reads the device's
state or loads a checkpoint's metadata does not import it.

Where a lower module must reach a higher one, the higher one installs a hook at import
(there is no upward import, not even inside a function):

* ``entry`` -> ``tensor.install_dispatcher``: until the op runtime is loaded, the first
  ``TpuTensor.__torch_dispatch__`` (or printing, ``TpuTensor.to_jax()``) loads it;
* ``dispatch`` -> ``tensor.install_dispatcher``: then they reach the dispatcher itself;
* ``dispatch`` -> ``kernels.install_redispatch``: a kernel that runs another op (``conj``)
  reaches the dispatcher;
* ``fused`` -> ``sync.flush_pending_work_with``: ``synchronize`` (and stubbed execution) run
  the pending window;
* ``recompiles`` -> ``runtime.observe_compilations``: each new program's first run is
  timed, profiled and checked for recompilation.

Outside the core, the modules here may import only ``tpurec.dense`` (the lowering table),
and ``tpurec.amp``, which import nothing of the core.

The other packages (``tpurec.compile``, ``tpurec.sparse``, ``tpurec.distributed``, the
package root, ...) reach the core through this package only: the names in ``__all__`` below
(the facade: run a program, store its result, wrap an array as a tensor, read a tensor's
array, the counters, the modes, ...), never a layer module. The facade's names of the op
runtime (``run_program``, ``value_of``, ...) load it when first read, as the layers do.
``tests/core/test_layering.py`` checks all of this. The old paths (``tpurec.runtime``,
``tpurec.device``, ...) load older checkpoints only (see ``tpurec._old_paths``).

Importing this package imports the eager layers in order, then ``entry``; importing
``dispatch`` imports the lazy ones in order. Either way each hook is installed before the
layer below can need it.
"""

import importlib
from typing import TYPE_CHECKING, Any

from tpurec.core import errors, views, rng, profiler, accounting, sync, headroom, stubs  # noqa: I001 (layer order)
from tpurec.core import runtime, recompiles  # noqa: I001 (layer order)
from tpurec.core import device, memory, tensor, conversion, fused, modes, graphs  # noqa: I001 (layer order)
from tpurec.core import entry

# Imported with the package (import tpurec), lowest first.
EAGER_LAYERS = (
    "errors",
    "views",
    "rng",
    "profiler",
    "accounting",
    "sync",
    "headroom",
    "stubs",
    "runtime",
    "recompiles",
    "device",
    "memory",
    "tensor",
    "conversion",
    "fused",
    "modes",
    "graphs",
)
# The op runtime: imported on the first tpu op (entry.load_runtime()), lowest first.
LAZY_LAYERS = (
    "mirrors",
    "programs",
    "calls",
    "view_ops",
    "kernels",
    "mutating",
    "host",
    "dispatch",
)
LAYERS = (*EAGER_LAYERS, *LAZY_LAYERS, "entry")

# The facade: what the packages outside the core use of it (tests/core/test_layering.py
# allows them nothing else). Grouped by the layer each name comes from.
from tpurec.core.errors import LIBRARY_DIRS, ArgumentTypeError, ArgumentValueError, unsupported_op  # noqa: E402
from tpurec.core.views import contiguous_strides, read_view, write_view  # noqa: E402
from tpurec.core.rng import get_state as get_rng_state, set_state as set_rng_state  # noqa: E402
from tpurec.core.rng import key_from as rng_key_from, next_seed_and_counter  # noqa: E402
from tpurec.core.profiler import enabled as profiling_enabled, program_label  # noqa: E402
from tpurec.core.profiler import record as profiler_range  # noqa: E402
from tpurec.core.accounting import counters, listen_to_jax, register_stats_source, reset_stats, stats  # noqa: E402
from tpurec.core.sync import synchronize  # noqa: E402
from tpurec.core.headroom import drop_programs_with  # noqa: E402
from tpurec.core.stubs import execution_stubbed, run_stub, stubbed_execution  # noqa: E402
from tpurec.core.runtime import Program, enable_disk_cache, mesh_arrays_exist, mesh_arrays_in_use  # noqa: E402
from tpurec.core.recompiles import compiling, current_compile_id, explain_recompiles  # noqa: E402
from tpurec.core.device import TpuModule, host_device, jax_device, platform  # noqa: E402
from tpurec.core.device import register as register_device, register_pinning, run_backward_on_calling_thread  # noqa: E402
from tpurec.core.memory import install as install_memory_api  # noqa: E402
from tpurec.core.tensor import (  # noqa: E402
    TpuTensor,
    alloc_storage,
    array_of,
    free_storage,
    host_array,
    host_to_jax,
    install_serialization,
    is_global,
    is_plain,
    jax_to_host,
    replace_array,
    with_storage_shape,
    wrap,
)
from tpurec.core.conversion import install as install_module_conversion  # noqa: E402
from tpurec.core.fused import Pending, flush, is_pending, max_ops as max_fused_ops  # noqa: E402
from tpurec.core.fused import record as record_in_fused_window  # noqa: E402
from tpurec.core.modes import get_mode, mode, set_mode  # noqa: E402
from tpurec.core.graphs import TpuGraph, graph, on_replay, replay_check  # noqa: E402
from tpurec.core.entry import load_runtime, register_factories  # noqa: E402

# The facade's names from the op runtime, with their layer: read, they load it (see __getattr__).
LAZY_NAMES = {
    "fresh": "programs",
    "fresh_with_key": "programs",
    "pending_value": "programs",
    "run_program": "programs",
    "store_array": "programs",
    "value_of": "programs",
    "install_shadow": "dispatch",
}

# Written out (not built from the imports) so that tools read it; tests/core/test_layering.py checks it.
__all__ = [
    "EAGER_LAYERS",
    "LAYERS",
    "LAZY_LAYERS",
    "LAZY_NAMES",
    # errors
    "LIBRARY_DIRS",
    "ArgumentTypeError",
    "ArgumentValueError",
    "unsupported_op",
    # views
    "contiguous_strides",
    "read_view",
    "write_view",
    # rng
    "get_rng_state",
    "set_rng_state",
    "rng_key_from",
    "next_seed_and_counter",
    # profiler
    "profiling_enabled",
    "program_label",
    "profiler_range",
    # accounting
    "counters",
    "listen_to_jax",
    "register_stats_source",
    "reset_stats",
    "stats",
    # sync
    "synchronize",
    # headroom
    "drop_programs_with",
    # stubs
    "execution_stubbed",
    "run_stub",
    "stubbed_execution",
    # runtime
    "Program",
    "enable_disk_cache",
    "mesh_arrays_exist",
    "mesh_arrays_in_use",
    # recompiles
    "compiling",
    "current_compile_id",
    "explain_recompiles",
    # device
    "TpuModule",
    "host_device",
    "jax_device",
    "platform",
    "register_device",
    "register_pinning",
    "run_backward_on_calling_thread",
    # memory
    "install_memory_api",
    # tensor
    "TpuTensor",
    "alloc_storage",
    "array_of",
    "free_storage",
    "host_array",
    "host_to_jax",
    "install_serialization",
    "is_global",
    "is_plain",
    "jax_to_host",
    "replace_array",
    "with_storage_shape",
    "wrap",
    # conversion
    "install_module_conversion",
    # fused
    "Pending",
    "flush",
    "is_pending",
    "max_fused_ops",
    "record_in_fused_window",
    # modes
    "get_mode",
    "mode",
    "set_mode",
    # graphs
    "TpuGraph",
    "graph",
    "on_replay",
    "replay_check",
    # entry
    "load_runtime",
    "register_factories",
    # programs and dispatch (the op runtime: loaded when read)
    "install_shadow",
    "fresh",
    "fresh_with_key",
    "pending_value",
    "run_program",
    "store_array",
    "value_of",
]


if TYPE_CHECKING:  # the lazy layers and names, for type checkers (at run time __getattr__ loads them)
    from tpurec.core import calls, dispatch, host, kernels, mirrors, mutating, programs, view_ops  # noqa: F401
    from tpurec.core.dispatch import install_shadow
    from tpurec.core.programs import fresh, fresh_with_key, pending_value, run_program, store_array, value_of


def __getattr__(name: str) -> Any:
    # tpurec.core.dispatch (and the other lazy layers), or a facade name of the op runtime,
    # read as attributes: the op runtime, loaded now.
    if name in LAZY_LAYERS:
        entry.load_runtime()  # imports all of them, in order
        return importlib.import_module(f"tpurec.core.{name}")
    if name in LAZY_NAMES:
        entry.load_runtime()
        value = getattr(importlib.import_module(f"tpurec.core.{LAZY_NAMES[name]}"), name)
        globals()[name] = value  # read once: later reads skip this function
        return value
    raise AttributeError(f"module 'tpurec.core' has no attribute {name!r}")
