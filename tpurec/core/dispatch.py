"""Eager execution: one ATen op on tpu tensors -> one cached, compiled JAX program.

``TpuTensor.__torch_dispatch__`` lands here. The op is classified:

* view ops make a new tensor over the same storage (no computation);
* in-place and ``out=`` ops run their functional variant and write the result
  back through the destination's view, inside the same program;
* everything else looks its lowering up in the table (``tpurec.dense``), then
  a ``torch._decomp`` decomposition, and otherwise fails naming the op.

A program is keyed by op, storage shapes, view specs, dtypes and static
arguments; ``Scalar``/``float`` arguments are runtime inputs, so a changing
learning rate reuses the same compiled program.
"""

from __future__ import annotations

import contextlib

import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import torch
from torch.utils._pytree import tree_flatten, tree_map

import torch.autograd.profiler as _torch_profiler

from tpurec import amp
from tpurec.composites import COMPOSITES
from tpurec.core import fused, modes, profiler, rng, runtime
from tpurec.dense import calling, dtype_rules
from tpurec.dense.calling import argument_kinds
from tpurec.dense.registry import TABLE, Kind, Lowering, get_lowering, lower, mark, to_jax_dtype
from tpurec.core.device import jax_device
from tpurec.core.errors import ArgumentError, lowering_failed, unsupported_op
from tpurec.core.tensor import Storage, TpuTensor, host_array, host_to_jax, install_dispatcher, jax_to_host, wrap
from tpurec.core.views import contiguous_strides, read_view, reinterpretation, view_capacity, write_view

aten = torch.ops.aten
# The KERNEL part of the one lowering table (tpurec/dense/registry.py): this module's device kernels.
_KERNELS = TABLE[Kind.KERNEL]

__all__ = ["dispatch", "fresh", "pending_value", "value_of"]


# --- running programs ---------------------------------------------------------


def _placed(index: int | None) -> dict:
    """jit options placing the outputs of a program without inputs on ``tpu:index``."""
    # keep_unused: a program that ignores an input's values still runs on its device.
    if index is None:
        return {"keep_unused": True}
    return {"out_shardings": jax.sharding.SingleDeviceSharding(jax_device(index))}


def _compile(key, fn, index: int | None = None) -> runtime.Program:
    """The cached program for ``key``; ``fn`` returns a list of arrays."""
    return runtime.programs.get(key, lambda: runtime.Program(fn, **_placed(index)))


def _run(program: runtime.Program, *inputs, now: bool = False, device: int = 0) -> list:
    """Runs (eager, debug) or records (fused) ``program`` on ``tpu:device``; returns its outputs."""
    if not now and modes.get_mode() == "fused":
        return fused.record(program, inputs, device)
    if any(fused.is_pending(x) for x in inputs):
        inputs = tuple(fused.resolve(x) for x in inputs)
    outs = program(*inputs)
    if modes.get_mode() == "debug":
        for o in outs:
            if o is not None:
                o.block_until_ready()
    return outs


def _store(storage: Storage, array) -> None:
    if fused.is_pending(array):
        fused.track(storage, replaced=storage.array)
    storage.array = array


def fresh(array, index: int, dtype: torch.dtype | None = None) -> TpuTensor:
    """A tpu tensor owning ``array``; a pending one (fused mode) is filled in by the next flush."""
    t = wrap(array, index, dtype)
    if fused.is_pending(array):
        fused.track(t._storage)
    return t


# --- reading values ---------------------------------------------------------


def _read_program(key):
    shape, dtype, size, stride, offset, storage_dtype = key
    reinterpret = reinterpretation(storage_dtype, dtype)

    def read(storage):
        return [read_view(storage, size, stride, offset, reinterpret)]

    return _compile(("read", key), read)


def value_of(t: TpuTensor, reason: str = "value needed") -> jax.Array:
    """The values of ``t`` as one concrete jax.Array shaped like ``t`` (a sync point)."""
    array = t._storage.array
    if fused.is_pending(array):
        fused.flush(reason)
        array = t._storage.array
    if t.is_full:
        return array
    return _run(_read_program(t._key), array, now=True)[0]


def pending_value(t: TpuTensor):
    """``t``'s values without a sync point: in fused mode they may still be pending.

    A whole-storage tensor gives its storage's array (concrete or pending); a view
    runs (or, in fused mode, records) the same read program :func:`value_of` uses.
    """
    array = t._storage.array
    if t.is_full:
        return array
    return _run(_read_program(t._key), array, device=t._storage.index)[0]


# --- building a call ---------------------------------------------------------


class _Call:
    """One op call split into runtime inputs (``inputs``) and the device they live on."""

    __slots__ = ("inputs", "index")

    def __init__(self) -> None:
        self.inputs: list = []
        self.index: int | None = None

    def tensor(self, t) -> tuple:
        """Records tensor ``t``; returns how the program rebuilds it."""
        if isinstance(t, TpuTensor):
            if self.index is None:
                self.index = t._storage.index
            elif t._storage.index != self.index:
                raise RuntimeError(
                    "Expected all tensors to be on the same device, but found at least two devices, "
                    f"tpu:{self.index} and tpu:{t._storage.index}!"
                )
            self.inputs.append(t._storage.array)
            return ("t",) + t._key
        if isinstance(t, torch.Tensor):
            if t.dim() == 0 and t.device.type == "cpu":
                # A CPU 0-dim tensor is a scalar operand, as on CUDA; as a numpy value
                # JAX moves it to wherever the program runs.
                self.inputs.append(host_array(t))
                return ("s", t.dtype)
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found a {t.device} tensor "
                f"of shape {tuple(t.shape)} mixed with tpu tensors; move it with .to('tpu')"
            )
        raise TypeError(f"expected a tensor, got {type(t).__name__}")


_static = calling.static_value


