"""Eager execution: one ATen op on tpu tensors -> one cached, compiled JAX program.

``TpuTensor.__torch_dispatch__`` lands here (and the PrivateUse1 factory kernels:
``torch.zeros(..., device="tpu")``, registered by ``tpurec.core.entry``, which imports
this module on the first tpu op). The op is classified:

* view ops make a new tensor over the same storage (no computation);
* in-place and ``out=`` ops run their functional variant and write the result
  back through the destination's view, inside the same program;
* everything else looks its lowering up in the table (``tpurec.dense``), then
  a ``torch._decomp`` decomposition, and otherwise fails naming the op.

A program is keyed by op, storage shapes, view specs, dtypes and static
arguments; ``Scalar``/``float`` arguments are runtime inputs, so a changing
learning rate reuses the same compiled program.

The parts live in the layers below: ``programs`` (running programs, reading
values), ``calls`` (one op call as a cached program), ``view_ops``, ``kernels``
(the device kernels), ``mutating`` (in-place and ``out=``) and ``host``. Their
names that other modules use stay importable from here.
"""

from __future__ import annotations

import warnings

import torch
import torch.autograd.profiler as _torch_profiler

from tpurec.core import accounting, kernels, mirrors, modes, profiler
from tpurec.core.calls import (
    _Call,
    _debug_check,
    _fallback,
    library_device_kernel,
    _flatten_out,
    _meta_outputs,
    execute,
)
from tpurec.core.host import (
    _DATA_DEPENDENT,
    _INDEXING,
    _has_bool_index,
    _masks_as_indices,
    _indexing_across_devices,
    _on_host,
)
from tpurec.core.kernels import (
    _cast_program,
    _copy_,
    _copy_program,
    _device_index,
    _new_storage,
    _to_copy,
)
from tpurec.core.mutating import _functional_variant, _run_mutating
from tpurec.core.programs import (
    _compile,
    _placed,
    _read_program,
    run_program,
    store_array,
    fresh,
    pending_value,
    value_of,
)
from tpurec.core.tensor import TpuTensor, install_dispatcher
from tpurec.core.view_ops import (
    _inplace_view,
    _meta_base,
    _set_metadata,
    _view,
    _view_metas,
)
from tpurec.dense.calling import argument_kinds
from tpurec.dense.registry import LOWERINGS, TABLE, Kind, get_lowering

aten = torch.ops.aten
# The KERNEL part of the one lowering table (tpurec/dense/registry.py): the device kernels.
_KERNELS = TABLE[Kind.KERNEL]

# Names of the layers below that other modules and tests use, importable from here as before.
_FROM_BELOW = (
    _Call,
    _debug_check,
    _flatten_out,
    _meta_outputs,
    _cast_program,
    _copy_program,
    _to_copy,
    _compile,
    _placed,
    _read_program,
    run_program,
    store_array,
    _meta_base,
    _set_metadata,
    _view_metas,
)

__all__ = ["copy_from", "dispatch", "execute", "factory_kernel", "fresh", "install_shadow", "pending_value", "value_of"]


# --- the entry point -----------------------------------------------------------


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
    if mirrors.live and id(func) in _MIRRORED and args and _may_be_mirrored(args[0]):
        out = _dispatch_entry(func, args, kwargs)
        mirrors.run_mirrored(func, args, kwargs, out)
        return out
    # (As _dispatch_entry, written out: this is every op's path.)
    if _shadow is not None:
        return _shadow(_dispatch_profiled, func, args, kwargs)
    if _torch_profiler._is_profiler_enabled:
        return _dispatch_profiled(func, args, kwargs)
    return _dispatch_checked(func, args, kwargs)


_MIRRORED = mirrors.mirrored_ops


def _may_be_mirrored(first) -> bool:
    """Whether an op with this first argument may have a result known on the host: not when it is a tpu
    tensor without a mirror (most views and ops on float tensors), since every tensor argument needs one."""
    return type(first) is not TpuTensor or first._mirror is not None


def _dispatch_entry(func, args: tuple, kwargs: dict):
    if _shadow is not None:
        return _shadow(_dispatch_profiled, func, args, kwargs)
    if _torch_profiler._is_profiler_enabled:
        return _dispatch_profiled(func, args, kwargs)
    return _dispatch_checked(func, args, kwargs)


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
    except Exception as error:
        accounting.counters().host_fallbacks[func.__name__] += 1
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


# --- routes: how an op was handled, kept so that its next call goes straight there ---------
#
# id(op) -> (how, table, table key, entry, ...): the op's table entry (a device kernel, its
# lowering, or its functional variant's lowering) as it was found. A route is followed only
# while the table still holds that entry, so replacing a lowering takes effect at once.
_KERNEL, _LOWERED, _IN_PLACE, _VIEW = "kernel", "lowered", "in place", "view"
_routes: dict[int, tuple] = {}
# How an op's outputs are returned: the one output, the list of them, or a tuple.
_ONE, _LIST, _TUPLE = 0, 1, 2


def _returned(func) -> int:
    returns = func._schema.returns
    if len(returns) == 1 and not isinstance(returns[0].type, torch._C.ListType):
        return _ONE
    return _LIST if len(returns) == 1 else _TUPLE


