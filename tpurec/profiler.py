"""tpurec's events in ``torch.profiler`` traces, and XLA's device trace.

Inside ``torch.profiler.profile()`` the runtime marks its work with
``record_function`` ranges, so ``prof.key_averages().table()`` and the Chrome
trace (``prof.export_chrome_trace``) show them next to the ``aten::`` ops:

=================================  ==================================================
range                              what it covers
=================================  ==================================================
``tpurec::dispatch``               tpurec's handling of one ATen op on tpu tensors
``tpurec::compile <program>``      the first run of a new program: tracing, XLA
                                   compilation (or a load from the disk cache) and
                                   the launch; the range's length is its seconds
``tpurec::execute <program>``      launching a cached program (XLA runs it
                                   asynchronously: device time is in the XLA trace)
``tpurec::sync (<reason>)``        a sync point: a fused window run because of
                                   ``.item()``, ``.cpu()``, printing, ...; or a wait
                                   for device values (``to host``, ``synchronize``)
``tpurec::host_fallback <op>``     an op run on the host (data-dependent shapes)
=================================  ==================================================

``<program>`` is ``op``, ``fused window`` or ``<forward|backward|inference> graph``.

:func:`profile` records both at once: the ``torch.profiler`` trace (written as
``torch_trace.json``) and XLA's own device trace through ``jax.profiler``
(``plugins/profile/...``, viewable in Perfetto or TensorBoard's profile plugin).

Example::

    with tpurec.profile("/tmp/trace") as prof:
        train_step()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=20))
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import jax
import torch

# The ranges are recorded by the runtime core (tpurec/core/profiler.py); profile() sits
# above the core because it synchronizes the device.
from tpurec.core import profiler_range as record
from tpurec.core import profiling_enabled as enabled
from tpurec.core import program_label, synchronize

__all__ = ["enabled", "record", "profile", "program_label"]


@contextlib.contextmanager
def profile(logdir: str, *, device_trace: bool = True, **profiler_options: Any) -> Iterator[torch.profiler.profile]:
    """Profiles the block with ``torch.profiler`` and, by default, XLA's device tracer.

    Args:
        logdir: folder for the traces: ``torch_trace.json`` (Chrome trace format)
            and, with ``device_trace``, ``jax.profiler``'s ``plugins/profile/<run>/``.
        device_trace: also record XLA's trace through ``jax.profiler``.
        **profiler_options: passed to ``torch.profiler.profile`` (e.g. ``record_shapes=True``).

    Yields:
        The ``torch.profiler.profile`` object (for ``key_averages()`` and the like).

    Raises:
        ValueError: ``logdir`` exists and is not a folder.
    """
    if os.path.exists(logdir) and not os.path.isdir(logdir):
        raise ValueError(f"tpurec.profile: {logdir!r} exists and is not a folder; pass a folder for the traces")
    os.makedirs(logdir, exist_ok=True)
    options: dict[str, Any] = {"activities": [torch.profiler.ProfilerActivity.CPU]}
    options.update(profiler_options)
    prof = torch.profiler.profile(**options)
    if device_trace:
        jax.profiler.start_trace(logdir)
    try:
        with prof:
            yield prof
            # Waits inside the profiled region, so the device work of the block is in both traces.
            synchronize()
    finally:
        if device_trace:
            jax.profiler.stop_trace()
    prof.export_chrome_trace(os.path.join(logdir, "torch_trace.json"))