def _rebuild_tensor(spec: tuple, it):
    """A tensor argument inside the program: its view of a storage, or a CPU scalar operand."""
    if spec[0] == "t":
        _, shape, dtype, size, stride, offset, storage_dtype = spec
        return read_view(next(it), size, stride, offset, reinterpretation(storage_dtype, dtype))
    return next(it).astype(to_jax_dtype(spec[1]))  # "s": a CPU 0-dim tensor


def _flatten_out(out) -> list:
    if isinstance(out, (tuple, list)):
        return list(out)
    return [out]


def _meta_outputs(func, args, kwargs) -> list | None:
    """(shape, dtype) of each output as PyTorch's meta kernels predict them, or None without one."""

    def to_meta(x):
        if isinstance(x, TpuTensor):
            return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device="meta")
        if isinstance(x, torch.device):
            return torch.device("meta")
        return x

    meta_kwargs = {k: to_meta(v) for k, v in kwargs.items()}
    if "device" in meta_kwargs:
        meta_kwargs["device"] = torch.device("meta")
    try:
        out = func(*tree_map(to_meta, args), **meta_kwargs)
    except Exception:
        return None
    return [(tuple(o.shape), o.dtype) if isinstance(o, torch.Tensor) else None for o in _flatten_out(out)]


def _debug_check(func, outs, metas) -> None:
    """Debug mode: each result against the meta shape/dtype, and optionally NaN/Inf."""
    for i, o in enumerate(outs):
        if o is None:
            continue
        if metas is not None and metas[i] is not None:
            shape, dtype = metas[i]
            if tuple(o.shape) != shape or o.dtype != to_jax_dtype(dtype):
                raise RuntimeError(
                    f"tpurec debug: {func} output {i} is {tuple(o.shape)} {o.dtype}, but PyTorch's meta kernel "
                    f"says {shape} {dtype}; this is a lowering bug, please report it"
                )
        if modes.check_nan() and jnp.issubdtype(o.dtype, jnp.inexact) and not bool(jnp.isfinite(o).all()):
            raise FloatingPointError(f"tpurec debug: {func} produced NaN or Inf in output {i} (TPUREC_CHECK_NAN=1)")


def execute(func, lowering: Lowering, args: tuple, kwargs: dict, targets: list | None = None, device=None):
    """Runs ``lowering`` for ``func`` as one cached program.

    Args:
        func: the functional ATen overload being run.
        lowering: its table entry.
        args, kwargs: the call, with tpu tensors.
        targets: tpu tensors to overwrite with the outputs (in-place / out=
            variants), one per output; ``None`` returns fresh tensors.
        device: device index for ops without tensor inputs.
    """
    kinds = argument_kinds(func, lowering.static_scalars)
    call = _Call()
    inputs, record = call.inputs, call.tensor
    arg_specs = tuple(calling.split(calling.kind_of(kinds, i), a, inputs, record) for i, a in enumerate(args))
    kw_specs = tuple((k, calling.split(calling.kind_of(kinds, k), v, inputs, record)) for k, v in kwargs.items())
    target_specs = ()
    if targets is not None:
        target_specs = tuple(call.tensor(t) for t in targets)
    if lowering.random:
        call.inputs.extend(rng.next_seed_and_counter())
    index = call.index if call.index is not None else (device if device is not None else torch.tpu.current_device())
    placed_on = index if call.index is None else None
    key = (func, arg_specs, kw_specs, target_specs, placed_on)

    def build():
        # Mixed dtypes PyTorch refuses (JAX would promote them); once per program, not per call.
        dtype_rules.check(func, args, kwargs, targets)
        metas = _meta_outputs(func, args, kwargs)
        dtypes = None if metas is None else [None if m is None else m[1] for m in metas]
        if targets is not None and dtypes is not None:
            dtype_rules.check_writable(dtypes, [t.dtype for t in targets])
        random = lowering.random

        def program(*inputs):
            it = iter(inputs)
            a = [calling.rebuild(s, it, _rebuild_tensor) for s in arg_specs]
            kw = {k: calling.rebuild(s, it, _rebuild_tensor) for k, s in kw_specs}
            storages = [next(it) for _ in target_specs]
            if random:
                kw["key"] = rng.key_from(next(it), next(it), next(it))
            outs = _flatten_out(lowering.fn(*a, **kw))
            if dtypes is not None:
                outs = [o if d is None or o is None else o.astype(to_jax_dtype(d)) for o, d in zip(outs, dtypes)]
            if not target_specs:
                return outs
            return [
                write_view(storage, out, spec[3], spec[4], spec[5], reinterpretation(spec[6], spec[2]))
                for storage, out, spec in zip(storages, outs, target_specs)
            ]

        entry = runtime.Program(program, **_placed(placed_on))
        entry.metas = metas
        return entry

    program = runtime.programs.get(key, build)
    try:
        outs = _run(program, *call.inputs, device=index)
    except Exception as error:
        if program.ran or program.out_avals is not None or isinstance(error, ArgumentError):
            raise
        raise lowering_failed(func, error) from error
    if targets is not None:
        for t, new in zip(targets, outs):
            _store(t._storage, new)
        return targets
    if modes.get_mode() == "debug":
        _debug_check(func, outs, program.metas)
    return [None if o is None else fresh(o, index) for o in outs]


# --- view ops ----------------------------------------------------------------


# (op, base dtype/size/stride/offset/storage dtype, static arguments) -> the outputs'
# metadata, or None when the op copies for this layout (reshape of a permuted tensor,
# to(dtype) with a new dtype, ...). The dtype is part of the key: the same view
# of an int64 and a float32 tensor of one shape are different entries.
_view_cache: dict = {}


def _meta_base(base: TpuTensor) -> torch.Tensor:
    """A meta tensor with ``base``'s dtype, size, stride and offset over a big enough storage."""
    shape, dtype, size, stride, offset, storage_dtype = base._key
    capacity = view_capacity(shape, reinterpretation(storage_dtype, dtype))
    room = max(capacity, offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1)
    return torch.empty(room, dtype=dtype, device="meta").as_strided(size, stride, offset)


