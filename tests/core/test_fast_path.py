"""The fast path of a repeated op (tpurec/core/calls.py, dispatch.py, view_ops.py) and the fused replay.

A repeated call with the same argument metadata skips the calling convention's split and
reuses what its first call found; a fused window recorded node for node as an earlier one
reuses its structure. Each must give what the full path gives: the values of PyTorch CPU,
runtime scalars read on every call, static arguments told apart, replaced lowerings used.
"""

import pytest
import torch

import tpurec
from tpurec.core import calls, fused, runtime, view_ops
from tpurec.dense.registry import LOWERINGS, Lowering

aten = torch.ops.aten


def _pair(shape=(4, 5), seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)


def _fast_entries(op) -> int:
    return sum(1 for signature in runtime.programs.fast_table() if signature[0] == id(op))


@pytest.mark.parametrize("mode", ["eager", "fused"])
def test_a_repeated_op_takes_the_fast_path_with_the_values_of_pytorch_cpu(mode):
    a, b = _pair()
    ta, tb = a.to("tpu"), b.to("tpu")
    with tpurec.mode(mode):
        outs = [ta * tb + ta for _ in range(5)]
        mats = [ta @ tb.T for _ in range(5)]
        tpurec.synchronize()
    assert _fast_entries(aten.mul.Tensor) >= 1 and _fast_entries(aten.mm.default) >= 1
    for out in outs:
        assert out.shape == (4, 5) and out.stride() == (5, 1) and out.dtype == torch.float32
        torch.testing.assert_close(out.cpu(), a * b + a, rtol=1e-6, atol=1e-6)
    for out in mats:
        torch.testing.assert_close(out.cpu(), a @ b.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["eager", "fused"])
def test_a_changing_python_scalar_is_read_on_every_call_and_compiles_once(mode):
    a, b = _pair(seed=1)
    ta, tb = a.to("tpu"), b.to("tpu")
    with tpurec.mode(mode):
        ta.add(tb, alpha=0.5)  # warm-up: the program and its fast entry
        tpurec.synchronize()
        before = tpurec.stats()["compile_requests"]
        results = [ta.add(tb, alpha=alpha) for alpha in (0.25, 2.0, -3.0)]
        scaled = [ta * factor for factor in (1.5, 2.5)]
        scaled += [ta * factor for factor in (1.5, 2.5)]  # the second round: every program warm
        tpurec.synchronize()
        assert tpurec.stats()["compile_requests"] - before <= (3 if mode == "fused" else 1)
    for alpha, out in zip((0.25, 2.0, -3.0), results):
        torch.testing.assert_close(out.cpu(), a.add(b, alpha=alpha))
    for factor, out in zip((1.5, 2.5, 1.5, 2.5), scaled):
        torch.testing.assert_close(out.cpu(), a * factor)


def test_static_arguments_are_told_apart():
    a, _ = _pair(seed=2)
    ta = a.to("tpu")
    for _ in range(2):
        for dim in (0, 1):
            for keepdim in (False, True):
                out = ta.sum(dim=dim, keepdim=keepdim)
                assert out.shape == a.sum(dim=dim, keepdim=keepdim).shape
                torch.testing.assert_close(out.cpu(), a.sum(dim=dim, keepdim=keepdim))
        # True and 1 in the same position are different calls (a bool is static, an int a runtime scalar)
        torch.testing.assert_close((ta + True).cpu(), a + True)
        torch.testing.assert_close((ta + 1).cpu(), a + 1)
        torch.testing.assert_close(ta.to(torch.float64).cpu(), a.to(torch.float64))


def test_in_place_ops_write_through_views_on_the_fast_path():
    base = torch.arange(12.0).reshape(3, 4)
    t = base.to("tpu")
    for step in range(3):
        t[1:].add_(1.0, alpha=2.0)
        t[:, 0].mul_(0.5)
        base[1:].add_(1.0, alpha=2.0)
        base[:, 0].mul_(0.5)
        torch.testing.assert_close(t.cpu(), base, msg=f"step {step}")


def test_repeated_views_give_their_own_metadata_and_share_the_storage():
    a = torch.arange(24.0).reshape(4, 6)
    t = a.to("tpu")
    for _ in range(3):
        for view, expected in (
            (t[1:], a[1:]),
            (t[2:], a[2:]),
            (t[:, 1:5:2], a[:, 1:5:2]),
            (t.T, a.T),
            (t.unbind(0)[2], a.unbind(0)[2]),
            (t.view(6, 4), a.view(6, 4)),  # sizes as a list
            (t.view(3, 8), a.view(3, 8)),
        ):
            assert view.shape == expected.shape and view.stride() == expected.stride()
            assert view.storage_offset() == expected.storage_offset()
            assert view._storage is t._storage  # pyright: ignore[reportAttributeAccessIssue]
            torch.testing.assert_close(view.cpu(), expected)
    assert any(key[0] == id(aten.slice.Tensor) for key in view_ops._fast_views)


