"""Device memory statistics for ``torch.tpu``, with CUDA's meanings.

``torch.tpu.memory_allocated()``, ``max_memory_allocated()``,
``memory_reserved()``, ``max_memory_reserved()``, ``memory_stats()``,
``reset_peak_memory_stats()``, ``mem_get_info()``, ``get_device_name()`` and
``get_device_properties()`` behave as their ``torch.cuda`` namesakes.

Where the numbers come from:

* **the platform's allocator** (XLA on TPU and GPU reports ``bytes_in_use``,
  ``peak_bytes_in_use``, ``bytes_limit``, ... through ``jax.Device.memory_stats()``):
  ``memory_allocated`` is ``bytes_in_use``, so it also counts buffers tpurec
  does not own (jax arrays of the user, program temporaries while one runs).
  XLA cannot reset its peak: after ``reset_peak_memory_stats()`` the peak is
  exact once XLA's peak rises above its value at the reset, and otherwise an
  estimate from tpurec's own accounting;
* **tpurec's own live-buffer accounting** otherwise (XLA:CPU reports nothing):
  the bytes of the distinct device buffers held by tpu tensors. A buffer
  shared by several tensors (views, ``copy_`` of a whole tensor) counts once;
  in fused mode a tensor's buffer exists from the sync point that computes it.

Example::

    x = torch.empty(1024, 1024, device="tpu")
    torch.tpu.memory_allocated()      # >= 4 MiB
    del x
    torch.tpu.max_memory_allocated()  # still >= 4 MiB
    torch.tpu.reset_peak_memory_stats()
"""

from __future__ import annotations

import collections
import dataclasses
import os
from typing import Any

import torch

from tpurec.core.device import jax_device

__all__ = [
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "memory_stats",
    "reset_peak_memory_stats",
    "reset_max_memory_allocated",
    "mem_get_info",
    "get_device_name",
    "get_device_properties",
    "TpuDeviceProperties",
    "install",
]


class _Accounting:
    """tpurec's live-buffer bytes and counts for one device."""

    __slots__ = (
        "current",
        "peak",
        "count",
        "allocations",
        "frees",
        "allocated_total",
        "freed_total",
        "platform_peak_at_reset",
        "platform_in_use_at_reset",
        "own_at_reset",
    )

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0
        self.count = 0
        self.allocations = 0
        self.frees = 0
        self.allocated_total = 0
        self.freed_total = 0
        # Set by reset_peak_memory_stats where the platform keeps its own (unresettable) peak.
        self.platform_peak_at_reset: int | None = None
        self.platform_in_use_at_reset = 0
        self.own_at_reset = 0


_devices: dict[int, _Accounting] = collections.defaultdict(_Accounting)
# id(array) -> (device index, bytes) of each buffer counted, so a free needs no lookup on the array.
_live: dict[int, tuple[int, int]] = {}


def allocated(
    array: Any, index: int, nbytes: int | None = None, _live: dict = _live, _devices: dict = _devices
) -> None:
    """Counts ``array`` as held by tpu tensors on ``tpu:index`` (its first holder appeared).

    ``nbytes``: the array's size in bytes, where the caller knows it (a fused program's outputs).
    """
    if nbytes is None:
        nbytes = array.size * array.dtype.itemsize
    _live[id(array)] = (index, nbytes)
    account = _devices[index]
    account.current += nbytes
    account.count += 1
    account.allocations += 1
    account.allocated_total += nbytes
    if account.current > account.peak:
        account.peak = account.current


def freed(array: Any, _live: dict = _live, _devices: dict = _devices) -> None:
    """Stops counting ``array`` (its last tpu holder let it go)."""
    entry = _live.pop(id(array), None)
    if entry is None:
        return
    index, nbytes = entry
    account = _devices[index]
    account.current -= nbytes
    account.count -= 1
    account.frees += 1
    account.freed_total += nbytes


# --- the torch.tpu API ----------------------------------------------------------------


def _index(device: Any) -> int:
    """The tpu device index of ``device`` (None: the current device), as torch.cuda accepts it."""
    if device is None:
        return torch.tpu.current_device()
    if isinstance(device, int) and not isinstance(device, bool):
        index = device
    elif isinstance(device, (str, torch.device)):
        parsed = torch.device(device)
        if parsed.type != "tpu":
            raise ValueError(f"Expected a tpu device, but got: {device!r}")
        index = parsed.index if parsed.index is not None else torch.tpu.current_device()
    else:
        raise TypeError(f"device must be an int, a string or a torch.device, got {type(device).__name__}")
    jax_device(index)  # raises RuntimeError("Invalid device ordinal ...") like CUDA
    return index


def _platform_stats(index: int) -> dict[str, int] | None:
    """XLA's allocator statistics for ``tpu:index``, or None where the platform reports none (XLA:CPU)."""
    try:
        stats = jax_device(index).memory_stats()
    except Exception:  # noqa: BLE001 (some PJRT plugins raise instead of returning None)
        return None
    return stats if stats and "bytes_in_use" in stats else None


def memory_allocated(device: Any = None) -> int:
    """Bytes of device memory occupied by tensors (see the module docstring for the source)."""
    index = _index(device)
    stats = _platform_stats(index)
    return int(stats["bytes_in_use"]) if stats is not None else _devices[index].current


def max_memory_allocated(device: Any = None) -> int:
    """The peak of :func:`memory_allocated` since the start or the last :func:`reset_peak_memory_stats`."""
    index = _index(device)
    account = _devices[index]
    stats = _platform_stats(index)
    if stats is None:
        return account.peak
    in_use = int(stats["bytes_in_use"])
    peak = int(stats.get("peak_bytes_in_use", in_use))
    if account.platform_peak_at_reset is None or peak > account.platform_peak_at_reset:
        return max(peak, in_use)
    # XLA's peak predates the reset: estimate the new one from tpurec's own accounting.
    estimate = account.platform_in_use_at_reset + (account.peak - account.own_at_reset)
    return max(in_use, account.platform_in_use_at_reset, estimate)


