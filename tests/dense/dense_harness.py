"""Checks lowerings against PyTorch CPU, op by op.

``LoweringChecker`` is a ``TorchDispatchMode``: while a CPU program runs under
it, every ATen call is executed for real (the reference) and, if the op has a
lowering, also through ``call_lowering``; the two results are compared.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from tpurec.dense.registry import call_lowering, get_lowering

# Tolerances, stated per dtype. float32 default = torch.testing's defaults.
# XLA:CPU's transcendental approximations (exp, log, tanh, erf, pow...) are a
# few ulp away from glibc/Sleef, so ops using them get TRANSCENDENTAL_TOL;
# so do long reductions that XLA accumulates in another order (addbmm).
DEFAULT_TOL = {
    torch.float32: dict(rtol=1.3e-6, atol=1e-5),
    torch.float64: dict(rtol=1e-7, atol=1e-7),
    # torch CPU computes bf16 ops in float32 and rounds: one bf16 ulp is 2**-8.
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5),
    torch.float16: dict(rtol=1e-3, atol=1e-5),
}
TRANSCENDENTAL_TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float64: dict(rtol=1e-7, atol=1e-7),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-3),
    torch.float16: dict(rtol=1e-3, atol=1e-4),
}


def to_torch(x) -> torch.Tensor:
    a = np.asarray(x)
    if a.dtype == jnp.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.array(a))


# In-place ops whose functional form is not "the name without _, same overload".
_SPECIAL_FUNCTIONAL = {
    "normal_.default": "normal_functional.default",
    "bernoulli_.float": "bernoulli.p",
}


def _functional_of(func) -> torch._ops.OpOverload | None:
    """The lowered functional overload behind an in-place op, if any."""
    name = func._schema.name.split("::")[1]
    if not name.endswith("_") or name.endswith("__") or not func._schema.is_mutable:
        return None
    if not func._schema.arguments or func._schema.arguments[0].alias_info is None:
        return None  # an out= variant or similar: not the core's write-back path
    special = _SPECIAL_FUNCTIONAL.get(f"{name}.{func._overloadname}")
    if special:
        packet_name, overload = special.split(".")
        return getattr(getattr(torch.ops.aten, packet_name), overload)
    packet = getattr(torch.ops.aten, name[:-1], None)
    if packet is None:
        return None
    # Same argument types, e.g. pow_.Scalar -> pow.Tensor_Scalar (not pow.Scalar).
    want = [str(a.type) for a in func._schema.arguments]
    for overload in packet.overloads():
        op = getattr(packet, overload)
        if [str(a.type) for a in op._schema.arguments] == want and not op._schema.is_mutable:
            return op if get_lowering(op) is not None else None
    return None


def _signature(func, args, kwargs) -> tuple:
    def key(v):
        if isinstance(v, torch.Tensor):
            return ("T", tuple(v.shape), v.dtype)
        if isinstance(v, (list, tuple)):
            return tuple(key(x) for x in v)
        return repr(v)

    return (func, key(args), tuple(sorted((k, key(v)) for k, v in kwargs.items())))


@dataclasses.dataclass
class Record:
    op: torch._ops.OpOverload
    ok: bool
    message: str = ""


class LoweringChecker(TorchDispatchMode):
    """Runs each lowered ATen call through its lowering too and compares."""

    def __init__(self, tol=None, nondeterministic_outputs: dict | None = None):
        """
        Args:
            tol: dtype -> assert_close kwargs (DEFAULT_TOL when None).
            nondeterministic_outputs: see ``self.loose``.
        """
        super().__init__()
        self.tol = tol
        # op -> output positions whose values are implementation-defined (e.g.
        # the indices of tied sort keys); only shape and dtype are compared.
        self.loose = nondeterministic_outputs or {}
        self.records: list[Record] = []
        self.refused: list[Record] = []
        self.seen: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        functional = _functional_of(func)
        if functional is not None:
            return self._check_inplace(func, functional, args, kwargs)
        out = func(*args, **kwargs)
        lowering = get_lowering(func)
        if lowering is None or func._schema.is_mutable:
            return out
        if any(
            isinstance(t, torch.Tensor) and (t.is_sparse or t.is_complex() or t.layout != torch.strided)
            for t in tree_flatten((args, kwargs))[0]
        ):
            return out
        sig = _signature(func, args, kwargs)
        if sig in self.seen:  # same op, shapes and static args: nothing new to learn
            return out
        self.seen.add(sig)
        try:
            if lowering.random:
                self._check_random(func, args, kwargs, out)
            else:
                got = call_lowering(func, args, kwargs)
                self._compare(func, out, got)
            self.records.append(Record(func, True))
        except NotImplementedError as e:
            # A documented refusal (e.g. a data-dependent boolean mask), not a
            # wrong answer; the op must still be reached successfully elsewhere.
            self.refused.append(Record(func, False, str(e)))
        except Exception as e:  # recorded, reported by the test
            self.records.append(Record(func, False, f"{type(e).__name__}: {e}"))
        return out

    def _check_inplace(self, func, functional, args, kwargs):
        """``x.add_(y)``: the runtime runs ``add.Tensor`` and writes the result
        back into ``x``; check that the functional lowering on the inputs
        equals what torch wrote."""
        before_args, before_kwargs = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, (args, kwargs))
        out = func(*args, **kwargs)
        sig = _signature(functional, before_args, before_kwargs)
        if sig in self.seen:
            return out
        self.seen.add(sig)
        try:
            lowering = get_lowering(functional)
            if lowering.random:
                self._check_random(functional, before_args, before_kwargs, args[0])
            else:
                got = call_lowering(functional, before_args, before_kwargs)
                self._compare(functional, args[0], got)
            self.records.append(Record(functional, True))
        except NotImplementedError as e:
            self.refused.append(Record(functional, False, str(e)))
        except Exception as e:
            self.records.append(Record(functional, False, f"(via {func}) {type(e).__name__}: {e}"))
        return out

    def _tol(self, dtype):
        table = self.tol or DEFAULT_TOL
        return table.get(dtype, dict(rtol=0, atol=0))

    def _compare(self, func, ref, got):
        refs = list(ref) if isinstance(ref, (tuple, list)) else [ref]
        gots = list(got) if isinstance(got, (tuple, list)) else [got]
        assert len(refs) == len(gots), f"{len(gots)} outputs, torch has {len(refs)}"
        for i, (r, g) in enumerate(zip(refs, gots)):
            if not isinstance(r, torch.Tensor):
                continue
            if g is None:
                raise AssertionError(f"output {i} is None")
            gt = to_torch(g)
            assert tuple(gt.shape) == tuple(r.shape), f"output {i}: shape {tuple(gt.shape)} != {tuple(r.shape)}"
            assert gt.dtype == r.dtype, f"output {i}: dtype {gt.dtype} != {r.dtype}"
            if i in self.loose.get(func, ()):
                continue
            torch.testing.assert_close(gt, r, equal_nan=True, **self._tol(r.dtype), msg=lambda m: f"output {i}: {m}")

    def _check_random(self, func, args, kwargs, ref):
        key = jax.random.key(7)
        a = call_lowering(func, args, kwargs, key=key)
        b = call_lowering(func, args, kwargs, key=key)
        refs = list(ref) if isinstance(ref, (tuple, list)) else [ref]
        refs = [r for r in refs if isinstance(r, torch.Tensor)]
        a = list(a) if isinstance(a, (tuple, list)) else [a]
        b = list(b) if isinstance(b, (tuple, list)) else [b]
        for r, x, y in zip(refs, a, b):
            xt, yt = to_torch(x), to_torch(y)
            assert xt.shape == r.shape and xt.dtype == r.dtype, f"{xt.shape}/{xt.dtype} != {r.shape}/{r.dtype}"
            assert torch.equal(xt, yt), "not deterministic for a fixed key"