def _shares_layout(storage_dtype: torch.dtype, dtype: torch.dtype) -> bool:
    """A view of ``dtype`` can read a storage of ``storage_dtype`` (the same, or a complex/real pair)."""
    try:
        reinterpretation(storage_dtype, dtype)
    except NotImplementedError:
        return False
    return True


def _view_metas(func, args, kwargs) -> list | None:
    """Size, stride, offset and dtype of each output of view op ``func``, or None when it copies here.

    Whether an op aliases is decided by the strides, as PyTorch does, not by its
    schema: ``reshape``, ``to``, ``contiguous``, ``flatten``... return views only
    when the layout allows, and below autograd (inside decompositions) they
    arrive here with their aliasing schema either way. A view may change the
    dtype between a complex dtype and its real counterpart (``view_as_real``,
    ``view_as_complex``, ``view(dtype)``): both read the same storage.
    """
    base = args[0]
    static = tuple(_static(a) for a in args[1:]), tuple((k, _static(v)) for k, v in kwargs.items())
    key = (func, base._key[1:], static)
    if key in _view_cache:
        return _view_cache[key]
    meta_base = _meta_base(base)
    storage = meta_base.untyped_storage()
    out = func(meta_base, *args[1:], **kwargs)
    outs = _flatten_out(out)
    storage_dtype = base.storage_dtype
    aliased = all(
        _shares_layout(storage_dtype, o.dtype) and o.untyped_storage()._cdata == storage._cdata for o in outs
    )
    metas = [(tuple(o.size()), tuple(o.stride()), o.storage_offset(), o.dtype) for o in outs] if aliased else None
    _view_cache[key] = metas
    return metas


def _view(func, args, kwargs):
    """A view op: new tensors over the same storage, with metadata from the meta kernel."""
    base = args[0]
    metas = _view_metas(func, args, kwargs)
    if metas is None:
        return _view_that_copies(func, args, kwargs)
    _check_in_storage(base, metas)
    # In inference mode a view of a normal tensor is a normal tensor (PyTorch then
    # shares the base's version counter with it, which an inference tensor refuses).
    with torch.inference_mode(False) if torch.is_inference_mode_enabled() and not base.is_inference() else contextlib.nullcontext():
        views = [
            TpuTensor(base._storage, size, stride, offset, dtype, storage_dtype=base.storage_dtype)
            for size, stride, offset, dtype in metas
        ]
    returns = func._schema.returns
    if len(returns) == 1 and not isinstance(returns[0].type, torch._C.ListType):
        return views[0]
    return views if isinstance(returns[0].type, torch._C.ListType) else tuple(views)


def _check_in_storage(base: TpuTensor, metas: list) -> None:
    """Views (``as_strided``) must stay inside the storage, as PyTorch checks on CPU and CUDA."""
    shape, _, _, _, _, storage_dtype = base._key
    for size, stride, offset, dtype in metas:
        storage_numel = view_capacity(shape, reinterpretation(storage_dtype, dtype))
        needed = offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1 if all(size) else 0
        if needed > storage_numel:
            raise RuntimeError(
                f"setStorage: sizes {list(size)}, strides {list(stride)}, storage offset {offset} need a storage of "
                f"{needed} elements, but this tpu tensor's storage has {storage_numel}; a tpu tensor made with "
                ".to('tpu') holds only its own elements, not the rest of a CPU view's storage"
            )


def _view_that_copies(func, args, kwargs):
    """An aliasing-schema op whose result cannot be a view of this input: computed as a copy.

    Composite ops (reshape, to, contiguous, flatten, ...) run their own
    decomposition, which clones or casts first; the rest are views whose
    result changes the dtype, which a storage of one dtype cannot hold.
    """
    if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
        out = func.decompose(*args, **kwargs)
        if out is not NotImplemented:
            return out
    raise NotImplementedError(
        f"tpurec: {func} would return a view with a different dtype ({args[0].dtype} storage); "
        "views that reinterpret the bytes are not supported on tpu. Use .to(dtype) to convert the values instead."
    )


def _set_metadata(t: TpuTensor, size, stride, offset: int, storage: Storage | None = None) -> None:
    """Makes ``t`` itself (not a new tensor) have this size, stride, offset and storage."""
    new = TpuTensor(storage or t._storage, size, stride, offset, t.dtype, storage_dtype=t.storage_dtype)
    with torch._C._DisableTorchDispatch():
        # set_data copies the TensorImpl metadata and keeps t's autograd state and identity.
        torch._C.TensorBase.data.__set__(t, new)
    t._storage = new._storage
    t._key = new._key


def _inplace_view(func, args, kwargs):
    """``squeeze_``, ``unsqueeze_``, ``t_``, ``transpose_``, ``as_strided_``...: ``self`` changes shape."""
    self = args[0]
    meta = _meta_base(self)
    to_meta = lambda x: _meta_base(x) if isinstance(x, TpuTensor) else x  # noqa: E731 (resize_as_'s template)
    func(meta, *tree_map(to_meta, args[1:]), **tree_map(to_meta, kwargs))
    _check_in_storage(self, [(tuple(meta.size()), tuple(meta.stride()), meta.storage_offset(), self.dtype)])
    _set_metadata(self, tuple(meta.size()), tuple(meta.stride()), meta.storage_offset())
    return self


# --- special ops -------------------------------------------------------------


def _new_storage(size, stride, dtype, index) -> TpuTensor:
    size = tuple(size)
    stride = tuple(stride) if stride is not None else contiguous_strides(size)
    if stride == contiguous_strides(size):
        shape = size
    else:
        shape = (1 + sum((n - 1) * s for n, s in zip(size, stride)),) if all(size) else (0,)
    jdtype = to_jax_dtype(dtype)
    program = _compile(("zeros", shape, jdtype, index), lambda: [jnp.zeros(shape, jdtype)], index)
    storage = Storage(None, index)
    _store(storage, _run(program, device=index)[0])
    return TpuTensor(storage, size, stride, 0, dtype)


