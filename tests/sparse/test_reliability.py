"""Regression tests of issue 8: batches that crashed or misbehaved, empty batches,
weight dtypes, duplicate keys, stray weights, optimizer-state loads, op argument
checks, float32 gain overflow, inference, checkpoints."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagCollection as TorchrecEBC
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

import tpurec.sparse as sp
from helpers import make_tables, random_kjt


def _two_feature_tables() -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["f0", "f1", "f2"])]


def _state(ebc: sp.EmbeddingBagCollection) -> list[torch.Tensor]:
    """Every tensor a rejected batch must leave alone: tables and slots (copied to the host)."""
    return [t.detach().cpu().clone() for t in [*ebc.parameters(), *ebc.buffers()]]


def _assert_unchanged(ebc: sp.EmbeddingBagCollection, before: list[torch.Tensor], steps: list[int]) -> None:
    for a, b in zip(_state(ebc), before):
        assert torch.equal(a, b)
    assert ebc._steps == steps


# --- item 1: lengths whose sum wraps around int64 ------------------------------------------------


def test_wrapping_lengths_do_not_crash_the_interpreter():
    # Before the fix this segfaulted in np.repeat: run it in a child so a crash fails the test.
    code = textwrap.dedent(
        """
        import torch
        import tpurec.sparse as sp
        from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
        tables = [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["f0"])]
        kjt = KeyedJaggedTensor(keys=["f0"], values=torch.tensor([1, 2, 3]),
                                lengths=torch.tensor([2**63 - 1, 2**63 - 1, 5]))
        for call in (lambda: sp.preprocess_kjt(kjt, tables, 2, sp.Capacity(8)),
                     lambda: sp.EmbeddingBagCollection(tables)(kjt)):
            try:
                call()
            except ValueError as e:
                assert "feature 'f0'" in str(e), e
                print("rejected:", e)
            else:
                raise SystemExit("accepted a batch whose lengths wrap around")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr[-3000:]}"
    assert result.stdout.count("rejected:") == 2


def test_huge_lengths_blame_the_right_feature():
    kjt = KeyedJaggedTensor(
        keys=["f0", "f1", "f2"], values=torch.tensor([1, 2, 3, 4, 5]), lengths=torch.tensor([2**62] * 4 + [5, 0])
    )
    with pytest.raises(ValueError, match=r"feature 'f0' has a bag length 4611686018427387904 but values has only 5"):
        sp.preprocess_kjt(kjt, _two_feature_tables())
    # The first too-long feature is named, even when an earlier one is fine.
    kjt = KeyedJaggedTensor(
        keys=["f0", "f1", "f2"], values=torch.tensor([1, 2, 3, 4, 5]), lengths=torch.tensor([1, 0, 2**62, 2**62, 2, 2])
    )
    with pytest.raises(ValueError, match=r"feature 'f1'"):
        sp.preprocess_kjt(kjt, _two_feature_tables())


# --- item 2: batches of size 0 -------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", "tpu"])
@pytest.mark.parametrize("optimizer", [sp.SGD(0.1), sp.Adam(0.1)], ids=["sgd", "adam"])
def test_empty_batch_matches_torchrec_and_changes_no_row(device, optimizer):
    tables = make_tables()
    ref = TorchrecEBC(tables)
    ebc = sp.from_torchrec(ref, optimizer=optimizer, device=device, num_partitions=2)
    keys = [f for t in tables for f in t.feature_names]
    empty = KeyedJaggedTensor(
        keys=keys, values=torch.zeros(0, dtype=torch.long), lengths=torch.zeros(0, dtype=torch.int32)
    )
    before = _state(ebc)
    out = ebc(empty)
    theirs = ref(empty)
    assert (
        out.values().shape == theirs.values().shape == (0, sum(t.embedding_dim * len(t.feature_names) for t in tables))
    )
    assert out.keys() == theirs.keys() and out.length_per_key() == theirs.length_per_key()
    out.values().sum().backward()
    for a, b in zip(_state(ebc), before):
        assert torch.equal(a, b)
    # A normal batch afterwards still works and matches torchrec.
    kjt = random_kjt(tables, 3, np.random.default_rng(0))
    torch.testing.assert_close(ebc(kjt).values().cpu(), ref(kjt).values(), atol=1e-6, rtol=0)


