"""Regression tests for device semantics that once gave silently wrong results (issue 13).

Each test runs the user's op through the ``tpu`` device and compares with
PyTorch CPU: values exactly (these are copies and shape changes, no arithmetic
beyond what max/mean need), shapes, strides where PyTorch defines them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tpurec
from tpurec.core import dispatch

aten = torch.ops.aten


def both(host: torch.Tensor, requires_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The same values on CPU and on tpu, both leaves."""
    host = host.detach().clone().requires_grad_(requires_grad)
    return host, host.detach().to("tpu").requires_grad_(requires_grad)


# --- reshape / to / contiguous below autograd copy when the strides require -----


PERMUTING_OPS = {
    "max_pool2d": lambda x: F.max_pool2d(x, 2),
    "max_pool3d": lambda x: F.max_pool3d(x.reshape(1, 1, 2, 4, 4), 2),
    "pixel_shuffle": lambda x: F.pixel_shuffle(x.reshape(1, 4, 2, 2), 2),
    "pixel_unshuffle": lambda x: F.pixel_unshuffle(x, 2),
    "channel_shuffle": lambda x: F.channel_shuffle(x.reshape(1, 4, 2, 2), 2),
}


@pytest.mark.parametrize("name", sorted(PERMUTING_OPS))
def test_decomposed_reshape_of_a_permuted_tensor_copies(name):
    # These decompose into permute + reshape below autograd; the reshape must copy.
    fn = PERMUTING_OPS[name]
    host, dev = both(torch.randn(32) if name == "max_pool3d" else torch.randn(1, 1, 4, 4), requires_grad=True)
    expected, actual = fn(host), fn(dev)
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual.cpu(), expected, rtol=0, atol=0)
    cotangent = torch.randn(expected.shape)
    expected.backward(cotangent)
    actual.backward(cotangent.to("tpu"))
    torch.testing.assert_close(dev.grad.cpu(), host.grad, rtol=0, atol=0)


def test_max_pool2d_of_arange_matches_cpu():
    x = torch.arange(16.0).reshape(1, 1, 4, 4)
    assert F.max_pool2d(x.to("tpu"), 2).cpu().flatten().tolist() == [5.0, 7.0, 13.0, 15.0]


@pytest.mark.parametrize(
    "op, args",
    [
        (aten.reshape.default, ((6,),)),
        (aten.reshape.default, ((3, 2),)),
        (aten.contiguous.default, ()),
        (aten.to.dtype, (torch.float64,)),
        (aten.flatten.using_ints, ()),
    ],
)
def test_aliasing_schema_ops_below_autograd_copy_a_permuted_tensor(op, args):
    host = torch.arange(6.0).reshape(2, 3).t()
    dev = host.to("tpu")
    expected = op(host, *args)
    # What the dispatcher hands the device when the op arrives below autograd
    # (inside a torch._decomp decomposition), instead of its composite kernel.
    actual = dispatch.dispatch(op, (dev, *args), {})
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert torch.equal(actual.cpu(), expected)


def test_reshape_that_can_view_still_aliases():
    dev = torch.arange(6.0).to("tpu")
    view = aten.reshape.default(dev, (2, 3))
    view.add_(1)
    assert dev.cpu().tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]


# --- in-place shape ops ------------------------------------------------------------


INPLACE_SHAPE_OPS = {
    "squeeze_": lambda t: t.squeeze_(),
    "squeeze_dim": lambda t: t.squeeze_(0),
    "unsqueeze_": lambda t: t.unsqueeze_(1),
    "t_": lambda t: t.t_() if t.dim() <= 2 else t.squeeze_(0).t_(),
    "transpose_": lambda t: t.transpose_(-1, -2),
    "swapdims_": lambda t: t.swapdims_(0, 2),
    "as_strided_": lambda t: t.as_strided_((2, 2), (1, 3), 1),
}


@pytest.mark.parametrize("name", sorted(INPLACE_SHAPE_OPS))
def test_inplace_shape_ops_change_the_tensor_itself(name):
    fn = INPLACE_SHAPE_OPS[name]
    host, dev = both(torch.arange(6.0).reshape(1, 2, 3))
    same = dev
    fn(host)
    result = fn(dev)
    assert result is same
    assert dev.shape == host.shape and dev.stride() == host.stride() and dev.storage_offset() == host.storage_offset()
    assert torch.equal(dev.cpu(), host)
    # Later ops see the new shape, and writes still reach the shared storage.
    dev.mul_(2)
    host.mul_(2)
    assert torch.equal(dev.cpu(), host)