def _device_index(device) -> int:
    device = torch.device(device) if device is not None else torch.device("tpu")
    if device.type != "tpu":
        raise RuntimeError(f"expected a tpu device, got {device}")
    index = device.index if device.index is not None else torch.tpu.current_device()
    jax_device(index)
    return index


@lower(aten.empty_like.default, kind=Kind.KERNEL)
def _empty_like(self, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    index = _device_index(device) if device is not None else self._storage.index
    return _new_storage(self.size(), None, dtype or self.dtype, index)


@lower(aten.new_empty.default, kind=Kind.KERNEL)
def _new_empty(self, size, *, dtype=None, layout=None, device=None, pin_memory=None):
    index = _device_index(device) if device is not None else self._storage.index
    return _new_storage(size, None, dtype or self.dtype, index)


@lower(aten.new_empty_strided.default, kind=Kind.KERNEL)
def _new_empty_strided(self, size, stride, *, dtype=None, layout=None, device=None, pin_memory=None):
    index = _device_index(device) if device is not None else self._storage.index
    return _new_storage(size, stride, dtype or self.dtype, index)


def _cast_program(key, dtype):
    shape, view_dtype, size, stride, offset, storage_dtype = key
    reinterpret = reinterpretation(storage_dtype, view_dtype)
    jdtype = to_jax_dtype(dtype)

    def cast(storage):
        return [read_view(storage, size, stride, offset, reinterpret).astype(jdtype)]

    return _compile(("cast", key, jdtype), cast)


@lower(aten._to_copy.default, kind=Kind.KERNEL)
def _to_copy(self, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None):
    dtype = dtype or self.dtype
    target = torch.device(device) if device is not None else self.device
    if target.type == "cpu":
        values = value_of(self, "transfer to cpu")
        if values.dtype != to_jax_dtype(dtype):
            shape = tuple(values.shape)
            key = (shape, self.dtype, shape, contiguous_strides(shape), 0, self.dtype)
            values = _run(_cast_program(key, dtype), values, now=True)[0]
        return jax_to_host(values)
    if target.type != "tpu":
        raise RuntimeError(f"cannot copy a tpu tensor to {target} directly; go through .cpu()")
    index = _device_index(target)
    if index != self._storage.index:
        values = jax.device_put(value_of(self, "transfer between devices"), jax_device(index))
        return _to_copy(wrap(values, index, self.dtype), dtype=dtype)
    return fresh(_run(_cast_program(self._key, dtype), self._storage.array, device=index)[0], index, dtype)


def _copy_program(dst_key, src_key):
    _, dtype, size, stride, offset, storage_dtype = dst_key
    _, src_dtype, src_size, src_stride, src_offset, src_storage_dtype = src_key
    reinterpret = reinterpretation(storage_dtype, dtype)
    src_reinterpret = reinterpretation(src_storage_dtype, src_dtype)

    def copy(storage, src):
        value = read_view(src, src_size, src_stride, src_offset, src_reinterpret)
        return [write_view(storage, value, size, stride, offset, reinterpret)]

    return _compile(("copy", dst_key, src_key), copy)


@lower(aten.copy_.default, kind=Kind.KERNEL)
def _copy_(dst, src, non_blocking=False):
    if not isinstance(dst, TpuTensor):
        # tpu -> cpu: bring the values over, then let the CPU kernel do the rest.
        host = jax_to_host(value_of(src, "transfer to cpu"))
        with torch._C._DisableTorchDispatch():
            return dst.copy_(host)
    if isinstance(src, TpuTensor) and src._storage.index == dst._storage.index:
        if dst.is_full and src.is_full and src.dtype == dst.dtype and src.shape == dst.shape:
            # Arrays are immutable, so the destination can share the source's buffer.
            _store(dst._storage, src._storage.array)
            return dst
        source, source_key = src._storage.array, src._key
    else:
        device = jax_device(dst._storage.index)
        if not isinstance(src, TpuTensor) and dst.is_full and src.dtype == dst.dtype and src.shape == dst.shape:
            # A whole host tensor into a whole tpu tensor (``.to("tpu")``): the transfer is the copy.
            _store(dst._storage, host_to_jax(src, device))
            return dst
        if isinstance(src, TpuTensor):
            source = jax.device_put(value_of(src, "transfer between devices"), device)
        else:
            source = host_to_jax(src, device)
        shape = tuple(source.shape)
        source_key = (shape, src.dtype, shape, contiguous_strides(shape), 0, src.dtype)
    program = _copy_program(dst._key, source_key)
    _store(dst._storage, _run(program, dst._storage.array, source, device=dst._storage.index)[0])
    return dst


@lower(aten._local_scalar_dense.default, torch.ops.prims.item.default, kind=Kind.KERNEL)
def _local_scalar_dense(self):
    return jax_to_host(value_of(self, "item")).item()


@lower(aten.detach.default, kind=Kind.KERNEL)
def _detach(self):
    return TpuTensor(
        self._storage, self.size(), self.stride(), self.storage_offset(), self.dtype, storage_dtype=self.storage_dtype
    )


def _grow_program(shape: tuple, length: int):
    def grow(storage):
        flat = storage.reshape(-1)
        return [jnp.concatenate([flat, jnp.zeros((length - flat.shape[0],), flat.dtype)])]

    return _compile(("grow", shape, length), grow)


@lower(aten.resize_.default, kind=Kind.KERNEL)
def _resize_(self, size, memory_format=None):
    """``resize_`` as on CPU: the new size with contiguous strides, the storage grown if needed.

    Growing gives ``self`` a new, larger storage that starts with the old
    values and continues with zeros (PyTorch leaves them uninitialised). Other
    views of the old storage keep the old storage: PyTorch reallocates in place,
    but a tpu storage's shape is part of every program that reads it.
    """
    if any(n < 0 for n in size):
        raise ValueError(f"resize_: sizes must be non-negative, got {tuple(size)}")
    if tuple(size) == tuple(self.size()) and memory_format is None:
        return self
    meta = _meta_base(self)
    meta.resize_(size, memory_format=memory_format)
    new_size, new_stride, offset = tuple(meta.size()), tuple(meta.stride()), meta.storage_offset()
    needed = offset + sum((n - 1) * s for n, s in zip(new_size, new_stride)) + 1 if all(new_size) else 0
    storage_shape, dtype, _, _, _, storage_dtype = self._key
    storage = None
    if needed > view_capacity(storage_shape, reinterpretation(storage_dtype, dtype)):
        if storage_dtype != dtype:
            raise RuntimeError(
                f"tpurec: resize_ cannot grow a {dtype} view of a {storage_dtype} storage (view_as_real/"
                "view_as_complex); resize the tensor it views, or a copy (.clone()), instead"
            )
        index = self._storage.index
        grown = _run(_grow_program(storage_shape, needed), self._storage.array, device=index)[0]
        storage = Storage(None, index)
        _store(storage, grown)
    _set_metadata(self, new_size, new_stride, offset, storage)
    return self


@lower(aten.native_batch_norm.default, kind=Kind.KERNEL)
def _native_batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """``native_batch_norm``: in eval mode with running statistics, the saved statistics are empty, as on CPU.

    The op mutates the running statistics in training mode although its schema
    does not say so, so it is no table entry: training (and eval without running
    statistics, which normalises with the batch's own) goes through its decomposition.
    """
    if not training and running_mean is not None and running_var is not None:
        return aten._native_batch_norm_legit_no_training.default(input, weight, bias, running_mean, running_var, momentum, eps)
    return _fallback(aten.native_batch_norm.default, (input, weight, bias, running_mean, running_var, training, momentum, eps), {})


@lower(aten._native_batch_norm_legit.default, kind=Kind.KERNEL)
def _native_batch_norm_legit(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """``_native_batch_norm_legit``: the functional lowering, then the running statistics written back."""
    out, mean, invstd, new_mean, new_var = aten._native_batch_norm_legit_functional.default(
        input, weight, bias, running_mean, running_var, training, momentum, eps
    )
    if training:
        running_mean.copy_(new_mean)
        running_var.copy_(new_var)
    return out, mean, invstd


@lower(aten._batch_norm_with_update.default, kind=Kind.KERNEL)
def _batch_norm_with_update(input, weight, bias, running_mean, running_var, momentum, eps):
    """``_batch_norm_with_update``: training-mode batch norm; the reserve space is empty, as on CPU."""
    out, mean, invstd = _native_batch_norm_legit(input, weight, bias, running_mean, running_var, True, momentum, eps)
    return out, mean, invstd, torch.empty((0,), dtype=torch.uint8, device=input.device)


def _adjacent_views(tensors, dim: int):
    """One view of the storage that ``tensors`` tile, in order, along ``dim``, or None.

    The pieces of a split, narrow or unbind, concatenated again in order (TorchRec's
    ``KeyedTensor.to_dict()`` then ``torch.cat``, and the backward of a ``cat``), are
    one view of their common storage: reading it is a slice, where concatenating the
    pieces is a copy that XLA does not fold.
    """
    if len(tensors) < 2 or not all(isinstance(t, TpuTensor) for t in tensors):
        return None
    first = tensors[0]
    storage, ndim = first._storage, first.dim()
    if ndim == 0:
        return None
    dim = dim % ndim
    _, dtype, size, stride, offset, storage_dtype = first._key
    if dtype != storage_dtype:  # a complex/real reinterpretation: leave it to the lowering
        return None
    step = stride[dim]
    expected = offset
    total = 0
    for t in tensors:
        _, t_dtype, t_size, t_stride, t_offset, _ = t._key
        if t._storage is not storage or t_dtype != dtype or t_stride != stride or t_offset != expected:
            return None
        if t_size[dim] == 0 or any(a != b for d, (a, b) in enumerate(zip(t_size, size)) if d != dim):
            return None
        expected += t_size[dim] * step
        total += t_size[dim]
    joined = list(size)
    joined[dim] = total
    return first.as_strided(joined, stride, offset)


@lower(aten.cat.default, kind=Kind.KERNEL)
def _cat(tensors, dim=0):
    joined = _adjacent_views(tensors, dim)
    if joined is not None:
        return aten.clone.default(joined, memory_format=torch.contiguous_format)
    return execute(aten.cat.default, get_lowering(aten.cat.default), (tensors, dim), {})[0]


@lower(aten.embedding.default, kind=Kind.KERNEL)
def _embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    """``embedding``: the lowering, but ``sparse=True`` with a gradient is refused up front.

    A sparse (COO) gradient has no tpu layout, and the failure would otherwise
    surface inside the autograd engine, where it cannot be raised cleanly.
    """
    if sparse and weight.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            "tpurec: nn.Embedding(sparse=True) / F.embedding(sparse=True) is not supported on the tpu device: "
            "sparse gradients have no tpu layout. Use sparse=False (a dense gradient; optimizers give the same "
            "result), or tpurec.sparse for large embedding tables."
        )
    return execute(aten.embedding.default, get_lowering(aten.embedding.default), (weight, indices, padding_idx, scale_grad_by_freq, sparse), {})[0]


@lower(aten.rrelu_with_noise.default, kind=Kind.KERNEL)
def _rrelu_with_noise(input, noise, lower=0.125, upper=1.0 / 3.0, training=False, generator=None):
    """``rrelu_with_noise`` writes the slopes it drew into ``noise`` (a positional argument, so it has no
    out= twin): its functional form, then the slopes copied into ``noise``."""
    out, slopes = aten.rrelu_with_noise_functional.default(input, noise, lower, upper, training, generator=generator)
    if training:
        noise.copy_(slopes)
    return out


@lower(aten._pin_memory.default, kind=Kind.KERNEL)
def _pin_tpu_tensor(self, device=None):
    raise RuntimeError(f"cannot pin a {self.device} tensor: only CPU tensors can be pinned (as for CUDA tensors)")


@lower(aten.allclose.default, kind=Kind.KERNEL)
def _allclose(self, other, rtol=1e-05, atol=1e-08, equal_nan=False) -> bool:
    return bool(torch.isclose(self, other, rtol, atol, equal_nan).all())


@lower(aten.equal.default, kind=Kind.KERNEL)
def _equal(self, other) -> bool:
    # Like the CPU kernel: False for different shapes, never a broadcast.
    return self.shape == other.shape and bool(torch.eq(self, other).all())


# --- torch.compile support (tpurec/compile) ------------------------------------


@lower(aten._assert_async.default, aten._assert_async.msg, kind=Kind.KERNEL)
def _assert_async(self, assert_msg=None) -> None:
    """Eager and debug modes check on the host, as the CPU kernel does; fused mode does not sync
    (like CUDA's asynchronous device assert; the lowering is a no-op inside programs)."""
    if modes.get_mode() == "fused":
        return None
    if self.numel() != 1:
        values = "no values" if self.numel() == 0 else "more than one value"
        raise RuntimeError(f"Boolean value of Tensor with {values} is ambiguous")
    if not bool(jax_to_host(value_of(self, "_assert_async")).item()):
        raise RuntimeError(assert_msg if assert_msg is not None else "Expected Tensor with single nonzero value, but got zero")
    return None


@lower(aten.is_pinned.default, kind=Kind.KERNEL)
def _is_pinned(self, device=None) -> bool:
    return False


lower(aten._amp_foreach_non_finite_check_and_unscale_.default, kind=Kind.KERNEL)(amp.non_finite_check_and_unscale_)


lower(aten._amp_update_scale_.default, kind=Kind.KERNEL)(amp.update_scale_)


@lower(aten.lift_fresh.default, kind=Kind.KERNEL)
def _lift_fresh(self):
    return self


@lower(aten._conj.default, kind=Kind.KERNEL)
# The conj bit is a flag on a CPU/CUDA tensor's key set that a tpu tensor does not carry:
# treated as a view, conj() returned the unconjugated values (ifft of real input was wrong).
# So conj materialises on tpu: is_conj() stays False and the values are conjugated.
def _conj(self):
    return _dispatch(aten._conj_physical.default, (self,), {})


# --- in-place and out= variants ----------------------------------------------

_FUNCTIONAL_NAMES = {"normal_": "normal_functional"}
_functional_cache: dict = {}


def _functional_variant(func):
    """The functional overload that computes what ``func`` writes, or None."""
    if func in _functional_cache:
        return _functional_cache[func]
    found = None
    name, overload = func._schema.name.split("::")[1], func._overloadname
    if name.startswith("__i") and name.endswith("__"):  # x &= y -> __and__
        packet = getattr(aten, "__" + name[3:], None)
        found = getattr(packet, overload, None) if packet is not None else None
    elif name.endswith("_"):
        packet = getattr(aten, _FUNCTIONAL_NAMES.get(name, name[:-1]), None)
        if packet is not None:
            found = getattr(packet, overload, None) or getattr(packet, "default", None)
    elif all(a.kwarg_only for a in func._schema.arguments if a.alias_info and a.alias_info.is_write):
        # An out= variant. (Ops that write a positional argument, such as
        # _native_batch_norm_legit's running statistics, have no such twin: an
        # overload with the other arguments' names would drop the writes.)
        packet = getattr(aten, name, None)
        wanted = [a.name for a in func._schema.arguments if not (a.alias_info and a.alias_info.is_write)]
        if packet is not None:
            for candidate in packet.overloads():
                op = getattr(packet, candidate)
                if op._schema.is_mutable:
                    continue
                if [a.name for a in op._schema.arguments] == wanted:
                    found = op
                    break
    _functional_cache[func] = found
    return found


def _mutated(func, args, kwargs) -> tuple[list, Any]:
    """The tensors ``func`` writes, and what it returns."""
    schema = func._schema
    first = schema.arguments[0]
    if first.alias_info is not None and first.alias_info.is_write and not first.kwarg_only:
        targets = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
        returns = None if not schema.returns else args[0]
        return list(targets), returns
    outs = [kwargs[a.name] for a in schema.arguments if a.kwarg_only and a.alias_info and a.alias_info.is_write]
    returns = outs[0] if len(outs) == 1 else tuple(outs)
    return outs, returns


def _run_mutating(func, args, kwargs):
    functional = _functional_variant(func)
    if functional is None:
        raise unsupported_op(func, "it mutates its arguments and has no functional variant")
    targets, returns = _mutated(func, args, kwargs)
    call_args, call_kwargs = args, kwargs
    write_names = {a.name for a in func._schema.arguments if a.kwarg_only and a.alias_info and a.alias_info.is_write}
    if write_names:
        call_kwargs = {k: v for k, v in kwargs.items() if k not in write_names}
    lowering = get_lowering(functional)
    if lowering is None:
        results = _fallback(functional, call_args, call_kwargs)
        for t, r in zip(targets, _flatten_out(results)):
            if isinstance(t, TpuTensor):
                if tuple(r.shape) != tuple(t.shape) and tuple(t.shape) != tuple(torch.broadcast_shapes(r.shape, t.shape)):
                    _resize_(t, r.shape)
                _copy_(t, r)
        return returns
    for t in targets:
        if not isinstance(t, TpuTensor):
            raise RuntimeError(f"{func}: expected tpu tensors to write into, got a {t.device} tensor")
    execute(functional, lowering, call_args, call_kwargs, targets=targets)
    return returns


# --- the entry point -----------------------------------------------------------


def _fallback(func, args, kwargs):
    """Ops without a lowering: a decomposition into ops that have one, or a clear error."""
    from torch._decomp import decomposition_table

    composite = COMPOSITES.get(func)
    decomposition = composite.fn if composite is not None else decomposition_table.get(func)
    if decomposition is not None:
        return decomposition(*args, **kwargs)
    if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
        out = func.decompose(*args, **kwargs)
        if out is not NotImplemented:
            return out
    if func.namespace not in ("aten", "prims") and torch._C._dispatch_has_kernel_for_dispatch_key(
        func.name(), "CompositeExplicitAutograd"
    ):
        # A library's device-independent implementation (torch.library.custom_op's default kernel,
        # e.g. torch.nn's chunked linear_cross_entropy), written in torch ops that run here one by one.
        return func._op_dk(torch._C.DispatchKey.CompositeExplicitAutograd, *args, **kwargs)
    raise unsupported_op(func)


# Ops whose output shape depends on input values: XLA needs static shapes, so
# they run on the host (a sync point in fused mode) and their result comes back.
mark(
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten._unique.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.bincount.default,
    aten.repeat_interleave.Tensor,
    kind=Kind.DATA_DEPENDENT,
)
_DATA_DEPENDENT = TABLE[Kind.DATA_DEPENDENT]


# --- index tensors on another device -------------------------------------------
# ATen's advanced indexing (make_info) moves index tensors to the indexed tensor's device,
# so CUDA takes ``t[cpu_idx]``, ``t[cpu_idx] = v`` and their backward; as there, a 0-dim
# value moves with them. Every other op keeps refusing a CPU tensor with dimensions.
_INDEXING = {
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl.default,
    aten._index_put_impl_.default,
}


def _indexing_across_devices(func, args):
    """``(args, None)`` with CPU indices of a tpu tensor moved to it, or ``(None, result)``
    for a CPU tensor indexed by tpu indices (run on CPU, as ATen moves them there)."""
    if func not in _INDEXING or len(args) < 2 or not isinstance(args[1], (list, tuple)):
        return args, None
    self, indices = args[0], args[1]
    if isinstance(self, TpuTensor):
        index = self._storage.index
        move = lambda t: wrap(host_to_jax(t, jax_device(index)), index)  # noqa: E731
        foreign = lambda t: isinstance(t, torch.Tensor) and not isinstance(t, TpuTensor) and t.device.type == "cpu"  # noqa: E731
    elif isinstance(self, torch.Tensor) and self.device.type == "cpu":
        move = lambda t: jax_to_host(value_of(t, "indexing a CPU tensor"))  # noqa: E731
        foreign = lambda t: isinstance(t, TpuTensor)  # noqa: E731
    else:
        return args, None
    if not any(foreign(i) for i in indices):
        return args, None
    rest = list(args[2:])
    if rest and foreign(rest[0]) and rest[0].dim() == 0:
        rest[0] = move(rest[0])
    args = (self, [move(i) if foreign(i) else i for i in indices], *rest)
    if isinstance(self, TpuTensor):
        return args, None
    return None, func(*args)


def _has_bool_index(func, args) -> bool:
    """Reading through a boolean mask, or writing per-element values through one."""
    if func is aten.index.Tensor:
        pass
    elif func in (aten.index_put.default, aten.index_put_.default):
        if args[2].numel() <= 1:  # a broadcast value: the lowering keeps shapes static (a where)
            return False
    else:
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (args[1] or ()))