def test_empty_batch_through_preprocess_kjt_has_empty_partitions():
    tables = make_tables()
    keys = [f for t in tables for f in t.feature_names]
    empty = KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.zeros(0, dtype=torch.long), lengths=torch.zeros(0, dtype=torch.long)
    )
    batch = sp.preprocess_kjt(empty, tables, num_partitions=2, capacities=sp.Capacity(8))
    assert batch.batch_size == 0
    for csr in batch.stacks.values():
        assert (csr.embedding_ids == sp.PAD_ID).all()
        assert csr.row_pointers.tolist() == [0, 8]


# --- item 3: every float weight dtype -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_weight_dtypes_match_torchrec(dtype):
    tables = make_tables(dims=(4, 4, 4))
    ref = TorchrecEBC(tables, is_weighted=True)
    ebc = sp.from_torchrec(ref, optimizer=sp.SGD())
    kjt = random_kjt(tables, 3, np.random.default_rng(0), weighted=True)
    weights = kjt.weights().to(dtype)
    ours = ebc(KeyedJaggedTensor.from_lengths_sync(kjt.keys(), kjt.values(), kjt.lengths(), weights=weights))
    # torchrec's EmbeddingBag wants float32 weights; the low-precision weights, widened, are the reference.
    theirs = ref(KeyedJaggedTensor.from_lengths_sync(kjt.keys(), kjt.values(), kjt.lengths(), weights=weights.float()))
    torch.testing.assert_close(ours.values(), theirs.values(), atol=1e-6, rtol=0)


def test_bfloat16_weights_do_not_hide_the_real_error():
    tables = make_tables(dims=(4, 4, 4))
    kjt = random_kjt(tables, 2, np.random.default_rng(0), lengths=1)
    values = kjt.values().clone()
    values[0] = 1000
    bad = KeyedJaggedTensor.from_lengths_sync(
        kjt.keys(), values, kjt.lengths(), weights=torch.ones(values.numel(), dtype=torch.bfloat16)
    )
    with pytest.raises(ValueError, match=r"feature 'f0' has id 1000"):
        sp.preprocess_kjt(bad, tables, is_weighted=True)


def test_integer_weights_are_rejected():
    tables = make_tables()
    kjt = random_kjt(tables, 2, np.random.default_rng(0), lengths=1)
    bad = KeyedJaggedTensor.from_lengths_sync(
        kjt.keys(), kjt.values(), kjt.lengths(), weights=torch.ones(kjt.values().numel(), dtype=torch.int64)
    )
    with pytest.raises(ValueError, match=r"weights .* must be float16, bfloat16, float32 or float64"):
        sp.preprocess_kjt(bad, tables, is_weighted=True)


# --- item 4: duplicate keys and stray weights ------------------------------------------------------


def test_duplicate_keys_are_rejected_naming_the_key():
    tables = _two_feature_tables()
    ebc = sp.EmbeddingBagCollection(tables, optimizer=sp.Adagrad(0.1))
    kjt = KeyedJaggedTensor(
        keys=["f0", "f1", "f0", "f2"], values=torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([1, 1, 1, 1])
    )
    before = _state(ebc)
    with pytest.raises(ValueError, match=r"feature 'f0' appears more than once"):
        ebc(kjt)
    _assert_unchanged(ebc, before, [0])


@pytest.mark.parametrize("n_weights", [2, 4])
def test_stray_weights_of_the_wrong_length_are_rejected(n_weights):
    tables = _two_feature_tables()
    ebc = sp.EmbeddingBagCollection(tables, optimizer=sp.Adagrad(0.1))  # unweighted
    kjt = KeyedJaggedTensor(
        keys=["f0", "f1", "f2"],
        values=torch.tensor([1, 2, 3]),
        lengths=torch.tensor([1, 1, 1]),
        weights=torch.ones(n_weights),
    )
    before = _state(ebc)
    with pytest.raises(
        ValueError,
        match=rf"weights has {n_weights} entries but values has 3 ids \(first feature without matching weights: 'f2'\)",
    ):
        ebc(kjt)
    _assert_unchanged(ebc, before, [0])
    with pytest.raises(Exception):  # torchrec refuses it too (with a split_with_sizes RuntimeError)
        TorchrecEBC(tables)(kjt)


