"""EmbeddingBagCollection vs torchrec (forward) and FBGEMM (fused optimizers)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen
from torchrec import EmbeddingBagCollection as TorchrecEBC
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import PoolingType

import tpurec.sparse as sp
from helpers import make_tables, random_kjt


@st.composite
def tables_and_kjt(draw):
    weighted = draw(st.booleans())
    n_tables = draw(st.integers(1, 3))
    tables = []
    for i in range(n_tables):
        n_features = draw(st.integers(1, 2))
        tables.append(
            EmbeddingBagConfig(
                name=f"t{i}",
                embedding_dim=draw(st.sampled_from([2, 4])),
                num_embeddings=draw(st.integers(1, 9)),
                feature_names=[f"t{i}f{j}" for j in range(n_features)],
                # torchrec's nn.EmbeddingBag takes per-sample weights only with SUM.
                pooling=PoolingType.SUM if weighted else draw(st.sampled_from([PoolingType.SUM, PoolingType.MEAN])),
            )
        )
    seed = draw(st.integers(0, 2**31))
    batch = draw(st.integers(1, 4))
    kjt = random_kjt(tables, batch, np.random.default_rng(seed), max_len=draw(st.integers(0, 5)), weighted=weighted)
    return tables, kjt, weighted, draw(st.integers(1, 3))


@settings(max_examples=40, deadline=None)
@given(tables_and_kjt())
def test_forward_matches_torchrec(case):
    tables, kjt, weighted, partitions = case
    ref = TorchrecEBC(tables, is_weighted=weighted)
    ebc = sp.from_torchrec(ref, optimizer=sp.SGD(), num_partitions=partitions)
    ours, theirs = ebc(kjt), ref(kjt)
    assert ours.keys() == theirs.keys()
    assert ours.length_per_key() == theirs.length_per_key()
    torch.testing.assert_close(ours.values(), theirs.values(), atol=1e-6, rtol=0)


def test_forward_shared_table_duplicates_empty_bags():
    tables = [
        EmbeddingBagConfig(
            name="t", embedding_dim=3, num_embeddings=4, feature_names=["a", "b"], pooling=PoolingType.MEAN
        )
    ]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["a", "b"], values=torch.tensor([1, 1, 1, 2, 3, 3]), lengths=torch.tensor([3, 0, 0, 3])
    )
    ref = TorchrecEBC(tables)
    ebc = sp.from_torchrec(ref, optimizer=sp.SGD(), num_partitions=2)
    torch.testing.assert_close(ebc(kjt).values(), ref(kjt).values(), atol=1e-6, rtol=0)


FBGEMM_CASES = [
    (sp.SGD(learning_rate=0.1), EmbOptimType.EXACT_SGD, {"learning_rate": 0.1}),
    (sp.Adagrad(learning_rate=0.1, eps=1e-3), EmbOptimType.EXACT_ADAGRAD, {"learning_rate": 0.1, "eps": 1e-3}),
    (
        sp.RowWiseAdagrad(learning_rate=0.1, eps=1e-3),
        EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        {"learning_rate": 0.1, "eps": 1e-3},
    ),
]


@pytest.mark.parametrize(
    "weighted,pooling",
    [(False, PoolingType.SUM), (True, PoolingType.SUM), (False, PoolingType.MEAN)],
    ids=["sum", "weighted_sum", "mean"],
)
@pytest.mark.parametrize("optimizer,fbgemm_type,fbgemm_kwargs", FBGEMM_CASES, ids=["sgd", "adagrad", "rowwise_adagrad"])
def test_ten_steps_match_fbgemm(optimizer, fbgemm_type, fbgemm_kwargs, weighted, pooling):
    tables = make_tables(pooling=pooling)
    ebc = sp.EmbeddingBagCollection(tables, is_weighted=weighted, optimizer=optimizer, num_partitions=2)
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(t.num_embeddings, t.embedding_dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for t in tables],
        feature_table_map=[i for i, t in enumerate(tables) for _ in t.feature_names],
        optimizer=fbgemm_type,
        pooling_mode=PoolingMode.SUM if pooling == PoolingType.SUM else PoolingMode.MEAN,
        device="cpu",
        **fbgemm_kwargs,
    )
    with torch.no_grad():
        for t, w in zip(tables, tbe.split_embedding_weights()):
            w.copy_(ebc.table_weight(t.name))
    rng = np.random.default_rng(0)
    for _ in range(10):
        kjt = random_kjt(tables, 3, rng, weighted=weighted)
        ours = ebc(kjt).values()
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(kjt.lengths()).long()
        theirs = tbe(kjt.values().long(), offsets, per_sample_weights=kjt.weights() if weighted else None)
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
        upstream = torch.from_numpy(rng.standard_normal(ours.shape).astype(np.float32))
        ours.backward(upstream)
        theirs.backward(upstream)
    slots = ebc.optimizer_state_dict()["state"]
    for t, w, states in zip(tables, tbe.split_embedding_weights(), tbe.split_optimizer_states()):
        torch.testing.assert_close(ebc.table_weight(t.name).detach(), w, atol=1e-5, rtol=0)
        mine = list(slots[f"embedding_bags.{t.name}.weight"].values())
        assert len(mine) == len(states)
        for a, b in zip(mine, states):
            # Accumulators grow to ~1e2: allow float32 rounding relative to their size.
            torch.testing.assert_close(a, b.reshape(a.shape), atol=1e-5, rtol=1e-6)
    assert ebc.stacked_weight(0).grad is None


def test_weighted_mean_forward_matches_fbgemm():
    # torchrec's EBC cannot pool weighted bags with MEAN (nn.EmbeddingBag refuses);
    # FBGEMM can: sum(w * e) / bag length. Only the forward is compared: FBGEMM's
    # CPU backward for weighted MEAN drops the 1 / length factor (its gradient is
    # w * g, inconsistent with its own forward); ours is the exact gradient.
    tables = make_tables(pooling=PoolingType.MEAN)
    ebc = sp.EmbeddingBagCollection(tables, is_weighted=True)
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(t.num_embeddings, t.embedding_dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for t in tables],
        feature_table_map=[i for i, t in enumerate(tables) for _ in t.feature_names],
        pooling_mode=PoolingMode.MEAN,
        device="cpu",
    )
    with torch.no_grad():
        for t, w in zip(tables, tbe.split_embedding_weights()):
            w.copy_(ebc.table_weight(t.name))
    kjt = random_kjt(tables, 5, np.random.default_rng(0), weighted=True)
    offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(kjt.lengths()).long()
    theirs = tbe(kjt.values().long(), offsets, per_sample_weights=kjt.weights())
    torch.testing.assert_close(ebc(kjt).values(), theirs, atol=1e-6, rtol=0)


def _lazy_adam_reference(w, m1, m2, row_grads, touched, step, lr, b1, b2, eps, wd):
    """FBGEMM's ADAM on the touched rows (numpy, float64)."""
    g = row_grads[touched]
    m1[touched] = b1 * m1[touched] + (1 - b1) * g
    m2[touched] = b2 * m2[touched] + (1 - b2) * g * g
    m_hat = m1[touched] / (1 - b1**step)
    v_hat = m2[touched] / (1 - b2**step)
    w[touched] -= lr * (m_hat / (np.sqrt(v_hat) + eps) + wd * w[touched])


