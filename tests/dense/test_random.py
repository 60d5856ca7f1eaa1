"""Random lowerings: right shape and dtype, deterministic per key, different
across keys, and the right distribution (loose moment checks on 20k draws)."""

from __future__ import annotations

import jax
import pytest
import torch

from dense_harness import to_torch
from tpurec.dense.registry import call_lowering

aten = torch.ops.aten
N = 20_000


def draw(op, args, kwargs=None, seed=0):
    out = call_lowering(op, args, kwargs or {}, key=jax.random.key(seed))
    return [to_torch(o) for o in out] if isinstance(out, (tuple, list)) else to_torch(out)


def test_deterministic_per_key_and_varies_across_keys():
    x = torch.empty(64)
    a, b, c = (draw(aten.uniform.default, (x,), seed=s) for s in (1, 1, 2))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_uniform_and_rand():
    u = draw(aten.uniform.default, (torch.empty(N), -2.0, 4.0))
    assert u.dtype == torch.float32 and u.min() >= -2 and u.max() < 4
    assert abs(u.mean().item() - 1.0) < 0.05
    r = draw(aten.rand.default, ([N],), {"dtype": torch.bfloat16})
    assert r.dtype == torch.bfloat16 and r.shape == (N,) and 0 <= r.min() and r.max() <= 1


def test_normal_family():
    z = draw(aten.normal_functional.default, (torch.empty(N, dtype=torch.float64), 3.0, 2.0))
    assert z.dtype == torch.float64 and abs(z.mean() - 3) < 0.05 and abs(z.std() - 2) < 0.05
    z = draw(aten.randn.default, ([100, 200],))
    assert z.shape == (100, 200) and z.dtype == torch.float32 and abs(z.std() - 1) < 0.03
    z = draw(aten.normal.Tensor_Tensor, (torch.full((N,), 5.0), torch.full((N,), 0.5)))
    assert abs(z.mean() - 5) < 0.02 and abs(z.std() - 0.5) < 0.02
    z = draw(aten.normal.float_float, (1.0, 1.0, [N]))
    assert z.dtype == torch.float32 and abs(z.mean() - 1) < 0.05
    assert draw(aten.randn_like.default, (torch.empty(3, 2, dtype=torch.float64),)).dtype == torch.float64


def test_bernoulli():
    b = draw(aten.bernoulli.p, (torch.empty(N), 0.3))
    assert b.dtype == torch.float32 and set(b.unique().tolist()) <= {0.0, 1.0}
    assert abs(b.mean() - 0.3) < 0.02
    p = torch.linspace(0, 1, N)
    b = draw(aten.bernoulli.default, (p,))
    assert b[p == 0].sum() == 0 and b[p == 1].min() == 1 and abs(b.mean() - 0.5) < 0.02


def test_integer_draws():
    r = draw(aten.randint.low, (-3, 5, [N]))
    assert r.dtype == torch.int64 and r.min() == -3 and r.max() == 4
    r = draw(aten.random.to, (torch.empty(N, dtype=torch.int32), 7))
    assert r.dtype == torch.int32 and r.min() == 0 and r.max() == 6
    r = draw(getattr(aten.random, "from"), (torch.empty(N), 2, 4))
    assert set(r.unique().tolist()) == {2.0, 3.0}
    r = draw(aten.random.default, (torch.empty(N, dtype=torch.bool),))
    assert set(r.unique().tolist()) == {False, True}
    p = draw(aten.randperm.default, (50,))
    assert p.dtype == torch.int64 and sorted(p.tolist()) == list(range(50))
    r = draw(aten.randint_like.low_dtype, (torch.empty(10, dtype=torch.int16), 1, 3))
    assert r.dtype == torch.int16 and set(r.tolist()) <= {1, 2}


@pytest.mark.parametrize("p", [0.0, 0.25, 1.0])
def test_native_dropout(p):
    x = torch.full((N,), 2.0)
    out, mask = draw(aten.native_dropout.default, (x, p, True))
    assert mask.dtype == torch.bool and out.dtype == torch.float32
    assert abs(mask.float().mean().item() - (1 - p)) < 0.02
    expected = torch.where(mask, x / (1 - p), 0.0) if p < 1 else torch.zeros_like(x)
    torch.testing.assert_close(out, expected)
    out, mask = draw(aten.native_dropout.default, (x, p, False))
    assert torch.equal(out, x) and bool(mask.all())