def test_a_view_needing_grad_is_still_made_by_autograd():
    t = torch.randn(3, 4).to("tpu").requires_grad_()
    for _ in range(2):
        (t[1:] * 2).sum().backward()
    assert t.grad is not None
    torch.testing.assert_close(t.grad.cpu(), torch.tensor([[0.0] * 4] + [[4.0] * 4] * 2))


def test_mixed_devices_still_fail_clearly():
    x = torch.ones(3).to("tpu:0")
    y = torch.ones(3).to("tpu:1")
    _ = x + x  # a fast entry for tpu:0 tensors
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        _ = x + y
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        _ = x + torch.ones(3)


def test_a_replaced_lowering_is_used_at_once(monkeypatch):
    op = aten.sub.Tensor
    right = LOWERINGS[op]
    t = torch.ones(3).to("tpu")
    torch.testing.assert_close((t - t).cpu(), torch.zeros(3))  # route and fast entry kept
    monkeypatch.setitem(LOWERINGS, op, Lowering(op, lambda a, b, alpha=1: right.fn(a, b, alpha=alpha) + 7.0))
    runtime.programs.clear()  # the programs traced with the old lowering
    try:
        torch.testing.assert_close((t - t).cpu(), torch.full((3,), 7.0))
    finally:
        # The programs traced with the replaced lowering must not outlive it (later tests in this process).
        monkeypatch.undo()
        runtime.programs.clear()


def test_the_fast_path_gathers_what_the_full_path_gathers():
    """The first call of each signature checks both gather the same inputs; a repeat then matches."""
    a, b = _pair(seed=4)
    ta, tb = a.to("tpu"), b.to("tpu")
    table = runtime.programs.fast_table()
    torch.where(ta > 0, ta, tb)
    torch.clamp(ta, min=-0.5, max=0.5)
    hits = tpurec.stats()["cache_hits"]
    out = torch.clamp(ta, min=-0.25, max=0.75)  # other runtime scalars: the same entry
    assert tpurec.stats()["cache_hits"] == hits + 1
    torch.testing.assert_close(out.cpu(), torch.clamp(a, min=-0.25, max=0.75))
    assert any(signature[0] == id(aten.clamp.default) for signature in table)
    assert (
        calls._gather(aten.clamp.default, calls.argument_kinds(aten.clamp.default), (ta, [1.0]), {}, None, frozenset())
        is None
    )


