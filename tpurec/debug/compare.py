"""The shadow's comparison engine: one op's tpu outputs and in-place writes against PyTorch CPU's.

:func:`compare` runs an ATen op again on CPU copies of the values its tpu inputs had
(:class:`Inputs`, taken just before it ran) and judges each output and each written argument
within the tolerances of its dtype, or as PyTorch's own float64 reference allows
(``FLOAT64_FACTOR``). ``tpurec.debug.hook`` calls it for every op of a shadow session.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import Counter
from typing import Any, cast

import torch
from torch.utils._pytree import tree_flatten, tree_map

from tpurec import core
from tpurec.core import TpuTensor, array_of, flush, is_pending, jax_to_host
from tpurec.dense.registry import get_lowering

__all__ = [
    "DEFAULT_TOLERANCES",
    "FLOAT64_FACTOR",
    "Inputs",
    "ShadowReport",
    "compare",
    "is_random",
    "op_name",
    "owner_of",
    "roots",
    "tensor_summary",
]

aten = torch.ops.aten

# (rtol, atol) per dtype, as the project's OpInfo check (float32: tests/dense/opinfo_device.py)
# and torch.testing (the others) use them: XLA's vectorised transcendental functions and
# reduction orders differ from ATen's by a few ulp, compounded over one op.
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-5),
    torch.complex64: (1e-4, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.complex128: (1e-7, 1e-7),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float16: (1e-3, 1e-5),
}
# A result that misses the tolerance is still right when it is as accurate as PyTorch's own:
# no farther from the op run in float64 than this many times CPU's error (the OpInfo rule).
FLOAT64_FACTOR = 2.0

# Their values are uninitialised memory on CPU: only shapes and dtypes can be compared.
_UNINITIALISED = {
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.empty_like.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten.empty_permuted.default,
    aten.resize_.default,
}
# Outputs that are a backend's workspace for its own backward op, not results: CTC's log_alpha
# is (N, T, 2 max(target_lengths) + 1) on CPU and CUDA, which read the lengths on the host (a
# sync); tpu bounds it by the targets' length instead, and CPU leaves the entries past each
# input's and target's length uninitialised. Only their dtype is compared; the loss and the
# gradient that the backward computes from them are compared in full.
_WORKSPACES = {aten._ctc_loss.default: (1,), aten._ctc_loss.Tensor: (1,)}
# Index outputs that may order ties either way (sort without stable=True, topk): any indices
# that pick CPU's values from the input are right.
_TIES = {aten.sort.default, aten.sort.stable, aten.topk.default}


@dataclasses.dataclass
class ShadowReport:
    """What a shadow session compared.

    Attributes:
        checked: ops whose values were compared, by name.
        random: ops only shape- and dtype-checked because they draw random numbers.
        unchecked: ops PyTorch CPU could not run on these inputs -> its error.
        meta_conformant: outputs whose shape or dtype differs from CPU's as PyTorch's meta
            kernel says it should (CPU's own choice, e.g. bfloat16 layer norm statistics).
        undefined_casts: float -> integer casts with NaN, infinite or out-of-range elements,
            which are not compared (undefined in C++: x86 CPU gives INT_MIN, tpu and CUDA
            saturate, NaN -> 0).
        workspaces: outputs that only feed the op's own backward (CTC's ``log_alpha``), whose
            dtype alone is compared.
        ties: sort/topk index outputs that order equal values differently from CPU but pick
            the same values (PyTorch leaves that order unspecified unless ``stable=True``).
    """

    rtol: float | None = None
    atol: float | None = None
    checked: Counter = dataclasses.field(default_factory=Counter)
    random: Counter = dataclasses.field(default_factory=Counter)
    unchecked: dict = dataclasses.field(default_factory=dict)
    meta_conformant: Counter = dataclasses.field(default_factory=Counter)
    undefined_casts: Counter = dataclasses.field(default_factory=Counter)
    workspaces: Counter = dataclasses.field(default_factory=Counter)
    ties: Counter = dataclasses.field(default_factory=Counter)


# --- comparing values -----------------------------------------------------------------


def _tolerance(dtype: torch.dtype, report: ShadowReport) -> tuple[float, float]:
    rtol, atol = DEFAULT_TOLERANCES.get(dtype, (0.0, 0.0))
    return (rtol if report.rtol is None else report.rtol), (atol if report.atol is None else report.atol)


def _host(value) -> torch.Tensor:
    # A tpu value here is an op's input or output: the op runtime is loaded.
    value = core.value_of(value, "tpurec.debug.shadow") if isinstance(value, TpuTensor) else value
    value = jax_to_host(value) if not isinstance(value, torch.Tensor) else value
    return value.detach().resolve_conj().resolve_neg()


def _beyond(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> torch.Tensor:
    """Where ``actual`` misses ``expected`` (NaNs must sit in the same places, infinities be equal)."""
    a, e = actual.to(expected.dtype), expected
    close = (a - e).abs() <= atol + rtol * e.abs()
    close |= a == e
    close |= a.isnan() & e.isnan()
    return ~close


def _max_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    if not actual.numel():
        return 0.0
    error = (actual.to(reference.dtype) - reference).abs()
    error = torch.where(actual.isnan() & reference.isnan(), torch.zeros_like(error), error)
    return float(error.nan_to_num(nan=float("inf")).max())


def _index(flat: int, shape) -> list[int]:
    out = []
    for n in reversed(shape):
        out.append(flat % n)
        flat //= n
    return out[::-1]


def _difference(actual: torch.Tensor, expected: torch.Tensor, bad: torch.Tensor, rtol: float, atol: float) -> str:
    a, e = (
        actual.to(torch.complex128 if actual.is_complex() else torch.float64),
        expected.to(torch.complex128 if expected.is_complex() else torch.float64),
    )
    nan = a.isnan() != e.isnan()
    if bool(nan.any()):
        first = _index(int(nan.reshape(-1).nonzero()[0]), a.shape)
        side = "tpu" if bool(a.isnan()[tuple(first)]) else "CPU"
        return f"NaN in different places: {int(nan.sum())} elements, first at {first} (NaN on {side} only)"
    diff = (a - e).abs().nan_to_num(nan=0.0, posinf=float("inf"))
    flat = int(diff.reshape(-1).argmax())
    at = _index(flat, a.shape)
    rel = diff / e.abs()
    rel = torch.where(diff == 0, torch.zeros_like(rel), rel).nan_to_num(nan=0.0)
    rel_flat = int(rel.reshape(-1).argmax())
    return (
        f"max abs diff {float(diff.reshape(-1)[flat]):.3g} at {at} (tpu {a.reshape(-1)[flat].item():.6g}, "
        f"CPU {e.reshape(-1)[flat].item():.6g}); max rel diff {float(rel.reshape(-1)[rel_flat]):.3g} at "
        f"{_index(rel_flat, a.shape)}; {int(bad.sum())} of {bad.numel()} elements beyond rtol={rtol:g}, atol={atol:g}"
    )


def tensor_summary(t: torch.Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}"


def _judge(actual: torch.Tensor, expected: torch.Tensor, reference, report: ShadowReport) -> str | None:
    """None when the tpu value ``actual`` matches CPU's ``expected``, else what differs.

    ``reference()`` gives CPU's result of the op in float64 (or raises), asked only on a miss.
    """
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        return f"tpu gives {tensor_summary(actual)}, CPU {tensor_summary(expected)}"
    if not (actual.is_floating_point() or actual.is_complex()):
        if torch.equal(actual, expected):
            return None
        bad = actual != expected
        flat = int(bad.reshape(-1).nonzero()[0])
        at = _index(flat, actual.shape)
        return (
            f"{int(bad.sum())} of {bad.numel()} elements differ (integers and bools must be equal), first at {at}: "
            f"tpu {actual.reshape(-1)[flat].item()}, CPU {expected.reshape(-1)[flat].item()}"
        )
    if torch.equal(actual, expected):  # most ops (views, copies, exact arithmetic): one pass
        return None
    rtol, atol = _tolerance(actual.dtype, report)
    bad = _beyond(actual, expected, rtol, atol)
    if not bool(bad.any()):
        return None
    text = _difference(actual, expected, bad, rtol, atol)
    if bool((actual.isnan() != expected.isnan()).any()):
        return text
    try:
        wide = reference()
    except Exception as error:  # noqa: BLE001 (an op may not run in float64: then the miss stands)
        return text + f"; (float64 run failed: {type(error).__name__})"
    if wide is None or wide.shape != actual.shape:
        return text
    if not bool(_beyond(actual, wide, rtol, atol).any()):
        return None
    tpu_error, cpu_error = _max_error(actual, wide), _max_error(expected, wide)
    if tpu_error <= FLOAT64_FACTOR * cpu_error:
        return None
    return text + f"; against float64 tpu errs by {tpu_error:.3g}, CPU {str(expected.dtype)[6:]} by {cpu_error:.3g}"


# --- one op on CPU ---------------------------------------------------------------------


_WIDE = {
    torch.float32: torch.float64,
    torch.bfloat16: torch.float64,
    torch.float16: torch.float64,
    torch.complex64: torch.complex128,
}


class Inputs:
    """An op's tpu inputs as they were before it ran (jax arrays are immutable: references suffice)."""

    def __init__(self, args, kwargs) -> None:
        self.args, self.kwargs = args, kwargs
        self.before: dict[int, tuple] = {}
        # Each tensor's view as it was: in-place view ops (t_, squeeze_, as_strided_) change it.
        self.keys: dict[int, tuple] = {}
        for x in tree_flatten((args, kwargs))[0]:
            if isinstance(x, TpuTensor):
                self.keys.setdefault(id(x), x._key)
            if isinstance(x, TpuTensor) and id(x._storage) not in self.before:
                array = array_of(x)
                if is_pending(array):
                    flush("tpurec.debug.shadow")
                    array = array_of(x)
                self.before[id(x._storage)] = (x._storage, array)

    def on_cpu(self, widen: bool = False, unify: bool = False):
        """The call with each tpu tensor a view of a CPU copy of its storage; CPU tensors cloned.

        ``widen``: floats as float64 (complex64 as complex128). ``unify``: floats in the dtype
        of the first floating tensor.
        """
        storages: dict[int, torch.Tensor] = {}
        common: torch.dtype | None = None
        if unify:
            common = next(
                x.dtype
                for x in tree_flatten((self.args, self.kwargs))[0]
                if isinstance(x, torch.Tensor) and x.is_floating_point()
            )

        def convert(x):
            if isinstance(x, TpuTensor):
                flat = storages.get(id(x._storage))
                if flat is None:
                    flat = jax_to_host(self.before[id(x._storage)][1]).reshape(-1)
                    if widen and flat.dtype in _WIDE:
                        flat = flat.to(_WIDE[flat.dtype])
                    elif common is not None and flat.is_floating_point():
                        flat = flat.to(common)
                    storages[id(x._storage)] = flat
                _, dtype, size, stride, offset, storage_dtype = self.keys[id(x)]
                if widen:
                    dtype = _WIDE.get(dtype, dtype)
                elif common is not None and dtype.is_floating_point:
                    dtype = common
                base = flat if dtype == flat.dtype else flat.view(cast(torch.dtype, dtype))
                return base.as_strided(size, stride, offset)
            if isinstance(x, torch.Tensor):
                x = x.detach().clone()
                if common is not None and x.is_floating_point():
                    return x.to(common)
                return x.to(_WIDE[x.dtype]) if widen and x.dtype in _WIDE else x
            if isinstance(x, torch.device) and x.type == "tpu":
                return torch.device("cpu")
            return x

        args, kwargs = tree_map(convert, (self.args, self.kwargs))
        if isinstance(kwargs.get("device"), str) and kwargs["device"].startswith("tpu"):
            kwargs["device"] = "cpu"
        return args, kwargs, storages