def test_ten_steps_adam():
    # FBGEMM's CPU TBE rejects ADAM ("not supported in CPU mode"), so the
    # reference is FBGEMM's formula in numpy, checked against torch.optim.Adam
    # when every row is touched every step.
    tables = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=6, feature_names=["f"])]
    opt = sp.Adam(learning_rate=0.05, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.01)
    ebc = sp.EmbeddingBagCollection(tables, optimizer=opt)
    w = ebc.table_weight("t").detach().double().numpy().copy()
    m1, m2 = np.zeros_like(w), np.zeros_like(w)
    rng = np.random.default_rng(1)
    for step in range(1, 11):
        kjt = random_kjt(tables, 3, rng, max_len=3)
        out = ebc(kjt).values()
        upstream = rng.standard_normal(out.shape)
        out.backward(torch.from_numpy(upstream.astype(np.float32)))
        ids, lengths = kjt.values().numpy(), kjt.lengths().numpy()
        row_grads = np.zeros_like(w)
        np.add.at(row_grads, ids, upstream[np.repeat(np.arange(3), lengths)])
        touched = np.unique(ids)
        _lazy_adam_reference(w, m1, m2, row_grads, touched, step, 0.05, 0.8, 0.95, 1e-6, 0.01)
    np.testing.assert_allclose(ebc.table_weight("t").detach().numpy(), w, atol=1e-5)
    state = ebc.optimizer_state_dict()["state"]["embedding_bags.t.weight"]
    np.testing.assert_allclose(state["momentum1"].numpy(), m1, atol=1e-5)
    np.testing.assert_allclose(state["momentum2"].numpy(), m2, atol=1e-5)
    assert ebc.optimizer_state_dict()["steps"] == [10]


