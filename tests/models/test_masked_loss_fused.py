"""A loss over the positions a boolean mask selects, trained in one long fused-mode loop.

ELECTRA's discriminator (``ElectraForPreTraining``) takes its loss over
``logits[attention_mask == 1]``. The mask came from the host, so its values are known there
(tpurec.core.mirrors) and the masked indexing, forward and backward, runs as a gather and a
scatter on the device: no sync point inside the step. Were it a sync point, each fused window
would run from the middle of one step to the middle of the next, and the window holding the
first steady optimizer step would compile at step 3, after the warm-up.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import transformers

import tpurec
import zoo

STEPS = 5
WARMUP = 2  # step 1 creates AdamW's state, step 2 is the first steady step


def _electra_discriminator() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.ElectraForPreTraining(transformers.ElectraConfig(**zoo._ENC, embedding_size=16))


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = zoo._ids(g)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0  # the second sequence is padded
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 2, ids.shape, generator=g)}


def _train(model: torch.nn.Module, device: str) -> tuple[list[float], list[int], list[torch.Tensor]]:
    """Losses, new programs per step, and the final parameters of AdamW steps run in one fused-mode block."""
    model = copy.deepcopy(model).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = {k: v.to(device) for k, v in _batch().items()}
    losses, programs = [], []
    with tpurec.mode("fused") if device == "tpu" else contextlib.nullcontext():
        for _ in range(STEPS):
            tpurec.reset_stats()
            optimizer.zero_grad()
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            programs.append(tpurec.stats()["compile_requests"])
    return losses, programs, [p.detach().cpu() for p in model.parameters()]


def test_electra_discriminator_compiles_nothing_after_warmup_in_one_fused_block() -> None:
    model = _electra_discriminator()
    cpu_losses, _, cpu_params = _train(model, "cpu")
    losses, programs, params = _train(model, "tpu")
    assert programs[WARMUP:] == [0] * (STEPS - WARMUP), programs
    torch.testing.assert_close(losses, cpu_losses, **zoo.TOL)
    for got, want in zip(params, cpu_params):
        torch.testing.assert_close(got, want, **zoo.TOL)
