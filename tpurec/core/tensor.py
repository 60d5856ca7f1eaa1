"""Tensors on the "tpu" device: PyTorch metadata over a storage holding a jax.Array."""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch._prims_common import make_contiguous_strides_for

from tpurec.core import device as _device
from tpurec.core import memory as _memory
from tpurec.core import profiler as _profiler
from tpurec.core import runtime as _runtime
from tpurec.core.views import contiguous_strides, is_full
from tpurec.dense.registry import to_jax_dtype, to_torch_dtype

__all__ = [
    "Storage",
    "TpuTensor",
    "wrap",
    "with_key",
    "is_plain",
    "array_of",
    "replace_array",
    "with_storage_shape",
    "is_global",
    "free_storage",
    "alloc_storage",
    "host_array",
    "host_to_jax",
    "jax_to_host",
    "install_dispatcher",
]


# The op dispatcher (tpurec.core.dispatch) sits a layer above this module and imports it;
# it installs itself here at import, so tpu tensors reach it without an upward import.
_dispatch: Callable[[Any, tuple, dict], Any] | None = None
_value_of: Callable[..., jax.Array] | None = None


def install_dispatcher(dispatch: Callable[[Any, tuple, dict], Any], value_of: Callable[..., jax.Array]) -> None:
    """Connects tpu tensors to the op dispatcher.

    Args:
        dispatch: runs one ATen op on tpu tensors (``TpuTensor.__torch_dispatch__``).
        value_of: a tensor's values as one concrete jax.Array (printing, ``TpuTensor.to_jax()``).
    """
    global _dispatch, _value_of
    _dispatch, _value_of = dispatch, value_of


# How many storages hold each concrete jax.Array (by id): the fused mode donates
# an input buffer only when no storage holds it any more.
_holders: dict[int, int] = {}


try:  # JAX's concrete array type: ``type(x) is`` it is cheaper than ``isinstance(x, jax.Array)``
    from jax._src.array import ArrayImpl as _ArrayImpl
except ImportError:  # another JAX layout: every check takes the isinstance path
    _ArrayImpl = jax.Array


# Types of values a storage may hold that are no jax.Array (the fused mode's pending values):
# registered by their module, so that the checks below skip them without an isinstance.
NOT_ARRAYS: set[type] = {type(None)}


def _release(array, _array_type=jax.Array, _concrete=_ArrayImpl, _freed=_memory.freed, _skip=NOT_ARRAYS) -> None:
    # The default arguments keep the types and the hook alive for __del__ at interpreter exit.
    kind = type(array)
    if kind in _skip:
        return
    if (kind is _concrete or isinstance(array, _array_type)) and _holders is not None:
        left = _holders.get(id(array), 0) - 1
        if left > 0:
            _holders[id(array)] = left
        else:
            _holders.pop(id(array), None)
            _freed(array)  # tpurec.memory hook: live-buffer accounting


def _hold(array, index: int) -> None:
    """Counts one more storage holding ``array`` (a concrete array; pending values are not counted)."""
    kind = type(array)
    if kind is _ArrayImpl or (kind not in NOT_ARRAYS and isinstance(array, jax.Array)):
        held = _holders.get(id(array), 0)
        _holders[id(array)] = held + 1
        if not held:
            _memory.allocated(array, index)  # tpurec.memory hook: live-buffer accounting


def fill(storage: "Storage", array, nbytes: int | None) -> None:
    """``storage.array = array`` for a storage whose pending value a flush computed.

    The pending value was never counted, and ``array`` is a concrete array of ``nbytes``
    bytes (None: not known): so only the new holder is counted (a fused program fills
    dozens of storages).
    """
    held = _holders.get(id(array), 0)
    _holders[id(array)] = held + 1
    if not held:
        _memory.allocated(array, storage.index, nbytes)  # tpurec.memory hook: live-buffer accounting
    storage._array = array


def holders(array) -> int:
    """How many tpu storages hold ``array``."""
    return _holders.get(id(array), 0)


class Storage:
    """The memory behind one or more tpu tensors (a base and its views).

    ``array`` is replaced, never mutated, when a tensor sharing this storage is
    written in place; every view sees the new value.
    """

    __slots__ = ("_array", "index", "__weakref__")

    def __init__(self, array: jax.Array, index: int) -> None:
        self.index = index  # before the array: memory accounting reads it
        _hold(array, index)
        self._array = array

    @property
    def array(self):
        return self._array

    @array.setter
    def array(self, new) -> None:
        _release(self._array)
        _hold(new, self.index)
        self._array = new

    def __del__(self, _release=_release) -> None:
        # The default argument: at interpreter exit this module's globals may be cleared first.
        _release(self._array)

    @property
    def device(self) -> torch.device:
        device = _DEVICES.get(self.index)
        if device is None:
            device = _DEVICES[self.index] = torch.device("tpu", self.index)
        return device