def test_as_strided_outside_the_storage_raises_instead_of_reading_zeros():
    dev = torch.arange(10.0, device="tpu")
    assert dev.as_strided((2, 2), (1, 2), 6).cpu().tolist() == [[6.0, 8.0], [7.0, 9.0]]
    with pytest.raises(RuntimeError, match="storage offset 10 need a storage of 14 elements"):
        dev.as_strided((2, 2), (1, 2), 10)
    with pytest.raises(RuntimeError, match="storage"):
        dev.as_strided_((4,), (3,), 1)  # needs 11 elements
    assert dev.shape == (10,) and dev.stride() == (1,)  # unchanged after the error


def test_squeeze_then_matmul_has_the_squeezed_shape():
    x = torch.ones(1, 3, device="tpu")
    x.squeeze_()
    assert x.shape == (3,)
    assert (x @ torch.ones(3, 5, device="tpu")).shape == (5,)


def test_transpose_inplace_under_autograd_matches_cpu():
    host, dev = both(torch.randn(2, 3), requires_grad=True)
    outs = []
    for x in (host, dev):
        y = x * 2
        y.transpose_(0, 1)
        outs.append(y)
        (y * torch.arange(6.0).reshape(3, 2).to(x.device)).sum().backward()
    assert torch.equal(outs[1].cpu(), outs[0])
    assert torch.equal(dev.grad.cpu(), host.grad)


def test_rnn_runs_on_tpu_like_cpu():
    torch.manual_seed(0)
    rnn = torch.nn.RNN(3, 4, batch_first=True)
    x = torch.randn(2, 5, 3)
    expected, _ = rnn(x)
    actual, _ = rnn.to("tpu")(x.to("tpu"))
    torch.testing.assert_close(actual.cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("size", [(2, 2), (6,), (3, 3), (0,)])
def test_resize_matches_cpu(size):
    host, dev = both(torch.arange(6.0))
    host.resize_(size)
    dev.resize_(size)
    assert dev.shape == host.shape and dev.stride() == host.stride()
    # Values PyTorch defines: the old ones, wherever they still fit.
    kept = min(6, host.numel())
    assert torch.equal(dev.cpu().flatten()[:kept], host.flatten()[:kept])


def test_resize_rejects_negative_sizes_and_keeps_the_tensor():
    dev = torch.arange(6.0, device="tpu")
    with pytest.raises((ValueError, RuntimeError)):
        dev.resize_(-1, 2)
    assert dev.shape == (6,) and dev.cpu().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


# --- caches keyed by everything that changes their result ----------------------------


def test_view_cache_is_keyed_by_dtype():
    labels = torch.ones(4, dtype=torch.int64, device="tpu")
    scores = torch.ones(4, device="tpu")
    assert labels.unsqueeze(1).dtype == torch.int64
    assert scores.unsqueeze(1).dtype == torch.float32
    assert scores.to(torch.bfloat16).unsqueeze(1).dtype == torch.bfloat16


def test_view_that_changes_dtype_says_so():
    with pytest.raises(NotImplementedError, match="dtype"):
        torch.ones(4, device="tpu").view(torch.int32)


# --- shapes of quantile and batch norm ----------------------------------------------


def test_quantile_with_a_scalar_q_is_a_scalar():
    host, dev = both(torch.randn(7))
    for q in (0.5, torch.tensor(0.25)):
        expected = torch.quantile(host, q)
        actual = torch.quantile(dev, q.to("tpu") if isinstance(q, torch.Tensor) else q)
        assert actual.shape == expected.shape == ()
        torch.testing.assert_close(actual.cpu(), expected)


def test_native_batch_norm_eval_returns_empty_saved_stats():
    host, dev = both(torch.randn(4, 3, 2))
    stats = [torch.randn(3), torch.rand(3) + 0.5]
    expected = aten.native_batch_norm(host, None, None, *stats, False, 0.1, 1e-5)
    actual = aten.native_batch_norm(dev, None, None, *[s.to("tpu") for s in stats], False, 0.1, 1e-5)
    assert [tuple(a.shape) for a in actual] == [tuple(e.shape) for e in expected] == [(4, 3, 2), (0,), (0,)]
    torch.testing.assert_close(actual[0].cpu(), expected[0], rtol=1e-5, atol=1e-6)


def test_native_batch_norm_legit_no_stats_and_running_stat_updates():
    host, dev = both(torch.randn(4, 3, 2))
    expected = aten._native_batch_norm_legit.no_stats(host, None, None, True, 0.1, 1e-5)
    actual = aten._native_batch_norm_legit.no_stats(dev, None, None, True, 0.1, 1e-5)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a.cpu(), e, rtol=1e-5, atol=1e-6)
    # The overload with running statistics writes them in place.
    host_stats, dev_stats = [torch.zeros(3), torch.ones(3)], [torch.zeros(3, device="tpu"), torch.ones(3, device="tpu")]
    expected = aten._native_batch_norm_legit(host, None, None, *host_stats, True, 0.1, 1e-5)
    actual = aten._native_batch_norm_legit(dev, None, None, *dev_stats, True, 0.1, 1e-5)
    for a, e in zip(list(actual) + dev_stats, list(expected) + host_stats):
        torch.testing.assert_close(a.cpu(), e, rtol=1e-5, atol=1e-6)


