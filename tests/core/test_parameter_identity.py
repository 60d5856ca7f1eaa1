"""Moving a module to tpu and back keeps its Parameter objects, as moving it to CUDA does.

PyTorch converts a CUDA module's parameters in place (``param.data = new``); for tpu it made
new Parameter objects, which untied shared weights, dropped attributes and left optimizers
built before the move holding the CPU tensors. The autograd engine part: a backward pass
on any tpu device index, from any thread, also after CPU autograd ran before ``import tpurec``.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers

import tpurec

RTOL = 1e-5  # the same float32 math on both devices: differences are rounding only


class TiedLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.hidden = torch.nn.Linear(6, 6)
        self.out = torch.nn.Linear(6, 11, bias=False)
        self.out.weight = self.emb.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 6))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(self.emb(ids) * self.scale)))


def _train(model, optimizer, device: str, steps: int = 3) -> list[float]:
    ids = torch.tensor([[1, 4, 7], [2, 9, 10]], device=device)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), ids[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_tied_weights_attributes_and_an_optimizer_built_before_the_move_survive():
    torch.manual_seed(0)
    model = TiedLM()
    reference = copy.deepcopy(model)
    weight = model.emb.weight
    weight.note = "kept"
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)  # before .to, as users often do

    assert model.to("tpu") is model
    assert model.emb.weight is weight and model.out.weight is weight
    assert weight.device.type == "tpu" and isinstance(weight, torch.nn.Parameter) and weight.note == "kept"
    assert len(list(model.parameters())) == len(list(reference.parameters())) == 3
    assert list(model.state_dict()) == list(reference.state_dict())
    assert all(p.device.type == "tpu" for group in optimizer.param_groups for p in group["params"])

    losses = _train(model, optimizer, "tpu")
    expected = _train(reference, torch.optim.AdamW(reference.parameters(), lr=0.05), "cpu")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=RTOL, atol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=RTOL, atol=1e-6, msg=name)


def test_back_to_cpu_and_dtype_changes_keep_the_objects_grads_and_hooks():
    model = TiedLM()
    weight = model.emb.weight
    weight.note = "kept"
    seen = []
    weight.register_hook(lambda grad: seen.append(grad.device.type) or grad * 2)
    model.to("tpu")

    model(torch.tensor([[1, 2]], device="tpu")).sum().backward()
    assert seen == ["tpu"]  # a hook registered before the move runs on the moved parameter
    grad = weight.grad.cpu()

    model.cpu()
    assert model.emb.weight is weight and model.out.weight is weight
    assert type(weight) is torch.nn.Parameter and weight.device.type == "cpu" and weight.note == "kept"
    assert "_storage" not in weight.__dict__  # the CPU parameter holds no device buffer
    torch.testing.assert_close(weight.grad, grad, rtol=0, atol=0)

    model.to("tpu").to(torch.float64)
    assert model.emb.weight is weight and model.out.weight is weight
    assert weight.dtype == torch.float64 and weight.device.type == "tpu"
    assert weight.grad.dtype == torch.float64


def test_a_graph_built_before_the_move_refuses_to_run_backward():
    model = torch.nn.Linear(3, 3)
    loss = model(torch.ones(1, 3)).sum()  # this graph accumulates into the CPU weight
    model.to("tpu")
    with pytest.raises(RuntimeError, match="built before its parameter moved"):
        loss.backward()


def test_weak_references_to_a_parameter_follow_it():
    import weakref

    model = torch.nn.Linear(3, 3)
    weight = model.weight
    ref = weakref.ref(weight)  # torch.distributed / TorchRec keep per-parameter maps this way
    model.to("tpu")
    assert model.weight is weight and ref() is weight and weight.device.type == "tpu"


def test_a_parameter_that_cannot_be_swapped_is_replaced_with_a_warning():
    model = torch.nn.Linear(3, 3)
    weight = model.weight
    view = weight.view(-1)  # holds a second reference to the weight's tensor
    with pytest.warns(UserWarning, match="made a new Parameter object"):
        model.to("tpu")
    assert model.weight is not weight and model.weight.device.type == "tpu"
    del view


@pytest.mark.parametrize("move_first", [True, False], ids=["to-then-convert", "convert-then-to"])
def test_torchrec_in_backward_optimizer_survives_the_move(move_first):
    import torchrec
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from tpurec.sparse.convert import from_torchrec

    torch.manual_seed(0)
    tables = [torchrec.EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["f0"])]
    ebc = torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.5})
    before = ebc.embedding_bags["t0"].weight.detach().clone()
    model = from_torchrec(ebc.to("tpu")) if move_first else from_torchrec(ebc).to("tpu")
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f0"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1]))
    model(kjt).values().sum().backward()  # raised "no embedding optimizer" when .to dropped it
    after = model.state_dict()["embedding_bags.t0.weight"].cpu()
    expected = before.clone()
    expected[[1, 2, 3]] -= 0.5  # SGD on a sum-pooled sum: every looked-up row gets gradient 1
    torch.testing.assert_close(after, expected, rtol=0, atol=1e-6)


def test_gpt2_keeps_its_tied_embedding_and_its_first_gradient_matches_cpu():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config).eval()
    reference = copy.deepcopy(model)
    model.to("tpu")
    assert model.lm_head.weight is model.transformer.wte.weight
    assert len(list(model.named_parameters())) == len(list(reference.named_parameters()))

    ids = torch.randint(0, 64, (2, 8))
    model(ids.to("tpu"), labels=ids.to("tpu")).loss.backward()
    reference(ids, labels=ids).loss.backward()
    torch.testing.assert_close(
        model.transformer.wte.weight.grad.cpu(), reference.transformer.wte.weight.grad, rtol=1e-4, atol=1e-6
    )


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, env=env
    )


def test_cpu_backward_before_import_then_tpu_backward_in_a_subprocess():
    result = _run(
        """
        import threading, torch
        a = torch.ones(3, requires_grad=True)
        (a * 2).sum().backward()  # the engine sizes its device queues now, before tpu exists
        import tpurec
        b = torch.ones(3, device="tpu", requires_grad=True)
        (b * 3).sum().backward()
        c = torch.ones(3, device="tpu:5", requires_grad=True)
        out = []
        def work():
            (c * 4).sum().backward()
            out.append(c.grad.cpu().tolist())
        thread = threading.Thread(target=work)
        thread.start(); thread.join()
        print(b.grad.cpu().tolist(), c.grad.device, out)
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[3.0, 3.0, 3.0] tpu:5 [[4.0, 4.0, 4.0]]"


def test_duck_typed_jax_probes_do_not_flush_the_fused_window():
    # transformers' is_tracing() calls x.jax() when a tensor has it (torchax's protocol).
    x = torch.ones(4, device="tpu")
    assert not hasattr(x, "jax")
    with tpurec.mode("fused"):
        y = x * 2
        tpurec.reset_stats()
        assert not transformers.utils.import_utils.is_tracing(y)
        assert sum(tpurec.stats()["sync_points"].values()) == 0
        assert y.to_jax().shape == (4,)
