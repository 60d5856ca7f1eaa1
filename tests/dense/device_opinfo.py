"""Runs OpInfo samples through the ``tpu`` device and compares with CPU.

For one ``op_db`` entry: each sample's tensors are moved with ``.to("tpu")``,
the op runs there and on CPU, outputs are compared; then the input gradients
of ``sum(output * cotangent)`` (a fixed random cotangent per output) are
compared the same way. A backward op that falls back to the host (tpurec's
RuntimeWarning "ran on the host") is an error here, not a pass.
"""

from __future__ import annotations

import warnings
from typing import Iterable

import torch
from torch.testing._internal.common_methods_invocations import op_db
from torch.utils._pytree import tree_flatten, tree_map

import tpurec  # noqa: F401  (registers the device)

_BY_NAME = {(op.name + ("." + op.variant_test_name if op.variant_test_name else "")): op for op in op_db}


def opinfo(name: str):
    """The ``op_db`` entry called ``name`` (``"name.variant"`` for variants)."""
    return _BY_NAME[name]


def _to(x, device: str, requires_grad: bool = False):
    if isinstance(x, torch.Tensor):
        y = x.detach().to(device)
        if requires_grad and x.requires_grad:
            y.requires_grad_(True)
        return y
    return x


def _float_tensors(out) -> list[torch.Tensor]:
    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _run(op, sample, device: str, cotangents: list | None):
    """Forward (and backward when ``cotangents``) of one sample on ``device``."""
    inp = tree_map(lambda x: _to(x, device, True), sample.input)
    args = tree_map(lambda x: _to(x, device, True), sample.args)
    kwargs = tree_map(lambda x: _to(x, device, True), sample.kwargs)
    out = op(inp, *args, **kwargs)
    leaves = [t for t in tree_flatten((inp, args, kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = None
    if cotangents is not None and leaves:
        pairs = [(o, c) for o, c in zip(_float_tensors(out), cotangents) if o.requires_grad]
        if pairs:
            total = sum((o * c.to(device)).sum() for o, c in pairs)
            grads = torch.autograd.grad(total, leaves, allow_unused=True)
    return out, grads


def check_opinfo(
    name: str,
    dtype: torch.dtype = torch.float32,
    max_samples: int = 3,
    backward: bool = True,
    rtol: float = 1.3e-6,
    atol: float = 1e-5,
    skip_sample=None,
) -> int:
    """Checks up to ``max_samples`` samples of ``op_db`` entry ``name`` on tpu vs CPU.

    Args:
        name: the entry, ``"name"`` or ``"name.variant"``.
        dtype: sample dtype.
        max_samples: how many samples to run.
        backward: also compare input gradients (when the op supports autograd).
        rtol, atol: ``torch.testing.assert_close`` tolerances.
        skip_sample: predicate on a sample for cases the entry cannot support.

    Returns:
        How many samples were compared (the caller asserts it is > 0).
    """
    op = opinfo(name)
    requires_grad = backward and op.supports_autograd and dtype.is_floating_point
    checked = 0
    for sample in op.sample_inputs("cpu", dtype, requires_grad=requires_grad):
        if checked >= max_samples:
            break
        if skip_sample is not None and skip_sample(sample):
            continue
        # Recorded, not raised: an exception inside the autograd engine aborts the process.
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            torch.manual_seed(0)
            ref_out = op(sample.input, *sample.args, **sample.kwargs)
            cotangents = [torch.randn(t.shape, dtype=t.dtype) for t in _float_tensors(ref_out)] if requires_grad else None
            ref_out, ref_grads = _run(op, sample, "cpu", cotangents)
            out, grads = _run(op, sample, "tpu", cotangents)
        host = [str(w.message) for w in caught if "ran on the host" in str(w.message)]
        assert not host, f"{name}: an op fell back to the host: {host[0]}"
        msg = f"{name} sample {checked}: {sample.summary() if hasattr(sample, 'summary') else sample}"
        got = tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, out)
        torch.testing.assert_close(got, ref_out, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{msg}\n{m}")
        if ref_grads is not None:
            assert grads is not None, f"{msg}: no gradients on tpu"
            for i, (g, r) in enumerate(zip(grads, ref_grads)):
                if r is None:
                    continue
                assert g is not None, f"{msg}: gradient {i} missing on tpu"
                torch.testing.assert_close(
                    g.cpu(), r, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m, i=i: f"{msg}\ngrad {i}: {m}"
                )
        checked += 1
    return checked


def names_matching(prefixes: Iterable[str]) -> list[str]:
    """Every ``op_db`` entry whose name starts with one of ``prefixes``."""
    return sorted(n for n in _BY_NAME if any(n.startswith(p) for p in prefixes))