def _on_host(func, args, kwargs):
    """Runs ``func`` on CPU copies of its tpu inputs and moves the results back."""
    with profiler.record(f"tpurec::host_fallback {func}"):  # tpurec.profiler hook
        return _on_host_run(func, args, kwargs)


def _on_host_run(func, args, kwargs):
    index = next(a._storage.index for a in tree_flatten((args, kwargs))[0] if isinstance(a, TpuTensor))
    to_host = lambda x: jax_to_host(value_of(x, "data-dependent op")) if isinstance(x, TpuTensor) else x  # noqa: E731
    host_args, host_kwargs = tree_map(to_host, (args, kwargs))
    out = func(*host_args, **host_kwargs)
    device = jax_device(index)
    back = lambda x: wrap(host_to_jax(x, device), index) if isinstance(x, torch.Tensor) else x  # noqa: E731
    if func._schema.is_mutable:
        targets, returns = _mutated(func, args, kwargs)
        for t, h in zip(targets, _mutated(func, host_args, host_kwargs)[0]):
            _copy_(t, h)
        return returns
    return tree_map(back, out)


# A backward op that ran on the host under TPUREC_HOST_FALLBACK=error: raised by
# the next op outside the autograd engine (raising inside it aborts the process).
_pending_fallback_error: str | None = None


