"""Input forms TorchRec's EmbeddingBagCollection accepts, against TorchRec on CPU.

* Variable batch size per feature (VBE): a KJT built with ``stride_per_key_per_rank``
  gives each feature its own number of bags; ``inverse_indices`` expands each
  feature's pooled rows back to the full batch (TorchRec's
  ``process_pooled_embeddings``). ``inverse_indices`` on a KJT of one stride expand
  the same way.
* One feature looked up in two tables: TorchRec names the outputs
  ``"<feature>@<table>"``.

Each model is built on CPU by TorchRec, deep-copied, converted with
``tpurec.sparse.from_torchrec`` to the ``tpu`` device and trained on the same batches
as the TorchRec original for 5 steps, in eager and fused mode.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagCollection as TorchrecEBC
from torchrec import EmbeddingCollection as TorchrecEC
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, data_parallel, row_wise, table_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingConfig, PoolingType
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

import tpurec
import tpurec.sparse as sp
from helpers import make_tables, random_kjt, with_weights

STEPS = 5
MODES = ["eager", "fused"]


def shared_tables() -> list[EmbeddingBagConfig]:
    """``shared`` is looked up in t0 (SUM, next to f0) and in t1 (MEAN, another dim)."""
    return [
        EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=13, feature_names=["f0", "shared"]),
        EmbeddingBagConfig(
            name="t1", embedding_dim=8, num_embeddings=7, feature_names=["shared"], pooling=PoolingType.MEAN
        ),
        EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=5, feature_names=["f2", "shared"]),
    ]


def _features(tables) -> dict[str, int]:
    """Feature -> rows of the smallest table it looks up (its ids must fit every one)."""
    rows: dict[str, int] = {}
    for t in tables:
        for f in t.feature_names:
            rows[f] = min(rows.get(f, t.num_embeddings), t.num_embeddings)
    return rows


def vbe_kjt(tables, batch, rng, max_len=3, inverse=True, strides=None, weighted=False) -> KeyedJaggedTensor:
    """A VBE KJT: feature f has ``strides[f]`` bags (random in [1, batch]) over two ranks;
    ``inverse_indices`` (keys in reverse order, as TorchRec allows) map the ``batch``
    samples to them."""
    features = _features(tables)
    keys = list(features)
    per_rank, lengths, values, rows = [], [], [], []
    for f in keys:
        b = int(rng.integers(1, batch + 1)) if strides is None else strides[f]
        first = int(rng.integers(0, b + 1))
        per_rank.append([first, b - first])
        ls = rng.integers(0, max_len + 1, b)
        lengths.append(ls)
        values.append(rng.integers(0, features[f], int(ls.sum())))
        rows.append(rng.integers(0, b, batch) if b else np.zeros(batch, np.int64))
    kwargs = {}
    if inverse:
        kwargs["inverse_indices"] = (keys[::-1], torch.from_numpy(np.stack(rows[::-1])).long())
    v = torch.from_numpy(np.concatenate(values)).long()
    if weighted:
        kwargs["weights"] = torch.from_numpy(rng.uniform(0.5, 2.0, v.numel()).astype(np.float32))
    return KeyedJaggedTensor(
        keys=keys,
        values=v,
        lengths=torch.from_numpy(np.concatenate(lengths)).long(),
        stride_per_key_per_rank=per_rank,
        **kwargs,
    )


def uniform_kjt(tables, batch, rng, max_len=3) -> KeyedJaggedTensor:
    features = _features(tables)
    lengths = rng.integers(0, max_len + 1, (len(features), batch))
    values = np.concatenate([rng.integers(0, n, int(ls.sum())) for n, ls in zip(features.values(), lengths)])
    return KeyedJaggedTensor.from_lengths_sync(
        keys=list(features),
        values=torch.from_numpy(values).long(),
        lengths=torch.from_numpy(lengths.reshape(-1)).long(),
    )


def _tables_of(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in module.state_dict().items()}


def _in_backward_pair(tables, optimizer_class, kwargs):
    """TorchRec's EBC with ``apply_optimizer_in_backward`` (torch's update), and its converted copy."""
    torch.manual_seed(0)
    reference = TorchrecEBC(tables)
    ours = copy.deepcopy(reference)
    apply_optimizer_in_backward(optimizer_class, reference.parameters(), dict(kwargs))
    apply_optimizer_in_backward(optimizer_class, ours.parameters(), dict(kwargs))
    return reference, sp.from_torchrec(ours, device="tpu")


# FBGEMM's fused Adagrad is torch's Adagrad with FBGEMM's eps (one update per lookup on the
# rows the batch touched equals torch's dense update there: SGD and Adagrad leave other rows).
_FBGEMM_DEFAULTS = {torch.optim.SGD: {}, torch.optim.Adagrad: {"eps": 1e-8}}


def _fused_pair(tables, optimizer_class, kwargs):
    """TorchRec's FusedEmbeddingBagCollection (FBGEMM's update) converted, and as its reference
    TorchRec's EBC from the same tables trained by torch's optimizer with FBGEMM's settings
    (TorchRec's fused module itself ignores ``inverse_indices``)."""
    torch.manual_seed(0)
    fused = FusedEmbeddingBagCollection(tables, optimizer_type=optimizer_class, optimizer_kwargs=dict(kwargs))
    reference = TorchrecEBC(tables)
    reference.load_state_dict(fused.state_dict())
    apply_optimizer_in_backward(
        optimizer_class, reference.parameters(), {**kwargs, **_FBGEMM_DEFAULTS[optimizer_class]}
    )
    return reference, sp.from_torchrec(fused, device="tpu")


FORMS = {
    "vbe": (lambda: make_tables(dims=(4, 4, 8)), vbe_kjt),
    "shared-feature": (shared_tables, uniform_kjt),
    "shared-feature-vbe": (shared_tables, vbe_kjt),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "optimizer_class, kwargs",
    [(torch.optim.SGD, {"lr": 0.5}), (torch.optim.Adagrad, {"lr": 0.1})],
    ids=["sgd", "adagrad"],
)
@pytest.mark.parametrize("source", ["in-backward", "fused-module"])
@pytest.mark.parametrize("form", list(FORMS))
def test_trains_as_torchrec(form, source, optimizer_class, kwargs, mode):
    build_tables, batch_of = FORMS[form]
    tables = build_tables()
    pair = _in_backward_pair if source == "in-backward" else _fused_pair
    reference, ours = pair(tables, optimizer_class, kwargs)
    assert set(_tables_of(ours)) == set(_tables_of(reference))  # TorchRec's state dict keys
    rng = np.random.default_rng(1)
    with tpurec.mode(mode):
        for _ in range(STEPS):
            kjt = batch_of(tables, 5, rng)
            theirs, mine = reference(kjt), ours(kjt)
            assert mine.keys() == theirs.keys() and mine.length_per_key() == theirs.length_per_key()
            torch.testing.assert_close(mine.values().cpu(), theirs.values().detach(), atol=1e-6, rtol=1e-5)
            theirs.values().pow(2).sum().backward()
            mine.values().pow(2).sum().backward()
    theirs = _tables_of(reference)
    for key, value in _tables_of(ours).items():
        torch.testing.assert_close(value, theirs[key], atol=1e-5, rtol=1e-5, msg=key)


@pytest.mark.parametrize(
    "make_batch",
    [
        lambda tables, rng: vbe_kjt(tables, 4, rng, inverse=False, strides={f: 3 for f in _features(tables)}),
        lambda tables, rng: KeyedJaggedTensor.from_lengths_sync(
            keys=["f0", "f1", "f2", "f3"],
            values=torch.tensor([1, 2, 3, 4, 0, 1]),
            lengths=torch.tensor([1, 1, 0, 2, 0, 1, 1, 0]),
            inverse_indices=(["f3", "f2", "f1", "f0"], torch.tensor([[1, 0, 0], [0, 0, 1], [1, 1, 0], [0, 1, 1]])),
        ),
        lambda tables, rng: vbe_kjt(tables, 3, rng, strides={f: 5 if f == "f1" else 2 for f in _features(tables)}),
    ],
    ids=["vbe-equal-strides-no-inverse", "inverse-indices-one-stride", "more-bags-than-samples"],
)
def test_other_batch_layouts_look_up_as_torchrec(make_batch):
    tables = make_tables(dims=(4, 4, 8))
    torch.manual_seed(0)
    reference = TorchrecEBC(tables)
    ours = sp.from_torchrec(copy.deepcopy(reference), device="tpu")
    kjt = make_batch(tables, np.random.default_rng(3))
    theirs, mine = reference(kjt), ours(kjt)
    assert mine.keys() == theirs.keys()
    torch.testing.assert_close(mine.values().cpu(), theirs.values().detach(), atol=1e-6, rtol=1e-5)


def test_weighted_vbe_gives_weights_torchrecs_gradient():
    tables = make_tables(dims=(4, 4, 8))
    torch.manual_seed(0)
    reference = TorchrecEBC(tables, is_weighted=True)
    ours = copy.deepcopy(reference)
    apply_optimizer_in_backward(torch.optim.SGD, reference.parameters(), {"lr": 0.5})
    apply_optimizer_in_backward(torch.optim.SGD, ours.parameters(), {"lr": 0.5})
    ours = sp.from_torchrec(ours, device="tpu")
    kjt = vbe_kjt(tables, 5, np.random.default_rng(4), weighted=True)
    grads = []
    for model in (reference, ours):
        weights = kjt.weights().clone().requires_grad_(True)
        out = model(with_weights(kjt, weights)).values()
        out.pow(2).sum().backward()
        grads.append((out.detach().cpu(), weights.grad))
    torch.testing.assert_close(grads[1][0], grads[0][0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grads[1][1], grads[0][1], atol=1e-5, rtol=1e-5)
    theirs = _tables_of(reference)
    for key, value in _tables_of(ours).items():
        torch.testing.assert_close(value, theirs[key], atol=1e-5, rtol=1e-5, msg=key)


@pytest.mark.parametrize("mode", MODES)
def test_vbe_batches_keep_one_program(mode):
    # Each feature's batch size changes every step; the full batch (inverse_indices) does not:
    # the CSR rows per feature are padded to it, so nothing compiles after the first step.
    tables = make_tables()
    ebc = sp.EmbeddingBagCollection(tables, optimizer=sp.Adagrad(0.05), capacities=sp.Capacity(64), device="tpu")
    rng = np.random.default_rng(5)
    seen = set()
    with tpurec.mode(mode):
        for step in range(8):
            if step == 1:
                tpurec.reset_stats()
            kjt = vbe_kjt(tables, 6, rng)
            seen.add(tuple(kjt.stride_per_key()))
            out = ebc(kjt).values()
            assert out.shape == (6, sum(t.embedding_dim * len(t.feature_names) for t in tables))
            out.square().sum().backward()
            out.sum().item()
    assert len(seen) > 4  # the feature batch sizes did vary
    assert tpurec.stats()["compilations"] == 0, [str(r) for r in tpurec.explain_recompiles()]


def _bad_batches():
    tables = make_tables()
    keys = ["f0", "f1", "f2", "f3"]
    values, lengths = torch.tensor([1, 2, 3, 4, 0, 1]), torch.tensor([1, 1, 0, 2, 1, 0, 1, 0])
    per_rank = [[2], [2], [2], [2]]
    good_inverse = torch.tensor([[0, 1, 1], [1, 0, 0], [0, 0, 1], [1, 1, 0]])

    def kjt(**changes):
        args = dict(
            keys=keys,
            values=values,
            lengths=lengths,
            stride_per_key_per_rank=per_rank,
            inverse_indices=(keys, good_inverse),
        )
        args.update(changes)
        return KeyedJaggedTensor(**args)

    return tables, [
        (
            kjt(stride_per_key_per_rank=[[2], [3], [2], [2]]),
            r"lengths has 8 entries but stride_per_key_per_rank gives 9 bags",
        ),
        (
            kjt(inverse_indices=(keys, good_inverse[:3])),
            r"inverse_indices name 4 features but its tensor has shape \(3, 3\)",
        ),
        (kjt(inverse_indices=(keys, good_inverse[0])), r"inverse_indices must be a 2-D integer tensor"),
        (kjt(inverse_indices=(keys, good_inverse.float())), r"inverse_indices must be a 2-D integer tensor"),
        (kjt(inverse_indices=(keys[:3], good_inverse[:3])), r"inverse_indices have no row for feature 'f3'"),
        (
            kjt(inverse_indices=(keys, good_inverse + torch.tensor([[0], [0], [1], [0]]))),
            r"inverse_indices of feature 'f2' hold 2, outside \[0, 2\) \(the feature's 2 bags\)",
        ),
        (
            KeyedJaggedTensor(
                keys=keys,
                values=values,
                lengths=torch.tensor([1, 1, 0, 2, 1, 0, 1, 0, 0]),
                stride_per_key_per_rank=[[2], [3], [2], [2]],
            ),
            r"features have different batch sizes \{'f0': 2, 'f1': 3, 'f2': 2, 'f3': 2\} but the KeyedJaggedTensor has no "
            "inverse_indices",
        ),
    ]


_TABLES, _BAD = _bad_batches()


@pytest.mark.parametrize("preprocess", ["native", "numpy"])
@pytest.mark.parametrize(
    "index",
    range(len(_BAD)),
    ids=[
        "strides-vs-lengths",
        "inverse-rows",
        "inverse-1d",
        "inverse-float",
        "inverse-missing-feature",
        "inverse-out-of-range",
        "no-inverse",
    ],
)
def test_bad_vbe_input_is_a_clear_error_that_changes_nothing(index, preprocess, monkeypatch):
    monkeypatch.setenv("TPUREC_PREPROCESS", preprocess)
    kjt, message = _BAD[index]
    ebc = sp.EmbeddingBagCollection(_TABLES, optimizer=sp.Adagrad(0.1), capacities=sp.Capacity(16), device="tpu")
    before = _tables_of(ebc)
    with pytest.raises(ValueError, match=message):
        ebc(kjt)
    for key, value in _tables_of(ebc).items():
        assert torch.equal(value, before[key]), key


def test_native_and_numpy_preprocessing_agree_on_vbe_and_shared_features(monkeypatch):
    from tpurec.sparse.kernels.native.preprocess import preprocess_native

    tables = shared_tables()
    stacks = sp.stack_tables(tables)
    rng = np.random.default_rng(6)
    for kjt in (vbe_kjt(tables, 5, rng), uniform_kjt(tables, 4, rng)):
        caps = {st.name: sp.Capacity(32) for st in stacks}
        native = preprocess_native(kjt, stacks, 2, caps, None, "error")
        assert native is not None  # these layouts take the native path
        monkeypatch.setenv("TPUREC_PREPROCESS", "numpy")
        reference = sp.preprocess_kjt(kjt, stacks, 2, caps)
        monkeypatch.delenv("TPUREC_PREPROCESS")
        assert native.batch_size == reference.batch_size
        assert (native.inverse_indices is None) == (reference.inverse_indices is None)
        for feature, rows in (reference.inverse_indices or {}).items():
            np.testing.assert_array_equal(native.inverse_indices[feature], rows)
        for name, csr in reference.stacks.items():
            for a, b in zip(native.stacks[name].arrays(), csr.arrays()):
                assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), name


def test_a_feature_listed_twice_in_one_table_is_refused():
    tables = [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=5, feature_names=["f", "f"])]
    with pytest.raises(ValueError, match="table 't0' lists feature 'f' twice"):
        sp.EmbeddingBagCollection(tables, optimizer=sp.SGD(0.1))


