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
``programs``    running (or recording) an eager program; reading a tensor's values
``calls``       one op call -> a cached program (the calling convention's split of the
                arguments); composites and decompositions for ops without a lowering
``view_ops``    eager views: new tensors over the same storage
``kernels``     the device kernels (copies, casts, allocations, ``resize_``, ...)
``mutating``    in-place and ``out=`` ops through their functional variant
``host``        data-dependent ops on the host; index tensors on another device
``dispatch``    one ATen op on tpu tensors -> a cached program (or a recorded node); the
                PrivateUse1 factory kernels
==============  ===========================================================================

Where a lower module must reach a higher one, the higher one installs a hook at import
(there is no upward import, not even inside a function):

* ``dispatch`` -> ``tensor.install_dispatcher``: ``TpuTensor.__torch_dispatch__``, printing
  and ``TpuTensor.to_jax()`` reach the dispatcher;
* ``dispatch`` -> ``kernels.install_redispatch``: a kernel that runs another op (``conj``)
  reaches the dispatcher;
* ``fused`` -> ``runtime.flush_pending_work_with``: ``synchronize`` runs the pending window;
* ``recompiles`` -> ``runtime.observe_compilations``: each new program's first run is
  timed, profiled and checked for recompilation.

Outside the core, the modules here may import only ``tpurec.dense`` (the lowering table),
``tpurec.amp`` and ``tpurec.composites``, which import nothing of the core.
``tests/core/test_layering.py`` checks all of this. The old paths (``tpurec.runtime``,
``tpurec.device``, ...) load older checkpoints only (see ``tpurec._old_paths``).

Importing this package imports every layer in order, so the hooks are always installed.
"""

from tpurec.core import errors, views, rng, profiler, runtime, recompiles  # noqa: I001 (layer order)
from tpurec.core import device, memory, tensor, conversion, fused, modes  # noqa: I001 (layer order)
from tpurec.core import programs, calls, view_ops, kernels, mutating, host, dispatch

LAYERS = (
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
    "programs",
    "calls",
    "view_ops",
    "kernels",
    "mutating",
    "host",
    "dispatch",
)

__all__ = ["LAYERS", *LAYERS]
