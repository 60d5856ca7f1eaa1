"""Models the first lowerings must carry: forward and backward equal to CPU."""

import pytest
import torch

import tpurec  # noqa: F401
from tpurec.bench.modes import DenseStep


def compare(make_model, make_inputs, loss_fn, rtol=1e-5, atol=1e-6):
    torch.manual_seed(0)
    cpu_model = make_model()
    tpu_model = make_model()
    tpu_model.load_state_dict(cpu_model.state_dict())
    tpu_model.to("tpu")
    inputs = make_inputs()
    cpu_loss = loss_fn(cpu_model, *inputs)
    cpu_loss.backward()
    tpu_loss = loss_fn(tpu_model, *(x.to("tpu") for x in inputs))
    tpu_loss.backward()
    torch.testing.assert_close(tpu_loss.cpu(), cpu_loss.detach(), rtol=rtol, atol=atol)
    for (name, p), q in zip(cpu_model.named_parameters(), tpu_model.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=rtol * 10, atol=atol * 10, msg=name)


def test_dlrm_dense_arch_with_dot_interaction():
    def inputs():
        g = torch.Generator().manual_seed(1)
        return (
            torch.randn(16, 13, generator=g),
            torch.randn(16, 26, 64, generator=g),
            torch.rand(16, 1, generator=g).round(),
        )

    compare(DenseStep, inputs, lambda m, d, s, y: torch.nn.functional.binary_cross_entropy_with_logits(m(d, s), y))


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 32)
        self.block = torch.nn.TransformerEncoderLayer(
            32, 4, dim_feedforward=64, dropout=0.0, activation="gelu", batch_first=True
        )
        self.head = torch.nn.Linear(32, 50)

    def forward(self, tokens):
        return self.head(torch.nn.functional.silu(self.block(self.embed(tokens))))


def test_transformer_block_with_embedding_and_cross_entropy():
    def inputs():
        g = torch.Generator().manual_seed(2)
        return torch.randint(0, 50, (4, 10), generator=g), torch.randint(0, 50, (4, 10), generator=g)

    def loss(m, tokens, targets):
        return torch.nn.functional.cross_entropy(m(tokens).reshape(-1, 50), targets.reshape(-1))

    compare(TinyLM, inputs, loss, rtol=2e-5, atol=2e-6)


def test_mse_tanh_sigmoid_log_softmax_mlp():
    def model():
        return torch.nn.Sequential(
            torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Sigmoid(), torch.nn.Linear(8, 3)
        )

    def inputs():
        g = torch.Generator().manual_seed(3)
        return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)

    compare(model, inputs, lambda m, x, y: torch.nn.functional.mse_loss(m(x).log_softmax(-1), y))


def test_dropout_trains_with_device_randomness():
    torch.manual_seed(0)
    x = torch.ones(2000, device="tpu", requires_grad=True)
    y = torch.nn.functional.dropout(x, p=0.25, training=True)
    kept = (y.cpu() != 0).float()
    assert abs(kept.mean().item() - 0.75) < 0.05
    torch.testing.assert_close(y.cpu()[kept.bool()], torch.full((int(kept.sum()),), 1 / 0.75))
    y.sum().backward()
    torch.testing.assert_close(x.grad.cpu(), kept / 0.75)
    torch.manual_seed(0)
    again = torch.nn.functional.dropout(torch.ones(2000, device="tpu"), p=0.25, training=True)
    assert torch.equal(again.cpu(), y.detach().cpu())


@pytest.mark.parametrize("op", ["cat", "stack", "split", "chunk", "gather", "index_select", "index", "max", "argmax"])
def test_tensor_ops_match_cpu(op):
    g = torch.Generator().manual_seed(4)
    a = torch.randn(4, 6, generator=g)
    idx = torch.tensor([[0, 2], [1, 1], [5, 0], [3, 4]])
    fns = {
        "cat": lambda t, i: torch.cat([t, t * 2], dim=1),
        "stack": lambda t, i: torch.stack([t, t + 1]),
        "split": lambda t, i: torch.stack(torch.split(t, 3, dim=1)),
        "chunk": lambda t, i: torch.cat(torch.chunk(t, 2), dim=1),
        "gather": lambda t, i: torch.gather(t, 1, i),
        "index_select": lambda t, i: torch.index_select(t, 1, i[:, 0]),
        "index": lambda t, i: t[i[:, 0] % 4, i[:, 1]],
        "max": lambda t, i: torch.stack([t.max(dim=1).values, t.min(dim=1).values]),
        "argmax": lambda t, i: t.argmax(dim=0),
    }
    expected = fns[op](a, idx)
    got = fns[op](a.to("tpu"), idx.to("tpu"))
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got.cpu(), expected)


# per_sample_weights exist only for mode="sum" in PyTorch.
@pytest.mark.parametrize("mode,weighted", [("sum", False), ("sum", True), ("mean", False), ("max", False)])
def test_embedding_bag_forward_and_backward(mode, weighted):
    torch.manual_seed(0)
    cpu = torch.nn.EmbeddingBag(20, 6, mode=mode, padding_idx=3)
    dev = torch.nn.EmbeddingBag(20, 6, mode=mode, padding_idx=3).to("tpu")
    dev.load_state_dict(cpu.state_dict())
    indices = torch.tensor([1, 2, 3, 5, 5, 9, 0, 3, 19])
    offsets = torch.tensor([0, 2, 2, 6])  # bag 2 is empty; index 3 is padding
    weights = torch.rand(9) if weighted else None
    out_cpu = cpu(indices, offsets, per_sample_weights=weights)
    out_dev = dev(
        indices.to("tpu"), offsets.to("tpu"), per_sample_weights=None if weights is None else weights.to("tpu")
    )
    torch.testing.assert_close(out_dev.cpu(), out_cpu)
    g = torch.randn_like(out_cpu)
    out_cpu.backward(g)
    out_dev.backward(g.to("tpu"))
    torch.testing.assert_close(dev.weight.grad.cpu(), cpu.weight.grad)


def test_embedding_bag_include_last_offset_and_sample_weight_grad():
    torch.manual_seed(1)
    weight = torch.randn(12, 4, requires_grad=True)
    indices = torch.tensor([0, 4, 4, 7, 11, 2])
    offsets = torch.tensor([0, 3, 3, 6])
    psw = torch.rand(6, requires_grad=True)
    ref = torch.nn.functional.embedding_bag(
        indices, weight, offsets, mode="sum", per_sample_weights=psw, include_last_offset=True
    )
    ref.square().sum().backward()
    w_dev = weight.detach().to("tpu").requires_grad_()
    p_dev = psw.detach().to("tpu").requires_grad_()
    out = torch.nn.functional.embedding_bag(
        indices.to("tpu"), w_dev, offsets.to("tpu"), mode="sum", per_sample_weights=p_dev, include_last_offset=True
    )
    out.square().sum().backward()
    torch.testing.assert_close(out.cpu(), ref.detach())
    torch.testing.assert_close(w_dev.grad.cpu(), weight.grad)
    torch.testing.assert_close(p_dev.grad.cpu(), psw.grad)


def test_allclose_and_equal():
    x = torch.randn(5, device="tpu")
    assert torch.allclose(x, x + 1e-9) and not torch.allclose(x, x + 1)
    assert torch.equal(x, x.clone()) and not torch.equal(x, x[:4])
