"""The "tpu" PyTorch device: PrivateUse1 renamed, backed by JAX devices.

``tpu:N`` is the N-th device of JAX's default backend: a TPU where there is
one, otherwise XLA:GPU or XLA:CPU (this is how tpurec is built and tested on
machines without TPUs).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator

import jax
import torch

from tpurec.core import rng, sync

__all__ = ["platform", "jax_device", "TpuModule", "register", "register_pinning"]


def platform() -> str:
    """The XLA platform backing the ``tpu`` device: ``"tpu"``, ``"gpu"`` or ``"cpu"``."""
    return jax.default_backend()


def _devices() -> list:
    # This process's devices: with several processes, tpu:0 is each one's first.
    return jax.local_devices()


def host_device():
    """JAX's CPU device (a ``jax.Device``), for work on CPU tensors; the default device where JAX runs
    without its CPU backend (``JAX_PLATFORMS=tpu``, as a TPU machine may set), so that such work
    still runs."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:  # "Unknown backend: 'cpu' requested, but no platforms ... are present"
        return jax.devices()[0]


def jax_device(index: int | None) -> jax.Device:
    """The JAX device behind ``tpu:index`` (the current device for ``None``)."""
    devices = _devices()
    if index is None:
        index = _state.current
    if not 0 <= index < len(devices):
        raise RuntimeError(
            f"Invalid device ordinal tpu:{index}: this process has {len(devices)} tpu device(s) "
            f"(platform {platform()}); use an index in [0, {len(devices)})"
        )
    return devices[index]


class _State(threading.local):
    current = 0


_state = _State()


def _index(device: torch.device | str | int | None) -> int:
    """The tpu index of ``device`` (the current device for None or a bare ``"tpu"``)."""
    if device is None:
        return _state.current
    if isinstance(device, int):
        return device
    index = torch.device(device).index
    return _state.current if index is None else index


class Event:
    """``torch.tpu.Event``: a point in a device's work (for device-agnostic code such as FSDP2).

    tpurec runs each device's work in the order it was issued (JAX tracks what every pending value
    depends on), so work issued after an event already follows it: waiting on an event is satisfied
    by that order. :meth:`synchronize` waits for all the device work issued so far.
    """

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self._recorded = False

    def record(self, stream: Stream | None = None) -> None:
        """Marks the work issued so far."""
        self._recorded = True

    def wait(self, stream: Stream | None = None) -> None:
        """Later work follows this event (already true in issue order)."""

    def query(self) -> bool:
        """Whether the marked work is done; JAX offers no cheap test, so this waits for it, then says True."""
        if self._recorded:
            sync.synchronize()
        return True

    def synchronize(self) -> None:
        """Waits until the device work issued before the event is computed."""
        sync.synchronize()


class Stream:
    """``torch.tpu.Stream``: a name for the device's one ordered queue of work.

    PyTorch code written for CUDA streams (FSDP2's all-gather and reduce-scatter streams) creates
    streams and orders them with events. On tpu every stream is the device's single issue-ordered
    queue, so ``wait_stream`` / ``wait_event`` hold already and cost nothing.

    Args:
        device: the tpu device (default the current one).
        priority: accepted for ``torch.cuda.Stream`` compatibility; the queue has one priority.
    """

    def __init__(self, device: torch.device | str | int | None = None, priority: int = 0, **kwargs: object) -> None:
        self.device = torch.device("tpu", _index(device))
        self.priority = priority

    def wait_stream(self, stream: Stream) -> None:
        """Later work on this stream follows ``stream``'s work (already true in issue order)."""

    def wait_event(self, event: Event | None) -> None:
        """Later work on this stream follows ``event`` (already true in issue order)."""

    def record_event(self, event: Event | None = None) -> Event:
        """An event marking the work issued so far."""
        event = Event() if event is None else event
        event.record(self)
        return event

    def query(self) -> bool:
        """Whether the stream's work is done; this waits for it, then says True (as :meth:`Event.query`)."""
        sync.synchronize()
        return True

    def synchronize(self) -> None:
        """Waits until the device work issued so far is computed."""
        sync.synchronize()


class _Streams(threading.local):
    current: Stream | None = None


_streams = _Streams()