def test_offsets_must_start_at_zero():
    tables = _two_feature_tables()
    kjt = KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=torch.tensor([1, 2, 3]), offsets=torch.tensor([1, 2, 3, 3]))
    with pytest.raises(ValueError, match=r"offsets .* must start at 0"):
        sp.preprocess_kjt(kjt, tables)


# --- item 8: duplicate ids whose weights sum past float32 ----------------------------------------


def test_duplicate_ids_with_huge_weights_stay_finite_like_torchrec():
    tables = [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=10, feature_names=["f0", "f1"])]
    ref = TorchrecEBC(tables, is_weighted=True)
    ebc = sp.from_torchrec(ref, optimizer=sp.SGD(), num_partitions=2)
    kjt = KeyedJaggedTensor(
        keys=["f0", "f1"],
        values=torch.tensor([3, 3, 3, 1, 2]),
        lengths=torch.tensor([3, 0, 1, 1]),
        weights=torch.tensor([3e38, 3e38, -2e38, 1.0, 0.5]),
    )
    theirs = ref(kjt).values()
    ours = ebc(kjt).values()
    assert torch.isfinite(theirs).all() and torch.isfinite(ours).all()
    # Same products, summed in another order: allow float32 rounding relative to ~1e38.
    torch.testing.assert_close(ours, theirs, atol=0, rtol=1e-5)
    batch = sp.preprocess_kjt(kjt, tables, 2, sp.Capacity(8))
    assert np.isfinite(batch.stacks["t0"].gains).all()


# --- item 7: argument checks of the torch.ops.tpurec ops -------------------------------------------


def _csr_args(partitions: int = 2, size: int = 8, rows: int = 6, dim: int = 4, batch: int = 3):
    rp = torch.tensor([p * size + 2 for p in range(partitions)], dtype=torch.int32)
    ids = torch.full((partitions * size,), sp.PAD_ID, dtype=torch.int32)
    samples = torch.full((partitions * size,), sp.PAD_ID, dtype=torch.int32)
    gains = torch.zeros(partitions * size)
    for p in range(partitions):
        ids[p * size : p * size + 2] = torch.tensor([p, p + partitions], dtype=torch.int32)
        samples[p * size : p * size + 2] = torch.tensor([0, batch - 1], dtype=torch.int32)
        gains[p * size : p * size + 2] = 1.0
    table = torch.randn(rows, dim)
    return [rp, ids, samples, gains], table, torch.randn(batch, dim)


