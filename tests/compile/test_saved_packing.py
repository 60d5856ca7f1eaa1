"""The forward's small saved activations reach the backward packed (tpurec/compile/saved.py).

Checked through ``torch.compile(backend="tpu")``: a Hugging Face BERT and a model saving
float32, int64 and bool activations train with the gradients and losses of PyTorch on CPU,
packed or not, in eager and fused mode; the forward graph returns fewer tensors when packed;
large and symbolic-shaped activations are left as they are.
"""

from __future__ import annotations

import copy

import pytest
import torch

import tpurec
from tpurec.bench.text import VOCAB, tiny_bert
from tpurec.compile import backend, saved

# float32 on two backends, a few SGD steps: the compile tests' relative tolerance.
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture
def graph_outputs(monkeypatch):
    """How many values each compiled graph returned on its last call, by graph kind (forward/backward)."""
    counts: dict[str, int] = {}
    original = backend.CompiledGraph.__call__

    def spy(self, *args):
        results = original(self, *args)
        counts[self.name.split("#")[0]] = len(results)
        return results

    monkeypatch.setattr(backend.CompiledGraph, "__call__", spy)
    return counts


class _Mixed(torch.nn.Module):
    """Saves float32 activations, int64 indices (max_pool2d) and a bool mask (a comparison) for its backward."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 4, 3, padding=1)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        h = torch.tanh(self.conv(x))
        h, _ = torch.nn.functional.max_pool2d(h, 2, return_indices=True)
        h = torch.where(h > 0.1, h * h, -h)
        return torch.sigmoid(self.head(h.flatten(1))).sum()


class _WeightTransforms(torch.nn.Module):
    """Saves activations of the weights alone (static shapes) beside batch-sized ones and the batch size."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(4, 6) * 0.5)
        self.w2 = torch.nn.Parameter(torch.randn(6, 3) * 0.5)
        self.scale = torch.nn.Parameter(torch.randn(3))

    def forward(self, x):
        h = torch.tanh(x @ torch.tanh(self.w1))
        h = h @ torch.sigmoid(self.w2)
        return (h * torch.exp(self.scale)).mean(0).sum() * x.shape[0]


def _train(model: torch.nn.Module, batches: list, device: str, mode: str, packed: bool, dynamic: bool = False):
    """Losses and final gradients of SGD steps over ``batches`` (each a dict of forward kwargs or a tensor)."""
    model = copy.deepcopy(model).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    forward = torch.compile(model, backend="tpu", dynamic=dynamic) if device == "tpu" else model
    losses = []
    with tpurec.mode(mode), tpurec.config.override(compile_pack_saved=packed):
        for batch in batches:
            optimizer.zero_grad()
            if isinstance(batch, dict):
                loss = forward(**{k: v.to(device) for k, v in batch.items()}).loss
            else:
                loss = forward(batch.to(device))
            loss.backward()
            grads = [p.grad.detach().to("cpu") for p in model.parameters() if p.grad is not None]
            optimizer.step()
            losses.append(loss.item())
    return losses, grads


def _bert_batches(steps: int = 3) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (4, 16), generator=g)
    return [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}] * steps


@pytest.mark.parametrize("mode", ["eager", "fused"])
def test_a_compiled_bert_trains_as_on_cpu_with_its_saved_activations_packed(mode, graph_outputs):
    model = tiny_bert(hidden=32, intermediate=64, positions=64)
    batches = _bert_batches()
    cpu_losses, cpu_grads = _train(model, batches, "cpu", "eager", packed=True)
    losses, grads = _train(model, batches, "tpu", mode, packed=True)
    packed_outputs = graph_outputs["forward"]
    torch._dynamo.reset()
    _, unpacked_grads = _train(model, batches, "tpu", mode, packed=False)
    unpacked_outputs = graph_outputs["forward"]

    torch.testing.assert_close(losses, cpu_losses, rtol=RTOL, atol=ATOL)
    for got, unpacked, want in zip(grads, unpacked_grads, cpu_grads):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(unpacked, want, rtol=RTOL, atol=ATOL)
    # The forward returns its loss, logits and what the backward needs: about 50 of those are
    # small activations, which now travel as one tensor.
    assert packed_outputs < unpacked_outputs - 30, (packed_outputs, unpacked_outputs)


@pytest.mark.parametrize("mode", ["eager", "fused"])
def test_float_index_and_mask_activations_are_packed_per_dtype_with_cpus_gradients(mode, graph_outputs, monkeypatch):
    torch.manual_seed(0)
    model = _Mixed()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(2, 2, 4, 4, generator=g) for _ in range(3)]
    packed_counts = []
    original = saved.pack_saved
    monkeypatch.setattr(saved, "pack_saved", lambda *a: packed_counts.append(original(*a)) or packed_counts[-1])

    cpu_losses, cpu_grads = _train(model, batches, "cpu", "eager", packed=True)
    losses, grads = _train(model, batches, "tpu", mode, packed=True)

    torch.testing.assert_close(losses, cpu_losses, rtol=RTOL, atol=ATOL)
    for got, want in zip(grads, cpu_grads):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    packed_outputs = graph_outputs["forward"]
    torch._dynamo.reset()
    _train(model, batches, "tpu", mode, packed=False)
    assert packed_counts[0] >= 3, packed_counts
    # The packed tensors (one per dtype with several) replace the ones they hold.
    assert graph_outputs["forward"] - packed_outputs >= packed_counts[0] - 3


