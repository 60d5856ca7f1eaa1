"""torch's OpInfo database run through the tpu device, against PyTorch CPU.

For each ``op_db`` entry that supports float32 on CPU, the first
``MAX_SAMPLES`` samples are run twice: on CPU (the reference) and with every
tensor moved to ``tpu``. Forward outputs are compared (shape, dtype, values
within ``TOL``); for entries with autograd, the gradients of the sample's
inputs under a fixed random cotangent are compared too. Everything runs in the
calling process, one entry after another, so state leaking between ops (caches,
pending errors) shows up as failures.

An op that fails on the device during backward and quietly runs on the host
counts as a failure (``TPUREC_HOST_FALLBACK=error`` and the
``host_fallbacks`` counter). Data-dependent ops (``nonzero``, ``masked_select``,
``unique``...) run on the host by design and are reported, not failed.

How values are compared (:func:`_compare`):

* **Tolerance.** Floating and complex results must match CPU float32 within
  ``TOL`` (``torch.testing.assert_close``); integers and bools exactly.
* **Float rounding, judged against float64.** Where tpu and CPU float32 differ by
  more than ``TOL``, both are measured against the float64 CPU result of the same
  sample (same inputs, cotangents and seed, every float32 tensor widened). The tpu
  result is accepted if it is within ``TOL`` of float64, or if its error against
  float64 (largest absolute difference) is at most ``FLOAT64_FACTOR`` times CPU
  float32's own error: the device is then as accurate as PyTorch CPU, and the two
  merely round differently (ill-conditioned ops such as ``matrix_exp`` or the
  backward of ``logcumsumexp`` amplify the last-bit differences of XLA's and
  ATen's operation order far beyond ``TOL``). A wrong result is still rejected:
  its error against float64 is far larger than CPU's (see the negative tests in
  ``test_opinfo_device.py``). When CPU cannot compute the sample in float64, the
  float32 mismatch stands.
* **Outputs unique only up to sign or phase** (``GAUGE_FREE``: eigenvectors,
  singular vectors; torch's docs say so). Each tpu vector is aligned with CPU's by
  the phase of their inner product (a sign for real vectors) before comparing, so
  a flipped sign passes and a different vector does not. For the backward pass,
  the cotangent of such an output is rotated by the same phase on the tpu side,
  which makes the two losses the same function of the input, so the input
  gradients compare directly.

Known failures live in ``opinfo_known_failures.txt`` (one line per entry and
phase, with the reason). An entry that fails and is not listed, or that is
listed and passes, fails the run: the list cannot go stale.

Command line (``make coverage``)::

    python tests/dense/opinfo_device.py --doc docs/ops.md      # whole database
    python tests/dense/opinfo_device.py --update-known          # rewrite the list
    python tests/dense/opinfo_device.py --update-known --only fft.fft polar   # rewrite these entries' lines
    JAX_PLATFORMS=tpu python tests/dense/opinfo_device.py --isolate 20       # on a TPU: 20 entries per process
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import os
import pathlib
import sys
import time
import types
import warnings
from collections.abc import Callable, Iterable, Iterator

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import torch  # noqa: E402
from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten, tree_map  # noqa: E402

import tpurec  # noqa: E402, F401 (registers the tpu device)
from tpurec.core import accounting, dispatch  # noqa: E402

MAX_SAMPLES = 3
# float32, tpu vs CPU: XLA:CPU's vectorised transcendental functions and its
# reduction order differ from ATen's by a few ulp, which compound over a sample.
TOL = dict(rtol=1e-4, atol=1e-5)
# How many times CPU float32's error (against float64) a tpu result may err when it misses TOL against
# CPU float32. Two float32 implementations that compute the same formula in different orders have
# rounding errors of the same size but not the same value: per sample, either one may be the larger
# by a small factor (measured on matrix_exp, logcumsumexp and layer_norm backward, see docs/ops.md).
# 2 accepts that spread; a wrong formula, index or sign errs by orders of magnitude more than CPU.
FLOAT64_FACTOR = 2.0
# Outputs whose vectors are unique only up to a sign (real) or a unit phase (complex), per entry:
# output leaf index -> the axis along which each vector lies (-2: columns, -1: rows).
GAUGE_FREE: dict[str, dict[int, int]] = {
    "linalg.eigh": {1: -2},  # eigenvectors, columns of V
    "linalg.eig": {1: -2},
    "linalg.svd": {0: -2, 2: -1},  # U's columns, Vh's rows
    "svd": {0: -2, 2: -2},  # U's and V's columns
}
KNOWN_FAILURES = pathlib.Path(__file__).with_name("opinfo_known_failures.txt")
PHASES = ("forward", "backward")
# The backward status of an entry whose forward fails: counted as failing, listed once (forward).
BLOCKED = "blocked: forward fails"


def entry_name(op) -> str:
    """``name`` or ``name.variant``: how entries are named in the list and in docs/ops.md."""
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def float32_entries() -> list:
    """The ``op_db`` entries that run in float32 on CPU, in database order."""
    return [op for op in op_db if op.supports_dtype(torch.float32, "cpu")]


@dataclasses.dataclass
class Result:
    """The outcome of one entry.

    ``forward``/``backward`` are ``"pass"``, ``"n/a"`` (no sample ran on CPU,
    or no differentiable output) or a one-line failure reason.
    """

    name: str
    forward: str = "n/a"
    backward: str = "n/a"
    host_ops: tuple[str, ...] = ()
    seconds: float = 0.0
    # Samples whose forward was compared on the device (CPU-rejected samples are not counted).
    samples: int = 0

    def status(self, phase: str) -> str:
        return getattr(self, phase)


class Mismatch(AssertionError):
    """Values, shapes or dtypes differ from CPU."""


def _first_line(error: BaseException, limit: int = 160) -> str:
    text = " ".join(str(error).split())
    # tpurec's own errors start with the op name; keep that part.
    return f"{type(error).__name__}: {text[:limit]}"


def _storage_numel(x: torch.Tensor) -> int:
    return x.untyped_storage().nbytes() // x.element_size()


def _is_partial_view(x: torch.Tensor) -> bool:
    """``x`` is a view into a larger storage (not a conj/neg view, whose bits need resolving)."""
    return (
        x.layout == torch.strided
        and not (x.is_conj() or x.is_neg())
        and (x.storage_offset() != 0 or _storage_numel(x) > x.numel())
    )


def _with_storage(x: torch.Tensor, device: str) -> torch.Tensor:
    """``x`` on ``device`` as a view of its whole storage moved there, with the same sizes, strides and offset.

    ``.to(device)`` copies only the view's own elements. OpInfo samples are made on the
    device under test (on CUDA too), so a sample that is a view of a larger tensor
    (``as_strided.partial_views``, which then reads elements outside the view) has its
    storage there; moving the storage and re-applying ``as_strided`` gives the same.
    """
    whole = x.detach().as_strided((_storage_numel(x),), (1,), 0)
    return whole.to(device).as_strided(x.size(), x.stride(), x.storage_offset())


def _to_device(x, device: str):
    """``x`` as a user on ``device`` would pass it: tensors moved there, and a device naming cpu renamed.

    Factory samples (arange, ones, signal.windows...) and ``Tensor.to`` name their device as an argument
    (``device="cpu"``); left as is they would test CPU against CPU, so the device they name becomes ``device``.
    """
    if isinstance(x, torch.Tensor):
        moved = _with_storage(x, device) if _is_partial_view(x) else x.detach().to(device)
        return moved.requires_grad_(x.requires_grad) if moved.is_floating_point() or moved.is_complex() else moved
    if isinstance(x, torch.device) and x.type == "cpu":
        return torch.device(device)
    if isinstance(x, str) and x == "cpu":
        return device
    return x


# Sample parts that torch's API requires on the host whatever the input's device, as a user passes
# them (``tensor_split``'s ``tensor_indices_or_sections`` must be a CPU tensor, on CUDA too).
_HOST_ARGUMENTS: dict[str, tuple[str, ...]] = {"tensor_split": ("args",)}


_JUDGED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Sample dtypes whose rounding mismatches are judged against float64 (float32, and the
reduced-precision floats, where CPU's per-op roundings are no more exact than tpu's)."""


