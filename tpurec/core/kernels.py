"""The device kernels: ops eager execution runs itself on tpu tensors.

Each is a ``KERNEL`` entry of the one lowering table (``tpurec.dense.registry``):
allocations, copies and casts between devices, ``resize_``, batch norm's
running statistics, ``cat`` of adjacent views, ``item()``... They run before any
``JAX`` lowering of the same op (which compiled graphs use instead).

``_conj`` runs another op as the dispatcher runs any op, a layer above: it reaches
the dispatcher through the hook :func:`install_redispatch` (installed by ``dispatch``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from tpurec import amp
from tpurec.core import modes
from tpurec.core.calls import _fallback, execute
from tpurec.core.device import jax_device
from tpurec.core.mirrors import from_host, mirror_of
from tpurec.core.programs import _compile, run_program, store_array, fresh, value_of
from tpurec.core.tensor import Storage, TpuTensor, host_to_jax, is_plain, jax_to_host, with_key, wrap
from tpurec.core.view_ops import _meta_base, _set_metadata
from tpurec.core.views import (
    contiguous_strides,
    read_view,
    reinterpretation,
    view_capacity,
    write_view,
)
from tpurec.dense.registry import LOWERINGS, Kind, lower, to_jax_dtype

aten = torch.ops.aten

__all__ = ["install_redispatch"]


def _not_installed(func, args: tuple, kwargs: dict):
    raise RuntimeError("tpurec: the dispatcher is not installed (import tpurec.core, not one of its layers alone)")


# The dispatcher's op runner, ``run(func, args, kwargs)``: installed by tpurec.core.dispatch.
_redispatch = _not_installed


def install_redispatch(run) -> None:
    """Installs the dispatcher's op runner (``dispatch`` does, at import)."""
    global _redispatch
    _redispatch = run


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
    store_array(storage, run_program(program, device=index)[0])
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
        known = mirror_of(self)
        if known is not None:
            return known.to(dtype=dtype, copy=True).contiguous()
        values = value_of(self, "transfer to cpu")
        if values.dtype != to_jax_dtype(dtype):
            shape = tuple(values.shape)
            key = (shape, self.dtype, shape, contiguous_strides(shape), 0, self.dtype)
            values = run_program(_cast_program(key, dtype), values, now=True)[0]
        return jax_to_host(values)
    if target.type != "tpu":
        raise RuntimeError(f"cannot copy a tpu tensor to {target} directly; go through .cpu()")
    index = _device_index(target)
    if index != self._storage.index:
        values = jax.device_put(value_of(self, "transfer between devices"), jax_device(index))
        return _to_copy(wrap(values, index, self.dtype), dtype=dtype)
    return fresh(run_program(_cast_program(self._key, dtype), self._storage.array, device=index)[0], index, dtype)


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
        host = mirror_of(src)
        if host is None:
            host = jax_to_host(value_of(src, "transfer to cpu"))
        with torch._C._DisableTorchDispatch():
            return dst.copy_(host)
    if isinstance(src, TpuTensor) and src._storage.index == dst._storage.index:
        if dst.is_full and src.is_full and src.dtype == dst.dtype and src.shape == dst.shape:
            # Arrays are immutable, so the destination can share the source's buffer.
            store_array(dst._storage, src._storage.array)
            return dst
        source, source_key = src._storage.array, src._key
    else:
        device = jax_device(dst._storage.index)
        if not isinstance(src, TpuTensor) and dst.is_full and src.dtype == dst.dtype and src.shape == dst.shape:
            # A whole host tensor into a whole tpu tensor (``.to("tpu")``): the transfer is the copy.
            store_array(dst._storage, host_to_jax(src, device))
            from_host(dst, src)
            return dst
        if isinstance(src, TpuTensor):
            source = jax.device_put(value_of(src, "transfer between devices"), device)
        else:
            source = host_to_jax(src, device)
        shape = tuple(source.shape)
        source_key = (shape, src.dtype, shape, contiguous_strides(shape), 0, src.dtype)
    program = _copy_program(dst._key, source_key)
    store_array(dst._storage, run_program(program, dst._storage.array, source, device=dst._storage.index)[0])
    return dst


@lower(aten._local_scalar_dense.default, torch.ops.prims.item.default, kind=Kind.KERNEL)
def _local_scalar_dense(self):
    known = mirror_of(self)
    if known is not None:
        return known.item()  # no sync point (tpurec.core.mirrors)
    return jax_to_host(value_of(self, "item")).item()


@lower(aten.detach.default, kind=Kind.KERNEL)
def _detach(self):
    # The same metadata: the key itself is reused (autograd detaches every saved tensor and new gradient).
    key = self._key
    return with_key(self._storage, key, is_plain(key))


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
    # (a meta tensor's sizes are plain ints here: tpu tensors have no symbolic shapes)
    new_size, new_stride = tuple(int(n) for n in meta.size()), tuple(int(s) for s in meta.stride())
    offset = int(meta.storage_offset())
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
        grown = run_program(_grow_program(storage_shape, needed), self._storage.array, device=index)[0]
        storage = Storage(None, index)
        store_array(storage, grown)
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
        return aten._native_batch_norm_legit_no_training.default(
            input, weight, bias, running_mean, running_var, momentum, eps
        )
    return _fallback(
        aten.native_batch_norm.default, (input, weight, bias, running_mean, running_var, training, momentum, eps), {}
    )


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
    return execute(aten.cat.default, LOWERINGS[aten.cat.default], (tensors, dim), {})[0]


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
    return execute(
        aten.embedding.default,
        LOWERINGS[aten.embedding.default],
        (weight, indices, padding_idx, scale_grad_by_freq, sparse),
        {},
    )[0]


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
        return
    if self.numel() != 1:
        values = "no values" if self.numel() == 0 else "more than one value"
        raise RuntimeError(f"Boolean value of Tensor with {values} is ambiguous")
    if not bool(jax_to_host(value_of(self, "_assert_async")).item()):
        raise RuntimeError(
            assert_msg if assert_msg is not None else "Expected Tensor with single nonzero value, but got zero"
        )
    return


@lower(aten.is_pinned.default, kind=Kind.KERNEL)
def _is_pinned(self, device=None) -> bool:
    return False


lower(aten._amp_foreach_non_finite_check_and_unscale_.default, kind=Kind.KERNEL)(amp.non_finite_check_and_unscale_)


lower(aten._amp_update_scale_.default, kind=Kind.KERNEL)(amp.update_scale_)


@lower(aten.lift_fresh.default, kind=Kind.KERNEL)
def _lift_fresh(self):
    return self


# The conj bit is a flag on a CPU/CUDA tensor's key set that a tpu tensor does not carry:
# treated as a view, conj() returned the unconjugated values (ifft of real input was wrong).
# So conj materialises on tpu: is_conj() stays False and the values are conjugated.
@lower(aten._conj.default, kind=Kind.KERNEL)
def _conj(self):
    return _redispatch(aten._conj_physical.default, (self,), {})