def test_large_and_symbolic_activations_are_left_as_they_are(monkeypatch):
    torch.manual_seed(0)
    model = _Mixed()
    g = torch.Generator().manual_seed(2)
    packed_counts = []
    original = saved.pack_saved
    monkeypatch.setattr(saved, "pack_saved", lambda *a: packed_counts.append(original(*a)) or packed_counts[-1])

    monkeypatch.setattr(saved, "MAX_PACKED_ELEMENTS", 0)
    batches = [torch.randn(2, 2, 4, 4, generator=g)]
    losses, grads = _train(model, batches, "tpu", "fused", packed=True)
    cpu_losses, cpu_grads = _train(model, batches, "cpu", "eager", packed=True)
    torch.testing.assert_close(losses, cpu_losses, rtol=RTOL, atol=ATOL)
    assert packed_counts == [0]

    monkeypatch.setattr(saved, "MAX_PACKED_ELEMENTS", 2**18)
    torch._dynamo.reset()
    packed_counts.clear()
    batches = [torch.randn(n, 2, 4, 4, generator=g) for n in (2, 3, 5)]
    losses, grads = _train(model, batches, "tpu", "fused", packed=True, dynamic=True)
    cpu_losses, cpu_grads = _train(model, batches, "cpu", "eager", packed=True)
    torch.testing.assert_close(losses, cpu_losses, rtol=RTOL, atol=ATOL)
    for got, want in zip(grads, cpu_grads):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    # Batch-sized activations have a symbolic size; only the weights' shapes are static.
    assert packed_counts and all(count == 0 for count in packed_counts)


@pytest.mark.parametrize("mode", ["eager", "fused"])
def test_static_activations_of_a_graph_with_symbolic_sizes_are_packed_in_the_order_the_backward_takes(
    mode, monkeypatch
):
    # The backward takes the saved sizes (SymInts) before the saved tensors, the forward returns
    # them after: the packed tensors must reach the backward in the tensors' place.
    torch.manual_seed(0)
    model = _WeightTransforms()
    g = torch.Generator().manual_seed(3)
    batches = [torch.randn(n, 4, generator=g) for n in (3, 5, 7)]
    packed_counts = []
    original = saved.pack_saved
    monkeypatch.setattr(saved, "pack_saved", lambda *a: packed_counts.append(original(*a)) or packed_counts[-1])

    losses, grads = _train(model, batches, "tpu", mode, packed=True, dynamic=True)
    cpu_losses, cpu_grads = _train(model, batches, "cpu", "eager", packed=True)

    torch.testing.assert_close(losses, cpu_losses, rtol=RTOL, atol=ATOL)
    for got, want in zip(grads, cpu_grads):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    assert packed_counts and packed_counts[0] >= 2, packed_counts  # tanh(w1), sigmoid(w2), exp(scale)


class _CpuScale(torch.nn.Module):
    """Divides its activations by a scale computed on the CPU in the forward (DeBERTa-v2's attention scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return torch.sigmoid(self.b(h) / torch.sqrt(torch.tensor(8.0))).sum()


class _CpuIndexedTable(torch.nn.Module):
    """Indexes a bias table with an int64 index built on the CPU in the forward (BEiT's relative
    position bias), beside int64 indices computed on the device."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.n = n
        self.table = torch.nn.Parameter(torch.randn(2 * n - 1, 2))
        self.proj = torch.nn.Linear(n, n)

    def forward(self, x):
        positions = torch.arange(self.n)
        index = positions[:, None] - positions[None, :] + self.n - 1  # on the CPU
        bias = self.table[index.view(-1)].view(self.n, self.n, 2).sum(-1)
        h = torch.tanh(self.proj(x) + bias)
        order = h.argmax(-1, keepdim=True)
        picked = torch.gather(torch.sigmoid(h), -1, order)
        first = torch.gather(h * h, -1, h.argmin(-1, keepdim=True))
        return (picked * first).sum()


@pytest.mark.parametrize("mode", ["eager", "fused"])
@pytest.mark.parametrize("model_class", [_CpuScale, _CpuIndexedTable])
def test_activations_saved_on_the_cpu_stay_out_of_the_packing_and_train_as_on_cpu(mode, model_class, monkeypatch):
    # A tensor the forward graph computes on the CPU (a 0-dim scale, an int64 index) is saved
    # for the backward beside tpu tensors of its dtype: packing them into one tpu tensor would
    # concatenate across devices.
    torch.manual_seed(0)
    model = model_class()
    g = torch.Generator().manual_seed(4)
    batches = [torch.randn(2, 4, 4, generator=g) for _ in range(3)]
    packed_counts = []
    original = saved.pack_saved
    monkeypatch.setattr(saved, "pack_saved", lambda *a: packed_counts.append(original(*a)) or packed_counts[-1])

    losses, grads = _train(model, batches, "tpu", mode, packed=True)
    cpu_losses, cpu_grads = _train(model, batches, "cpu", "eager", packed=True)

    torch.testing.assert_close(losses, cpu_losses, rtol=RTOL, atol=ATOL)
    assert len(grads) == len(cpu_grads)
    for got, want in zip(grads, cpu_grads):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    assert packed_counts and packed_counts[0] >= 2, packed_counts  # the tpu activations are still packed