def _bad_calls():
    """(description, op name, tensor arguments, kwargs, error type, message pattern)."""
    csr, table, grad = _csr_args()
    rp, ids, samples, gains = csr
    fwd = "sparse_dense_matmul"
    calls = [
        (
            "int64 ids",
            fwd,
            [rp, ids.long() + 2**32, samples, gains, table],
            {"batch_size": 3},
            TypeError,
            r"embedding_ids must be int32, got int64",
        ),
        (
            "float ids",
            fwd,
            [rp, ids.float(), samples, gains, table],
            {"batch_size": 3},
            TypeError,
            r"embedding_ids must be int32, got float32",
        ),
        (
            "int64 row pointers",
            fwd,
            [rp.long(), ids, samples, gains, table],
            {"batch_size": 3},
            TypeError,
            r"row_pointers must be int32",
        ),
        (
            "float64 gains",
            fwd,
            [rp, ids, samples, gains.double(), table],
            {"batch_size": 3},
            TypeError,
            r"gains must be float32",
        ),
        (
            "int table",
            fwd,
            [rp, ids, samples, gains, table.long()],
            {"batch_size": 3},
            TypeError,
            r"table must be a floating point tensor",
        ),
        (
            "2-D ids",
            fwd,
            [rp, ids.view(2, -1), samples, gains, table],
            {"batch_size": 3},
            ValueError,
            r"embedding_ids must be 1-D",
        ),
        (
            "ids not a multiple of partitions",
            fwd,
            [torch.tensor([2, 8, 10], dtype=torch.int32), ids, samples, gains, table],
            {"batch_size": 3},
            ValueError,
            r"embedding_ids has 16 entries, not a multiple of the 3 partitions",
        ),
        (
            "short samples",
            fwd,
            [rp, ids, samples[:-1], gains, table],
            {"batch_size": 3},
            ValueError,
            r"sample_ids has 15 entries, embedding_ids has 16",
        ),
        ("1-D table", fwd, [rp, ids, samples, gains, table[:, 0]], {"batch_size": 3}, ValueError, r"table must be 2-D"),
        (
            "negative batch",
            fwd,
            [rp, ids, samples, gains, table],
            {"batch_size": -1},
            ValueError,
            r"batch_size must be >= 0",
        ),
        (
            "grad of the wrong dim",
            "sparse_dense_matmul_grad_with_sgd",
            [*csr, grad[:, :3], table],
            {"learning_rate": 0.1},
            ValueError,
            r"grad_output must be \[batch, 4\]",
        ),
        (
            "adagrad slot shape",
            "sparse_dense_matmul_grad_with_adagrad",
            [*csr, grad, table, torch.zeros(6)],
            {"learning_rate": 0.1, "eps": 1e-8},
            ValueError,
            r"accumulator must have the table's shape \(6, 4\)",
        ),
        (
            "rowwise slot shape",
            "sparse_dense_matmul_grad_with_rowwise_adagrad",
            [*csr, grad, table, torch.zeros(6, 4)],
            {"learning_rate": 0.1, "eps": 1e-8, "weight_decay": 0.0},
            ValueError,
            r"accumulator must be \[rows\]",
        ),
        (
            "adam slot shape",
            "sparse_dense_matmul_grad_with_adam",
            [*csr, grad, table, torch.zeros(6, 4), torch.zeros(5, 4)],
            {"learning_rate": 0.1, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.0, "step": 1.0},
            ValueError,
            r"momentum2 must have the table's shape",
        ),
    ]
    return calls


@pytest.mark.parametrize("mode", ["cpu", "eager", "fused"])
@pytest.mark.parametrize("case", range(len(_bad_calls())), ids=[c[0].replace(" ", "_") for c in _bad_calls()])
def test_op_argument_checks(case, mode):
    import tpurec

    _, name, tensors, kwargs, error, pattern = _bad_calls()[case]
    op = getattr(torch.ops.tpurec, name)
    if mode != "cpu":
        tensors = [t.to("tpu") for t in tensors]
    with tpurec.mode(mode if mode != "cpu" else "eager"):
        with pytest.raises(error, match=rf"torch.ops.tpurec.{name}: {pattern}"):
            op(*tensors, **kwargs)


def test_valid_direct_calls_still_run_on_every_path():
    csr, table, grad = _csr_args()
    want = torch.ops.tpurec.sparse_dense_matmul(*csr, table, batch_size=3)
    got = torch.ops.tpurec.sparse_dense_matmul(*[t.to("tpu") for t in csr], table.to("tpu"), batch_size=3)
    torch.testing.assert_close(got.cpu(), want, atol=1e-6, rtol=0)
    expected = torch.zeros(3, 4)
    for p in range(2):
        expected[0] += table[p]
        expected[2] += table[p + 2]
    torch.testing.assert_close(want, expected, atol=1e-6, rtol=0)


# --- item 6: inference ------------------------------------------------------------------------------


def _torchrec_dlrm(tables, seed: int = 0):
    from torchrec.models.dlrm import DLRM

    torch.manual_seed(seed)
    return DLRM(
        embedding_bag_collection=TorchrecEBC(tables),
        dense_in_features=5,
        dense_arch_layer_sizes=[8, 4],
        over_arch_layer_sizes=[8, 1],
    )