def _widened(x):
    """``x`` with float32/bfloat16/float16 (complex64) tensors as float64 (complex128), the reference precision."""
    if isinstance(x, torch.Tensor) and x.dtype in (*_JUDGED_DTYPES, torch.complex64):
        wide = x.detach().to(torch.complex128 if x.dtype == torch.complex64 else torch.float64)
        return wide.requires_grad_(x.requires_grad)
    return x


def _within(actual: torch.Tensor, reference: torch.Tensor, tol: dict) -> bool:
    try:
        torch.testing.assert_close(actual, reference, equal_nan=True, check_dtype=False, **tol)
    except AssertionError:
        return False
    return True


def _max_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest absolute difference, NaNs in the same places counting as equal."""
    both_nan = actual.isnan() & reference.isnan()
    difference = (actual.to(reference.dtype) - reference).abs()
    difference = torch.where(both_nan, torch.zeros_like(difference), difference)
    return float(difference.nan_to_num(nan=float("inf")).max()) if difference.numel() else 0.0


def float64_verdict(expected: torch.Tensor, actual: torch.Tensor, reference: torch.Tensor, tol: dict) -> str | None:
    """Judges a tpu result that missed ``tol`` against CPU float32, by the float64 ``reference``.

    Args:
        expected: CPU's float32 result.
        actual: tpu's float32 result (on the host).
        reference: CPU's float64 result of the same sample.
        tol: ``rtol``/``atol``.

    Returns:
        None when ``actual`` is accepted (within ``tol`` of float64, or erring at most
        ``FLOAT64_FACTOR`` times as much as CPU float32), else the errors, for the report.
    """
    if reference.shape != actual.shape:
        return "float64 reference has another shape"
    if _within(actual, reference, tol):
        return None
    tpu_error, cpu_error = _max_error(actual, reference), _max_error(expected, reference)
    if tpu_error <= FLOAT64_FACTOR * cpu_error:
        return None
    return f"against float64: tpu errs by {tpu_error:.2g}, CPU float32 by {cpu_error:.2g}"


def gauge_phases(expected: torch.Tensor, actual: torch.Tensor, axis: int) -> torch.Tensor:
    """Per vector, the unit phase ``p`` (a sign for real tensors) with ``actual ~ expected * p``.

    The vectors lie along ``axis`` (-2: columns, -1: rows); ``p`` broadcasts against
    the tensors. A vector orthogonal to CPU's (not the same vector at all) gets p = 1,
    so the comparison that follows fails.
    """
    inner = (expected.conj() * actual).sum(dim=axis, keepdim=True)
    magnitude = inner.abs()
    phase = torch.where(magnitude > 0, inner / magnitude.clamp_min(torch.finfo(magnitude.dtype).tiny), 1)
    return phase.to(actual.dtype)


def _wide_copy(x):
    """A fresh copy of sample part ``x`` in the reference precision (see :func:`_widened`)."""
    if isinstance(x, torch.Tensor):
        wide = _widened(x)
        if wide is x:
            wide = x.detach().clone().requires_grad_(x.requires_grad)
        return wide
    return x


class Float64Reference:
    """CPU's float64 results for one sample: outputs, and input gradients for given cotangents.

    Made before the sample runs on CPU (in-place ops write into their inputs), from
    copies of its tensors with float32 widened to float64 (complex64 to complex128).
    Nothing runs until asked, and then only once.
    """

    def __init__(self, op, sample, gauge: dict[int, int] | None = None) -> None:
        self._op = op
        self._sample = types.SimpleNamespace(
            **{k: tree_map(_wide_copy, getattr(sample, k)) for k in ("input", "args", "kwargs")}
        )
        self._gauge = gauge or {}
        self._outputs = None

    def outputs(self):
        """The op's float64 outputs (raises what the op raises in float64)."""
        if self._outputs is None:
            self._outputs = _run(self._op, self._sample, 0)
        return self._outputs

    def grads(self, expected, cotangents: list[torch.Tensor]) -> list[torch.Tensor]:
        """Input gradients for CPU float32's ``cotangents`` of ``expected``'s differentiable outputs.

        The cotangent of a gauge-free output is rotated by the phase between CPU's float32
        vectors and the float64 ones, so that both losses are one function of the input.
        """
        outputs = self.outputs()
        leaves, wide_leaves = tree_flatten(expected)[0], tree_flatten(outputs)[0]
        wide_cotangents = []
        for k, i in enumerate(_differentiable_leaves(expected)):
            c = _widened(cotangents[k])
            if i in self._gauge and leaves[i].dim() >= 2:
                e = leaves[i].detach().to(wide_leaves[i].dtype)
                c = c * gauge_phases(e, wide_leaves[i].detach(), self._gauge[i])
            wide_cotangents.append(c)
        return _grads(outputs, _grad_inputs(self._sample), wide_cotangents)