def _raise_pending_fallback() -> None:
    global _pending_fallback_error
    message, _pending_fallback_error = _pending_fallback_error, None
    raise RuntimeError(message)


# tpurec.debug.shadow() (a layer above) checks each op against PyTorch CPU through this hook:
# ``hook(run, func, args, kwargs)`` runs the op with ``run(func, args, kwargs)``, then compares.
# None unless shadowing, so that off it costs one test per op.
_shadow = None


def install_shadow(hook) -> None:
    """Installs (or, with None, removes) tpurec.debug's per-op check."""
    global _shadow
    _shadow = hook


def dispatch(func, args: tuple, kwargs: dict):
    if _shadow is not None:
        return _shadow(_dispatch_profiled, func, args, kwargs)
    return _dispatch_profiled(func, args, kwargs)


def _dispatch_profiled(func, args: tuple, kwargs: dict):
    if _torch_profiler._is_profiler_enabled:  # tpurec.profiler hook: a dispatch range per op
        with profiler.record("tpurec::dispatch"):
            return _dispatch_checked(func, args, kwargs)
    return _dispatch_checked(func, args, kwargs)


def _dispatch_checked(func, args: tuple, kwargs: dict):
    global _pending_fallback_error
    if torch._C._current_autograd_node() is None:
        if _pending_fallback_error is not None:
            _raise_pending_fallback()
        return _dispatch(func, args, kwargs)
    # Inside the autograd engine an exception cannot travel back to the caller:
    # PyTorch's Python device guard runs (noexcept) while it unwinds and the
    # process aborts. So a failing op runs on the host instead, with a warning.
    try:
        return _dispatch(func, args, kwargs)
    except Exception as error:  # noqa: BLE001 (re-raising here would abort the interpreter)
        runtime.counters().host_fallbacks[func.__name__] += 1
        message = (
            f"tpurec: {func} failed on the tpu device during backward ({type(error).__name__}: {error}); "
            "it ran on the host instead"
        )
        if modes.host_fallback_policy() == "error":
            if _pending_fallback_error is None:
                _pending_fallback_error = message + " (TPUREC_HOST_FALLBACK=error)"
        else:
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        return _on_host(func, args, kwargs)


