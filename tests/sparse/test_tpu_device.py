"""The sparse modules run unchanged on the "tpu" device (ops dispatch to their lowerings)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagCollection as TorchrecEBC

import tpurec.sparse as sp
import tpurec
from helpers import make_tables, random_kjt


@pytest.mark.parametrize(
    "optimizer", [sp.SGD(0.1), sp.RowWiseAdagrad(0.1), sp.Adam(0.1)], ids=lambda o: type(o).__name__
)
def test_module_on_tpu_matches_cpu(optimizer):
    tables = make_tables()
    cpu = sp.EmbeddingBagCollection(tables, optimizer=optimizer, num_partitions=2, capacities=sp.Capacity(32))
    tpu = sp.EmbeddingBagCollection(
        tables, optimizer=optimizer, num_partitions=2, capacities=sp.Capacity(32), device="tpu"
    )
    tpu.load_state_dict(cpu.state_dict())
    assert tpu.device.type == "tpu" and tpu.stacked_weight(0).device.type == "tpu"
    rng = np.random.default_rng(0)
    for _ in range(3):
        kjt = random_kjt(tables, 3, rng)
        a, b = cpu(kjt).values(), tpu(kjt).values()
        assert b.device.type == "tpu"
        torch.testing.assert_close(b.cpu(), a, atol=1e-6, rtol=0)
        a.pow(2).sum().backward()
        b.pow(2).sum().backward()
    for x, y in zip([*cpu.parameters(), *cpu.buffers()], [*tpu.parameters(), *tpu.buffers()]):
        torch.testing.assert_close(y.cpu(), x.detach(), atol=1e-5, rtol=1e-6)
    assert set(tpu.state_dict()) == set(TorchrecEBC(tables).state_dict())


@pytest.mark.parametrize("mode", ["eager", "fused"])
def test_thirty_batches_of_varying_lengths_compile_nothing_after_the_first(mode):
    tables = make_tables()
    ebc = sp.EmbeddingBagCollection(
        tables, optimizer=sp.Adagrad(0.05), num_partitions=2, capacities=sp.Capacity(64), device="tpu"
    )
    rng = np.random.default_rng(1)
    with tpurec.mode(mode):
        for step in range(31):
            if step == 1:
                tpurec.reset_stats()
            ebc.optimizer.learning_rate = 0.05 / (1 + step)  # a schedule: a runtime scalar, no recompile
            out = ebc(random_kjt(tables, 4, rng)).values()
            out.square().sum().backward()
            out.sum().item()
    assert tpurec.stats()["compilations"] == 0
