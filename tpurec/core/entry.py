"""Where torch enters the tpu device, and where the op runtime is loaded: on the first tpu op.

``import tpurec`` imports the core's layers up to ``graphs`` (devices, tensors, counters,
modes, captured steps) and this module, the top layer. The op runtime above them (``mirrors``, ``programs``,
``calls``, ``view_ops``, ``kernels``, ``mutating``, ``host``, ``dispatch``: ``LAZY_LAYERS``
in ``tpurec.core``) is imported by :func:`load_runtime`, which every entry point below
calls first:

* the PrivateUse1 kernels of the ATen factories and copies (``torch.zeros(...,
  device="tpu")``, ``tensor.to("tpu")``, ``torch.tensor(data, device="tpu")``), registered
  here at import and handing over to ``dispatch``'s kernels;
* ``TpuTensor.__torch_dispatch__``, printing and ``TpuTensor.to_jax()``: this module
  installs loaders as ``tensor``'s dispatcher hooks, which ``dispatch`` replaces with
  itself when it is imported.

So a process that only plans (``tpurec plan``, ``import tpurec.sparse.planner``) or only
reads the device's state never imports the op runtime.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Callable

import torch

from tpurec.core.tensor import install_dispatcher
from tpurec.dense.registry import TABLE, Kind, mark

__all__ = ["load_runtime", "loaded", "register_factories"]

aten = torch.ops.aten

_runtime: ModuleType | None = None


def load_runtime() -> ModuleType:
    """Imports the op runtime (``tpurec.core.dispatch`` and the layers below it that ``import tpurec``
    leaves out), once; it installs its hooks into ``tensor`` and ``kernels`` as it is imported.

    Returns:
        The ``tpurec.core.dispatch`` module.
    """
    global _runtime
    if _runtime is None:
        # Two threads' first ops: Python's import lock makes the second wait for the whole module.
        # (import_module, not ``from tpurec.core import``: that would ask the package's __getattr__ first.)
        _runtime = importlib.import_module("tpurec.core.dispatch")
    return _runtime


def loaded() -> bool:
    """Whether the op runtime has been imported (by a tpu op, or by importing ``tpurec.core.dispatch``)."""
    from tpurec.core import tensor as _tensor

    return _tensor._dispatch is not _first_dispatch


def _first_dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    # Installed until dispatch is imported, which replaces this hook with its own dispatcher.
    return load_runtime().dispatch(func, args, kwargs)


def _first_value_of(value: Any, *args: Any, **kwargs: Any) -> Any:
    return load_runtime().value_of(value, *args, **kwargs)


install_dispatcher(_first_dispatch, _first_value_of)


# --- the PrivateUse1 kernels: ops reached without a tpu tensor argument ---------------

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


def _factory(func: Any) -> Callable[..., Any]:
    """A kernel of factory ``func`` that loads the runtime on its first call, then runs ``dispatch``'s."""
    run: Callable[..., Any] | None = None

    def kernel(*args: Any, **kwargs: Any) -> Any:
        nonlocal run
        found = run
        if found is None:
            found = run = load_runtime().factory_kernel(func)
        return found(*args, **kwargs)

    return kernel


def _copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    return load_runtime().copy_from(src, dst, non_blocking)


def _copy_from_and_resize(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    return load_runtime().copy_from(src, dst)


_library: torch.library.Library | None = None


def register_factories() -> None:
    """Registers PrivateUse1 kernels for ATen factories (``torch.zeros(..., device="tpu")``) and copies (once)."""
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
    # Reached with Python dispatch excluded, e.g. by torch.tensor(data, device="tpu").
    _library.impl("_copy_from", _copy_from, "PrivateUse1")
    _library.impl("_copy_from_and_resize", _copy_from_and_resize, "PrivateUse1")