def test_adam_equals_torch_adam_when_all_rows_touched():
    tables = [EmbeddingBagConfig(name="t", embedding_dim=3, num_embeddings=4, feature_names=["f"])]
    ebc = sp.EmbeddingBagCollection(tables, optimizer=torch.optim.Adam, optimizer_kwargs={"lr": 0.1})
    dense = torch.nn.Parameter(ebc.table_weight("t").detach().clone())
    adam = torch.optim.Adam([dense], lr=0.1, eps=1e-8)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f"], values=torch.tensor([0, 1, 2, 3, 1]), lengths=torch.tensor([3, 2])
    )
    for _ in range(10):
        ebc(kjt).values().pow(2).sum().backward()
        adam.zero_grad()
        torch.nn.functional.embedding_bag(kjt.values(), dense, torch.tensor([0, 3]), mode="sum").pow(2).sum().backward()
        adam.step()
    torch.testing.assert_close(ebc.table_weight("t").detach(), dense.detach(), atol=1e-5, rtol=0)


def test_thirty_batches_compile_once():
    from tpurec.sparse.kernels.reference import TRACE_COUNTS

    tables = make_tables()
    rng = np.random.default_rng(3)
    batches = [random_kjt(tables, 4, rng, max_len=int(rng.integers(1, 5))) for _ in range(30)]
    caps = sp.suggest_capacities(batches, tables, num_partitions=2)
    # A learning rate that changes every step must not recompile either.
    ebc = sp.EmbeddingBagCollection(tables, optimizer=sp.Adagrad(0.1), num_partitions=2, capacities=caps)
    ebc(batches[0]).values().sum().backward()
    before = dict(TRACE_COUNTS)
    for i, kjt in enumerate(batches[1:]):
        ebc.optimizer.learning_rate = 0.1 / (i + 2)
        ebc(kjt).values().sum().backward()
    assert dict(TRACE_COUNTS) == before


def test_automatic_capacities_grow_by_powers_of_two():
    from tpurec.sparse.kernels.reference import TRACE_COUNTS

    tables = make_tables()
    ebc = sp.EmbeddingBagCollection(tables, optimizer=sp.SGD())
    rng = np.random.default_rng(5)
    ebc(random_kjt(tables, 4, rng, lengths=1)).values().sum().backward()
    before = sum(TRACE_COUNTS.values())
    for _ in range(5):  # same or smaller batches: no growth, no new compilation
        ebc(random_kjt(tables, 4, rng, lengths=1)).values().sum().backward()
    assert sum(TRACE_COUNTS.values()) == before
    big = random_kjt(tables, 4, rng, lengths=6)
    ebc(big).values().sum().backward()  # grows
    assert ebc._auto_capacities["t0__t1"].max_ids_per_partition >= 40


def test_bad_input_leaves_tables_unchanged():
    tables = make_tables()
    ebc = sp.EmbeddingBagCollection(tables, optimizer=sp.Adagrad(0.1))
    ebc(random_kjt(tables, 2, np.random.default_rng(0))).values().sum().backward()
    before = {k: v.clone() for k, v in ebc.state_dict().items()}
    slots_before = [b.clone() for b in ebc.buffers()]
    kjt = random_kjt(tables, 2, np.random.default_rng(1), lengths=1)
    values = kjt.values().clone()
    values[-1] = 99  # feature f3 of table t2 has 5 rows
    bad = KeyedJaggedTensor.from_lengths_sync(keys=kjt.keys(), values=values, lengths=kjt.lengths())
    with pytest.raises(ValueError, match=r"feature 'f3'.*99"):
        ebc(bad)
    for k, v in ebc.state_dict().items():
        assert torch.equal(v, before[k])
    for a, b in zip(ebc.buffers(), slots_before):
        assert torch.equal(a, b)


def test_state_dict_round_trip_with_torchrec():
    tables = make_tables()
    ref = TorchrecEBC(tables)
    ebc = sp.EmbeddingBagCollection(tables, optimizer=sp.SGD())
    assert set(ebc.state_dict()) == set(ref.state_dict())
    ebc.load_state_dict(ref.state_dict())
    kjt = random_kjt(tables, 3, np.random.default_rng(0))
    torch.testing.assert_close(ebc(kjt).values(), ref(kjt).values(), atol=1e-6, rtol=0)
    ebc(kjt).values().sum().backward()
    ref.load_state_dict(ebc.state_dict())
    torch.testing.assert_close(ebc(kjt).values(), ref(kjt).values(), atol=1e-6, rtol=0)
    with pytest.raises(RuntimeError, match="Missing key"):
        ebc.load_state_dict({})


