"""Lowerings added for OpInfo entries that had none: every sample of each entry through the device vs CPU."""

from __future__ import annotations

import pytest
import torch

from opinfo_device import check_opinfo

pytestmark = pytest.mark.usefixtures("no_host_fallback")


@pytest.mark.parametrize(
    "name",
    [
        "nonzero_static",  # static-size nonzero (fill past the count, empty inputs)
        "nn.functional.bilinear",  # aten._trilinear
        "geqrf",
        "linalg.householder_product",
        "ormqr",
        "nn.functional.pdist",
    ],
)
def test_every_sample_through_the_device(name):
    # ormqr has 144 samples: the first 24 cover every left/transpose combination.
    assert check_opinfo(name, max_samples=24 if name == "ormqr" else 1000) > 3


@pytest.mark.parametrize("p", [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, float("inf")])
def test_pdist_with_equal_rows_matches_cpu(p):
    # Rows 0 and 1 are equal: a zero distance, where every p's gradient is defined as 0.
    x = torch.tensor([[0.0, 1.0, 2.0], [0.0, 1.0, 2.0], [1.0, -1.0, 0.5], [2.0, 1.0, -3.0]])
    host, dev = x.clone().requires_grad_(), x.to("tpu").requires_grad_()
    expected, actual = torch.nn.functional.pdist(host, p), torch.nn.functional.pdist(dev, p)
    torch.testing.assert_close(actual.cpu(), expected.detach(), rtol=1e-6, atol=1e-6)
    expected.sum().backward()
    actual.sum().backward()
    torch.testing.assert_close(dev.grad.cpu(), host.grad, rtol=1e-6, atol=1e-6)


def test_multinomial_frequencies_and_distinct_draws():
    torch.tpu.manual_seed(0)
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    drawn = torch.multinomial(probs.to("tpu"), 20000, replacement=True)
    assert drawn.device.type == "tpu" and drawn.dtype == torch.int64
    frequencies = torch.bincount(drawn.cpu(), minlength=4) / 20000
    # 4 standard deviations of a frequency over 20000 draws is at most 0.015.
    torch.testing.assert_close(frequencies, probs, rtol=0, atol=0.015)
    pairs = torch.multinomial(probs.repeat(5000, 1).to("tpu"), 2).cpu()  # without replacement
    assert (pairs[:, 0] != pairs[:, 1]).all() and (pairs != 1).all()
    torch.testing.assert_close(torch.bincount(pairs[:, 0], minlength=4) / 5000, probs, rtol=0, atol=0.03)


@pytest.mark.parametrize(
    "name", ["nn.functional.linear_cross_entropy.chunked", "nn.functional.linear_cross_entropy.chunked_none"]
)
def test_library_custom_ops_run_their_default_implementation_on_the_device(name):
    # torch.nn's chunked linear_cross_entropy is a torch.library.custom_op whose default
    # (CompositeExplicitAutograd) kernel is written in torch ops: on tpu it runs op by op.
    assert check_opinfo(name, max_samples=6) > 0


def test_a_user_custom_op_with_a_default_implementation():
    @torch.library.custom_op("tpurec_test::scaled_sum", mutates_args=())
    def scaled_sum(x: torch.Tensor, scale: float) -> torch.Tensor:
        return (x * scale).sum(dim=-1)

    @scaled_sum.register_fake
    def _(x, scale):
        return x.new_empty(x.shape[:-1])

    x = torch.randn(3, 4)
    actual = scaled_sum(x.to("tpu"), 2.5)
    assert actual.device.type == "tpu"
    torch.testing.assert_close(actual.cpu(), scaled_sum(x, 2.5))


@pytest.mark.parametrize("name", ["histogram", "histogramdd"])
def test_histogram_samples_through_the_device(name):
    # Bin counts and edge tensors, ranges, weights, density; empty and constant inputs among them.
    assert check_opinfo(name, max_samples=48) > 3


@pytest.mark.parametrize(
    "values, bins, kwargs",
    [
        ([0.0, 0.1, 0.2, 0.3, 0.7, 1.0], 10, {}),  # values on the edges; 1.0 in the last bin
        ([1.0, 1.0, 1.0], 4, {}),  # constant: edges widened by 0.5
        ([], 3, {}),  # empty: edges span [0, 1]
        ([0.0, 0.1, 0.2, 0.3, 0.7, 1.0], 3, {"range": (0.1, 0.7)}),  # outside the range: not counted
        (torch.arange(0, 1, 0.01).tolist(), 100, {}),
    ],
)
def test_histogram_bins_values_on_edges_as_cpu(values, bins, kwargs):
    x = torch.tensor(values)
    expected = torch.histogram(x, bins, **kwargs)
    actual = torch.histogram(x.to("tpu"), bins, **kwargs)
    assert torch.equal(actual.hist.cpu(), expected.hist)
    assert torch.equal(actual.bin_edges.cpu(), expected.bin_edges)


def test_histogramdd_counts_points_inside_every_range():
    x = torch.tensor([[0.0, 1.0], [0.5, 1.0], [1.0, 1.0], [2.0, 0.5], [0.25, 3.0]])
    weight = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    for kwargs in ({}, {"range": [0.0, 1.0, 0.5, 1.5]}, {"weight": weight, "density": True}):
        dev_kwargs = {k: v.to("tpu") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        expected = torch.histogramdd(x, [2, 3], **kwargs)
        actual = torch.histogramdd(x.to("tpu"), [2, 3], **dev_kwargs)
        torch.testing.assert_close(actual.hist.cpu(), expected.hist, rtol=1e-6, atol=0)
        for a, e in zip(actual.bin_edges, expected.bin_edges):  # linspace: equal up to float32 rounding
            torch.testing.assert_close(a.cpu(), e, rtol=1e-6, atol=0)


def test_rrelu_training_draws_slopes_and_backward_uses_them():
    torch.tpu.manual_seed(0)
    x = torch.randn(2000).to("tpu").requires_grad_()
    y = torch.nn.functional.rrelu(x, 0.1, 0.3, training=True)
    host_x = x.detach().cpu()
    slopes = (y / x).detach().cpu()[host_x <= 0]
    assert 0.1 <= slopes.min() and slopes.max() <= 0.3
    assert abs(slopes.mean().item() - 0.2) < 0.01  # U(0.1, 0.3): sd of the mean over ~1000 draws ~ 0.002
    assert torch.equal(y.detach().cpu()[host_x > 0], host_x[host_x > 0])
    y.sum().backward()
    torch.testing.assert_close(x.grad.cpu()[host_x <= 0], slopes)
    evaluated = torch.nn.functional.rrelu(x.detach(), 0.1, 0.3, training=False)
    torch.testing.assert_close(evaluated.cpu(), torch.nn.functional.rrelu(host_x, 0.1, 0.3, training=False))


@pytest.mark.parametrize(
    "x", [torch.randn(3, 4), torch.arange(10), torch.tensor([True, False, True]), torch.randn(2, 3).double()]
)
def test_hash_tensor_matches_cpu_bit_for_bit(x):
    assert torch.equal(torch.hash_tensor(x.to("tpu")).cpu(), torch.hash_tensor(x))
    assert torch.equal(
        torch.hash_tensor(x.to("tpu"), dim=[0], keepdim=True).cpu(), torch.hash_tensor(x, dim=[0], keepdim=True)
    )


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_limited_unsigned_dtypes_move_to_the_device_and_back(dtype):
    x = torch.tensor([0, 1, 2**15, 65535]).to(dtype)
    moved = x.to("tpu")
    assert moved.dtype == dtype and torch.equal(moved.cpu(), x)