@pytest.mark.parametrize("mode", ["eager", "fused"])
@pytest.mark.parametrize("context", [torch.inference_mode, torch.no_grad], ids=["inference_mode", "no_grad"])
def test_serving_loop_on_tpu_matches_torchrec(context, mode):
    import tpurec

    tables = make_tables(dims=(4, 4, 4))
    reference = _torchrec_dlrm(tables).eval()
    model = sp.from_torchrec(_torchrec_dlrm(tables), capacities=sp.Capacity(64), num_partitions=2).to("tpu").eval()
    ebc = model.sparse_arch.embedding_bag_collection
    assert isinstance(ebc, sp.EmbeddingBagCollection) and ebc.optimizer is None
    before = _state(ebc)
    rng = np.random.default_rng(0)
    with tpurec.mode(mode), context():
        for _ in range(3):
            dense = torch.from_numpy(rng.standard_normal((4, 5)).astype(np.float32))
            kjt = random_kjt(tables, 4, rng)
            ours = torch.sigmoid(model(dense.to("tpu"), kjt)).cpu()
            theirs = torch.sigmoid(reference(dense, kjt))
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    for a, b in zip(_state(ebc), before):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", ["cpu", "tpu"])
def test_backward_through_an_inference_lookup_raises_and_changes_nothing(device):
    tables = make_tables()
    for ebc in (sp.EmbeddingBagCollection(tables, device=device), sp.from_torchrec(TorchrecEBC(tables), device=device)):
        assert ebc.optimizer is None and not list(ebc.buffers())
        before = _state(ebc)
        out = ebc(random_kjt(tables, 3, np.random.default_rng(0))).values()
        with pytest.raises(RuntimeError, match=r"has no embedding optimizer, so it is for inference"):
            out.sum().backward()
        for a, b in zip(_state(ebc), before):
            assert torch.equal(a, b)
        assert ebc._steps == [0] * len(ebc.stacks)
        # Detached output: a frozen lookup under a trained dense part.
        ebc(random_kjt(tables, 3, np.random.default_rng(1))).values().detach().requires_grad_().sum().backward()


def test_inference_mode_dense_ops_on_tpu_match_cpu():
    torch.manual_seed(0)
    layer = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.LayerNorm(5))
    x = torch.randn(4, 6)
    want = layer(x).detach()
    on_tpu = layer.to("tpu")
    with torch.inference_mode():
        got = on_tpu(x.to("tpu"))
        assert got.is_inference()
        got = got.to(torch.float64).cpu()  # to.dtype_layout / _to_copy reach the device whole in inference mode
    torch.testing.assert_close(got, want.double(), atol=1e-6, rtol=0)


# --- item 5 and checkpoints ---------------------------------------------------------------------------

OPTIMIZERS = [sp.SGD(0.1), sp.Adagrad(0.1), sp.RowWiseAdagrad(0.1, weight_decay=0.01), sp.Adam(0.05)]


def test_loading_another_optimizers_state_changes_nothing():
    tables = make_tables()
    adagrad = sp.EmbeddingBagCollection(tables, optimizer=sp.Adagrad(0.1))
    adagrad(random_kjt(tables, 3, np.random.default_rng(0))).values().sum().backward()
    adam = sp.EmbeddingBagCollection(tables, optimizer=sp.Adam(0.1))
    adam(random_kjt(tables, 3, np.random.default_rng(1))).values().sum().backward()
    before = _state(adam)
    with pytest.raises(ValueError, match=r"state is of Adagrad, but this EmbeddingBagCollection uses Adam"):
        adam.load_optimizer_state_dict(adagrad.optimizer_state_dict())
    # Without the optimizer name (an older state): the slot sets still differ, checked before writing.
    state = adagrad.optimizer_state_dict()
    del state["optimizer"]
    with pytest.raises(ValueError, match=r"has slots \['momentum1'\], but Adam needs \['momentum1', 'momentum2'\]"):
        adam.load_optimizer_state_dict(state)
    _assert_unchanged(adam, before, [1, 1])


