"""View ops of eager execution: new tensors over the same storage, no computation.

Whether an op aliases is decided by PyTorch's meta kernels on the tensor's
layout; an op that must copy for this layout runs as a copy instead.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_map

from tpurec.core.calls import _flatten_out
from tpurec.core.tensor import Storage, TpuTensor, with_key
from tpurec.core.views import reinterpretation, view_capacity
from tpurec.dense.calling import static_value

__all__: list[str] = []


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
    static = tuple(static_value(a) for a in args[1:]), tuple((k, static_value(v)) for k, v in kwargs.items())
    key = (func, base._key[1:], static)
    if key in _view_cache:
        return _view_cache[key]
    meta_base = _meta_base(base)
    storage = meta_base.untyped_storage()
    out = func(meta_base, *args[1:], **kwargs)
    outs = _flatten_out(out)
    storage_dtype = base.storage_dtype
    aliased = all(_shares_layout(storage_dtype, o.dtype) and o.untyped_storage()._cdata == storage._cdata for o in outs)
    metas = [(tuple(o.size()), tuple(o.stride()), o.storage_offset(), o.dtype) for o in outs] if aliased else None
    _view_cache[key] = metas
    return metas


# (id(op), base key, the other arguments) -> (the outputs' keys, how they are returned):
# views already checked, so that a repeated view only makes its tensors. Only calls
# without keyword arguments whose arguments are hashable as they come (ints, None; not
# lists) are kept; the rest take the full path each time.
_fast_views: dict = {}
_ONE, _LIST, _TUPLE = 0, 1, 2


def _view(func, args, kwargs):
    """A view op: new tensors over the same storage, with metadata from the meta kernel."""
    base = args[0]
    if kwargs or torch.is_inference_mode_enabled():
        return _view_full(func, args, kwargs)
    key = (id(func), base._key, args[1:])
    try:
        known = _fast_views.get(key)
    except TypeError:  # an unhashable argument: a list of sizes (as a tuple), or a symbolic one
        try:
            key = (id(func), base._key, tuple((list, *a) if type(a) is list else a for a in args[1:]))
            known = _fast_views.get(key)
        except TypeError:
            return _view_full(func, args, kwargs)
    if known is None:
        out = _view_full(func, args, kwargs)
        _remember_view(key, func, base, out)
        return out
    keys, returned = known
    storage = base._storage
    if returned == _ONE:
        return with_key(storage, keys[0])
    views = [with_key(storage, k) for k in keys]
    return views if returned == _LIST else tuple(views)


def _remember_view(key: tuple, func, base: TpuTensor, out) -> None:
    """Keeps the outputs' keys of a view just made (when they are views of ``base``'s storage)."""
    if key != key:  # a NaN argument: never equal to itself, a cache entry would never be found again
        return
    outs = _flatten_out(out)
    if not all(isinstance(o, TpuTensor) and o._storage is base._storage and not o.requires_grad for o in outs):
        return  # copied (_view_that_copies), or something a repeat would not rebuild the same way
    returns = func._schema.returns
    if len(returns) == 1 and not isinstance(returns[0].type, torch._C.ListType):
        returned = _ONE
    else:
        returned = _LIST if isinstance(returns[0].type, torch._C.ListType) else _TUPLE
    if len(_fast_views) < 100_000:  # views of many shapes (a model over varying lengths): bounded
        _fast_views[key] = (tuple(o._key for o in outs), returned)


def _view_full(func, args, kwargs):
    """:func:`_view` from the op's meta kernel (cached per op, layout and static arguments)."""
    base = args[0]
    metas = _view_metas(func, args, kwargs)
    if metas is None:
        return _view_that_copies(func, args, kwargs)
    _check_in_storage(base, metas)
    # In inference mode a view of a normal tensor is a normal tensor (PyTorch then
    # shares the base's version counter with it, which an inference tensor refuses).
    with (
        torch.inference_mode(False)
        if torch.is_inference_mode_enabled() and not base.is_inference()
        else contextlib.nullcontext()
    ):
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


def _set_metadata(
    t: TpuTensor, size, stride, offset: int, storage: Storage | None = None, storage_dtype: torch.dtype | None = None
) -> None:
    """Makes ``t`` itself (not a new tensor) have this size, stride, offset and storage."""
    new = TpuTensor(
        storage or t._storage, size, stride, offset, t.dtype, storage_dtype=storage_dtype or t.storage_dtype
    )
    with torch._C._DisableTorchDispatch():
        # set_data copies the TensorImpl metadata and keeps t's autograd state and identity.
        torch._C.TensorBase.data.__set__(t, new)
    t._storage = new._storage
    t._key = new._key


def _inplace_view(func, args, kwargs):
    """``squeeze_``, ``unsqueeze_``, ``t_``, ``transpose_``, ``as_strided_``...: ``self`` changes shape."""
    self = args[0]
    if func in _SET_FROM_TENSOR:
        return _set_from_tensor(func, self, args[1], args[2:], kwargs)
    meta = _meta_base(self)
    to_meta = lambda x: _meta_base(x) if isinstance(x, TpuTensor) else x  # noqa: E731 (resize_as_'s template)
    func(meta, *tree_map(to_meta, args[1:]), **tree_map(to_meta, kwargs))
    _check_in_storage(self, [(tuple(meta.size()), tuple(meta.stride()), meta.storage_offset(), self.dtype)])
    _set_metadata(self, tuple(meta.size()), tuple(meta.stride()), meta.storage_offset())
    return self


_SET_FROM_TENSOR = (torch.ops.aten.set_.source_Tensor, torch.ops.aten.set_.source_Tensor_storage_offset)


def _set_from_tensor(func, self: TpuTensor, source, rest: tuple, kwargs: dict) -> TpuTensor:
    """``self.set_(source, ...)``: ``self`` becomes a view of ``source``'s storage."""
    if not isinstance(source, TpuTensor) or source._storage.index != self._storage.index:
        where = source.device if isinstance(source, torch.Tensor) else type(source).__name__
        raise RuntimeError(f"set_: the source must be a tensor on {self.device} like the tensor set, not on {where}")
    meta = _meta_base(self)
    func(meta, _meta_base(source), *rest, **kwargs)  # PyTorch's own checks (dtype) and resulting layout
    layout = (tuple(meta.size()), tuple(meta.stride()), int(meta.storage_offset()))
    _check_in_storage(source, [(*layout, self.dtype)])
    _set_metadata(self, *layout, storage=source._storage, storage_dtype=source.storage_dtype)
    return self
