"""Moving a module to or from tpu keeps its ``Parameter`` objects, as moving it to CUDA does.

``Module._apply`` (behind ``.to()``, ``.cpu()``, ``.half()``, ``.to_empty()``...) changes a
parameter in place (``param.data = new``) only when the two tensor types can share one
implementation, as CPU and CUDA tensors can. A tpu tensor cannot share a CPU tensor's, so
PyTorch makes a new ``Parameter`` for every registration it meets. That unties weights
shared between modules (an embedding tied to an output projection becomes two), and loses
whatever was attached to the old object: attributes (TorchRec's in-backward optimizers),
optimizers and references created before the move.

:func:`install` wraps ``Module._apply``: after PyTorch's conversion, each parameter that
moved to or from tpu gets the new contents swapped into its old object
(``torch.utils.swap_tensors``, PyTorch's own mechanism for tensor subclasses), keeping the
attributes set on it. A parameter registered twice converts at its first registration; at
the second it is already on its device and PyTorch keeps it. Buffers are replaced by the
converted tensors, as PyTorch does on every device.
"""

from __future__ import annotations

import copyreg
import warnings

import torch

from tpurec.core.tensor import TpuTensor

__all__ = ["install", "keep_parameter_identity"]

# Attributes that belong to a tensor's contents, not to the Python object's identity
# (``_is_param`` marks a tensor subclass as a Parameter; a CPU Parameter is one by type).
_CONTENT_ATTRIBUTES = frozenset((*TpuTensor.CONTENT_ATTRIBUTES, "_is_param"))

_torch_apply = torch.nn.Module._apply


def _on_tpu(t: torch.Tensor) -> bool:
    return t.device.type == "tpu"


def _refuse_stale_graph(grad_outputs):
    raise RuntimeError(
        "this autograd graph was built before its parameter moved to another device or dtype "
        "(module.to(...)); run the forward pass again after the move"
    )


def _swap_contents(old: torch.Tensor, new: torch.Tensor) -> None:
    """``torch.utils.swap_tensors`` that lets ``old`` keep its weak references.

    PyTorch refuses to swap a tensor that has weak references, since a weak reference
    would then see other contents. Keeping ``old``'s object with new contents is the point
    here, and the objects PyTorch keeps weakly by parameter (TorchRec's and
    ``torch.distributed``'s per-parameter optimizer maps) key them by identity.
    """
    if copyreg._slotnames(type(old)) or copyreg._slotnames(type(new)):
        torch.utils.swap_tensors(old, new)  # it moves slots too
        return
    for t in (old, new):
        if t._use_count() == 1:
            continue
        if t._use_count() == 2 and t.is_leaf and t.requires_grad:
            node = torch.autograd.graph.get_gradient_edge(t).node
            if t._use_count() == 2:
                # The other reference is the gradient accumulator of a graph still alive (it
                # was not made just now): that graph must not run into the swapped tensor.
                node.register_prehook(_refuse_stale_graph)
                continue
        raise RuntimeError(f"{t._use_count()} references to the tensor are held (e.g. by a saved autograd graph)")
    old.__class__, new.__class__ = new.__class__, old.__class__
    old.__dict__, new.__dict__ = new.__dict__, old.__dict__
    torch._C._swap_tensor_impl(old, new)


def keep_parameter_identity(old: torch.nn.Parameter, new: torch.nn.Parameter) -> bool:
    """Gives ``old`` the contents of ``new`` (values, device, dtype, grad), keeping its attributes.

    Returns ``False``, with a warning, when the contents cannot be swapped (more references to
    ``old``'s tensor are held than its gradient accumulator's): ``new`` then replaces it, as
    before tpurec kept identities.
    """
    attributes = {k: v for k, v in old.__dict__.items() if k not in _CONTENT_ATTRIBUTES}
    try:
        _swap_contents(old, new)
    except RuntimeError as error:
        warnings.warn(
            f"moving a parameter of shape {tuple(old.shape)} to {new.device} made a new Parameter object "
            f"({error}); ties to it and references held to the old object no longer follow it. Move the "
            "module before building optimizers or graphs that hold the parameter.",
            stacklevel=4,
        )
        return False
    for key, value in attributes.items():
        old.__dict__.setdefault(key, value)
    # Hook dictionaries stay with the Python object, but autograd runs them from the tensor
    # they were registered on: setting them again registers them with the new contents.
    if old._backward_hooks is not None:
        old._backward_hooks = old._backward_hooks
    if old._post_accumulate_grad_hooks is not None:
        old._post_accumulate_grad_hooks = old._post_accumulate_grad_hooks
    return True


def _apply(self: torch.nn.Module, fn, recurse: bool = True):
    before = dict(self._parameters)
    result = _torch_apply(self, fn, recurse)
    for name, old in before.items():
        new = self._parameters.get(name)
        if old is None or new is None or new is old or not (_on_tpu(old) or _on_tpu(new)):
            continue
        if keep_parameter_identity(old, new):
            self._parameters[name] = old
    return result


def install() -> None:
    """Wraps ``torch.nn.Module._apply`` (once)."""
    if torch.nn.Module._apply is not _apply:
        torch.nn.Module._apply = _apply
