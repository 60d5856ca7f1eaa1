"""Captured steps (``tpurec.graph``) of transformers models from the zoo, against PyTorch CPU.

The zoo's tiny configs (tests/models/zoo.py) train with ``AdamW(fused=True)`` (its state on the
device, as a captured step needs): two plain fused steps, the capture, then replays. Losses and
parameters are held to the zoo's float32 tolerance against the same steps on CPU. A model that
reads a value in Python during the step is refused, with the step run in full.
"""

import copy

import pytest
import torch

import tpurec
import zoo

STEPS = 6


def _batches(family: zoo.Family) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(STEPS):
        batch = family.inputs(g)
        batch.pop("attention_mask", None)  # an all-ones mask is read in Python (is it all ones?): no mask
        batches.append(batch)
    return batches


def _step(model, optimizer, batch):
    optimizer.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    return loss


@pytest.mark.parametrize("name", ["llama", "bert", "t5"])
def test_a_captured_step_trains_as_on_cpu(name):
    family = zoo.FAMILIES[name]
    torch.manual_seed(0)
    cpu = family.build()
    model = copy.deepcopy(cpu).to("tpu")
    batches = _batches(family)
    cpu_optimizer = torch.optim.AdamW(cpu.parameters(), lr=zoo.LR, fused=True)
    expected = [_step(cpu, cpu_optimizer, batch).item() for batch in batches]
    optimizer = torch.optim.AdamW(model.parameters(), lr=zoo.LR, fused=True)
    static = {key: torch.zeros_like(value, device="tpu") for key, value in batches[0].items()}
    graph = tpurec.TpuGraph()
    losses = []
    with tpurec.mode("fused"):
        for i, batch in enumerate(batches):
            for key, value in batch.items():
                static[key].copy_(value)
            if i < 2:
                losses.append(_step(model, optimizer, static).item())
            elif i == 2:
                with tpurec.graph(graph):
                    static_loss = _step(model, optimizer, static)
                losses.append(static_loss.item())
            else:
                graph.replay()
                losses.append(static_loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), **zoo.TOL)
    for (key, ours), theirs in zip(model.named_parameters(), cpu.parameters()):
        torch.testing.assert_close(ours.detach().cpu(), theirs.detach(), **zoo.TOL, msg=lambda m: f"{key}: {m}")


def test_a_model_that_reads_values_in_python_is_refused():
    family = zoo.FAMILIES["gpt2"]  # its forward reads a value of the batch on the host
    torch.manual_seed(0)
    model = family.build().to("tpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=zoo.LR, fused=True)
    batch = {key: value.to("tpu") for key, value in _batches(family)[0].items()}
    with tpurec.mode("fused"):
        for _ in range(2):
            _step(model, optimizer, batch).item()
        with pytest.raises(RuntimeError, match=r"sync point\(s\) \(item\)"):
            with tpurec.graph(tpurec.TpuGraph()):
                _step(model, optimizer, batch)