def test_sequence_collection_takes_a_feature_in_two_tables_and_vbe_as_torchrec():
    # (tests/sparse/test_sequence.py trains both against TorchRec.)
    tables = [
        EmbeddingConfig(name="a", embedding_dim=4, num_embeddings=5, feature_names=["f", "g"]),
        EmbeddingConfig(name="b", embedding_dim=4, num_embeddings=5, feature_names=["f"]),
    ]
    torch.manual_seed(0)
    reference = TorchrecEC(tables)
    ec = sp.from_torchrec(copy.deepcopy(reference), optimizer=sp.SGD(0.1), device="tpu")
    bags = [EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=5, feature_names=["f", "g"])]
    kjt = vbe_kjt(bags, 3, np.random.default_rng(8), strides={"f": 1, "g": 3})
    with torch.no_grad():
        ours, theirs = ec(kjt), reference(kjt)
    assert list(ours) == list(theirs) == ["f@a", "g", "f@b"]
    for key in theirs:
        torch.testing.assert_close(ours[key].values().cpu(), theirs[key].values(), atol=1e-6, rtol=0, msg=key)
        torch.testing.assert_close(ours[key].lengths().cpu(), theirs[key].lengths(), msg=key)


def test_quantized_collection_looks_up_a_shared_feature_as_torchrec_and_refuses_vbe():
    from torchrec.inference.modules import quantize_embeddings

    tables = shared_tables()
    torch.manual_seed(0)
    reference = quantize_embeddings(torch.nn.Sequential(TorchrecEBC(tables)), dtype=torch.qint8, inplace=False)[0]
    ours = sp.from_torchrec(reference, device="tpu")
    assert isinstance(ours, sp.QuantEmbeddingBagCollection) and ours.feature_names == ["f0", "shared", "f2"]
    rng = np.random.default_rng(10)
    kjt = uniform_kjt(tables, 4, rng)
    theirs, mine = reference(kjt), ours(kjt)
    assert mine.keys() == theirs.keys() and mine.length_per_key() == theirs.length_per_key()
    torch.testing.assert_close(mine.values().cpu(), theirs.values(), atol=1e-6, rtol=1e-5)
    with pytest.raises(NotImplementedError, match=r"variable batch size per feature"):
        ours(vbe_kjt(tables, 4, rng))


