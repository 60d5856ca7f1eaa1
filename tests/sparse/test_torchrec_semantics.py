"""A converted TorchRec model trains as TorchRec trains it, or says why it cannot.

Reference: the same TorchRec model trained on CPU by TorchRec itself (its in-backward
optimizers run torch's optimizer on each table's dense gradient). Each case here was a
silent deviation before: a default, an update rule or a module that tpurec changed
without a word.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagCollection as TorchrecEBC
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.optim import RowWiseAdagrad as TorchrecRowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import tpurec
import tpurec.sparse as sp
from helpers import make_tables, random_kjt

STEPS = 5


def _pair(optimizer_class, kwargs, tables=None):
    tables = tables or make_tables(dims=(4, 4, 8))
    torch.manual_seed(0)
    reference = TorchrecEBC(tables)
    ours = copy.deepcopy(reference)
    apply_optimizer_in_backward(optimizer_class, reference.parameters(), dict(kwargs))
    apply_optimizer_in_backward(optimizer_class, ours.parameters(), dict(kwargs))
    return tables, reference, sp.from_torchrec(ours, device="tpu")


def _tables_of(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in module.state_dict().items()}


# Gradients of about 1e-7 (loss scale 1e-6) make Adagrad's eps visible: FBGEMM's 1e-8 in place
# of torch's 1e-10 moves the tables by ~1e-3 in 5 steps.
@pytest.mark.parametrize(
    "optimizer_class, kwargs, scale",
    [
        (torch.optim.Adagrad, {"lr": 0.1}, 1e-6),  # torch's eps=1e-10, not FBGEMM's 1e-8
        (TorchrecRowWiseAdagrad, {"lr": 0.1}, 1e-6),
        (torch.optim.SGD, {"lr": 0.5}, 1.0),
        (torch.optim.Adagrad, {"lr": 0.1, "eps": 1e-3, "lr_decay": 0.0, "weight_decay": 0.0}, 1.0),
    ],
    ids=["adagrad-default-eps", "rowwise-adagrad-default-eps", "sgd", "adagrad-explicit"],
)
def test_in_backward_optimizer_trains_as_torchrec(optimizer_class, kwargs, scale):
    tables, reference, ours = _pair(optimizer_class, kwargs)
    rng = np.random.default_rng(1)
    for _ in range(STEPS):
        kjt = random_kjt(tables, 4, rng, max_len=3)
        (reference(kjt).values().pow(2).sum() * scale).backward()
        (ours(kjt).values().pow(2).sum() * scale).backward()
    theirs = _tables_of(reference)
    for key, value in _tables_of(ours).items():
        # Adagrad's 1/sqrt(sum) amplifies float32 rounding of the accumulated squares.
        torch.testing.assert_close(value, theirs[key], atol=1e-5, rtol=1e-5, msg=key)


def test_in_backward_adagrad_takes_torch_default_eps():
    _, _, ours = _pair(torch.optim.Adagrad, {"lr": 0.1})
    assert ours.optimizer.eps == 1e-10
    assert ours.optimizer_semantics == "torch"
    # A fused module keeps FBGEMM's defaults, as torchrec's FusedEmbeddingBagCollection does.
    assert sp.EmbeddingBagCollection(make_tables(), optimizer=torch.optim.Adagrad).optimizer.eps == 1e-8


@pytest.mark.parametrize(
    "optimizer_class, kwargs, what",
    [
        (torch.optim.Adam, {"lr": 0.1}, "dense Adam"),
        (TorchrecRowWiseAdagrad, {"lr": 0.1, "weight_decay": 0.01}, "weight_decay=0.01"),
        (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.1}, "lr_decay=0.1"),
    ],
    ids=["adam", "rowwise-weight-decay", "adagrad-lr-decay"],
)
def test_in_backward_settings_without_an_exact_fused_update_raise(optimizer_class, kwargs, what):
    model = TorchrecEBC(make_tables())
    apply_optimizer_in_backward(optimizer_class, model.parameters(), kwargs)
    with pytest.raises(ValueError, match=what):
        sp.from_torchrec(model, device="tpu")


@pytest.mark.parametrize(
    "optimizer_class, kwargs",
    [(torch.optim.Adagrad, {"lr": 0.1}), (TorchrecRowWiseAdagrad, {"lr": 0.1}), (torch.optim.SGD, {"lr": 0.5})],
    ids=["adagrad", "rowwise-adagrad", "sgd"],
)
@pytest.mark.parametrize("device", ["tpu", "cpu"])
def test_two_lookups_in_one_step_make_one_update_on_the_summed_gradient(optimizer_class, kwargs, device):
    # apply_optimizer_in_backward updates a table once per backward pass, on the gradient summed
    # over every lookup of the step; a fused update per lookup would square Adagrad's sum apart.
    tables, reference, ours = _pair(optimizer_class, kwargs)
    ours = ours.to(device)
    rng = np.random.default_rng(2)
    for _ in range(STEPS):
        a, b = random_kjt(tables, 3, rng), random_kjt(tables, 2, rng)
        (reference(a).values().pow(2).sum() + reference(b).values().sum()).backward()
        (ours(a.to(device)).values().pow(2).sum() + ours(b.to(device)).values().sum()).backward()
    theirs = _tables_of(reference)
    for key, value in _tables_of(ours).items():
        torch.testing.assert_close(value, theirs[key], atol=1e-5, rtol=1e-5, msg=key)


def test_a_lookup_left_out_of_the_backward_takes_no_update():
    tables, reference, ours = _pair(torch.optim.Adagrad, {"lr": 0.1})
    rng = np.random.default_rng(3)
    a, b = random_kjt(tables, 3, rng), random_kjt(tables, 3, rng)
    reference(a).values().sum().backward()
    ours(b)  # looked up, never differentiated: TorchRec's hooks see no gradient from it
    ours(a).values().sum().backward()
    theirs = _tables_of(reference)
    for key, value in _tables_of(ours).items():
        torch.testing.assert_close(value, theirs[key], atol=1e-6, rtol=1e-6, msg=key)


def test_second_lookup_before_backward_is_exact_for_sgd():
    tables, reference, ours = _pair(torch.optim.SGD, {"lr": 0.5})
    rng = np.random.default_rng(3)
    a, b = random_kjt(tables, 3, rng), random_kjt(tables, 3, rng)
    (reference(a).values().pow(2).sum() + reference(b).values().sum()).backward()
    (ours(a).values().pow(2).sum() + ours(b).values().sum()).backward()
    theirs = _tables_of(reference)
    for key, value in _tables_of(ours).items():
        torch.testing.assert_close(value, theirs[key], atol=1e-6, rtol=0, msg=key)


def _position_weighted(tables):
    from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

    features = [f for t in tables for f in t.feature_names]
    torch.manual_seed(0)
    model = FeatureProcessedEmbeddingBagCollection(
        TorchrecEBC(tables, is_weighted=True), PositionWeightedModuleCollection({f: 4 for f in features})
    )
    with torch.no_grad():  # TorchRec starts them at 1: random ones show every position's gradient
        for p in model._feature_processors.parameters():
            p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("mode", ["eager", "fused"])
def test_position_weighted_feature_processor_trains_as_torchrec(mode):
    tables = make_tables(dims=(4, 4, 8))
    reference = _position_weighted(tables)
    ours = copy.deepcopy(reference)
    for model in (reference, ours):
        apply_optimizer_in_backward(torch.optim.Adagrad, model._embedding_bag_collection.parameters(), {"lr": 0.1})
    ours = sp.from_torchrec(ours, device="tpu")
    dense_reference = torch.optim.SGD(reference._feature_processors.parameters(), lr=0.1)
    dense_ours = torch.optim.SGD(ours._feature_processors.parameters(), lr=0.1)
    rng = np.random.default_rng(4)
    with tpurec.mode(mode):
        for _ in range(STEPS):
            kjt = random_kjt(tables, 3, rng, max_len=4)
            for model, dense in ((reference, dense_reference), (ours, dense_ours)):
                dense.zero_grad()
                model(kjt).values().pow(2).sum().backward()
                dense.step()
    theirs, start = _tables_of(reference), _tables_of(_position_weighted(tables))
    changed = 0
    for key, value in _tables_of(ours).items():
        torch.testing.assert_close(value, theirs[key], atol=1e-5, rtol=1e-5, msg=key)
        changed += "position_weight" in key and not torch.equal(value, start[key])
    assert changed == sum(len(t.feature_names) for t in tables)  # every feature's position weights trained


def test_position_weights_with_mean_pooling_raise():
    from torchrec.modules.embedding_configs import PoolingType

    tables = [
        EmbeddingBagConfig(
            name="t0", embedding_dim=4, num_embeddings=10, feature_names=["f0"], pooling=PoolingType.MEAN
        )
    ]
    ebc = sp.EmbeddingBagCollection(tables, is_weighted=True, optimizer=sp.SGD(0.1), device="tpu")
    weights = torch.ones(3, requires_grad=True)
    kjt = KeyedJaggedTensor.from_lengths_sync(["f0"], torch.tensor([1, 2, 3]), torch.tensor([2, 1]), weights=weights)
    with pytest.raises(NotImplementedError, match="SUM pooling"):
        ebc(kjt)
    with torch.no_grad():
        ebc(kjt)


def _fused_embedding_collection():
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingCollection

    tables = [EmbeddingConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["f0"])]
    # TorchRec builds it on CUDA or meta only.
    return FusedEmbeddingCollection(
        tables, optimizer_type=torch.optim.SGD, optimizer_kwargs={"lr": 0.1}, device=torch.device("meta")
    )


def _quantized_ebc_with_int8_output():
    # Quantized collections convert (tests/sparse/test_quant.py); an INT8 *output* has no exact tpurec form.
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEBC

    tables = [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["f0"])]
    model = torch.nn.Sequential(TorchrecEBC(tables))
    model[0].qconfig = torch.ao.quantization.QConfig(
        activation=torch.ao.quantization.PlaceholderObserver.with_args(dtype=torch.qint8),
        weight=torch.ao.quantization.PlaceholderObserver.with_args(dtype=torch.qint8),
    )
    return torch.nn.Sequential(QuantEBC.from_float(model[0]))


@pytest.mark.parametrize(
    "build, name",
    [
        (
            lambda: torch.nn.ModuleDict({"seq": _fused_embedding_collection()}),
            r"model\.seq \(.*FusedEmbeddingCollection\)",
        ),
        (_quantized_ebc_with_int8_output, r"model\.0 \(torchrec\.quant\.embedding_modules\.EmbeddingBagCollection\)"),
    ],
    ids=["fused-embedding-collection", "quantized-int8-output"],
)
def test_from_torchrec_names_a_module_it_cannot_convert(build, name):
    model = build()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(NotImplementedError, match=name):
        sp.from_torchrec(model, optimizer=sp.SGD(0.1), device="tpu")
    for key, value in model.state_dict().items():  # nothing converted halfway
        assert value.device.type == "meta" or torch.equal(value, before[key]), key
    assert not any(type(m).__module__.startswith("tpurec") for m in model.modules())
