"""In-place and ``out=`` ops: their functional variant, written back through the destinations' views."""

from __future__ import annotations

from typing import Any

import torch

from tpurec.core.calls import _fallback, _flatten_out, execute
from tpurec.core.errors import unsupported_op
from tpurec.core.kernels import _copy_, _resize_
from tpurec.core.tensor import TpuTensor
from tpurec.dense.registry import get_lowering

aten = torch.ops.aten

__all__: list[str] = []


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
        # Every positional argument it writes, in order: most ops write only the first; the
        # fused optimizers (_fused_adam_ ...) write the parameters, gradients and state lists.
        targets = []
        for k, argument in enumerate(schema.arguments):
            if argument.kwarg_only or argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = args[k] if k < len(args) else kwargs[argument.name]
            targets.extend(value if isinstance(value, (list, tuple)) else [value])
        returns = None if not schema.returns else args[0]
        return targets, returns
    outs = [kwargs[a.name] for a in schema.arguments if a.kwarg_only and a.alias_info and a.alias_info.is_write]
    # A Tensor[] out argument (split_with_sizes_copy.out, ...): each of its tensors is a destination.
    targets = [t for out in outs for t in (out if isinstance(out, (list, tuple)) else [out])]
    if not schema.returns:  # e.g. split_with_sizes_copy.out(..., *, Tensor(a!)[] out) -> ()
        return targets, None
    returns = outs[0] if len(outs) == 1 else tuple(outs)
    return targets, returns


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
                if tuple(r.shape) != tuple(t.shape) and tuple(t.shape) != tuple(
                    torch.broadcast_shapes(r.shape, t.shape)
                ):
                    _resize_(t, r.shape)
                _copy_(t, r)
        return returns
    for t in targets:
        if not isinstance(t, TpuTensor):
            raise RuntimeError(f"{func}: expected tpu tensors to write into, got a {t.device} tensor")
    execute(functional, lowering, call_args, call_kwargs, targets=targets)
    return returns