class _Pooled(torch.nn.Module):
    def __init__(self, ebc: torch.nn.Module) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.ebc(kjt).values()


def test_export_of_a_feature_in_two_tables_equals_eager_and_torchrec():
    tables = shared_tables()
    torch.manual_seed(0)
    reference = _Pooled(TorchrecEBC(tables)).eval()
    converted = sp.from_torchrec(copy.deepcopy(reference), capacities=sp.Capacity(64)).eval().to("tpu")
    rng = np.random.default_rng(9)
    kjt = uniform_kjt(tables, 4, rng)
    program = torch.export.export(converted, (kjt,)).module()
    with torch.no_grad():
        out, eager, expected = program(kjt), converted(kjt), reference(kjt)
    torch.testing.assert_close(out.cpu(), eager.cpu(), atol=0, rtol=0)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-6, rtol=1e-5)
    # The exported lookup rebuilds the KJT from its tensors: inverse_indices would be lost.
    with_inverse = KeyedJaggedTensor.from_lengths_sync(
        keys=kjt.keys(),
        values=kjt.values(),
        lengths=kjt.lengths(),
        inverse_indices=(kjt.keys(), torch.zeros(len(kjt.keys()), 4, dtype=torch.long)),
    )
    with pytest.raises(NotImplementedError, match="inverse_indices"):
        torch.export.export(converted, (with_inverse,))


