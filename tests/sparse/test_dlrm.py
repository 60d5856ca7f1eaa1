"""torchrec's DLRM through from_torchrec trains like torchrec with FBGEMM's fused optimizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagCollection as TorchrecEBC
from torchrec.models.dlrm import DLRM
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from torchrec.optim import RowWiseAdagrad as TorchrecRowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import tpurec.sparse as sp
import tpurec
from helpers import make_tables, random_kjt


@pytest.mark.parametrize("device,mode", [("cpu", None), ("tpu", "eager"), ("tpu", "fused"), ("tpu", "compiled")])
@pytest.mark.parametrize(
    "optimizer_type,kwargs",
    [(torch.optim.SGD, {"lr": 0.5}), (TorchrecRowWiseAdagrad, {"lr": 0.1})],
    ids=["sgd", "rowwise_adagrad"],
)
def test_dlrm_ten_steps_match_torchrec(optimizer_type, kwargs, device, mode):
    torch.manual_seed(0)
    tables = make_tables(dims=(8, 8, 8), rows=(30, 20, 10))
    layers = {"dense_in_features": 5, "dense_arch_layer_sizes": [16, 8], "over_arch_layer_sizes": [16, 1]}
    reference = DLRM(
        embedding_bag_collection=FusedEmbeddingBagCollection(
            tables, optimizer_type=optimizer_type, optimizer_kwargs=kwargs
        ),
        **layers,
    )
    ours = DLRM(embedding_bag_collection=TorchrecEBC(tables), **layers)
    ours.load_state_dict(reference.state_dict())
    apply_optimizer_in_backward(optimizer_type, ours.sparse_arch.parameters(), kwargs)
    # The tpu device runs the same module unchanged: torch.ops.tpurec.* dispatch
    # to their lowerings; the KJT stays on the host (preprocessing is host-side).
    ours = sp.from_torchrec(ours, capacities=sp.Capacity(128)).to(device)
    assert isinstance(ours.sparse_arch.embedding_bag_collection, sp.EmbeddingBagCollection)

    dense_ref = torch.optim.Adagrad(reference.parameters(), lr=0.05)
    dense_ours = torch.optim.Adagrad(ours.parameters(), lr=0.05)
    # Compiled: the dense arch compiles; the sparse lookup (host preprocessing) runs outside the graph.
    forward = torch.compile(ours, backend="tpu") if mode == "compiled" else ours
    rng = np.random.default_rng(0)
    with tpurec.mode(mode if mode in ("eager", "fused") else "eager"):
        _train_both(reference, forward, dense_ref, dense_ours, tables, rng, device)
    state = ours.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key].cpu(), value, atol=1e-4, rtol=0)


def _train_both(reference, ours, dense_ref, dense_ours, tables, rng, device):
    for step in range(10):
        kjt = random_kjt(tables, 8, rng)
        dense = torch.from_numpy(rng.standard_normal((8, 5)).astype(np.float32))
        labels = torch.from_numpy(rng.integers(0, 2, 8).astype(np.float32))
        losses = []
        for model, opt, dev in ((reference, dense_ref, "cpu"), (ours, dense_ours, device)):
            opt.zero_grad()
            logits = model(dense.to(dev), kjt).squeeze(-1)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.to(dev))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) < 1e-4, (step, losses)