def _step(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss


def test_fused_replay_gives_the_losses_of_eager_and_compiles_nothing_after_warm_up():
    def run(mode):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to("tpu")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(32, 6, generator=g).to("tpu"), torch.randn(32, 1, generator=g).to("tpu")
        losses, compiles = [], None
        with tpurec.mode(mode):
            for step in range(8):
                if step == 3:
                    compiles = tpurec.stats()["compile_requests"]
                losses.append(_step(model, optimizer, x, y).item())  # .item(): a sync point mid-step
            compiles = tpurec.stats()["compile_requests"] - compiles
        return losses, compiles

    eager, _ = run("eager")
    fused_losses, compiles = run("fused")
    torch.testing.assert_close(fused_losses, eager, rtol=1e-5, atol=1e-6)
    assert compiles == 0
    last = fused._last[0]
    assert last.next is not None and len(last.programs) >= 1  # the step's windows replay in a cycle


def test_a_window_that_leaves_the_replayed_structure_midway_still_computes_right():
    a, b = _pair(seed=5)
    ta, tb = a.to("tpu"), b.to("tpu")
    with tpurec.mode("fused"):
        for _ in range(3):
            out = ((ta + tb) * tb).sum()
            torch.testing.assert_close(out.cpu(), ((a + b) * b).sum())
        out = ((ta + tb) - tb).sum()  # the same first op, then another
        torch.testing.assert_close(out.cpu(), ((a + b) - b).sum())
        shorter = ta + tb
        torch.testing.assert_close(shorter.cpu(), a + b)


@pytest.mark.parametrize("mode", ["eager", "fused"])
def test_tensor_lists_and_foreach_ops_on_the_fast_path(mode):
    g = torch.Generator().manual_seed(6)
    xs = [torch.randn(3, generator=g), torch.randn(2, 2, generator=g)]
    ts = [x.to("tpu") for x in xs]
    cats = []
    with tpurec.mode(mode):
        for step in range(3):
            aten._foreach_add_.Scalar(ts, 1.5)
            aten._foreach_mul_.ScalarList(ts, [0.5, 2.0 + step])  # a scalar list: runtime inputs
            cats.append(torch.cat([ts[0], ts[1].flatten()]))
            aten._foreach_add_.Scalar(xs, 1.5)
            aten._foreach_mul_.ScalarList(xs, [0.5, 2.0 + step])
            torch.testing.assert_close(cats[-1].cpu(), torch.cat([xs[0], xs[1].flatten()]), msg=f"step {step}")
    for t, x in zip(ts, xs):
        torch.testing.assert_close(t.cpu(), x)
    assert any(signature[0] == id(aten._foreach_mul.ScalarList) for signature in runtime.programs.fast_table())


@pytest.mark.parametrize("mode", ["eager", "fused"])
def test_targets_sharing_a_storage_or_not_are_different_calls(mode):
    """Views of one buffer and views of two buffers with the same metadata need different programs."""
    srcs = [torch.full((3,), 1.0).to("tpu"), torch.full((3,), 2.0).to("tpu")]
    with tpurec.mode(mode):
        for _ in range(2):
            one, two = torch.zeros(6).to("tpu"), torch.zeros(6).to("tpu")
            aten._foreach_copy_.default([two[0:3], one[3:6]], srcs)  # two storages
            aten._foreach_copy_.default([one[0:3], one[3:6]], srcs)  # one storage: both writes kept
            torch.testing.assert_close(one.cpu(), torch.tensor([1.0, 1, 1, 2, 2, 2]))
            torch.testing.assert_close(two.cpu(), torch.tensor([1.0, 1, 1, 0, 0, 0]))


def _fused_program_arguments(step) -> list:
    """(program, arguments) of each fused program that ``step()`` runs (spied on runtime.Program.__call__)."""
    seen, original = [], runtime.Program.__call__

    def spy(self, *args):
        if self.origin is not None and self.origin[0] == "fused":
            seen.append((self, args))
        return original(self, *args)

    runtime.Program.__call__ = spy
    try:
        step()
    finally:
        runtime.Program.__call__ = original
    return seen


def test_a_windows_python_scalars_reach_its_program_packed_and_keep_their_types():
    # Python numbers keep JAX's weak types when packed: a float32 tensor times a float stays
    # float32, an int64 tensor plus a large int stays exact, a bool argument stays a bool.
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 3, generator=g)
    n = torch.arange(15, dtype=torch.int64).reshape(5, 3)
    h = torch.arange(15, dtype=torch.float16).reshape(5, 3)
    tx, tn, th = x.to("tpu"), n.to("tpu"), h.to("tpu")

    def step():
        return [
            tx * 2.5 + 0.25,
            tn + 2**40,
            tn * 3,
            th * 1.5,
            torch.clamp(tx, min=-0.5, max=0.5),
            torch.cumsum(tn, 0, dtype=torch.int64) + 1,
            torch.nn.functional.leaky_relu(tx, 0.125),
        ]

    with tpurec.mode("fused"):
        step()
        tpurec.synchronize()
        outs = []
        calls = _fused_program_arguments(lambda: (outs.extend(step()), tpurec.synchronize()))
    expected = [
        x * 2.5 + 0.25,
        n + 2**40,
        n * 3,
        h * 1.5,
        torch.clamp(x, min=-0.5, max=0.5),
        torch.cumsum(n, 0) + 1,
        torch.nn.functional.leaky_relu(x, 0.125),
    ]
    for out, want in zip(outs, expected):
        assert out.dtype == want.dtype
        torch.testing.assert_close(out.cpu(), want, rtol=1e-6, atol=1e-6)  # ints: exactly
        assert str(tpurec.core.programs.value_of(out).dtype) == str(want.dtype).removeprefix("torch.")
    ((program, args),) = calls
    donated, kept, floats, ints, bools, others = args
    assert all(not isinstance(x, (int, float)) for x in kept)
    assert floats is not None and floats.dtype.name == "float64" and 2.5 in floats.tolist()
    assert ints is not None and ints.dtype.name == "int64" and 2**40 in ints.tolist()
    # The float32 and float16 math stays in its dtype (no float64 math, which a TPU emulates).
    hlo = program.jitted.lower(*args).as_text()
    assert "tensor<5x3xf64>" not in hlo and "tensor<5x3xf32>" in hlo


@pytest.mark.parametrize("value", [2.5, 2**40, True])
def test_a_packed_scalar_is_traced_as_jax_traces_the_python_scalar(value):
    import jax
    import numpy as np

    packed = np.array([0, value], dtype={float: np.float64, int: np.int64, bool: np.bool_}[type(value)])
    as_argument = jax.eval_shape(lambda v: v, value)
    unpacked = jax.eval_shape(lambda p: fused._unpacked(p, 1, type(value)), packed)
    assert (unpacked.shape, unpacked.dtype, unpacked.weak_type) == ((), as_argument.dtype, as_argument.weak_type)
