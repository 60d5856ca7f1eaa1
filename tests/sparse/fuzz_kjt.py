"""Property-based fuzzing of the whole sparse input path (run as a child process).

``tests/sparse/test_fuzz.py`` starts this script in a subprocess, so that a
crash (a segfault in numpy or in the native kernels) fails that test with the
reproducer instead of killing pytest. Before each example the case is written,
as one JSON line, to the ``--last`` file: after a crash it is the reproducer,
and ``--replay '<json>'`` runs exactly that case again.

One example is a JSON-able *case*: tables (dims, rows, shared tables, SUM /
MEAN), weighted or not (weights in float16 / bfloat16 / float32 / float64),
int32 / int64 ids and lengths, a lengths or offsets KJT, batch size 0-4, MOD
partitions, fixed / small / automatic capacities, overflow ``error`` / ``drop``,
an optimizer, a seed for the values, and optionally one *mutation* that makes
the batch malformed. Each example:

1. runs one training step on a valid batch and checks it:
   * forward against torchrec's ``EmbeddingBagCollection`` (or, when the
     capacity drops entries, against a pure-Python pooling of the entries
     that tpurec's documented drop rule keeps);
   * the optimizer step against FBGEMM's TBE (SGD, Adagrad, RowWiseAdagrad) or
     a float64 numpy lazy Adam on torchrec's gradient (FBGEMM's CPU TBE has no
     Adam); rows the batch does not touch must stay bit-identical;
   * a batch past a fixed capacity with ``overflow="error"`` must raise a
     ``CapacityError`` naming its stacked table and change nothing;
2. if the case has a mutation, feeds the malformed batch and requires a
   ``ValueError`` naming the right feature, with tables, slots, step counts
   and capacities bit-identical afterwards.

Usage::

    python tests/sparse/fuzz_kjt.py --examples 200 --last /tmp/last.json [--seed 0]
    python tests/sparse/fuzz_kjt.py --replay '{"seed": 1, ...}'
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torchrec import EmbeddingBagCollection as TorchrecEBC  # noqa: E402
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor  # noqa: E402
from torchrec.modules.embedding_configs import PoolingType  # noqa: E402

import tpurec.sparse as sp  # noqa: E402

OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")
WEIGHT_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
MUTATIONS = (
    "id_too_large",
    "id_negative",
    "huge_length",
    "negative_length",
    "extra_value",
    "missing_value",
    "weights_wrong_length",
    "integer_weights",
    "duplicate_key",
    "unknown_key",
    "missing_key",
    "float_ids",
    "missing_weights",
)
# Forward: float32 sums of a few products of O(1) numbers.
FORWARD_ATOL = 1e-5
# One optimizer step, float32 kernels vs FBGEMM (float32) or a float64 reference.
STEP_ATOL, STEP_RTOL = 2e-5, 1e-5


# --- cases ---------------------------------------------------------------------------------------


# Table layouts (name, dim, rows, features): few shapes, so that after warm-up an
# example reuses compiled kernels (compiling is ~95% of a cold example's time).
# Together they cover one table, shared tables (two features), several tables
# stacked in one dim, several stacks, and a one-row table.
LAYOUTS = (
    (("t0", 4, 7, ("a",)),),
    (("t0", 4, 5, ("a", "b")),),
    (("t0", 4, 6, ("a", "b")), ("t1", 4, 3, ("c",)), ("t2", 8, 4, ("d",))),
    (("t0", 8, 1, ("a",)), ("t1", 4, 9, ("b", "c"))),
    (("t0", 4, 2, ("a",)), ("t1", 4, 5, ("b",)), ("t2", 4, 12, ("c",))),
)


@st.composite
def cases(draw) -> dict[str, Any]:
    """A JSON-able description of one example (see the module docstring)."""
    weighted = draw(st.booleans())
    tables = []
    for name, dim, rows, features in LAYOUTS[draw(st.integers(0, len(LAYOUTS) - 1))]:
        tables.append(
            {
                "name": name,
                "dim": dim,  # FBGEMM needs multiples of 4
                "rows": rows,
                "features": list(features),
                # torchrec pools weighted bags with SUM only.
                "pooling": "SUM" if weighted else draw(st.sampled_from(["SUM", "MEAN"])),
            }
        )
    capacity = draw(st.sampled_from(["fixed", "small", "auto"]))
    mutate = draw(st.booleans())
    return {
        "tables": tables,
        "weighted": weighted,
        "weight_dtype": draw(st.sampled_from(sorted(WEIGHT_DTYPES))),
        "stray_weights": (not weighted) and draw(st.booleans()),
        "id_dtype": draw(st.sampled_from(["int32", "int64"])),
        "length_dtype": draw(st.sampled_from(["int32", "int64"])),
        "form": draw(st.sampled_from(["lengths", "offsets"])),
        "batch": draw(st.sampled_from([0, 1, 3])),
        "max_len": draw(st.integers(0, 4)),
        "partitions": draw(st.integers(1, 3)),
        "capacity": capacity,
        "overflow": draw(st.sampled_from(["error", "drop"])) if capacity == "small" else "error",
        "optimizer": draw(st.sampled_from(OPTIMIZERS)),
        "mutation": draw(st.sampled_from(MUTATIONS)) if mutate else None,
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


def _configs(case) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=t["name"],
            embedding_dim=t["dim"],
            num_embeddings=t["rows"],
            feature_names=list(t["features"]),
            pooling=PoolingType[t["pooling"]],
        )
        for t in case["tables"]
    ]


def _optimizer(name: str) -> sp.EmbeddingOptimizer:
    return {
        "sgd": sp.SGD(0.1),
        "adagrad": sp.Adagrad(0.1, eps=1e-3),
        "rowwise_adagrad": sp.RowWiseAdagrad(0.1, eps=1e-3),
        "adam": sp.Adam(0.05, beta1=0.8, beta2=0.95, eps=1e-3),
    }[name]


class Batch:
    """A KJT's parts, kept as numpy so mutations can edit them."""

    def __init__(self, keys, lengths, values, weights, case):
        self.keys, self.lengths, self.values, self.weights, self.case = list(keys), lengths, values, weights, case

    def kjt(self, values_dtype=None) -> KeyedJaggedTensor:
        id_dtype = values_dtype or getattr(torch, self.case["id_dtype"])
        length_dtype = getattr(torch, self.case["length_dtype"])
        values = torch.from_numpy(self.values).to(id_dtype)
        lengths = torch.from_numpy(self.lengths).to(length_dtype)
        weights = self.weights
        if self.case["form"] == "offsets":
            offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
            offsets[1:] = torch.cumsum(torch.from_numpy(self.lengths).long(), 0)  # may wrap: that is the point
            return KeyedJaggedTensor(keys=self.keys, values=values, offsets=offsets.to(length_dtype), weights=weights)
        return KeyedJaggedTensor(keys=self.keys, values=values, lengths=lengths, weights=weights)


