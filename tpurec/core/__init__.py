"""The runtime core of the ``tpu`` device, in layers: each module imports only the ones below it.

Lowest first (``LAYERS``):

==============  ===========================================================================
``errors``      the errors users see (unsupported op, failed lowering, bad arguments)
``views``       strided views over a storage array, as pure JAX functions
``rng``         the device's random state (seed and counter)
``profiler``    ``record_function`` ranges in ``torch.profiler`` traces (the hooks only;
                ``tpurec.profile`` lives above the core, in ``tpurec/profiler.py``)
``runtime``     counters (``stats``), compiled programs and their cache, the disk cache,
                ``synchronize``
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
* ``fused`` -> ``runtime.flush_pending_work_with``: ``synchronize`` runs the pending window;
* ``recompiles`` -> ``runtime.observe_compilations``: each new program's first run is
  timed, profiled and checked for recompilation.

Outside the core, the modules here may import only ``tpurec.dense`` (the lowering table),
``tpurec.amp`` and ``tpurec.composites``, which import nothing of the core.
``tests/core/test_layering.py`` checks all of this. The old paths (``tpurec.runtime``,
``tpurec.device``, ...) load older checkpoints only (see ``tpurec._old_paths``).

Importing this package imports the eager layers in order, then ``entry``; importing
``dispatch`` imports the lazy ones in order. Either way each hook is installed before the
layer below can need it.
"""

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

from tpurec.core import errors, views, rng, profiler, runtime, recompiles  # noqa: I001 (layer order)
from tpurec.core import device, memory, tensor, conversion, fused, modes, graphs  # noqa: I001 (layer order)
from tpurec.core import entry

# Imported with the package (import tpurec), lowest first.
EAGER_LAYERS = (
    "errors",
    "views",
    "rng",
    "profiler",
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

# Written out (not built from LAYERS) so that tools read it; tests/core/test_layering.py checks it.
__all__ = [
    "EAGER_LAYERS",
    "LAYERS",
    "LAZY_LAYERS",
    "errors",
    "views",
    "rng",
    "profiler",
    "runtime",
    "recompiles",
    "device",
    "memory",
    "tensor",
    "conversion",
    "fused",
    "modes",
    "graphs",
    "mirrors",
    "programs",
    "calls",
    "view_ops",
    "kernels",
    "mutating",
    "host",
    "dispatch",
    "entry",
]


if TYPE_CHECKING:  # the lazy layers, for type checkers (at run time __getattr__ loads them)
    from tpurec.core import calls, dispatch, host, kernels, mirrors, mutating, programs, view_ops  # noqa: F401


def __getattr__(name: str) -> ModuleType:
    # tpurec.core.dispatch (and the other lazy layers) read as attributes: the op runtime, loaded now.
    if name in LAZY_LAYERS:
        entry.load_runtime()  # imports all of them, in order
        return importlib.import_module(f"tpurec.core.{name}")
    raise AttributeError(f"module 'tpurec.core' has no attribute {name!r}")
