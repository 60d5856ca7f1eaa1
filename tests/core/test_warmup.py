"""tpurec.warmup: the step's programs compiled ahead of the first real batch, the step undone."""

from __future__ import annotations

import pytest
import torch

import tpurec


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Dropout(0.25))
        self.norm = torch.nn.BatchNorm1d(12)  # buffers the step changes (running stats, batch count)
        self.head = torch.nn.Linear(12, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(x)))


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = _Net().to("tpu")
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)  # step counts in its state
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 6, generator=g).to("tpu"), torch.randn(16, 1, generator=g).to("tpu")) for _ in range(4)]

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    return model, optimizer, batches, step


@pytest.mark.parametrize("mode", ["fused", "eager"])
def test_after_warmup_the_first_steps_compile_nothing_and_train_as_without_it(mode):
    torch.tpu.manual_seed(7)
    model, optimizer, batches, step = _setup()
    with tpurec.mode(mode):
        report = tpurec.warmup(step, *batches[0], state=(model, optimizer))
        assert report["compile_requests"] > 0, report  # the warm-up met the programs first (compiled or from disk)
        assert optimizer.state == {} and all(p.grad is None for p in model.parameters())
        tpurec.reset_stats()
        warmed = [step(*batch).item() for batch in batches]
    counts = tpurec.stats()
    assert counts["compilations"] == 0 and counts["compile_requests"] == 0, counts

    torch.tpu.manual_seed(7)  # the same run without the warm-up: the same values bit for bit
    plain_model, _, _, plain_step = _setup()
    with tpurec.mode(mode):
        plain = [plain_step(*batch).item() for batch in batches]
    assert warmed == plain
    for (name, a), b in zip(model.state_dict().items(), plain_model.state_dict().values()):
        assert torch.equal(a.cpu(), b.cpu()), name


def test_warmup_puts_back_the_step_counts_of_a_fused_embedding_optimizer():
    import tpurec.sparse as sparse
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

    tables = [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=20, feature_names=["f0"])]

    def setup():
        torch.manual_seed(0)
        # Adam: its bias correction reads the step count, a Python number of the collection
        ebc = sparse.EmbeddingBagCollection(tables, optimizer=sparse.Adam(learning_rate=0.1), device="tpu")
        head = torch.nn.Linear(4, 1).to("tpu")
        optimizer = torch.optim.SGD(head.parameters(), lr=0.1)

        def step(kjt: KeyedJaggedTensor) -> torch.Tensor:
            optimizer.zero_grad()
            loss = head(ebc(kjt).values()).square().mean()
            loss.backward()
            optimizer.step()
            return loss

        return ebc, head, optimizer, step

    batches = [
        KeyedJaggedTensor.from_lengths_sync(
            keys=["f0"], values=torch.tensor([i, i + 1, 3, 7]), lengths=torch.tensor([2, 1, 1])
        )
        for i in range(3)
    ]
    ebc, head, optimizer, step = setup()
    with tpurec.mode("fused"):
        tpurec.warmup(step, batches[0], state=[ebc, head, optimizer])
        warmed = [step(kjt).item() for kjt in batches]
    plain_ebc, _, _, plain_step = setup()
    with tpurec.mode("fused"):
        plain = [plain_step(kjt).item() for kjt in batches]
    assert warmed == plain
    assert ebc.optimizer_state_dict()["steps"] == plain_ebc.optimizer_state_dict()["steps"] == [3]
    for key, value in plain_ebc.state_dict().items():
        assert torch.equal(ebc.state_dict()[key].cpu(), value.cpu()), key


def test_warmup_refuses_what_it_cannot_put_back():
    model, optimizer, batches, step = _setup()
    with pytest.raises(ValueError, match="needs the modules and optimizers the step changes"):
        tpurec.warmup(step, *batches[0], state=())
    with pytest.raises(TypeError, match="got a tensor"):
        tpurec.warmup(step, *batches[0], state=[model, batches[0][0]])
    with pytest.raises(ValueError, match="at least once"):
        tpurec.warmup(step, *batches[0], state=model, steps=0)