# TpuTensor._key -> TpuTensor.is_full of it: asked for most tensors an op reads, and the
# same few keys come back every step.
_FULL_KEYS: dict[tuple, bool] = {}
# TpuTensor._key -> is_plain(key): asked for every output of a cached op and every detach.
_PLAIN_KEYS: dict[tuple, bool] = {}


def _remember(table: dict[tuple, bool], key: tuple, value: bool) -> bool:
    """Stores ``value`` of tensor key ``key`` in a per-key table (``_FULL_KEYS``, ``_PLAIN_KEYS``); returns it."""
    if len(table) >= 1 << 16:  # a bound for programs of ever new shapes
        table.clear()
    table[key] = value
    return value


# tpu:N as torch.device objects, made once: every new tensor needs its device.
_DEVICES: dict[int, torch.device] = {}


class TpuTensor(torch.Tensor):
    """A tensor on the ``tpu`` device.

    Users never build one directly: ``torch.zeros(3, device="tpu")``,
    ``t.to("tpu")`` and the results of ops on tpu tensors are TpuTensors.
    """

    _storage: Storage
    # (storage shape, dtype, size, stride, offset, storage dtype): how programs see this tensor.
    # The storage dtype differs from the dtype only for views between a complex dtype and its
    # real counterpart (view_as_real, view_as_complex); see tpurec.core.views.reinterpretation.
    _key: tuple
    # The Python attributes that hold the tensor's contents (see tpurec.core.conversion).
    CONTENT_ATTRIBUTES = ("_storage", "_key")
    # (host values, storage, its array, key) when the values are known on the host (tpurec.core.mirrors).
    _mirror: tuple | None = None

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(
        cls,
        storage: Storage,
        size,
        stride,
        offset: int,
        dtype: torch.dtype,
        requires_grad: bool = False,
        storage_dtype: torch.dtype | None = None,
    ):
        t = torch.Tensor._make_wrapper_subclass(
            cls,
            size,
            strides=stride,
            storage_offset=offset,
            dtype=dtype,
            device=storage.device,
            requires_grad=requires_grad,
        )
        t._storage = storage
        t._key = (storage.array.shape, dtype, tuple(size), tuple(stride), offset, storage_dtype or dtype)
        return t

    def __init__(self, *args, **kwargs) -> None:
        pass

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})

    def __coerce_same_metadata_as_tangent__(self, expected_metadata, expected_type=None):
        # AOTAutograd traced a plain tensor where a tpu tensor arrives: for the compiler they are the same.
        if expected_type is not None and expected_type is not torch.Tensor:
            return None
        return self

    @property
    def data(self):
        return self.detach()

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        # C++ copies the TensorImpl metadata; the jax storage lives on the Python object.
        torch._C.TensorBase.data.__set__(self, new)
        self._storage = new._storage
        self._key = new._key

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype of the storage this tensor views (its own dtype but for complex/real views)."""
        return self._key[5]

    @property
    def is_full(self) -> bool:
        """This tensor is its whole storage, in the storage's layout."""
        key = self._key
        full = _FULL_KEYS.get(key)
        if full is None:
            shape, dtype, size, stride, offset, storage_dtype = key
            full = _remember(_FULL_KEYS, key, dtype == storage_dtype and is_full(shape, size, stride, offset))
        return full

    def __repr__(self, *, tensor_contents=None) -> str:
        host = jax_to_host(_value_of(self, "print"))
        text = repr(host)
        suffix = f"device='{self.device}'"
        extras = []
        if self.requires_grad and self.grad_fn is not None:
            extras.append(f"grad_fn=<{type(self.grad_fn).__name__}>")
        elif self.requires_grad:
            extras.append("requires_grad=True")
        body = text[: text.rfind(")")] if text.endswith(")") else text
        return body + ", " + ", ".join([suffix] + extras) + ")"

    def __reduce_ex__(self, protocol):
        # torch.save / pickle: the values as a CPU tensor plus the device, rebuilt by
        # PyTorch's own (weights_only-safe) function, as for other storage-less
        # backends. So torch.load honours map_location, and with
        # map_location="cpu" a tpu checkpoint loads in a process without tpurec.
        # A Parameter loads as a Parameter (as on CUDA: torch.export's serialized
        # programs and pickled modules need it), rebuilt by PyTorch's own function.
        if getattr(self, "_is_param", False):
            return (torch._utils._rebuild_parameter, (self.detach(), self.requires_grad, collections.OrderedDict()))
        return (
            torch._utils._rebuild_device_tensor_from_cpu_tensor,
            (self.detach().cpu(), self.dtype, str(self.device), self.requires_grad),
        )

    def numpy(self, *, force: bool = False):
        raise TypeError(
            f"can't convert {self.device} device type tensor to numpy. "
            "Use Tensor.cpu() to copy the tensor to host memory first."
        )

    def tolist(self):
        return self.cpu().tolist()

    def to_jax(self) -> jax.Array:
        """The tensor's values as a jax.Array on its device (no copy when possible; a sync point).

        Not named ``jax()``: libraries probe tensors for torchax's ``jax()`` method to detect
        JAX tracing (transformers does on every forward), and answering that probe would run
        the pending fused window at each call.
        """
        return _value_of(self)