def _written(func, args, kwargs) -> list[tuple[str, Any]]:
    """(argument name, value) of each argument the schema says the op writes."""
    found = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
            if value is not None:
                found.append((a.name, value))
    return found


_CASTS = {aten._to_copy.default, aten.copy.default, aten.copy_.default}


def _undefined_casts(func, cpu_args, result: torch.Tensor) -> torch.Tensor | None:
    """For a float -> integer cast, the elements of ``result`` whose source is NaN, infinite or
    outside the integer's range (C++ leaves their value undefined), as a bool mask; else None."""
    if func not in _CASTS or result.is_floating_point() or result.is_complex() or result.dtype == torch.bool:
        return None
    src = cpu_args[0] if func is aten._to_copy.default else cpu_args[1]
    if not isinstance(src, torch.Tensor) or not (src.is_floating_point() or src.is_complex()):
        return None
    info = torch.iinfo(result.dtype)
    value = (src.real if src.is_complex() else src).to(torch.float64).trunc()
    undefined = ~value.isfinite() | (value < info.min) | (value >= info.max + 1.0)
    return undefined.expand(result.shape) if bool(undefined.any()) else None


def _argument(func, args, kwargs, name: str, default):
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            value = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(name, default)
            return default if value is None else value
    return default


def _same_ties(func, cpu_args, cpu_kwargs, indices: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether ``indices`` (tpu's) pick CPU's ``values`` from the input, where ``func`` may order ties either way."""
    if func not in _TIES or (func is aten.sort.stable and _argument(func, cpu_args, cpu_kwargs, "stable", False)):
        return False
    source, dim = cpu_args[0], _argument(func, cpu_args, cpu_kwargs, "dim", -1)
    if source.dim() == 0 or indices.shape != values.shape or indices.dtype != torch.int64:
        return False
    if func is not aten.topk.default and not torch.equal(
        indices.sort(dim).values, torch.arange(source.shape[dim]).expand_as(indices.movedim(dim, -1)).movedim(-1, dim)
    ):
        return False  # a sort's indices are a permutation
    if bool(((indices < 0) | (indices >= source.shape[dim])).any()):
        return False
    picked = source.gather(dim, indices)
    return bool(
        (
            (picked == values) | (picked.isnan() & values.isnan()) if picked.is_floating_point() else picked == values
        ).all()
    )


def _meta_run(func, inputs: Inputs):
    """The op's outputs by PyTorch's meta kernel (flattened), or the exception it raises."""

    def to_meta(x):
        if isinstance(x, TpuTensor):
            _, dtype, size, stride, _, _ = inputs.keys[id(x)]
            return torch.empty_strided(size, stride, dtype=dtype, device="meta")
        if isinstance(x, torch.Tensor):
            return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device="meta")
        if isinstance(x, torch.device) or (isinstance(x, str) and x.startswith("tpu")):
            return torch.device("meta")
        return x

    args, kwargs = tree_map(to_meta, (inputs.args, inputs.kwargs))
    try:
        return tree_flatten(func(*args, **kwargs))[0]
    except Exception as error:  # noqa: BLE001 (returned: the caller tells refusals from missing kernels)
        return error


def _meta_output(func, inputs: Inputs, i: int) -> tuple | None:
    """(shape, dtype) of output ``i`` by PyTorch's meta kernel (None without one)."""
    outs = _meta_run(func, inputs)
    if isinstance(outs, Exception) or i >= len(outs) or not isinstance(outs[i], torch.Tensor):
        return None
    return outs[i].shape, outs[i].dtype


def _refused(error: Exception) -> bool:
    """``error`` says the inputs are invalid (not that a kernel is missing for this backend)."""
    return isinstance(error, (RuntimeError, ValueError, IndexError, TypeError)) and not isinstance(
        error, NotImplementedError
    )


def is_random(func) -> bool:
    if torch.Tag.nondeterministic_seeded in func.tags:
        return True
    lowering = get_lowering(func)
    return lowering is not None and lowering.random


def _first_line(error: Exception) -> str:
    return (str(error).splitlines() or [""])[0][:200]


def op_name(func) -> str:
    return f"{func.namespace}.{func._schema.name.split('::')[-1]}.{func._overloadname}"


def compare(func, inputs: Inputs, out, report: ShadowReport) -> list[str] | None:
    """The differences between the tpu run (done) and a CPU run of ``func``; None when CPU cannot run it."""
    cpu_args, cpu_kwargs, cpu_storages = inputs.on_cpu()
    unified = False
    try:
        expected = func(*cpu_args, **cpu_kwargs)
    except Exception as error:  # noqa: BLE001 (CPU may lack the kernel: then unchecked, not a divergence)
        expected = None
        meta = _meta_run(func, inputs)
        if _refused(error) and isinstance(meta, Exception) and _refused(meta):
            # CPU and the meta kernel refuse these inputs (baddbmm of float32 and bfloat16): PyTorch
            # raises where tpu computed something.
            return [f"PyTorch refuses these inputs and tpu accepted them: {type(error).__name__}: {_first_line(error)}"]
        dtypes = {
            x.dtype
            for x in tree_flatten((inputs.args, inputs.kwargs))[0]
            if isinstance(x, torch.Tensor) and x.is_floating_point()
        }
        if len(dtypes) > 1 and not isinstance(meta, Exception):
            # Where tpu follows the meta kernel's dtypes (float32 statistics of a bfloat16 layer norm),
            # CPU's kernel may refuse them in its backward: ask it with every float in one dtype.
            cpu_args, cpu_kwargs, cpu_storages = inputs.on_cpu(unify=True)
            unified = True
            try:
                expected = func(*cpu_args, **cpu_kwargs)
            except Exception:  # noqa: BLE001
                pass
        if expected is None:
            report.unchecked.setdefault(op_name(func), f"{type(error).__name__}: {_first_line(error)}")
            return None
    wide_cache: list = []

    def wide_run():
        if not wide_cache:
            args, kwargs, storages = inputs.on_cpu(widen=True)
            wide_cache.append((tree_flatten(func(*args, **kwargs))[0], storages))
        return wide_cache[0]

    problems = []
    name = op_name(func)
    uninitialised = func in _UNINITIALISED
    actual_flat, expected_flat = tree_flatten(out)[0], tree_flatten(expected)[0]
    if len(actual_flat) != len(expected_flat):
        return [f"tpu returns {len(actual_flat)} values, CPU {len(expected_flat)}"]
    for i, (a, e) in enumerate(zip(actual_flat, expected_flat)):
        label = f"output {i}" if len(actual_flat) > 1 else "output"
        if isinstance(a, torch.Tensor) != isinstance(e, torch.Tensor):
            problems.append(f"{label}: tpu gives {type(a).__name__}, CPU {type(e).__name__}")
            continue
        if not isinstance(a, torch.Tensor):
            if isinstance(a, float) and isinstance(e, float):
                a, e = torch.tensor(a, dtype=torch.float64), torch.tensor(e, dtype=torch.float64)
            elif a != e:
                problems.append(f"{label}: tpu gives {a!r}, CPU {e!r}")
                continue
            else:
                continue
        a = _host(a)
        e = e.detach().resolve_conj().resolve_neg()
        if i in _WORKSPACES.get(func, ()):
            report.workspaces[name] += 1
            if a.dtype != e.dtype:
                problems.append(f"{label}: tpu gives {tensor_summary(a)}, CPU {tensor_summary(e)}")
            continue
        if uninitialised:
            if a.shape != e.shape or a.dtype != e.dtype:
                problems.append(f"{label}: tpu gives {tensor_summary(a)}, CPU {tensor_summary(e)}")
            continue
        if (a.dtype != e.dtype or a.shape != e.shape) and _meta_output(func, inputs, i) == (a.shape, a.dtype):
            # PyTorch's backends disagree here and tpu follows the meta kernel (as CUDA does):
            # native_layer_norm's statistics of a bfloat16 input are float32 there, bfloat16 on
            # CPU; _embedding_bag's unused max_indices are empty there, one per bag on CPU.
            report.meta_conformant[name] += 1
            if a.shape != e.shape:
                continue
            a = a.to(e.dtype)  # so judged at CPU's precision
        if (
            i == 1
            and func in _TIES
            and not torch.equal(a, e)
            and _same_ties(func, cpu_args, cpu_kwargs, a, expected_flat[0])
        ):
            report.ties[name] += 1
            continue
        undefined = _undefined_casts(func, cpu_args, e)
        if undefined is not None and undefined.shape == a.shape:
            report.undefined_casts[name] += 1
            e = torch.where(undefined, a, e)
        verdict = _judge(a, e, lambda i=i: wide_run()[0][i], report)
        if verdict:
            problems.append(f"{label} {tensor_summary(e)}: {verdict}")
    if uninitialised:
        return problems
    # Writes: the whole storage behind each written argument (its base and other views too),
    # and any storage the tpu side replaced although the schema does not say it writes it.
    written = {}
    for argument, value in _written(func, inputs.args, inputs.kwargs):
        values = value if isinstance(value, (list, tuple)) else [value]
        for k, t in enumerate(values):
            if isinstance(t, TpuTensor):
                where = f"argument '{argument}'" + (f" (tensor {k} of {len(values)})" if len(values) > 1 else "")
                written.setdefault(id(t._storage), (where, t))
    for key, (storage, array) in inputs.before.items():
        if storage.array is not array and key not in written:
            written[key] = ("an argument it should not write", None)
    for key, (where, tensor) in written.items():
        storage = inputs.before[key][0]
        a = jax_to_host(storage.array).reshape(-1)
        e = cpu_storages[key]
        if e.dtype != a.dtype and unified:
            e = e.to(a.dtype)
        if func is aten.copy_.default and tensor is not None and tensor is inputs.args[0]:
            dst = cpu_args[0]
            undefined = _undefined_casts(func, cpu_args, dst)
            if undefined is not None:
                # The same elements in the storage: where the written view lies in it.
                places = torch.arange(e.numel()).as_strided(dst.size(), dst.stride(), dst.storage_offset())
                flat = torch.zeros(e.numel(), dtype=torch.bool)
                flat[places[undefined]] = True
                e = torch.where(flat, a, e)
        verdict = _judge(a, e, lambda key=key: wide_run()[1][key], report)
        if verdict:
            owner = owner_of(storage)
            problems.append(f"{where}, written in place{owner} (storage {tensor_summary(e)}): {verdict}")
    return problems


# The modules run under a session (root modules: tpurec.debug.hook adds them): their
# parameters, gradients and buffers name a storage an op wrote in place.
roots: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def owner_of(storage) -> str:
    """Which known parameter, gradient or buffer lives in ``storage`` (for optimizer steps)."""
    for root in list(roots):
        for name, p in root.named_parameters():
            if isinstance(p, TpuTensor) and p._storage is storage:
                return f" = parameter {name}"
            if isinstance(p.grad, TpuTensor) and p.grad._storage is storage:
                return f" = gradient of {name}"
        for name, b in root.named_buffers():
            if isinstance(b, TpuTensor) and b._storage is storage:
                return f" = buffer {name}"
    return ""