def _compare(
    expected,
    actual,
    what: str,
    values: bool = True,
    tol: dict | None = None,
    reference64: Callable[[], object] | None = None,
    gauge: dict[int, int] | None = None,
) -> dict[int, torch.Tensor]:
    """``actual`` (from tpu) equals ``expected`` (CPU) within ``tol`` (default ``TOL``); raises Mismatch otherwise.

    Integer and bool results must be equal; ``tol`` applies to floating and complex ones.

    Args:
        expected: CPU's result.
        actual: tpu's result.
        what: how the results are named in errors ("output", "input grad").
        values: compare values (False: only shapes and dtypes, for random ops).
        tol: ``rtol``/``atol``.
        reference64: computes CPU's float64 result of the same sample, asked only when a
            floating result misses ``tol`` (see the module docstring); None: no such second look.
        gauge: leaf index -> vector axis of outputs unique up to sign/phase (``GAUGE_FREE``).

    Returns:
        The phases by which gauge-free leaves were aligned (leaf index -> :func:`gauge_phases`).
    """
    tol = TOL if tol is None else tol
    gauge = gauge or {}
    phases: dict[int, torch.Tensor] = {}
    wide: list = []
    exp_leaves, exp_spec = tree_flatten(expected)
    act_leaves, act_spec = tree_flatten(actual)
    if len(exp_leaves) != len(act_leaves):
        raise Mismatch(f"{what}: {len(act_leaves)} results, CPU gives {len(exp_leaves)}")
    for i, (e, a) in enumerate(zip(exp_leaves, act_leaves)):
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                raise Mismatch(f"{what}[{i}]: got {type(a).__name__}, CPU gives a tensor")
            if a.device.type != "tpu":
                raise Mismatch(f"{what}[{i}]: result on {a.device}, expected tpu")
            a = a.detach().cpu()
            e = e.detach()
            if a.shape != e.shape or a.dtype != e.dtype:
                raise Mismatch(f"{what}[{i}]: {tuple(a.shape)} {a.dtype}, CPU gives {tuple(e.shape)} {e.dtype}")
            if values:
                if i in gauge and e.dim() >= 2:
                    phases[i] = gauge_phases(e, a, gauge[i])
                    a = a * phases[i].conj()
                try:
                    inexact = e.is_floating_point() or e.is_complex()
                    torch.testing.assert_close(a, e, equal_nan=True, **(tol if inexact else {}))
                except AssertionError as error:
                    detail = [line for line in str(error).splitlines() if "Greatest" in line or "Mismatched" in line]
                    verdict = "no float64 reference" if inexact else "integers and bools must be equal"
                    if inexact and reference64 is not None:
                        if not wide:
                            try:
                                wide.append(tree_flatten(reference64())[0])
                            except Exception as failure:  # noqa: BLE001 (the op may not run in float64)
                                wide.append(f"float64 failed: {_first_line(failure, 60)}")
                        if isinstance(wide[0], list) and len(wide[0]) == len(exp_leaves):
                            reference = wide[0][i].detach()
                            if i in phases:  # align the float64 vectors with CPU's as well
                                reference = reference * gauge_phases(e.to(reference.dtype), reference, gauge[i]).conj()
                            verdict = float64_verdict(e, a, reference, tol)
                        else:
                            verdict = wide[0] if isinstance(wide[0], str) else "float64 gives other results"
                    if verdict is not None:
                        raise Mismatch(f"{what}[{i}]: wrong values ({verdict}; {'; '.join(detail)[:120]})") from None
        elif values and e != a and not (isinstance(e, float) and e != e and a != a):
            raise Mismatch(f"{what}[{i}]: {a!r}, CPU gives {e!r}")
    return phases


