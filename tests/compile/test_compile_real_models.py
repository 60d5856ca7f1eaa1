"""What real model code does inside ``torch.compile(backend="tpu")``, checked against PyTorch CPU.

Each function runs compiled on tpu tensors and uncompiled on CPU copies of the same inputs.
Values are compared exactly where the computation is exact (indexing, factories, integer
results) and with rtol 1e-6 where float arithmetic is involved.
"""

import pytest
import torch
import torch.nn.functional as F

import tpurec  # noqa: F401


def _both(fn, *inputs, backend="tpu"):
    """``fn`` compiled on tpu copies of ``inputs`` (moved back) and eager on the CPU originals."""
    compiled = torch.compile(fn, backend=backend)(*(x.to("tpu") for x in inputs))
    return compiled, fn(*inputs)


def _cpu(out):
    return [o.cpu() for o in out] if isinstance(out, (list, tuple)) else out.cpu()


# --- factory tensors created inside the compiled code ------------------------


def _constant_list(x):
    return x + torch.tensor([1.0, 2.0, 3.0], device=x.device)


def _constant_times_two(x):
    # Ops on a constant alone are what fake mode would constant-fold on other devices.
    return x * (torch.tensor([1.0, 2.0, 3.0], device=x.device) * 2)


def _constant_scalar(x):
    return x * torch.tensor(0.5, device=x.device)


def _cpu_constant_moved(x):
    return x - torch.tensor([3.0, 2.0, 1.0]).to(x.device)


def _growing_cache(x):
    # Hugging Face's KV cache: starts as torch.tensor([]) and grows by torch.cat.
    cache = torch.tensor([], device=x.device)
    for _ in range(2):
        cache = torch.cat([cache, x]) if cache.numel() else x
    return cache


def _empty_then_cat(x):
    return torch.cat([torch.empty(0, device=x.device), x])


def _arange_and_full(x):
    return x * torch.arange(3, device=x.device) + torch.full((3,), 2.0, device=x.device)


@pytest.mark.parametrize(
    "fn",
    [_constant_list, _constant_times_two, _constant_scalar, _cpu_constant_moved, _growing_cache, _empty_then_cat,
     _arange_and_full],
)
def test_factory_tensors_inside_compiled_code_match_cpu(fn):
    x = torch.randn(3)
    compiled, expected = _both(fn, x)
    assert compiled.device.type == "tpu"
    torch.testing.assert_close(compiled.cpu(), expected, rtol=1e-6, atol=0)


# --- indexing with a Python list ------------------------------------------------


@pytest.mark.parametrize(
    "fn",
    [lambda y: y[..., [-2], :], lambda y: y[[0, 1, 0]], lambda y: y[:, [2, 0]] * 2],
    ids=["ellipsis_list", "leading_list", "list_then_mul"],
)
def test_list_index_inside_compiled_code_matches_cpu(fn):
    y = torch.randn(2, 3, 4)
    compiled, expected = _both(fn, y)
    torch.testing.assert_close(compiled.cpu(), expected, rtol=0, atol=0)


# --- a data-dependent graph break ---------------------------------------------


def _gather_valid(labels, values):
    picked = (labels >= 0).nonzero()  # data-dependent shape: Dynamo breaks the graph here
    return values.gather(0, picked.squeeze(1)) * 2


@pytest.mark.parametrize("backend", ["eager", "tpu"])
def test_data_dependent_graph_break_matches_cpu(backend):
    labels = torch.tensor([1, -1, 2, 0, -1])
    values = torch.randn(5)
    torch._dynamo.utils.counters.clear()
    compiled, expected = _both(_gather_valid, labels, values, backend=backend)
    tpu_breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.compile(_gather_valid, backend="eager")(labels, values)
    cpu_breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    torch.testing.assert_close(compiled.cpu(), expected, rtol=0, atol=0)
    assert tpu_breaks == cpu_breaks, (tpu_breaks, cpu_breaks)


# --- _assert_async (F.one_hot, MoE routers) -------------------------------------


def test_one_hot_compiles_and_matches_cpu():
    classes = torch.tensor([[1, 3], [0, 4], [2, 2]])
    compiled, expected = _both(lambda i: F.one_hot(i, 5).sum(1).float(), classes)
    torch.testing.assert_close(compiled.cpu(), expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    "value, message",
    [(True, "held"), (False, "one_hot: Class values must be non-negative."), (0.0, None), (3, None)],
)
def test_eager_assert_async_checks_like_cpu(value, message):
    def run(device):
        args = (torch.tensor(value, device=device),) + (() if message is None else (message,))
        try:
            torch._assert_async(*args)
        except RuntimeError as e:
            return str(e)
        return None

    assert run("tpu") == run("cpu")


def test_eager_assert_async_of_several_values_fails_like_cpu():
    with pytest.raises(RuntimeError, match="more than one value is ambiguous"):
        torch._assert_async(torch.tensor([True, True]))
    with pytest.raises(RuntimeError, match="more than one value is ambiguous"):
        torch._assert_async(torch.tensor([True, True], device="tpu"))


def test_fused_assert_async_is_no_sync_point():
    # Like CUDA's asynchronous device assert: it does not flush the window to read the value.
    with tpurec.mode("fused"):
        x = torch.ones(3, device="tpu") * 2
        tpurec.reset_stats()
        torch._assert_async((x > 0).all(), "positive")
        assert tpurec.stats()["sync_points"] == {}
        y = (x + 1).cpu()
    assert torch.equal(y, torch.full((3,), 3.0))