def test_loading_tables_without_the_optimizer_state_warns():
    tables = make_tables()
    trained = sp.EmbeddingBagCollection(tables, optimizer=sp.Adagrad(0.1))
    trained(random_kjt(tables, 3, np.random.default_rng(0))).values().sum().backward()
    fresh = sp.EmbeddingBagCollection(tables, optimizer=sp.Adagrad(0.1))
    with pytest.warns(UserWarning, match=r"not its Adagrad state .* the embedding optimizer restarts from zero"):
        fresh.load_state_dict(trained.state_dict())
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sp.EmbeddingBagCollection(tables, optimizer=sp.SGD(0.1)).load_state_dict(
            trained.state_dict()
        )  # SGD has no state
        sp.EmbeddingBagCollection(tables).load_state_dict(trained.state_dict())  # inference


def _dlrm_model(tables, optimizer, device, seed):
    model = sp.from_torchrec(
        _torchrec_dlrm(tables, seed), optimizer=optimizer, capacities=sp.Capacity(64), num_partitions=2
    )
    model = model.to(device)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _train(model, dense_optimizer, tables, device, seeds):
    for seed in seeds:
        rng = np.random.default_rng(seed)
        dense = torch.from_numpy(rng.standard_normal((4, 5)).astype(np.float32)).to(device)
        labels = torch.from_numpy(rng.integers(0, 2, (4, 1)).astype(np.float32)).to(device)
        dense_optimizer.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, random_kjt(tables, 4, rng)), labels)
        loss.backward()
        dense_optimizer.step()


def _everything(model, dense_optimizer) -> dict[str, torch.Tensor]:
    """Tables, slots, step counts, dense parameters and dense optimizer state, flattened."""
    from tpurec.sparse import checkpoint

    state = checkpoint.state_dict(model, dense_optimizer)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix, value):
        if isinstance(value, torch.Tensor):
            flat[prefix] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}/{i}", v)
        elif isinstance(value, (int, float)):
            flat[prefix] = torch.tensor(value)

    walk("", {k: v for k, v in state.items() if k != "rng"})
    return flat