class TpuModule:
    """``torch.tpu``: the device module, shaped like ``torch.cuda``."""

    Stream = Stream
    Event = Event

    @staticmethod
    def current_stream(device: torch.device | str | int | None = None) -> Stream:
        """The stream work is issued on (see :class:`Stream`: every stream is the one device queue)."""
        if _streams.current is None:
            _streams.current = Stream(device)
        return _streams.current

    @staticmethod
    def default_stream(device: torch.device | str | int | None = None) -> Stream:
        return TpuModule.current_stream(device)

    @staticmethod
    @contextlib.contextmanager
    def stream(stream: Stream | None) -> Iterator[None]:
        """Makes ``stream`` the current stream inside the block (as ``torch.cuda.stream``)."""
        previous = _streams.current
        if stream is not None:
            _streams.current = stream
        try:
            yield
        finally:
            _streams.current = previous

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def device_count() -> int:
        return len(_devices())

    @staticmethod
    def current_device() -> int:
        return _state.current

    @staticmethod
    def set_device(device) -> None:
        index = (
            torch.device(device, 0).index
            if isinstance(device, str) and ":" not in device
            else (torch.device(device).index if not isinstance(device, int) else device)
        )
        jax_device(index)  # validates
        _state.current = index

    @staticmethod
    def synchronize(device=None) -> None:
        sync.synchronize()

    @staticmethod
    def manual_seed(seed: int) -> None:
        rng.manual_seed(seed)

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        rng.manual_seed(seed)

    @staticmethod
    def get_rng_state(device=None) -> torch.Tensor:
        return rng.get_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device=None) -> None:
        rng.set_state(state)

    @staticmethod
    def platform() -> str:
        return platform()

    @staticmethod
    def get_amp_supported_dtype() -> list[torch.dtype]:
        """Lower-precision dtypes ``torch.autocast("tpu", dtype=...)`` accepts, as on CUDA."""
        return [torch.bfloat16, torch.float16]

    @staticmethod
    def is_bf16_supported(including_emulation: bool = True) -> bool:
        return True


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, dev_id) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class _Guard(torch._C._acc.DeviceGuard):
    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1


class _CallingThreadEngine:
    """PyTorch's autograd engine, running each backward pass on the thread that asked for it.

    The engine gives every non-CPU device index a worker queue, sized once, at the first
    backward pass of the process, from the device guards registered then. The guard of a
    Python backend reports one device, so a backward reaching ``tpu:1`` or higher fails an
    internal assert; and a backward run before ``import tpurec`` leaves no queue at all
    (``tpu:0`` fails too). With the engine's multithreading off, every node runs on the
    caller's queue, which the engine already does for CPU graphs: a tpu node gains nothing
    from a worker thread, since tpurec's dispatch holds the GIL.
    """

    def __init__(self, engine) -> None:
        self._engine = engine

    def run_backward(self, *args, **kwargs):
        with torch.autograd.set_multithreading_enabled(False):
            return self._engine.run_backward(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


def run_backward_on_calling_thread() -> None:
    """Makes autograd run each backward pass on the thread that asked for it (see ``_CallingThreadEngine``)."""
    from torch.autograd.variable import Variable

    if not isinstance(Variable._execution_engine, _CallingThreadEngine):
        Variable._execution_engine = _CallingThreadEngine(Variable._execution_engine)


_registered = False


def register() -> None:
    """Renames PrivateUse1 to ``tpu`` and installs hooks, guard and ``torch.tpu``."""
    global _registered
    if _registered:
        return
    if torch._C._get_privateuse1_backend_name() == "tpu":
        _registered = True
        return
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    from tpurec.native import torch_hooks

    # The C++ hooks first (PyTorch takes PrivateUse1 hooks once, and then refuses the Python
    # ones): they add pinned host memory, which DDP's reducer needs. Where they cannot be
    # built the Python hooks serve.
    torch_hooks.register()
    torch_hooks.set_synchronize(sync.synchronize)  # torch.accelerator.synchronize() on tpu
    _setup_privateuseone_for_python_backend("tpu", backend_module=TpuModule, hook=_Hooks(), device_guard=_Guard())
    _registered = True


# --- pin_memory() for the tpu device ----------------------------------------------

_pinning = None
_TORCH_PIN_KERNEL = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)


def _pin_cpu_memory(self: torch.Tensor, device=None) -> torch.Tensor:
    """``aten::_pin_memory`` of a CPU tensor: PyTorch's own kernel, or a contiguous copy without tpurec's C++ hooks.

    Pinning with no device pins for the current accelerator, which in a process with
    tpurec is tpu (PyTorch prefers a registered PrivateUse1 backend): that is what
    ``DataLoader(pin_memory=True)`` does. PyTorch then asks PrivateUse1 for a pinned host
    allocator. tpurec's C++ hooks (:mod:`tpurec.native.torch_hooks`) provide one, and then
    PyTorch's own kernel pins (``is_pinned()`` is true, as for ``empty(pin_memory=True)``).
    Where those hooks could not be built a Python backend has no such allocator, and pinning
    for tpu is a contiguous private copy (``is_pinned()`` stays False; JAX stages host memory
    for its transfers itself). Any other target (``device="cuda"``, ``"cpu"``) goes to
    PyTorch's own kernel, which pins or raises exactly as without tpurec.
    """
    from tpurec.native import torch_hooks

    target = torch.device(device) if device is not None else torch.accelerator.current_accelerator()
    if torch_hooks.registered() or target is None or target.type != torch._C._get_privateuse1_backend_name():
        return torch.ops.aten._pin_memory.default.redispatch(_TORCH_PIN_KERNEL, self, device)
    with torch._C._DisableTorchDispatch():
        return self.clone(memory_format=torch.contiguous_format)


def register_pinning() -> None:
    """Registers :func:`_pin_cpu_memory` as the CPU kernel of ``aten::_pin_memory`` (once)."""
    global _pinning
    if _pinning is not None:
        return
    _pinning = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": on purpose
        _pinning.impl("_pin_memory", _pin_cpu_memory, "CPU")