# --- the sharded collection: what it runs and what it refuses ------------------------------------


def _sharded(tables):
    model = torch.nn.ModuleDict({"ebc": sp.EmbeddingBagCollection(tables, optimizer=sp.SGD(0.1))}).to("tpu")
    meta = TorchrecEBC(tables=tables, device=torch.device("meta"))
    plan = construct_module_sharding_plan(
        meta, {t.name: table_wise(rank=i) for i, t in enumerate(tables)}, local_size=8, world_size=8, device_type="cpu"
    )
    return model, ShardingPlan({"ebc": plan})


def test_sharded_collection_pools_vbe_and_inverse_indices_as_the_unsharded_one():
    # (tests/sparse/sharding/test_sharded_vbe.py trains them against TorchRec.)
    tables = make_tables(dims=(8, 8), rows=(20, 12), features=(("f0",), ("f1",)))
    model, plan = _sharded(tables)
    unsharded = copy.deepcopy(model)
    sharded = tpurec.shard(model, plan)
    rng = np.random.default_rng(7)
    vbe = vbe_kjt(tables, 8, rng)
    uniform = random_kjt(tables, 8, rng)
    with_inverse = KeyedJaggedTensor.from_lengths_sync(
        keys=uniform.keys(),
        values=uniform.values(),
        lengths=uniform.lengths(),
        inverse_indices=(uniform.keys(), torch.from_numpy(rng.integers(0, 8, (2, 8))).long()),
    )
    with torch.no_grad():
        for kjt in (vbe, with_inverse):
            torch.testing.assert_close(sharded["ebc"](kjt).values().cpu(), unsharded["ebc"](kjt).values().cpu())