def _run(op, sample, seed: int):
    torch.manual_seed(seed)
    torch.tpu.manual_seed(seed)
    return op(sample.input, *sample.args, **sample.kwargs)


def _cloned(sample):
    """A copy of ``sample`` whose tensors are fresh (in-place random ops write into their input)."""
    clone = lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x  # noqa: E731
    return types.SimpleNamespace(**{k: tree_map(clone, getattr(sample, k)) for k in ("input", "args", "kwargs")})


class _RandomOpSeen(TorchDispatchMode):
    """Notes whether any ATen op PyTorch tags ``nondeterministic_seeded`` ran."""

    seen = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.seen = True
        return func(*args, **(kwargs or {}))


def _is_random(op, sample) -> bool:
    """The op draws random numbers (CPU and tpu generators differ: only shapes and dtypes compare)."""
    watcher = _RandomOpSeen()
    try:
        with watcher:
            _run(op, _cloned(sample), 0)
    except Exception:  # noqa: BLE001
        return False
    return watcher.seen


def _compare_cpu(a, b) -> None:
    for x, y in zip(tree_flatten(a)[0], tree_flatten(b)[0]):
        if isinstance(x, torch.Tensor):
            if not torch.equal(x.detach(), y.detach()) and not (
                x.isnan().any() and torch.allclose(x, y, equal_nan=True)
            ):
                raise Mismatch("random")


def _differentiable(outputs) -> list[torch.Tensor]:
    return [o for o in tree_flatten(outputs)[0] if isinstance(o, torch.Tensor) and o.requires_grad]


def _differentiable_leaves(outputs) -> list[int]:
    """Leaf indices (as in :func:`_compare`) of the outputs :func:`_differentiable` returns, in order."""
    return [i for i, o in enumerate(tree_flatten(outputs)[0]) if isinstance(o, torch.Tensor) and o.requires_grad]


def _grad_inputs(sample) -> list[torch.Tensor]:
    leaves = tree_flatten((sample.input, sample.args, sample.kwargs))[0]
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


def _grads(outputs, inputs, cotangents):
    grads = torch.autograd.grad(_differentiable(outputs), inputs, cotangents, allow_unused=True)
    return [torch.zeros_like(i) if g is None else g for g, i in zip(grads, inputs)]


def _fallbacks() -> int:
    return sum(accounting.counters().host_fallbacks.values())