def _valid_batch(case, configs, rng: np.random.Generator) -> Batch:
    keys, lengths, values = [], [], []
    for cfg in configs:
        for f in cfg.feature_names:
            keys.append(f)
            ls = rng.integers(0, case["max_len"] + 1, case["batch"])
            lengths.append(ls)
            values.append(rng.integers(0, cfg.num_embeddings, int(ls.sum())))
    lengths_np = np.concatenate(lengths).astype(np.int64)
    values_np = np.concatenate(values).astype(np.int64)
    weights = None
    if case["weighted"] or case["stray_weights"]:
        weights = torch.from_numpy(rng.uniform(0.25, 2.0, values_np.shape[0])).to(WEIGHT_DTYPES[case["weight_dtype"]])
    return Batch(keys, lengths_np, values_np, weights, case)


# --- pure-Python references ------------------------------------------------------------------------


def _stacks(configs) -> list[tuple[int, list[tuple[EmbeddingBagConfig, int]]]]:
    """tpurec's documented stacking: tables grouped by dim (first-appearance order), rows in table order."""
    groups: dict[int, list[tuple[EmbeddingBagConfig, int]]] = {}
    for cfg in configs:
        members = groups.setdefault(cfg.embedding_dim, [])
        offset = sum(c.num_embeddings for c, _ in members)
        members.append((cfg, offset))
    return list(groups.items())


def _entries(batch: Batch, configs, case):
    """Per stack: {(stacked row, output slot row): summed gain}, with slots numbered per stack."""
    batch_size = case["batch"]
    ends = np.cumsum(batch.lengths)
    starts = ends - batch.lengths
    weights = None if batch.weights is None or not case["weighted"] else batch.weights.double().numpy()
    out = []
    for _dim, members in _stacks(configs):
        pairs: dict[tuple[int, int], float] = {}
        slot = 0
        for cfg, offset in members:
            for f in cfg.feature_names:
                k = batch.keys.index(f)
                for b in range(batch_size):
                    i = k * batch_size + b
                    n = int(batch.lengths[i])
                    for j in range(int(starts[i]), int(ends[i])):
                        gain = 1.0 if weights is None else float(weights[j])
                        if cfg.pooling == PoolingType.MEAN:
                            gain /= n
                        key = (int(batch.values[j]) + offset, slot * batch_size + b)
                        pairs[key] = pairs.get(key, 0.0) + gain
                slot += 1
        out.append(pairs)
    return out