def _rebuild_tpu_tensor(values: torch.Tensor, device: str, requires_grad: bool) -> torch.Tensor:
    """Loads checkpoints written before tpu tensors used PyTorch's rebuild function."""
    return values.to(torch._utils._get_restore_location(device)).requires_grad_(requires_grad)


_torch_restore_location = torch._utils._get_restore_location


def _restore_location(device: str):
    """``torch._utils._get_restore_location``, also for a callable ``map_location``.

    PyTorch refuses callables for tensors rebuilt from CPU values; here the
    callable is asked as for a storage (``map_location(storage, "tpu:0")``) with
    an empty CPU storage: the device of what it returns is where the tensor goes,
    and ``None`` keeps the saved device, as torch.load does for storages.
    """
    map_location = torch.serialization._serialization_tls.map_location
    if map_location is None or isinstance(map_location, (dict, str, torch.device)):
        return _torch_restore_location(device)
    moved = map_location(torch.UntypedStorage(0), device)
    return device if moved is None else str(moved.device)


def _never_tag(storage) -> None:
    return None  # saving: tpu tensors are written as CPU values (see TpuTensor.__reduce_ex__)


def _keep_on_host(storage, location: str):
    """Loading with ``map_location="tpu..."``: the CPU values behind a tpu tensor stay on the host.

    A tpu tensor holds no PyTorch storage; ``_rebuild_device_tensor_from_cpu_tensor``
    moves the rebuilt tensor to its device. Storages of tensors saved on CPU also
    stay on CPU (PyTorch would move them; a storage cannot live on tpu).
    """
    return storage if location.startswith("tpu") else None


_serialization_installed = False


def install_serialization() -> None:
    """torch.save/torch.load of tpu tensors (once): the three changes to ``torch.serialization``.

    ``_rebuild_tpu_tensor`` is allowed under ``weights_only=True`` (under its own name
    and the one older checkpoints recorded, the module's path before tpurec.core);
    ``torch._utils._get_restore_location`` becomes :func:`_restore_location`; and a
    location handler keeps the CPU values behind tpu tensors on the host, at priority 11:
    right after CPU's (10), before PyTorch's PrivateUse1 handler (23), which would fail.
    """
    global _serialization_installed
    if _serialization_installed:
        return
    _serialization_installed = True
    torch.serialization.add_safe_globals(
        [_rebuild_tpu_tensor, (_rebuild_tpu_tensor, "tpurec.tensor._rebuild_tpu_tensor")]
    )
    import torch._utils as torch_utils

    torch_utils._get_restore_location = _restore_location
    torch.serialization.register_package(11, _never_tag, _keep_on_host)


def is_plain(key: tuple) -> bool:
    """``key`` (``TpuTensor._key``) describes a tensor laid out contiguously from offset 0.

    Such a tensor is made without passing strides and offset to PyTorch (which then lays it
    out the same way, a little faster): see :func:`with_key`.
    """
    plain = _PLAIN_KEYS.get(key)
    if plain is None:
        _, _, size, stride, offset, _ = key
        plain = _remember(_PLAIN_KEYS, key, offset == 0 and tuple(stride) == tuple(make_contiguous_strides_for(size)))
    return plain


_make_wrapper = torch.Tensor._make_wrapper_subclass


def with_key(storage: Storage, key: tuple, plain: bool = False) -> TpuTensor:
    """A tpu tensor over ``storage`` whose metadata tuple ``key`` (``TpuTensor._key``) is known.

    For results of cached calls (``tpurec.core.calls``): the same tensor as ``TpuTensor(...)``
    makes, without working the metadata out again. ``key[0]`` must be the storage's shape;
    ``plain``: ``is_plain(key)``, known to the caller.
    """
    _, dtype, size, stride, offset, _ = key
    if plain:
        t = _make_wrapper(TpuTensor, size, dtype=dtype, device=storage.device)
    else:
        t = _make_wrapper(TpuTensor, size, strides=stride, storage_offset=offset, dtype=dtype, device=storage.device)
    t._storage = storage
    t._key = key
    return t