def _host_fallback_names(before: dict) -> list[str]:
    now = accounting.counters().host_fallbacks
    return sorted(name for name, n in now.items() if n > before.get(name, 0))


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No warnings, and TPUREC_HOST_FALLBACK=error (restored afterwards: other tests expect the default)."""
    previous = os.environ.get("TPUREC_HOST_FALLBACK")
    os.environ["TPUREC_HOST_FALLBACK"] = "error"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        if previous is None:
            os.environ.pop("TPUREC_HOST_FALLBACK", None)
        else:
            os.environ["TPUREC_HOST_FALLBACK"] = previous


def check_entry(
    op,
    mode: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    wrap: Callable[[Callable], Callable] | None = None,
    max_samples: int = MAX_SAMPLES,
    dtype: torch.dtype = torch.float32,
    tol: dict | None = None,
    sample_filter: Callable[[object], bool] | None = None,
    backward: bool = True,
) -> Result:
    """Runs entry ``op`` through the tpu device; returns its Result.

    Args:
        op: the OpInfo entry.
        mode: a context to run the device side in (``lambda: tpurec.mode("fused")``).
        wrap: turns the op into what runs on the device (``torch.compile``); None runs it as is.
        max_samples: how many of the entry's samples to check.
        dtype: the dtype of the samples.
        tol: ``rtol``/``atol`` for floating and complex results (default ``TOL``).
        sample_filter: keeps only the samples it returns True for (cases an entry cannot support).
        backward: also compare input gradients (False: forward only, backward is "n/a").
    """
    device_op = op if wrap is None else wrap(op)
    requires_grad = bool(backward and op.supports_autograd and (dtype.is_floating_point or dtype.is_complex))
    result = Result(entry_name(op))
    start = time.perf_counter()
    host_ops_before = dict(accounting.counters().host_ops)
    forward: list[str] = []
    backward_outcomes: list[str] = []
    with _quiet():
        try:
            samples = op.sample_inputs("cpu", dtype, requires_grad=requires_grad)
            if sample_filter is not None:
                samples = filter(sample_filter, samples)
            samples = list(itertools.islice(samples, max_samples))
        except Exception as error:  # noqa: BLE001
            samples = []
            forward.append(f"sample generation failed: {_first_line(error)}")
        gauge = GAUGE_FREE.get(result.name, {})
        for sample in samples:
            reference = Float64Reference(op, sample, gauge) if dtype in _JUDGED_DTYPES else None
            try:
                expected = _run(op, sample, 0)
            except Exception:  # noqa: BLE001 (a sample CPU rejects says nothing about tpu)
                continue
            # Random ops, and ops returning uninitialised memory (new_empty...): only shapes and dtypes compare.
            random = _is_random(op, sample) or "empty" in op.name
            device_sample = types.SimpleNamespace(
                **{
                    k: getattr(sample, k)
                    if k in _HOST_ARGUMENTS.get(op.name, ())
                    else tree_map(lambda x: _to_device(x, "tpu"), getattr(sample, k))
                    for k in ("input", "args", "kwargs")
                }
            )
            fallbacks_before = dict(accounting.counters().host_fallbacks)
            try:
                with mode():
                    actual = _run(device_op, device_sample, 0)
                    phases = _compare(
                        expected,
                        actual,
                        "output",
                        values=not random,
                        tol=tol,
                        reference64=None if reference is None else reference.outputs,
                        gauge=gauge,
                    )
                forward.append("pass")
                result.samples += 1
            except Exception as error:  # noqa: BLE001
                dispatch._pending_fallback_error = None
                forward.append(_first_line(error) if isinstance(error, Mismatch) else f"error: {_first_line(error)}")
                if op.supports_autograd and not random:
                    backward_outcomes.append(BLOCKED)
                continue
            inputs = _grad_inputs(sample)
            outs = _differentiable(expected)
            if not (op.supports_autograd and inputs and outs) or random:
                continue
            cotangents = [torch.randn_like(o) for o in outs]
            try:
                expected_grads = _grads(expected, inputs, cotangents)
            except Exception:  # noqa: BLE001
                continue
            try:
                with mode():
                    device_inputs = _grad_inputs(device_sample)
                    # Gauge-free outputs: the cotangent turns with the vector (see the module docstring).
                    device_cotangents = [
                        c.to("tpu") * phases[i].to("tpu") if i in phases else c.to("tpu")
                        for c, i in zip(cotangents, _differentiable_leaves(expected))
                    ]
                    grads = _grads(actual, device_inputs, device_cotangents)
                    _compare(
                        expected_grads,
                        grads,
                        "input grad",
                        tol=tol,
                        reference64=None
                        if reference is None
                        else functools.partial(reference.grads, expected, cotangents),
                    )
                fell_back = _host_fallback_names(fallbacks_before)
                if fell_back:
                    raise Mismatch(f"host fallback in backward: {', '.join(fell_back)}")
                backward_outcomes.append("pass")
            except Exception as error:  # noqa: BLE001
                fell_back = _host_fallback_names(fallbacks_before)
                dispatch._pending_fallback_error = None
                if fell_back and not (isinstance(error, Mismatch) and "host fallback" in str(error)):
                    error = Mismatch(f"host fallback in backward: {', '.join(fell_back)}")
                backward_outcomes.append(
                    _first_line(error) if isinstance(error, Mismatch) else f"error: {_first_line(error)}"
                )
    dispatch._pending_fallback_error = None
    result.forward = _summary(forward)
    result.backward = _summary(backward_outcomes)
    now = accounting.counters().host_ops
    result.host_ops = tuple(sorted(n for n, k in now.items() if k > host_ops_before.get(n, 0)))
    result.seconds = time.perf_counter() - start
    return result


_ALL_ENTRIES = {entry_name(op): op for op in op_db}


def check_opinfo(
    name: str,
    dtype: torch.dtype = torch.float32,
    max_samples: int = MAX_SAMPLES,
    rtol: float = TOL["rtol"],
    atol: float = TOL["atol"],
    sample_filter: Callable[[object], bool] | None = None,
    backward: bool = True,
) -> int:
    """Asserts that entry ``name`` passes forward and backward through the tpu device.

    The strict form of :func:`check_entry` for tests of one lowering family: the
    forward outputs and the input gradients must match CPU within ``rtol``/``atol``,
    and any host fallback fails. Backward may be "n/a" only when no sample has a
    differentiable output (or the entry has no autograd).

    Args:
        name: the entry, ``"name"`` or ``"name.variant"``.
        dtype: the dtype of the samples.
        max_samples: how many samples to check.
        rtol: relative tolerance for floating and complex results.
        atol: absolute tolerance for floating and complex results.
        sample_filter: keeps only the samples it returns True for.
        backward: also compare input gradients; False checks the forward only (for a
            test that checks backward separately, e.g. as a strict xfail).

    Returns:
        How many samples were compared (callers assert it is > 0, so an entry
        whose samples all got filtered or rejected cannot pass silently).

    Raises:
        KeyError: ``name`` is not an ``op_db`` entry.
        AssertionError: a phase fails, with the first failure's reason.
    """
    if name not in _ALL_ENTRIES:
        raise KeyError(f"{name!r} is not an op_db entry (use 'name' or 'name.variant')")
    result = check_entry(
        _ALL_ENTRIES[name],
        max_samples=max_samples,
        dtype=dtype,
        tol=dict(rtol=rtol, atol=atol),
        sample_filter=sample_filter,
        backward=backward,
    )
    assert result.forward == "pass", f"{name} ({dtype}) forward: {result.forward}"
    assert result.backward in ("pass", "n/a"), f"{name} ({dtype}) backward: {result.backward}"
    return result.samples


def _summary(outcomes: list[str]) -> str:
    failures = [o for o in outcomes if o not in ("pass", BLOCKED)] or [o for o in outcomes if o == BLOCKED]
    if failures:
        return failures[0].replace("Mismatch: ", "")
    return "pass" if outcomes else "n/a"


# --- the known-failure list ----------------------------------------------------


def load_known(path: pathlib.Path = KNOWN_FAILURES) -> dict[tuple[str, str], str]:
    """``{(entry, phase): reason}`` from the checked-in list (``entry<TAB>phase<TAB>reason`` lines)."""
    known: dict[tuple[str, str], str] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split("\t")
        if len(parts) != 3 or parts[1] not in PHASES or not parts[2].strip():
            raise ValueError(f"{path}:{number}: expected 'entry<TAB>forward|backward<TAB>reason', got {line!r}")
        known[(parts[0], parts[1])] = parts[2]
    return known


def surprises(result: Result, known: dict[tuple[str, str], str]) -> list[str]:
    """Why ``result`` disagrees with the known-failure list (empty when it agrees)."""
    problems = []
    for phase in PHASES:
        status = result.status(phase)
        listed = (result.name, phase) in known
        if status == BLOCKED:
            continue
        if status not in ("pass", "n/a") and not listed:
            problems.append(f"{result.name} {phase} fails and is not a known failure: {status}")
        if status == "pass" and listed:
            problems.append(
                f"{result.name} {phase} passes but is listed as a known failure "
                f"({known[(result.name, phase)]}); remove it from {KNOWN_FAILURES.name}"
            )
    return problems


def write_known(
    results: Iterable[Result], path: pathlib.Path = KNOWN_FAILURES, keep: dict[tuple[str, str], str] | None = None
) -> None:
    """Writes the known-failure list from ``results``, in ``op_db`` order.

    Args:
        results: this run's outcomes; their entries' lines are replaced.
        path: the list to write.
        keep: the current list; lines of entries that did not run this time are kept
            (``--update-known --only ...`` updates just the entries it ran).
    """
    ran = {r.name: r for r in results}
    lines = [
        "# OpInfo entries that fail through the tpu device (float32, tpu vs CPU), one line per entry and phase:",
        "# entry<TAB>forward|backward<TAB>reason. Written by `python tests/dense/opinfo_device.py --update-known`;",
        "# an entry listed here that passes fails the run, so fix the op, then delete its line.",
    ]
    order = list(dict.fromkeys([entry_name(op) for op in op_db] + list(ran)))
    for name in order:
        for phase in PHASES:
            if name in ran:
                status = ran[name].status(phase)
                if status not in ("pass", "n/a", BLOCKED):
                    lines.append(f"{name}\t{phase}\t{' '.join(status.split())}")
            elif keep and (name, phase) in keep:
                lines.append(f"{name}\t{phase}\t{keep[(name, phase)]}")
    path.write_text("\n".join(lines) + "\n")


# --- docs/ops.md -----------------------------------------------------------------


def write_doc(results: list[Result], path: pathlib.Path, seconds: float) -> None:
    from tpurec.dense.registry import LOWERINGS, get_lowering

    get_lowering(torch.ops.aten.add.Tensor)  # loads every lowering family
    fwd = [r for r in results if r.forward != "n/a"]
    bwd = [r for r in results if r.backward != "n/a"]
    fwd_pass = sum(r.forward == "pass" for r in fwd)
    bwd_pass = sum(r.backward == "pass" for r in bwd)
    both = sum(r.forward == "pass" and r.backward in ("pass", "n/a") for r in fwd)
    wrong = sum("wrong values" in r.forward or "wrong values" in r.backward for r in results)
    fallback = sum("host fallback" in r.backward for r in results)
    host = sorted({n for r in results if r.forward == "pass" for n in r.host_ops})
    lines = [
        "# ATen coverage of the tpu device",
        "",
        "Written by `make coverage` (`python tests/dense/opinfo_device.py --doc docs/ops.md`): every entry of",
        f"torch's `op_db` that runs in float32 on CPU, up to {MAX_SAMPLES} samples each, run through the `tpu` device in",
        "one process (eager mode) and compared with PyTorch CPU: forward outputs and the gradients of the inputs",
        f"(rtol {TOL['rtol']}, atol {TOL['atol']}). A backward op that falls back to the host counts as a failure.",
        "",
        "How values are compared (details in the docstring of `tests/dense/opinfo_device.py`):",
        "",
        "* **Float rounding is judged against float64.** Where tpu and CPU float32 differ by more than the",
        "  tolerance, both are measured against CPU's float64 result of the same sample. The tpu result passes if",
        f"  it is within the tolerance of float64, or if its largest error against float64 is at most {FLOAT64_FACTOR:g}x CPU",
        "  float32's own: the device is then as accurate as PyTorch CPU and only rounds differently. Measured on the",
        "  entries this admits (tpu error / CPU float32 error, per sample): `matrix_exp` backward 1.25 (and within",
        "  the tolerance of float64), forward 0.62; `logcumsumexp` backward 1.55 and 1.67; `nn.functional.layer_norm`",
        "  backward 0.00 (tpu exact). Two float32 orderings of one formula err by the same order, either one the",
        f"  larger; {FLOAT64_FACTOR:g}x covers that spread, while a wrong result errs by orders of magnitude more (a transposed",
        "  `matrix_exp` is rejected: `test_a_wrong_matrix_exp_fails_despite_the_float64_rule`).",
        "* **Vectors unique only up to sign or phase** (eigenvectors of `linalg.eigh`/`linalg.eig`, singular",
        "  vectors of `linalg.svd`/`svd`) are aligned with CPU's by the phase of their inner product before the",
        "  comparison, and their cotangents turn with them in backward; swapped or perturbed vectors still fail",
        "  (`test_wrong_eigenvectors_fail`).",
        "* **Samples that are views of a larger tensor** move with their whole storage (sizes, strides and offset",
        "  re-applied on tpu), as OpInfo samples made on a CUDA device have theirs.",
        "",
        "| what | count |",
        "|---|---|",
        f"| `op_db` entries (float32 on CPU) | {len(results)} |",
        f"| pass forward | {fwd_pass} of {len(fwd)} |",
        f"| pass backward (input gradients; entries with autograd, failing forward counts as failing) | {bwd_pass} of {len(bwd)} |",
        f"| pass both (or forward-only entries passing forward) | {both} |",
        f"| fail with wrong values (forward or backward) | {wrong} |",
        f"| fail through a host fallback in backward | {fallback} |",
        f"| ATen overloads in the lowering table | {len(LOWERINGS)} |",
        f"| run time | {seconds:.0f} s |",
        "",
        "Data-dependent ops run on the host by design (their output shape depends on values); passing entries",
        f"that use them: {', '.join(f'`{h}`' for h in host) or 'none'}.",
        "",
        "## Failing entries and why",
        "",
        "| entry | forward | backward |",
        "|---|---|---|",
    ]
    for r in results:
        if r.forward not in ("pass", "n/a") or r.backward not in ("pass", "n/a"):
            cell = lambda s: s.replace("|", "\\|")  # noqa: E731
            lines.append(f"| `{r.name}` | {cell(r.forward)} | {cell(r.backward)} |")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


# --- isolated runs: one child process per chunk of entries --------------------------


def run_isolated(names: list[str], per_child: int, timeout: float, child_args: Iterable[str] = ()) -> list[Result]:
    """Results of ``names``, checked ``per_child`` at a time in child processes of this script.

    A child writes each result as it finishes. When a child dies (XLA's TPU compiler aborts the
    process on some programs) or runs past ``timeout`` seconds, the entry it was checking is
    reported as failed with the reason, and the entries after it run in a new child.
    """
    import json
    import subprocess
    import tempfile

    results: list[Result] = []
    pending = list(names)
    while pending:
        chunk = pending[:per_child]
        with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as report:
            command = [sys.executable, __file__, *child_args, "--report", report.name, "--only", *chunk]
            try:
                code = subprocess.run(command, timeout=timeout, stdout=subprocess.DEVNULL).returncode
                why = f"the process ended with exit code {code}"
            except subprocess.TimeoutExpired:
                why = f"the process ran past {timeout:g} s and was stopped"
            done = [Result(**{**row, "host_ops": tuple(row["host_ops"])}) for row in map(json.loads, report)]
        done.sort(key=lambda r: chunk.index(r.name))
        results += done
        for r in done:
            print(f"{r.name}: forward {r.forward} | backward {r.backward} ({r.seconds:.1f}s)", flush=True)
        finished = {r.name for r in done}
        left = [n for n in chunk if n not in finished]
        if left:  # the child stopped inside left[0]
            failed = Result(left[0], forward=f"error: {why} while checking this entry", backward=BLOCKED)
            results.append(failed)
            print(f"{failed.name}: forward {failed.forward}", flush=True)
        pending = left[1:] + pending[per_child:]
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--doc", type=pathlib.Path, help="write the coverage report (docs/ops.md) here")
    parser.add_argument("--update-known", action="store_true", help=f"rewrite {KNOWN_FAILURES.name} from this run")
    parser.add_argument("--only", nargs="*", help="entry names to run (default: all)")
    parser.add_argument(
        "--isolate",
        type=int,
        metavar="N",
        help="check N entries per child process, so that a crash of the process (XLA's TPU compiler aborts "
        "on some programs) fails one entry and the run goes on",
    )
    parser.add_argument("--child-timeout", type=float, default=900.0, help="seconds a child may run (--isolate)")
    parser.add_argument("--report", type=pathlib.Path, help=argparse.SUPPRESS)  # a child's results, one JSON line each
    parser.add_argument("--abort-at", help=argparse.SUPPRESS)  # tests: the process aborts on reaching this entry
    args = parser.parse_args(argv)
    entries = float32_entries()
    if args.only:
        entries = [op for op in entries if entry_name(op) in set(args.only)]
    current = load_known() if KNOWN_FAILURES.exists() else {}
    known = {} if args.update_known else current
    start = time.perf_counter()
    results, problems = [], []
    if args.isolate:
        results = run_isolated([entry_name(op) for op in entries], args.isolate, args.child_timeout)
        for r in results:
            problems += surprises(r, known)
    for i, op in enumerate([] if args.isolate else entries):
        if entry_name(op) == args.abort_at:
            os.abort()
        r = check_entry(op)
        results.append(r)
        problems += surprises(r, known)
        if args.report:
            import json

            with args.report.open("a") as report:
                report.write(json.dumps(dataclasses.asdict(r)) + "\n")
        print(
            f"[{i + 1}/{len(entries)}] {r.name}: forward {r.forward} | backward {r.backward} ({r.seconds:.1f}s)",
            flush=True,
        )
    seconds = time.perf_counter() - start
    if args.update_known:
        write_known(results, keep=current if args.only else None)
    if args.doc:
        write_doc(results, args.doc, seconds)
    fwd = [r for r in results if r.forward != "n/a"]
    bwd = [r for r in results if r.backward != "n/a"]
    print(
        f"forward {sum(r.forward == 'pass' for r in fwd)}/{len(fwd)}, "
        f"backward {sum(r.backward == 'pass' for r in bwd)}/{len(bwd)}, {seconds:.0f} s"
    )
    for p in problems:
        print("PROBLEM:", p)
    return 1 if problems and not args.update_known else 0


if __name__ == "__main__":
    sys.exit(main())