def memory_reserved(device: Any = None) -> int:
    """Bytes the allocator holds from the device (XLA's pool), at least :func:`memory_allocated`."""
    index = _index(device)
    stats = _platform_stats(index)
    if stats is None:
        # XLA:CPU allocates each buffer from the host allocator: nothing is held beyond what is in use.
        return _devices[index].current
    for key in ("bytes_reserved", "pool_bytes"):
        if key in stats:
            return max(int(stats[key]), int(stats["bytes_in_use"]))
    return int(stats["bytes_in_use"])


def max_memory_reserved(device: Any = None) -> int:
    """The peak of :func:`memory_reserved`."""
    index = _index(device)
    stats = _platform_stats(index)
    if stats is None:
        return _devices[index].peak
    for key in ("peak_bytes_reserved", "peak_pool_bytes"):
        if key in stats:
            return max(int(stats[key]), memory_reserved(index))
    return max_memory_allocated(index)


def reset_peak_memory_stats(device: Any = None) -> None:
    """Starts the peaks (:func:`max_memory_allocated`, :func:`max_memory_reserved`) over from the current values."""
    index = _index(device)
    account = _devices[index]
    account.peak = account.current
    stats = _platform_stats(index)
    if stats is not None:
        account.platform_peak_at_reset = int(stats.get("peak_bytes_in_use", stats["bytes_in_use"]))
        account.platform_in_use_at_reset = int(stats["bytes_in_use"])
        account.own_at_reset = account.current


def reset_max_memory_allocated(device: Any = None) -> None:
    """Like :func:`reset_peak_memory_stats` (the older CUDA name)."""
    reset_peak_memory_stats(device)


def memory_stats(device: Any = None) -> dict[str, int]:
    """Allocator statistics with ``torch.cuda.memory_stats`` key names.

    ``allocated_bytes.all.{current,peak,allocated,freed}``,
    ``reserved_bytes.all.{current,peak}``, ``active_bytes.all.{current,peak}``,
    ``allocation.all.{current,allocated,freed}`` (buffers held by tpu tensors,
    from tpurec's accounting); where XLA reports its own statistics they are
    added unchanged as ``xla.<name>`` (e.g. ``xla.bytes_limit``).
    """
    index = _index(device)
    account = _devices[index]
    result = {
        "allocated_bytes.all.current": memory_allocated(index),
        "allocated_bytes.all.peak": max_memory_allocated(index),
        "allocated_bytes.all.allocated": account.allocated_total,
        "allocated_bytes.all.freed": account.freed_total,
        "active_bytes.all.current": memory_allocated(index),
        "active_bytes.all.peak": max_memory_allocated(index),
        "reserved_bytes.all.current": memory_reserved(index),
        "reserved_bytes.all.peak": max_memory_reserved(index),
        "allocation.all.current": account.count,
        "allocation.all.allocated": account.allocations,
        "allocation.all.freed": account.frees,
    }
    stats = _platform_stats(index)
    if stats is not None:
        result.update({f"xla.{k}": int(v) for k, v in stats.items() if isinstance(v, (int, float))})
    return dict(sorted(result.items()))


def _host_memory() -> tuple[int, int]:
    """(available, total) bytes of host memory: what XLA:CPU allocates from."""
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes of the device's memory; on XLA:CPU, of the host's."""
    index = _index(device)
    stats = _platform_stats(index)
    if stats is not None and "bytes_limit" in stats:
        total = int(stats["bytes_limit"])
        return max(total - int(stats["bytes_in_use"]), 0), total
    return _host_memory()


@dataclasses.dataclass(frozen=True)
class TpuDeviceProperties:
    """What ``torch.tpu.get_device_properties`` returns (like ``torch.cuda``'s properties).

    Attributes:
        name: the device kind XLA reports (``"TPU v5p"``, ``"NVIDIA H100 80GB HBM3"``, ``"cpu"``).
        platform: the XLA platform: ``"tpu"``, ``"gpu"`` or ``"cpu"``.
        total_memory: bytes of device memory (XLA's ``bytes_limit``; host memory on XLA:CPU).
        index: the ``tpu:N`` index.
        id: the JAX device id.
        process_index: the process that owns the device.
        coords: the chip's coordinates in the TPU slice (TPU only).
        core_on_chip: the TensorCore index on its chip (TPU only).
    """

    name: str
    platform: str
    total_memory: int
    index: int
    id: int
    process_index: int
    coords: tuple[int, ...] | None = None
    core_on_chip: int | None = None


def get_device_properties(device: Any = None) -> TpuDeviceProperties:
    """The properties of a tpu device."""
    index = _index(device)
    d = jax_device(index)
    coords = getattr(d, "coords", None)
    return TpuDeviceProperties(
        name=d.device_kind,
        platform=d.platform,
        total_memory=mem_get_info(index)[1],
        index=index,
        id=d.id,
        process_index=d.process_index,
        coords=tuple(coords) if coords is not None else None,
        core_on_chip=getattr(d, "core_on_chip", None),
    )


def get_device_name(device: Any = None) -> str:
    """The device kind XLA reports for a tpu device."""
    return get_device_properties(device).name


def install(module: Any) -> None:
    """Adds the memory API to the ``torch.tpu`` device module."""
    for name in __all__:
        if name in ("TpuDeviceProperties", "install"):
            continue
        setattr(module, name, staticmethod(globals()[name]))