def _kept(pairs: dict, partitions: int, capacity: sp.Capacity) -> tuple[dict, bool]:
    """The entries tpurec keeps under ``capacity`` with overflow="drop", and whether it overflows.

    The documented rule: per partition (row % partitions), entries sorted by
    (row, output row); keep those of the first ``max_unique_ids_per_partition``
    distinct rows, then the first ``max_ids_per_partition`` of them.
    """
    kept, overflows = {}, False
    for p in range(partitions):
        mine = sorted(k for k in pairs if k[0] % partitions == p)
        rows = sorted({r for r, _ in mine})
        if len(mine) > capacity.max_ids_per_partition or len(rows) > capacity.max_unique_ids_per_partition:
            overflows = True
        allowed = set(rows[: capacity.max_unique_ids_per_partition])
        mine = [k for k in mine if k[0] in allowed][: capacity.max_ids_per_partition]
        kept.update({k: pairs[k] for k in mine})
    return kept, overflows


def _lazy_adam(w, m1, m2, grad, touched, step, lr, b1, b2, eps):
    for r in touched:
        m1[r] = b1 * m1[r] + (1 - b1) * grad[r]
        m2[r] = b2 * m2[r] + (1 - b2) * grad[r] ** 2
        w[r] -= lr * (m1[r] / (1 - b1**step)) / (np.sqrt(m2[r] / (1 - b2**step)) + eps)


# --- the check -------------------------------------------------------------------------------------


def _snapshot(ebc: sp.EmbeddingBagCollection):
    return (
        [t.detach().clone() for t in [*ebc.parameters(), *ebc.buffers()]],
        list(ebc._steps),
        dict(ebc._auto_capacities),
    )


def _assert_same_state(ebc, snapshot, what: str) -> None:
    tensors, steps, capacities = snapshot
    for a, b in zip([*ebc.parameters(), *ebc.buffers()], tensors):
        assert torch.equal(a.detach(), b), f"{what}: a table or slot changed"
    assert ebc._steps == steps, f"{what}: step counts changed {steps} -> {ebc._steps}"
    assert ebc._auto_capacities == capacities, f"{what}: capacities changed"


def _capacity(case):
    return {"fixed": sp.Capacity(64), "small": sp.Capacity(3, 2), "auto": None}[case["capacity"]]