@pytest.mark.parametrize("kinds", ["table_wise", "row_dp_table"])
def test_a_feature_in_two_tables_trains_sharded_as_torchrec(kinds):
    # ``shared`` is looked up in t0 (SUM), t1 (MEAN, another dim) and t2: each table its own
    # output block, as in TorchRec's EmbeddingBagCollection.
    tables = shared_tables()
    torch.manual_seed(0)
    reference = TorchrecEBC(tables)
    ours = copy.deepcopy(reference)
    apply_optimizer_in_backward(torch.optim.Adagrad, reference.parameters(), {"lr": 0.1})
    apply_optimizer_in_backward(torch.optim.Adagrad, ours.parameters(), {"lr": 0.1})
    model = torch.nn.ModuleDict({"ebc": sp.from_torchrec(ours)}).to("tpu")
    meta = TorchrecEBC(tables=tables, device=torch.device("meta"))
    per_table = (
        {t.name: table_wise(rank=i) for i, t in enumerate(tables)}
        if kinds == "table_wise"
        else {"t0": row_wise(), "t1": data_parallel(), "t2": table_wise(rank=5)}
    )
    plan = ShardingPlan(
        {"ebc": construct_module_sharding_plan(meta, per_table, local_size=8, world_size=8, device_type="cpu")}
    )
    sharded = tpurec.shard(model, plan)["ebc"]
    rng = np.random.default_rng(8)
    for _ in range(3):
        kjt = uniform_kjt(tables, 8, rng)
        out, expected = sharded(kjt), reference(kjt)
        assert out.keys() == expected.keys()
        torch.testing.assert_close(out.values().detach().cpu(), expected.values().detach(), atol=1e-6, rtol=1e-5)
        out.values().pow(2).sum().backward()
        expected.values().pow(2).sum().backward()
    full = sharded.full_tables()[0]
    for key, value in _tables_of(reference).items():
        name = key.split(".")[-2]
        np.testing.assert_allclose(np.asarray(full[name]), value.numpy(), atol=1e-5, rtol=1e-5, err_msg=key)