def _dispatch(func, args: tuple, kwargs: dict):
    runtime.counters().ops_by_name[func.__name__] += 1
    kernel = _KERNELS.get(func)
    if kernel is not None:
        return kernel.fn(*args, **kwargs)
    if func in _INDEXING:
        args, result = _indexing_across_devices(func, args)
        if args is None:
            return result
    if func in _DATA_DEPENDENT or _has_bool_index(func, args):
        runtime.counters().host_ops[func.__name__] += 1
        return _on_host(func, args, kwargs)
    if torch.is_inference_mode_enabled() or func.overloadpacket is aten.to:
        # The autograd kernels normally decompose CompositeImplicitAutograd ops
        # (aten.to.dtype_layout, aten.linear, ...). Where the autograd keys are off they
        # arrive whole: inference_mode drops them for every op, and ``to`` (possibly to
        # another device) also comes whole from the backward thread or a
        # TorchDispatchMode's own calls. Decompose them as autograd would have, rather
        # than run ``to`` as a view.
        out = func.decompose(*args, **kwargs)
        if out is not NotImplemented:
            return out
    if func.is_view:
        return _view(func, args, kwargs)
    if torch.Tag.inplace_view in func.tags:
        return _inplace_view(func, args, kwargs)
    if func._schema.is_mutable:
        return _run_mutating(func, args, kwargs)
    lowering = get_lowering(func)
    if lowering is None:
        return _fallback(func, args, kwargs)
    outs = execute(func, lowering, args, kwargs)
    returns = func._schema.returns
    if len(returns) == 1 and not isinstance(returns[0].type, torch._C.ListType):
        return outs[0]
    if len(returns) == 1:
        return outs
    return tuple(outs)