def _check_valid_step(case, configs, ebc, batch: Batch, rng) -> None:
    kjt = batch.kjt()
    capacity = _capacity(case)
    stacks = _stacks(configs)
    entries = _entries(batch, configs, case)
    drops, overflows = False, False
    if capacity is not None:
        for pairs in entries:
            kept, over = _kept(pairs, case["partitions"], capacity)
            overflows |= over
            drops |= len(kept) != len(pairs)
    if overflows and case["overflow"] == "error":
        before = _snapshot(ebc)
        try:
            ebc(kjt)
        except sp.CapacityError as e:
            assert "stacked table '" in str(e) and "raise it" in str(e), str(e)
        else:
            raise AssertionError("a batch past the fixed capacity was accepted with overflow='error'")
        _assert_same_state(ebc, before, "after a CapacityError")
        return
    reference = TorchrecEBC(configs, is_weighted=case["weighted"])
    reference.load_state_dict(ebc.state_dict())
    before = _snapshot(ebc)
    out = ebc(kjt)
    keys = [f for cfg in configs for f in cfg.feature_names]
    assert out.keys() == keys
    ours = out.values()
    assert ours.shape == (case["batch"], sum(c.embedding_dim * len(c.feature_names) for c in configs))
    ref_kjt = KeyedJaggedTensor(
        keys=batch.keys,
        values=torch.from_numpy(batch.values),
        lengths=torch.from_numpy(batch.lengths),
        weights=None if batch.weights is None else batch.weights.float(),
    )
    if not drops:
        theirs = reference(ref_kjt).values()
        torch.testing.assert_close(ours, theirs, atol=FORWARD_ATOL, rtol=0)
    else:
        # Pool the kept entries in float64 and place them in torchrec's output layout.
        expected = np.zeros(tuple(ours.shape))
        column = {}
        col = 0
        for cfg in configs:
            for f in cfg.feature_names:
                column[f] = col
                col += cfg.embedding_dim
        for (dim, members), pairs in zip(stacks, entries):
            table = torch.cat([ebc.table_weight(cfg.name).detach() for cfg, _ in members]).double().numpy()
            features = [f for cfg, _ in members for f in cfg.feature_names]
            for (row, sample), gain in _kept(pairs, case["partitions"], capacity)[0].items():
                f = features[sample // case["batch"]]
                expected[sample % case["batch"], column[f] : column[f] + dim] += gain * table[row]
        np.testing.assert_allclose(ours.detach().numpy(), expected, atol=FORWARD_ATOL, rtol=0)
    upstream = torch.from_numpy(rng.standard_normal(tuple(ours.shape)).astype(np.float32))
    ours.backward(upstream)
    # Rows no id of the batch names stay bit-identical (every optimizer is lazy).
    touched = {cfg.name: set() for cfg in configs}
    ends = np.cumsum(batch.lengths)
    for k, key in enumerate(batch.keys):
        cfg = next(c for c in configs if key in c.feature_names)
        lo = int(ends[k * case["batch"] - 1]) if k * case["batch"] > 0 else 0
        hi = int(ends[(k + 1) * case["batch"] - 1]) if case["batch"] else 0
        touched[cfg.name].update(int(v) for v in batch.values[lo:hi])
    for cfg in configs:  # the reference still holds the tables from before the step
        untouched = [r for r in range(cfg.num_embeddings) if r not in touched[cfg.name]]
        old = reference.embedding_bags[cfg.name].weight.detach()
        assert torch.equal(ebc.table_weight(cfg.name).detach()[untouched], old[untouched]), (
            f"table {cfg.name}: a row the batch does not touch changed"
        )
    if drops or case["batch"] == 0:
        return
    _check_step_against_reference(case, configs, ebc, reference, ref_kjt, upstream)


def _check_step_against_reference(case, configs, ebc, reference, ref_kjt, upstream) -> None:
    name = case["optimizer"]
    if name == "adam":
        # Lazy Adam (FBGEMM's semantics) in float64 on torchrec's gradient.
        out = reference(ref_kjt).values()
        out.backward(upstream)
        opt = _optimizer("adam")
        for cfg in configs:
            bag = reference.embedding_bags[cfg.name]
            w = bag.weight.detach().double().numpy().copy()
            grad = bag.weight.grad.double().numpy()
            m1, m2 = np.zeros_like(w), np.zeros_like(w)
            rows = set()
            for f in cfg.feature_names:
                rows.update(int(v) for v in ref_kjt[f].values())
            _lazy_adam(w, m1, m2, grad, sorted(rows), 1, opt.learning_rate, opt.beta1, opt.beta2, opt.eps)
            slots = ebc.optimizer_state_dict()["state"][f"embedding_bags.{cfg.name}.weight"]
            np.testing.assert_allclose(ebc.table_weight(cfg.name).detach().numpy(), w, atol=STEP_ATOL, rtol=STEP_RTOL)
            np.testing.assert_allclose(slots["momentum1"].numpy(), m1, atol=STEP_ATOL, rtol=STEP_RTOL)
            np.testing.assert_allclose(slots["momentum2"].numpy(), m2, atol=STEP_ATOL, rtol=STEP_RTOL)
        return
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    kind = {
        "sgd": EmbOptimType.EXACT_SGD,
        "adagrad": EmbOptimType.EXACT_ADAGRAD,
        "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    }[name]
    kwargs = {"learning_rate": 0.1} if name == "sgd" else {"learning_rate": 0.1, "eps": 1e-3}
    # FBGEMM pools one mode per TBE: one TBE per table keeps SUM and MEAN tables apart.
    for cfg in configs:
        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(cfg.num_embeddings, cfg.embedding_dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
            feature_table_map=[0] * len(cfg.feature_names),
            optimizer=kind,
            pooling_mode=PoolingMode.SUM if cfg.pooling == PoolingType.SUM else PoolingMode.MEAN,
            device="cpu",
            **kwargs,
        )
        with torch.no_grad():
            tbe.split_embedding_weights()[0].copy_(reference.embedding_bags[cfg.name].weight)
        jagged = [ref_kjt[f] for f in cfg.feature_names]
        offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(torch.cat([j.lengths() for j in jagged]).long()).long()
        weights = torch.cat([j.weights() for j in jagged]).float() if case["weighted"] else None
        theirs = tbe(torch.cat([j.values() for j in jagged]).long(), offsets, per_sample_weights=weights)
        # The table's columns of our output, per feature.
        col, cols = 0, {}
        for c in configs:
            for f in c.feature_names:
                cols[f] = (col, col + c.embedding_dim)
                col += c.embedding_dim
        grad = torch.cat([upstream[:, cols[f][0] : cols[f][1]] for f in cfg.feature_names], dim=1)
        theirs.backward(grad)
        torch.testing.assert_close(
            ebc.table_weight(cfg.name).detach(), tbe.split_embedding_weights()[0], atol=STEP_ATOL, rtol=STEP_RTOL
        )
        mine = list(ebc.optimizer_state_dict()["state"][f"embedding_bags.{cfg.name}.weight"].values())
        states = tbe.split_optimizer_states()  # [] for SGD
        theirs_slots = states[0] if states else []
        assert len(mine) == len(theirs_slots), (len(mine), len(theirs_slots))
        for a, b in zip(mine, theirs_slots):
            torch.testing.assert_close(a, b.reshape(a.shape), atol=STEP_ATOL, rtol=STEP_RTOL)


def _mutate(case, configs, batch: Batch, rng: np.random.Generator) -> tuple[KeyedJaggedTensor, list[str]]:
    """The malformed KJT of ``case["mutation"]`` and the features its error may name."""
    m = case["mutation"]
    keys, B = batch.keys, case["batch"]
    n_keys = len(keys)
    lengths, values = batch.lengths.copy(), batch.values.copy()
    ends = np.cumsum(lengths.reshape(n_keys, B).sum(axis=1)) if B else np.zeros(n_keys, np.int64)
    N = values.shape[0]
    weights = batch.weights
    rows = {f: c.num_embeddings for c in configs for f in c.feature_names}

    def feature_of(index: int) -> int:
        return int(np.searchsorted(ends, index, side="right"))

    def rebuilt(**kw) -> KeyedJaggedTensor:
        b = Batch(
            kw.get("keys", keys), kw.get("lengths", lengths), kw.get("values", values), kw.get("weights", weights), case
        )
        return b.kjt(kw.get("values_dtype"))

    if m in ("id_too_large", "id_negative") and N:
        i = int(rng.integers(0, N))
        k = feature_of(i)
        big = case["id_dtype"] == "int64" and rng.random() < 0.5
        values[i] = (
            (rows[keys[k]] + int(rng.integers(0, 2**40 if big else 5)))
            if m == "id_too_large"
            else -1 - int(rng.integers(0, 5))
        )
        return rebuilt(values=values), [keys[k]]
    if m == "huge_length" and B:
        i = int(rng.integers(0, n_keys * B))
        choices = [N + 1, 2**31 - 1] + ([2**62, 2**63 - 1] if case["length_dtype"] == "int64" else [])
        lengths[i] = choices[int(rng.integers(0, len(choices)))]
        return rebuilt(lengths=lengths), [keys[i // B]]
    if m == "negative_length" and B:
        i = int(rng.integers(0, n_keys * B))
        lengths[i] = -1 - int(rng.integers(0, 5))
        return rebuilt(lengths=lengths), [keys[i // B]]
    if m == "extra_value":
        return rebuilt(
            values=np.append(values, 0),
            weights=None
            if weights is None
            else torch.cat([weights, weights[:1] if N else torch.ones(1, dtype=weights.dtype)]),
        ), [keys[-1]]
    if m == "missing_value" and B:
        i = int(rng.integers(0, n_keys * B))
        k = i // B
        lengths[i] += 1
        # The first feature from k on whose running end passes len(values).
        named = next(j for j in range(k, n_keys) if ends[j] == N)
        return rebuilt(lengths=lengths), [keys[named]]
    if m == "weights_wrong_length" and (case["weighted"] or case["stray_weights"]):
        n = N + 1 if N == 0 or rng.random() < 0.5 else N - 1
        named = min(int(np.searchsorted(ends, min(n, N), side="right")), n_keys - 1)
        return rebuilt(weights=torch.ones(n, dtype=weights.dtype)), [keys[named]]
    if m == "integer_weights":
        return rebuilt(weights=torch.ones(N, dtype=torch.int64)), list(keys)
    if m == "duplicate_key" and B:
        k = int(rng.integers(0, n_keys))
        block = lengths.reshape(n_keys, B)[k]
        lo = int(ends[k] - block.sum())
        extra_w = None if weights is None else torch.cat([weights, weights[lo : int(ends[k])]])
        return rebuilt(
            keys=[*keys, keys[k]],
            lengths=np.concatenate([lengths, block]),
            values=np.concatenate([values, values[lo : int(ends[k])]]),
            weights=extra_w,
        ), [keys[k]]
    if m == "unknown_key" and B:
        extra_w = None if weights is None else torch.cat([weights, torch.ones(B, dtype=weights.dtype)])
        return rebuilt(
            keys=[*keys, "zz"],
            lengths=np.concatenate([lengths, np.ones(B, np.int64)]),
            values=np.concatenate([values, np.zeros(B, np.int64)]),
            weights=extra_w,
        ), ["zz"]
    if m == "missing_key" and n_keys > 1 and B:
        k = int(rng.integers(0, n_keys))
        block = lengths.reshape(n_keys, B)
        lo = int(ends[k] - block[k].sum())
        keep = np.r_[0:lo, int(ends[k]) : N]
        return rebuilt(
            keys=[f for j, f in enumerate(keys) if j != k],
            lengths=np.delete(block, k, axis=0).reshape(-1),
            values=values[keep],
            weights=None if weights is None else weights[torch.from_numpy(keep)],
        ), [keys[k]]
    if m == "float_ids" and N:
        return rebuilt(values_dtype=torch.float32), [keys[0]]
    if m == "missing_weights" and case["weighted"]:
        return rebuilt(weights=None), list(keys)
    return None, []  # this mutation does not apply to this batch


def check(case: dict[str, Any]) -> None:
    """Runs one example (see the module docstring); raises AssertionError on a finding."""
    configs = _configs(case)
    rng = np.random.default_rng(case["seed"])
    torch.manual_seed(case["seed"] % 2**31)
    ebc = sp.EmbeddingBagCollection(
        configs,
        is_weighted=case["weighted"],
        optimizer=_optimizer(case["optimizer"]),
        num_partitions=case["partitions"],
        capacities=_capacity(case),
        overflow=case["overflow"],
    )
    batch = _valid_batch(case, configs, rng)
    _check_valid_step(case, configs, ebc, batch, rng)
    if case["mutation"] is None:
        return
    bad, names = _mutate(case, configs, batch, rng)
    if bad is None:
        return
    before = _snapshot(ebc)
    try:
        ebc(bad)
    except ValueError as e:
        message = str(e)
        assert any(f"'{n}'" in message for n in names), f"{case['mutation']}: error names none of {names}: {message}"
    except Exception as e:  # noqa: BLE001 (any other type is a finding)
        raise AssertionError(f"{case['mutation']}: {type(e).__name__} instead of a ValueError: {e}") from e
    else:
        raise AssertionError(f"{case['mutation']}: the malformed batch was accepted")
    _assert_same_state(ebc, before, case["mutation"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=100)
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: random)")
    parser.add_argument(
        "--last", default=os.devnull, help="file that holds the case being run (the reproducer after a crash)"
    )
    parser.add_argument("--replay", default=None, help="run one case given as JSON")
    parser.add_argument("--progress", type=int, default=0, help="print a line every this many examples")
    args = parser.parse_args(argv)
    if args.replay:
        check(json.loads(args.replay))
        print("replayed: passed")
        return 0
    counts = {"examples": 0, "mutated": 0}
    crash_at = int(os.environ.get("TPUREC_FUZZ_CRASH_AT", "0"))

    @settings(
        max_examples=args.examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )
    @given(cases())
    def run(case):
        with open(args.last, "w") as f:
            f.write(json.dumps(case) + "\n")
            f.flush()
        counts["examples"] += 1
        if counts["examples"] == crash_at:  # tests the harness: a crash must be reported with this case
            os.kill(os.getpid(), signal.SIGSEGV)
        counts["mutated"] += case["mutation"] is not None
        if args.progress and counts["examples"] % args.progress == 0:
            print(f"fuzz: {counts['examples']} examples ({counts['mutated']} malformed) ...", flush=True)
        try:
            check(case)
        except Exception:
            print("REPRODUCER:", json.dumps(case), flush=True)
            raise

    if args.seed is not None:
        run = seed(args.seed)(run)
    run()
    print(f"fuzz: {counts['examples']} examples ({counts['mutated']} with a malformed batch), 0 failures", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