def wrap(array: jax.Array, index: int, dtype: torch.dtype | None = None) -> TpuTensor:
    """A fresh contiguous tpu tensor owning ``array``."""
    shape = tuple(array.shape)
    if dtype is None:
        dtype = to_torch_dtype(array.dtype)
    return TpuTensor(Storage(array, index), shape, contiguous_strides(shape), 0, dtype)


def _require_tpu(t: Any, what: str) -> TpuTensor:
    if not isinstance(t, TpuTensor):
        where = f" on {t.device}" if isinstance(t, torch.Tensor) else ""
        raise TypeError(f"{what} needs a tensor on the tpu device, got a {type(t).__name__}{where}")
    return t


def array_of(t: torch.Tensor) -> Any:
    """The array behind tpu tensor ``t``: its whole storage, as it is now.

    No copy and no sync. For a view this is the storage the view looks into, not
    the view's values. In the fused mode it may be a pending value of the
    deferred window (``tpurec.core.fused.is_pending``); ``t.to_jax()`` gives the
    tensor's own values as a concrete ``jax.Array``.

    Raises:
        TypeError: ``t`` is not a tpu tensor.
    """
    return _require_tpu(t, "array_of")._storage.array


def replace_array(t: torch.Tensor, array: jax.Array) -> None:
    """Makes tpu tensor ``t`` (and every view of its storage) hold ``array``, in place.

    For results of programs that update a tensor outside the dispatcher (a fused
    optimizer, a restore, a move onto a mesh): the tensor keeps its identity
    (a ``Parameter`` stays the same object) and its metadata, so ``array`` must
    have the storage's shape and dtype; its sharding may differ.

    Raises:
        TypeError: ``t`` is not a tpu tensor, or ``array`` is not a jax.Array.
        ValueError: ``array``'s shape or dtype differs from the storage's (nothing changes).
    """
    t = _require_tpu(t, "replace_array")
    if not isinstance(array, jax.Array):
        raise TypeError(f"replace_array needs a jax.Array, got {type(array).__name__}")
    old = t._storage.array
    shape, dtype = tuple(old.shape), np.dtype(old.dtype)
    if tuple(array.shape) != shape and tuple(array.shape) == tuple(t.shape) and _covers_storage(t):
        # The tensor's own values for a storage kept in another shape (with_storage_shape): same bytes.
        array = jnp.reshape(array, shape)
    if tuple(array.shape) != shape or np.dtype(array.dtype) != dtype:
        raise ValueError(
            f"replace_array: the new array is {array.dtype}{list(array.shape)} but the tensor's storage is "
            f"{dtype}{list(shape)}; an in-place replacement keeps the shape and dtype (make a new "
            "tensor with wrap() to change them)"
        )
    t._storage.array = array


def _covers_storage(t: TpuTensor) -> bool:
    """``t`` is its whole storage, contiguous from offset 0 (its shape may differ from the storage's)."""
    return (
        t.storage_offset() == 0
        and t.is_contiguous()
        and t.numel() == int(np.prod(t._storage.array.shape))
        and t.dtype == t.storage_dtype
    )


def with_storage_shape(t: torch.Tensor, shape: tuple[int, ...]) -> TpuTensor:
    """A new tpu tensor with ``t``'s values and metadata whose storage array has ``shape``.

    A storage is an array of its own shape that tensors view (:func:`tpurec.core.views.read_view`):
    a contiguous ``[rows, 64]`` tensor may keep its bytes as ``[rows / 2, 128]``, the layout a
    TPU's 128-lane vector memory reads without padding, and a program that reshapes it back
    (a kernel that streams 128-lane lines) moves no data. Other ops read the tensor's values as
    usual.

    Args:
        t: a contiguous tpu tensor covering its whole storage.
        shape: the new storage shape, with ``t.numel()`` elements.

    Raises:
        ValueError: ``t`` is a view into a larger storage, not contiguous, or ``shape`` holds
            another number of elements.

    Example::

        w = torch.randn(1000, 64).to("tpu")
        w.data = with_storage_shape(w, (500, 128))   # same values, lane-dense storage
    """
    t = _require_tpu(t, "with_storage_shape")
    if not _covers_storage(t):
        raise ValueError(
            "with_storage_shape: the tensor must be contiguous and cover its whole storage from offset 0 "
            f"(got shape {list(t.shape)}, strides {list(t.stride())}, offset {t.storage_offset()}); "
            "use it on a freshly made tensor, not a view"
        )
    shape = tuple(int(d) for d in shape)
    if int(np.prod(shape)) != t.numel():
        raise ValueError(
            f"with_storage_shape: shape {list(shape)} holds {int(np.prod(shape))} elements, the tensor {t.numel()}"
        )
    array = t.to_jax().reshape(shape)
    return TpuTensor(Storage(array, t._storage.index), tuple(t.shape), tuple(t.stride()), 0, t.dtype)