def test_optimizer_state_round_trip():
    tables = make_tables()
    a = sp.EmbeddingBagCollection(tables, optimizer=sp.Adam(0.1))
    a(random_kjt(tables, 3, np.random.default_rng(0))).values().sum().backward()
    b = sp.EmbeddingBagCollection(tables, optimizer=sp.Adam(0.1))
    with pytest.warns(UserWarning, match="restarts from zero unless load_optimizer_state_dict follows"):
        b.load_state_dict(a.state_dict())
    b.load_optimizer_state_dict(a.optimizer_state_dict())
    kjt = random_kjt(tables, 3, np.random.default_rng(1))
    a(kjt).values().sum().backward()
    b(kjt).values().sum().backward()
    for k, v in a.state_dict().items():
        torch.testing.assert_close(v, b.state_dict()[k], atol=0, rtol=0)


def test_from_torchrec_fused_and_in_backward():
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    tables = make_tables(dims=(4, 4, 4))
    fused = FusedEmbeddingBagCollection(tables, optimizer_type=torch.optim.Adagrad, optimizer_kwargs={"lr": 0.2})
    kjt = random_kjt(tables, 3, np.random.default_rng(0))
    fused(kjt).values().sum().backward()  # non-zero FBGEMM slots to carry over
    converted = sp.from_torchrec(torch.nn.Sequential(fused))[0]
    assert isinstance(converted.optimizer, sp.Adagrad) and converted.optimizer.learning_rate == 0.2
    kjt2 = random_kjt(tables, 3, np.random.default_rng(1))
    torch.testing.assert_close(converted(kjt2).values(), fused(kjt2).values(), atol=1e-6, rtol=0)
    converted(kjt2).values().sum().backward()
    fused(kjt2).values().sum().backward()
    for k, v in fused.state_dict().items():
        torch.testing.assert_close(converted.state_dict()[k], v, atol=1e-5, rtol=0)

    plain = TorchrecEBC(tables)
    apply_optimizer_in_backward(torch.optim.SGD, plain.parameters(), {"lr": 0.3})
    converted = sp.from_torchrec(plain)
    assert isinstance(converted.optimizer, sp.SGD) and converted.optimizer.learning_rate == 0.3
    assert sp.from_torchrec(TorchrecEBC(tables)).optimizer is None  # inference (see test_reliability.py)


@pytest.mark.parametrize(
    "optimizer",
    [sp.SGD(0.1), sp.Adagrad(0.1), sp.RowWiseAdagrad(0.1, weight_decay=0.01), sp.Adam(0.1)],
    ids=lambda o: type(o).__name__,
)
def test_cpu_in_place_path_equals_gradient_op(optimizer):
    # The module's CPU fast path (touched rows written in place) and the
    # functional torch.ops.tpurec gradient op (what the tpu device runs) agree (up to
    # XLA fusing the two programs differently).
    tables = make_tables()
    a = sp.EmbeddingBagCollection(tables, optimizer=optimizer, num_partitions=2)
    b = sp.EmbeddingBagCollection(tables, optimizer=optimizer, num_partitions=2)
    b.load_state_dict(a.state_dict())
    b.cpu_in_place = False
    rng = np.random.default_rng(0)
    for _ in range(3):
        kjt = random_kjt(tables, 3, rng)
        a(kjt).values().pow(2).sum().backward()
        b(kjt).values().pow(2).sum().backward()
    for x, y in zip([*a.parameters(), *a.buffers()], [*b.parameters(), *b.buffers()]):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-6)


def test_from_torchrec_materialises_meta_tables_from_their_configs():
    """Tables built on "meta" (as dlrm_main.py builds them) get the configs' initialisers."""
    tables = [
        EmbeddingBagConfig(
            name="t0",
            embedding_dim=4,
            num_embeddings=6,
            feature_names=["f0"],
            init_fn=lambda w: torch.nn.init.constant_(w, 0.25),
        ),
        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=5, feature_names=["f1"]),
    ]
    meta = TorchrecEBC(tables=tables, device=torch.device("meta"))
    converted = sp.from_torchrec(meta, optimizer=sp.SGD(0.1), device="tpu")
    assert converted.device.type == "tpu"
    w0, w1 = converted.table_weight("t0").cpu(), converted.table_weight("t1").cpu()
    assert torch.equal(w0, torch.full((6, 4), 0.25))
    bound = tables[1].get_weight_init_max()  # torchrec's default: uniform(-1/sqrt(rows), 1/sqrt(rows))
    assert w1.abs().max() <= bound and w1.std() > 0
    host = sp.from_torchrec(TorchrecEBC(tables=tables, device=torch.device("meta")), optimizer=sp.SGD(0.1))
    assert host.device.type == "cpu"  # no device given: materialised on the host, not left on meta