@pytest.mark.parametrize("device", ["cpu", "tpu"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: type(o).__name__)
def test_resume_from_checkpoint_equals_uninterrupted_run_bit_for_bit(optimizer, device, tmp_path):
    from tpurec.sparse import checkpoint

    tables = make_tables(dims=(4, 4, 4))
    model, dense_optimizer = _dlrm_model(tables, optimizer, device, seed=0)
    _train(model, dense_optimizer, tables, device, seeds=[0, 1])
    path = checkpoint.save(tmp_path / "ckpt.pt", model, dense_optimizer, extra={"step": 2})
    _train(model, dense_optimizer, tables, device, seeds=[2, 3])
    uninterrupted = _everything(model, dense_optimizer)

    resumed, resumed_optimizer = _dlrm_model(tables, optimizer, device, seed=1)  # other initial weights
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a full checkpoint load must not warn that the optimizer restarts
        assert checkpoint.load(path, resumed, resumed_optimizer) == {"step": 2}
    _train(resumed, resumed_optimizer, tables, device, seeds=[2, 3])
    after = _everything(resumed, resumed_optimizer)
    assert after.keys() == uninterrupted.keys()
    ebc = "sparse_arch.embedding_bag_collection"
    assert any(k.startswith(f"/embedding_optimizers/{ebc}/steps") for k in after)
    for key, value in uninterrupted.items():
        assert torch.equal(after[key], value), key


def test_checkpoint_tables_load_into_torchrec(tmp_path):
    from tpurec.sparse import checkpoint

    tables = make_tables(dims=(4, 4, 4))
    model, dense_optimizer = _dlrm_model(tables, sp.Adagrad(0.1), "cpu", seed=0)
    _train(model, dense_optimizer, tables, "cpu", seeds=[0])
    path = checkpoint.save(tmp_path / "ckpt.pt", model, dense_optimizer)
    reference = _torchrec_dlrm(tables, seed=3)
    reference.load_state_dict(torch.load(path, weights_only=True)["model"])  # strict: torchrec's key layout
    rng = np.random.default_rng(9)
    dense, kjt = torch.randn(4, 5), random_kjt(tables, 4, rng)
    torch.testing.assert_close(reference(dense, kjt), model(dense, kjt), atol=1e-6, rtol=0)


def test_bad_checkpoint_changes_nothing(tmp_path):
    from tpurec.sparse import checkpoint

    tables = make_tables(dims=(4, 4, 4))
    adagrad, adagrad_optimizer = _dlrm_model(tables, sp.Adagrad(0.1), "cpu", seed=0)
    _train(adagrad, adagrad_optimizer, tables, "cpu", seeds=[0])
    path = checkpoint.save(tmp_path / "adagrad.pt", adagrad, adagrad_optimizer)
    adam, adam_optimizer = _dlrm_model(tables, sp.Adam(0.1), "cpu", seed=1)
    _train(adam, adam_optimizer, tables, "cpu", seeds=[1])
    before = _everything(adam, adam_optimizer)
    with pytest.raises(ValueError, match=r"module 'sparse_arch.embedding_bag_collection'.*state is of Adagrad"):
        checkpoint.load(path, adam, adam_optimizer)
    with pytest.raises(ValueError, match=r"dense optimizer state but no optimizer was passed"):
        checkpoint.load(path, adam)
    with pytest.raises(ValueError, match=r"not a tpurec.sparse.checkpoint/1 checkpoint"):
        checkpoint.load_state_dict(adam, adam.state_dict())
    after = _everything(adam, adam_optimizer)
    for key, value in before.items():
        assert torch.equal(after[key], value), key


def test_save_is_atomic(tmp_path, monkeypatch):
    from tpurec.sparse import checkpoint

    tables = make_tables()
    ebc = sp.EmbeddingBagCollection(tables, optimizer=sp.Adagrad(0.1))
    path = checkpoint.save(tmp_path / "ckpt.pt", ebc)
    good = path.read_bytes()

    def torn_save(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", torn_save)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(path, ebc)
    assert path.read_bytes() == good  # the previous checkpoint is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]  # no temporary file left


@pytest.mark.slow
def test_resume_in_a_fresh_process_equals_uninterrupted_run(tmp_path):
    # The saved file alone must be enough: a new interpreter (new compilations, new
    # RNG, other initial weights) loads it and continues to the same bits.
    from tpurec.sparse import checkpoint

    tables = make_tables(dims=(4, 4, 4))
    model, dense_optimizer = _dlrm_model(tables, sp.Adam(0.05), "tpu", seed=0)
    _train(model, dense_optimizer, tables, "tpu", seeds=[0, 1])
    checkpoint.save(tmp_path / "step2.pt", model, dense_optimizer)
    _train(model, dense_optimizer, tables, "tpu", seeds=[2, 3])
    uninterrupted = _everything(model, dense_optimizer)
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(__import__("os").path.dirname(__file__))!r})
        import tpurec.sparse as sp
        from tpurec.sparse import checkpoint
        import test_reliability as t
        tables = t.make_tables(dims=(4, 4, 4))
        model, dense_optimizer = t._dlrm_model(tables, sp.Adam(0.05), "tpu", seed=7)
        checkpoint.load({str(tmp_path / "step2.pt")!r}, model, dense_optimizer)
        t._train(model, dense_optimizer, tables, "tpu", seeds=[2, 3])
        checkpoint.save({str(tmp_path / "step4.pt")!r}, model, dense_optimizer)
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    resumed, resumed_optimizer = _dlrm_model(tables, sp.Adam(0.05), "tpu", seed=3)
    checkpoint.load(tmp_path / "step4.pt", resumed, resumed_optimizer)
    after = _everything(resumed, resumed_optimizer)
    assert after.keys() == uninterrupted.keys()
    for key, value in uninterrupted.items():
        assert torch.equal(after[key], value), key
