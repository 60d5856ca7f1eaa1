"""tpurec.sparse.EmbeddingCollection against torchrec.EmbeddingCollection trained by TorchRec on CPU."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torchrec import KeyedJaggedTensor
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection as TorchrecEC
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import tpurec
import tpurec.sparse as sp
from helpers import random_kjt
from test_input_forms import vbe_kjt

STEPS = 5


def _tables():
    return [
        EmbeddingConfig(name="item", embedding_dim=4, num_embeddings=30, feature_names=["history", "clicked"]),
        EmbeddingConfig(name="shops", embedding_dim=4, num_embeddings=7, feature_names=["shop"]),
    ]


def _pair(optimizer_class=torch.optim.Adagrad, kwargs=None, need_indices=False, max_seq_len=None):
    torch.manual_seed(0)
    reference = TorchrecEC(_tables(), need_indices=need_indices)
    ours = copy.deepcopy(reference)
    for model in (reference, ours):
        apply_optimizer_in_backward(optimizer_class, model.parameters(), dict(kwargs or {"lr": 0.1}))
    return reference, sp.from_torchrec(ours, device="tpu", max_seq_len=max_seq_len)


def _assert_same_output(ours, theirs, need_indices=False):
    assert list(ours) == list(theirs)
    for key in theirs:
        torch.testing.assert_close(ours[key].values().cpu(), theirs[key].values(), atol=1e-6, rtol=0, msg=key)
        torch.testing.assert_close(ours[key].lengths().cpu(), theirs[key].lengths(), msg=key)
        if need_indices:
            torch.testing.assert_close(ours[key].weights().cpu(), theirs[key].weights(), msg=key)


def test_forward_matches_torchrec_with_indices_and_empty_sequences():
    reference, ours = _pair(need_indices=True)
    assert isinstance(ours, sp.EmbeddingCollection) and ours.need_indices()
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["history", "clicked", "shop"],
        values=torch.tensor([1, 2, 2, 3, 29, 4, 0, 6, 6]),
        lengths=torch.tensor([3, 0, 2, 0, 1, 0, 3, 0, 0]),  # batch of 3; empty sequences
    )
    with torch.no_grad():
        _assert_same_output(ours(kjt), reference(kjt), need_indices=True)


@pytest.mark.parametrize("mode", ["eager", "fused"])
@pytest.mark.parametrize("optimizer_class", [torch.optim.Adagrad, torch.optim.SGD], ids=["adagrad", "sgd"])
def test_five_steps_match_torchrec(mode, optimizer_class):
    reference, ours = _pair(optimizer_class)
    rng = np.random.default_rng(1)
    with tpurec.mode(mode):
        for _ in range(STEPS):
            kjt = random_kjt(_tables(), 4, rng, max_len=5)
            for model in (reference, ours):
                out = model(kjt)
                sum(jt.values().pow(2).sum() * (i + 1) for i, jt in enumerate(out.values())).backward()
    theirs = reference.state_dict()
    assert set(ours.state_dict()) == set(theirs)  # TorchRec's keys: embeddings.<table>.weight
    for key, value in ours.state_dict().items():
        torch.testing.assert_close(value.cpu(), theirs[key], atol=1e-5, rtol=1e-5, msg=key)


def test_state_dict_round_trip_and_optimizer_state():
    _, ours = _pair()
    kjt = random_kjt(_tables(), 3, np.random.default_rng(2), max_len=3)
    sum(jt.values().sum() for jt in ours(kjt).values()).backward()
    fresh = sp.EmbeddingCollection(_tables(), optimizer=sp.Adagrad(0.1, eps=1e-10), device="tpu")
    fresh.load_state_dict(TorchrecEC(_tables()).state_dict() | {k: v.cpu() for k, v in ours.state_dict().items()})
    fresh.load_optimizer_state_dict(ours.optimizer_state_dict())
    assert set(ours.optimizer_state_dict()["state"]) == {"embeddings.item.weight", "embeddings.shops.weight"}
    kjt2 = random_kjt(_tables(), 3, np.random.default_rng(3), max_len=3)
    for model in (ours, fresh):
        sum(jt.values().sum() for jt in model(kjt2).values()).backward()
    for key, value in ours.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[key].cpu(), value.cpu(), atol=0, rtol=0, msg=key)


def test_longer_sequence_than_max_seq_len_raises_and_changes_nothing():
    _, ours = _pair(max_seq_len={"history": 4, "clicked": 4, "shop": 2})
    before = {k: v.cpu().clone() for k, v in ours.state_dict().items()}
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["history", "clicked", "shop"], values=torch.tensor([1, 2, 3, 1, 2, 3]), lengths=torch.tensor([1, 2, 3])
    )
    with pytest.raises(sp.CapacityError, match="feature 'shop' has a sequence of 3 ids but max_seq_len=2"):
        ours(kjt)
    for key, value in ours.state_dict().items():
        assert torch.equal(value.cpu(), before[key]), key


def test_tables_of_two_dims_are_refused_as_in_torchrec():
    tables = [
        EmbeddingConfig(name="a", embedding_dim=4, num_embeddings=5, feature_names=["fa"]),
        EmbeddingConfig(name="b", embedding_dim=8, num_embeddings=5, feature_names=["fb"]),
    ]
    with pytest.raises(ValueError, match="one embedding dim"):
        sp.EmbeddingCollection(tables)


def test_a_feature_in_two_tables_trains_as_torchrec():
    # TorchRec names the outputs of a feature looked up in several tables "feature@table".
    tables = [
        EmbeddingConfig(name="item", embedding_dim=4, num_embeddings=30, feature_names=["history", "clicked"]),
        EmbeddingConfig(name="shops", embedding_dim=4, num_embeddings=7, feature_names=["shop", "clicked"]),
    ]
    torch.manual_seed(0)
    reference = TorchrecEC(tables, need_indices=True)
    ours = copy.deepcopy(reference)
    for model in (reference, ours):
        apply_optimizer_in_backward(torch.optim.Adagrad, model.parameters(), {"lr": 0.1})
    ours = sp.from_torchrec(ours, device="tpu")
    rng = np.random.default_rng(3)
    # One config with the three features and the smallest table's rows: ids that fit every table.
    batch_shape = [
        EmbeddingConfig(name="ids", embedding_dim=4, num_embeddings=7, feature_names=["history", "clicked", "shop"])
    ]
    for _ in range(3):
        kjt = random_kjt(batch_shape, 4, rng, max_len=4)
        outs = [model(kjt) for model in (reference, ours)]
        assert list(outs[1]) == list(outs[0]) == ["history", "clicked@item", "shop", "clicked@shops"]
        _assert_same_output(outs[1], outs[0], need_indices=True)
        for out in outs:
            sum(jt.values().pow(2).sum() * (i + 1) for i, jt in enumerate(out.values())).backward()
    theirs = reference.state_dict()
    for key, value in ours.state_dict().items():
        torch.testing.assert_close(value.cpu(), theirs[key], atol=1e-5, rtol=1e-5, msg=key)


@pytest.mark.parametrize("inverse", [False, True], ids=["no_inverse_indices", "inverse_indices_ignored"])
def test_a_variable_batch_per_feature_trains_as_torchrec(inverse):
    # TorchRec's EmbeddingCollection reads each feature's own sequences (and no inverse_indices).
    reference, ours = _pair()
    rng = np.random.default_rng(4)
    for _ in range(3):
        kjt = vbe_kjt(_tables(), 5, rng, max_len=4, inverse=inverse)
        outs = [model(kjt) for model in (reference, ours)]
        assert {k: v.lengths().numel() for k, v in outs[1].items()} == {
            k: v.lengths().numel() for k, v in outs[0].items()
        }
        _assert_same_output(outs[1], outs[0])
        for out in outs:
            sum(jt.values().pow(2).sum() * (i + 1) for i, jt in enumerate(out.values())).backward()
    theirs = reference.state_dict()
    for key, value in ours.state_dict().items():
        torch.testing.assert_close(value.cpu(), theirs[key], atol=1e-5, rtol=1e-5, msg=key)