def _dispatch(func, args: tuple, kwargs: dict):
    accounting.counters().ops_by_name[func.__name__] += 1
    route = _routes.get(id(func))
    if route is not None and route[1].get(route[2]) is route[3]:
        how = route[0]
        if how is _KERNEL:
            return route[3].fn(*args, **kwargs)
        if not torch.is_inference_mode_enabled():  # inference mode decomposes first (_dispatch_full)
            if how is _VIEW:
                return _view(func, args, kwargs)
            if how is _LOWERED:
                outs = execute(func, route[3], args, kwargs, kinds=route[4])
                returned = route[5]
                return outs[0] if returned == _ONE else outs if returned == _LIST else tuple(outs)
            target = args[0]  # _IN_PLACE: an op that writes its first argument, through its functional variant
            if isinstance(target, TpuTensor):
                execute(route[2], route[3], args, kwargs, targets=[target], kinds=route[4])
                return target if route[5] else None
            if type(target) is list and all(isinstance(t, TpuTensor) for t in target):  # _foreach_*_
                execute(route[2], route[3], args, kwargs, targets=list(target), kinds=route[4])
                return target if route[5] else None
    return _dispatch_full(func, args, kwargs)


def _dispatch_full(func, args: tuple, kwargs: dict):
    kernel = _KERNELS.get(func)
    if kernel is not None:
        _routes[id(func)] = (_KERNEL, _KERNELS, func, kernel)
        return kernel.fn(*args, **kwargs)
    if library_device_kernel(func):
        return func._op_dk(torch._C.DispatchKey.PrivateUse1, *args, **kwargs)
    if func in _INDEXING:
        args, result = _indexing_across_devices(func, args)
        if args is None:
            return result
    if _has_bool_index(func, args) and isinstance(args[0], TpuTensor):
        args = _masks_as_indices(func, args)
    if func in _DATA_DEPENDENT or _has_bool_index(func, args):
        accounting.counters().host_ops[func.__name__] += 1
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
        if func not in _INDEXING and func not in _DATA_DEPENDENT and func.overloadpacket is not aten.to:
            _routes[id(func)] = (_VIEW, _KERNELS, func, None)  # followed while the op has no kernel
        return _view(func, args, kwargs)
    if torch.Tag.inplace_view in func.tags:
        return _inplace_view(func, args, kwargs)
    if func._schema.is_mutable:
        _remember_in_place(func)
        return _run_mutating(func, args, kwargs)
    lowering = get_lowering(func)
    if lowering is None:
        if func in _DATA_DEPENDENT:  # marked by a deferred family that get_lowering just loaded
            accounting.counters().host_ops[func.__name__] += 1
            return _on_host(func, args, kwargs)
        return _fallback(func, args, kwargs)
    kinds = argument_kinds(func, lowering.static_scalars)
    if func not in _INDEXING and func.overloadpacket is not aten.to:
        _routes[id(func)] = (_LOWERED, LOWERINGS, func, lowering, kinds, _returned(func))
    outs = execute(func, lowering, args, kwargs, kinds=kinds)
    returned = _returned(func)
    return outs[0] if returned == _ONE else outs if returned == _LIST else tuple(outs)


def _remember_in_place(func) -> None:
    """Keeps the route of an op that writes its first (positional) argument and nothing else.

    Such an op (``add_``, ``mul_``...) runs its functional variant's lowering with the first
    argument as the target, as :func:`tpurec.core.mutating._run_mutating` does.
    """
    if func in _INDEXING or func in _DATA_DEPENDENT:
        return
    arguments = func._schema.arguments
    if not arguments or any(a.alias_info is not None and a.alias_info.is_write for a in arguments[1:]):
        return
    first = arguments[0]
    if first.kwarg_only or first.alias_info is None or not first.alias_info.is_write:
        return
    kind = first.type
    if isinstance(kind, torch._C.ListType):
        kind = kind.getElementType()  # _foreach_*_: each tensor of the list is a target
    if not isinstance(kind, torch._C.TensorType):
        return
    functional = _functional_variant(func)
    lowering = None if functional is None else get_lowering(functional)
    if functional is None or lowering is None:
        return
    kinds = argument_kinds(functional, lowering.static_scalars)
    _routes[id(func)] = (_IN_PLACE, LOWERINGS, functional, lowering, kinds, bool(func._schema.returns))


# TpuTensor lives a layer below this module: it reaches the dispatcher through this hook.
install_dispatcher(dispatch, value_of)
# kernels._conj runs another op through the dispatcher, a layer above it.
kernels.install_redispatch(_dispatch)


# --- factories: ops without tensor inputs reach the PrivateUse1 kernel ---------


def factory_kernel(func):
    """The PrivateUse1 kernel of factory ``func`` (registered by ``tpurec.core.entry``, which hands over to it)."""

    mirrored = id(func) in _MIRRORED

    def kernel(*args, **kwargs):
        if _shadow is not None:
            out = _shadow(lambda func, args, kwargs: compute(*args, **kwargs), func, args, kwargs)
        else:
            out = compute(*args, **kwargs)
        if mirrored:
            mirrors.run_mirrored(func, args, kwargs, out)  # a small integer factory is known on the host
        return out

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


def copy_from(src, dst, non_blocking: bool = False):
    """The PrivateUse1 kernel of ``_copy_from`` and ``_copy_from_and_resize``: reached with Python dispatch
    excluded, e.g. by ``torch.tensor(data, device="tpu")``."""
    return _copy_(dst, src)