# TpuTensor lives a layer below this module: it reaches the dispatcher through this hook.
install_dispatcher(dispatch, value_of)


# --- factories: ops without tensor inputs reach the PrivateUse1 kernel ---------


def _factory(func):
    def kernel(*args, **kwargs):
        if _shadow is not None:
            return _shadow(lambda func, args, kwargs: compute(*args, **kwargs), func, args, kwargs)
        return compute(*args, **kwargs)

    def compute(*args, **kwargs):
        device = kwargs.get("device")
        index = _device_index(device)
        if func in (aten.empty.memory_format,):
            return _new_storage(args[0], None, kwargs.get("dtype") or torch.get_default_dtype(), index)
        if func in (aten.empty_strided.default,):
            return _new_storage(args[0], args[1], kwargs.get("dtype") or torch.get_default_dtype(), index)
        lowering = get_lowering(func)
        if lowering is None:
            return _fallback(func, args, kwargs)
        outs = execute(func, lowering, args, kwargs, device=index)
        return outs[0]

    return kernel


mark(
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.full.default,
    aten.zeros.default,
    aten.ones.default,
    aten.arange.default,
    aten.arange.start,
    aten.arange.start_step,
    aten.scalar_tensor.default,
    aten.rand.default,
    aten.randn.default,
    aten.randint.default,
    aten.randint.low,
    aten.randperm.default,
    aten.linspace.default,
    aten.logspace.default,
    aten.eye.default,
    aten.eye.m,
    kind=Kind.FACTORY,
)

_library = None


def _pin_cpu_memory(self: torch.Tensor, device=None) -> torch.Tensor:
    """``pin_memory()`` of a CPU tensor for the tpu device: a contiguous copy (``is_pinned()`` stays False)."""
    target = torch.device(device) if device is not None else torch.device("tpu")
    if target.type != "tpu":
        raise RuntimeError(
            f"tpurec: pin_memory(device={str(target)!r}) is not available in a process using the tpu device; "
            "pin for 'tpu' (or leave device unset)"
        )
    with torch._C._DisableTorchDispatch():
        return self.clone(memory_format=torch.contiguous_format)


def register_factories() -> None:
    """Registers PrivateUse1 kernels for ATen factories (``torch.zeros(..., device="tpu")``)."""
    global _library
    if _library is not None:
        return
    _library = torch.library.Library("aten", "IMPL")
    for func in TABLE[Kind.FACTORY]:
        name = func._schema.name.split("::")[1]
        overload = func._schema.overload_name
        _library.impl(f"{name}.{overload}" if overload else name, _factory(func), "PrivateUse1")
    # Autograd formulas' "known zero" gradients (sgn's, ...): a plain zeros tensor on tpu. (Not a
    # table entry: on CPU the op makes a storage-less ZeroTensor, which a lowering cannot match.)
    _library.impl("_efficientzerotensor", _factory(aten.zeros.default), "PrivateUse1")
    # pin_memory() on a CPU tensor asks PrivateUse1 (the accelerator) for a pinned
    # allocator, which a Python backend cannot provide. JAX stages host memory for
    # transfers itself, so "pinning" for tpu is a contiguous private copy.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": on purpose
        _library.impl("_pin_memory", _pin_cpu_memory, "CPU")
    # Reached with Python dispatch excluded, e.g. by torch.tensor(data, device="tpu").
    _library.impl("_copy_from", lambda src, dst, non_blocking=False: _copy_(dst, src), "PrivateUse1")
    _library.impl("_copy_from_and_resize", lambda src, dst: _copy_(dst, src), "PrivateUse1")