# --- host fallbacks are counted, and an error under TPUREC_HOST_FALLBACK=error ------


@torch.library.custom_op("tpurec_test::host_only_double", mutates_args=(), device_types="cpu")
def _host_only_double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


_host_only_double.register_fake(lambda x: torch.empty_like(x))


class _DoubleInBackward(torch.autograd.Function):
    """Identity forward; the backward calls an op the tpu device cannot run."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return torch.ops.tpurec_test.host_only_double(grad)


def test_backward_host_fallback_is_counted_and_warns(monkeypatch):
    monkeypatch.setenv("TPUREC_HOST_FALLBACK", "warn")
    x = torch.ones(3, device="tpu", requires_grad=True)
    before = tpurec.stats()["host_fallbacks"].get("host_only_double.default", 0)
    with pytest.warns(RuntimeWarning, match="ran on the host"):
        _DoubleInBackward.apply(x).sum().backward()
    assert x.grad.cpu().tolist() == [2.0, 2.0, 2.0]
    assert tpurec.stats()["host_fallbacks"]["host_only_double.default"] == before + 1


def test_backward_host_fallback_raises_under_error_policy(monkeypatch):
    monkeypatch.setenv("TPUREC_HOST_FALLBACK", "error")
    x = torch.ones(3, device="tpu", requires_grad=True)
    _DoubleInBackward.apply(x).sum().backward()
    with pytest.raises(RuntimeError, match="host_only_double.*TPUREC_HOST_FALLBACK=error"):
        x.grad + 1
    assert dispatch._pending_fallback_error is None
    assert (x.grad + 1).cpu().tolist() == [3.0, 3.0, 3.0]


def test_bad_host_fallback_policy_is_a_clear_error(monkeypatch):
    from tpurec.core import modes

    monkeypatch.setenv("TPUREC_HOST_FALLBACK", "sometimes")
    with pytest.raises(ValueError, match="TPUREC_HOST_FALLBACK='sometimes'"):
        modes.host_fallback_policy()


# --- conj: tpu tensors carry no conj bit, so conj materialises -----------------


def test_conj_conjugates_the_values_of_a_complex_tensor():
    host = torch.tensor([[1 + 2j, -3 - 4j], [0.5j, 2.0]], dtype=torch.complex64)
    on_tpu = host.to("tpu")
    lazy = on_tpu.conj()
    # conj_physical semantics: the values are conjugated in a new tensor, no conj bit.
    assert not lazy.is_conj()
    assert torch.equal(lazy.cpu(), host.conj().resolve_conj())
    assert torch.equal(lazy.resolve_conj().cpu(), host.conj().resolve_conj())
    assert torch.equal(torch.conj_physical(on_tpu).cpu(), torch.conj_physical(host))
    assert torch.equal(on_tpu.conj().conj().cpu(), host)
    # the input is untouched (a materialised conj is not a view that writes back)
    assert torch.equal(on_tpu.cpu(), host)


def test_conj_of_a_real_tensor_is_the_tensor():
    host = torch.tensor([1.0, -2.0])
    assert torch.equal(host.to("tpu").conj().cpu(), host)


def test_conj_through_ifft_of_real_input_and_complex_autograd():
    """``ifft`` of real input conjugates an rfft internally: it used to return unconjugated values."""
    torch.manual_seed(0)
    x = torch.randn(7)
    torch.testing.assert_close(torch.fft.ifft(x.to("tpu")).cpu(), torch.fft.ifft(x), rtol=1e-5, atol=1e-6)
    z_host, z = both(torch.randn(5, dtype=torch.complex64), requires_grad=True)
    weights = torch.randn(5, dtype=torch.complex64)
    (z_host.conj() * weights + 1).abs().sum().backward()
    (z.conj() * weights.to("tpu") + 1).abs().sum().backward()
    torch.testing.assert_close(z.grad.cpu(), z_host.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["eager", "fused"])
def test_a_static_number_of_another_type_is_another_program(mode):
    """``arange(6)`` and ``arange(6.0)`` have equal arguments in Python (6 == 6.0) but results of two dtypes."""
    with tpurec.mode(mode):
        for args in [(6,), (6.0,), (0, 3, 1), (0, 3, 1.0), (6,)]:
            got, expected = torch.arange(*args, device="tpu"), torch.arange(*args)
            assert got.dtype == expected.dtype and got.tolist() == expected.tolist(), args