def is_global(t: Any) -> bool:
    """``t`` is a tpu tensor whose array spans several devices of a mesh (a sharded or replicated global array)."""
    return isinstance(t, TpuTensor) and _runtime.is_global(t._storage.array)


# Freed storage -> the (shape, dtype) of the array it held, to give it memory of that size back.
_freed: weakref.WeakKeyDictionary[Storage, tuple[tuple[int, ...], np.dtype]] = weakref.WeakKeyDictionary()


def free_storage(t: torch.Tensor) -> None:
    """Releases the device memory behind tpu tensor ``t``'s storage, for ``t`` and all its views.

    What ``t.untyped_storage().resize_(0)`` does on CUDA (FSDP2 frees unsharded parameters so);
    a tpu tensor's storage is a jax.Array that torch cannot resize. Until :func:`alloc_storage`
    the storage holds no elements, so reading a view of it fails. Freeing freed storage does nothing.

    Raises:
        TypeError: ``t`` is not a tpu tensor.
    """
    storage = _require_tpu(t, "free_storage")._storage
    if storage in _freed:
        return
    old: Any = storage.array  # a jax.Array or a pending value of the fused window; both have shape and dtype
    shape, dtype = tuple(old.shape), np.dtype(old.dtype)
    storage.array = jax.device_put(np.zeros((0,), dtype), _device.jax_device(storage.index))
    _freed[storage] = (shape, dtype)


def alloc_storage(t: torch.Tensor) -> None:
    """Gives storage freed by :func:`free_storage` device memory of its old size back (zeros).

    As ``untyped_storage().resize_(n)`` on CUDA, the contents are not the old ones: the caller
    writes them (FSDP2's all-gather does). Storage that was not freed is left as it is.

    Raises:
        TypeError: ``t`` is not a tpu tensor.
    """
    storage = _require_tpu(t, "alloc_storage")._storage
    freed = _freed.pop(storage, None)
    if freed is None:
        return
    shape, dtype = freed
    storage.array = jax.device_put(np.zeros(shape, dtype), _device.jax_device(storage.index))


class _Transfers(threading.local):
    """Host -> device copies of values made so far by this thread (a captured step may make none:
    tpurec.core.graphs; a pipeline's worker thread copies the next batch meanwhile). An empty
    tensor has no values to copy (``torch.tensor([], device="tpu")``) and is not counted."""

    count = 0


transfers = _Transfers()


def host_to_jax(t: torch.Tensor, device: jax.Device) -> jax.Array:
    """Copies a CPU tensor to ``device`` (exact for every supported dtype)."""
    if t.numel():
        transfers.count += 1
    return jax.device_put(host_array(t), device)


def host_array(t: torch.Tensor) -> np.ndarray:
    """A private numpy copy of CPU tensor ``t`` with the matching dtype.

    Private, because XLA:CPU may alias host memory and the caller may write to
    ``t`` before a deferred (fused) program reads it.
    """
    t = t.detach().resolve_conj().resolve_neg()
    to_jax_dtype(t.dtype)  # raises for unsupported dtypes
    t = t.clone(memory_format=torch.contiguous_format)
    return t.view(torch.int16).numpy().view(jnp.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()


def jax_to_host(array: jax.Array) -> torch.Tensor:
    """Copies a jax.Array into a new CPU tensor."""
    if isinstance(array, jax.Array) and not array.is_fully_addressable:
        # A global array spanning several processes: a replicated one (a loss)
        # has every value here; a sharded one does not.
        if not array.is_fully_replicated:
            raise RuntimeError(
                "this tensor is sharded over devices of several processes; only replicated values can be read "
                "on one process (gather it first, e.g. with jax.experimental.multihost_utils.process_allgather)"
            )
        array = array.addressable_data(0)
    with _profiler.record("tpurec::sync (to host)"):  # tpurec.profiler hook: waits for the device
        raw = np.asarray(array)
    if raw.dtype == jnp.bfloat16:
        return torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(raw.copy())
