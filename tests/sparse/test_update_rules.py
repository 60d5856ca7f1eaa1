"""An embedding optimizer is one update rule: a new one (SGD with heavy-ball momentum, declared
here and nowhere in tpurec) trains through every kernel family, checked against numpy."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import tpurec
import tpurec.sparse as sp
from helpers import make_tables, random_kjt
from tpurec.sparse import ops, update_rules
from tpurec.sparse.kernels import tpu
from tpurec.sparse.update_rules import Slot, UpdateRule


def _momentum_rows(g, w, m, *, learning_rate, momentum, dtype):
    m = momentum * m + g
    return (w - learning_rate * m).astype(dtype), m


@dataclasses.dataclass
class SGDMomentum(sp.EmbeddingOptimizer):
    momentum: float = 0.9

    rule: ClassVar[UpdateRule] = UpdateRule(
        "test_sgd_momentum",
        "SGD with heavy-ball momentum on the touched rows: m = mu m + g; w -= lr m",
        (Slot("momentum1", "element"),),
        ("learning_rate", "momentum"),
        _momentum_rows,
    )


def _numpy_steps(weights, steps, lr, mu):
    """The same training in numpy: loss = sum(out * C), SUM pooling, momentum on touched rows."""
    weights = {name: w.copy() for name, w in weights.items()}
    momenta = {name: np.zeros_like(w) for name, w in weights.items()}
    for tables, kjt, coefficients in steps:
        grads = {name: np.zeros_like(w) for name, w in weights.items()}
        touched = {name: set() for name in weights}
        column = 0
        for table in tables:
            for feature in table.feature_names:
                jt = kjt[feature]
                ids, lengths = jt.values().numpy(), jt.lengths().numpy()
                gain = jt.weights().numpy() if jt.weights_or_none() is not None else np.ones(len(ids), np.float32)
                start = 0
                for b, n in enumerate(lengths):
                    for i in range(start, start + n):
                        grads[table.name][ids[i]] += gain[i] * coefficients[b, column : column + table.embedding_dim]
                        touched[table.name].add(int(ids[i]))
                    start += n
                column += table.embedding_dim
        for name in weights:
            for r in touched[name]:
                momenta[name][r] = mu * momenta[name][r] + grads[name][r]
                weights[name][r] -= lr * momenta[name][r]
    return weights


def test_the_rule_defines_its_op_with_a_schema_and_checks():
    rule = SGDMomentum.rule
    assert SGDMomentum.op_name == "sparse_dense_matmul_grad_with_test_sgd_momentum"
    assert SGDMomentum.slots == {"momentum1": "element"}
    assert update_rules.RULES[rule.op_name] is rule and ops.SCHEMAS[rule.op_name] == rule.schema()
    assert SGDMomentum(learning_rate=0.5).hyperparameters(3) == {"learning_rate": 0.5, "momentum": 0.9}
    op = torch.ops.tpurec.sparse_dense_matmul_grad_with_test_sgd_momentum
    csr = (torch.tensor([1], dtype=torch.int32), torch.zeros(8, dtype=torch.int32))
    csr += (torch.zeros(8, dtype=torch.int32), torch.ones(8))
    with pytest.raises(ValueError, match="momentum1 must have the table's shape"):
        op(*csr, torch.ones(1, 4), torch.ones(3, 4), torch.ones(3, 5), learning_rate=0.1, momentum=0.9)
    # Registering it again is a no-op; another rule of its name is refused.
    update_rules.register(rule)
    with pytest.raises(ValueError, match="registered already"):
        update_rules.register(dataclasses.replace(rule, summary="another"))


def test_a_rule_without_learning_rate_or_a_config_without_its_fields_is_refused():
    with pytest.raises(ValueError, match="must include learning_rate"):
        UpdateRule("no_lr", "x", (), ("momentum",), _momentum_rows)

    @dataclasses.dataclass
    class Missing(sp.EmbeddingOptimizer):  # no momentum field
        rule: ClassVar[UpdateRule] = UpdateRule(
            "test_missing_field", "x", (Slot("momentum1", "element"),), ("learning_rate", "momentum"), _momentum_rows
        )

    with pytest.raises(TypeError, match=r"no field for the hyperparameters \['momentum'\]"):
        Missing()


def test_sparsecore_entry_exports_element_slot_rules_and_refuses_row_slots():
    rule = UpdateRule("test_row_slot", "x", (Slot("acc", "row"),), ("learning_rate",), lambda g, w, a, **k: (w, a))
    update_rules.register(rule)
    with pytest.raises(NotImplementedError, match="per-row slots"):
        getattr(tpu, rule.op_name)(*([None] * 7), learning_rate=0.1)
    # Element slots: the rule's row math runs in jax-tpu-embedding's generic primitive (a TPU program
    # exported here; running it needs a chip with SparseCores).
    import jax
    import jax.numpy as jnp

    from test_tpu_kernel import _DISABLED

    def step(rp, ids, samples, gains, grad, table, m):
        return getattr(tpu, SGDMomentum.op_name)(
            rp, ids, samples, gains, grad, table, m, learning_rate=0.1, momentum=0.9, num_sc_per_device=2
        )

    f32, i32 = jnp.float32, jnp.int32
    shapes = [((2,), i32), ((16,), i32), ((16,), i32), ((16,), f32), ((4, 8), f32), ((37, 8), f32), ((37, 8), f32)]
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
    text = jax.export.export(jax.jit(step), platforms=["tpu"], disabled_checks=_DISABLED)(*args).mlir_module()
    assert text.count("stablehlo.custom_call @SparseDenseMatmulGradOpWithOptimizerUpdate(") == 1


@pytest.mark.parametrize(
    "device,kernel", [("cpu", "auto"), ("tpu", "native"), ("tpu", "reference"), ("tpu", "tensorcore")]
)
def test_a_new_optimizer_trains_on_every_kernel_as_numpy(device, kernel):
    tables = make_tables()
    rng = np.random.default_rng(0)
    lr, mu = 0.1, 0.5
    ebc = sp.EmbeddingBagCollection(tables, is_weighted=True, optimizer=SGDMomentum(learning_rate=lr, momentum=mu))
    start = {k.split(".")[1]: v.numpy().copy() for k, v in ebc.state_dict().items()}
    steps = []
    for _ in range(3):
        kjt = random_kjt(tables, 4, rng, max_len=4, weighted=True)
        width = sum(t.embedding_dim * len(t.feature_names) for t in tables)
        steps.append((tables, kjt, rng.standard_normal((4, width)).astype(np.float32)))
    with tpurec.config.override(sparse_kernel=kernel):
        ebc = ebc.to(device)
        for _, kjt, coefficients in steps:
            out = ebc(kjt.to(device)).values()
            (out * torch.from_numpy(coefficients).to(device)).sum().backward()
    got = {k.split(".")[1]: v.cpu().numpy() for k, v in ebc.state_dict().items()}
    want = _numpy_steps(start, steps, lr, mu)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
    assert any(not np.allclose(got[n], start[n]) for n in want)  # it trained


@pytest.mark.parametrize("beta", [0.0, 0.5, 0.9, 0.99, 0.999, 0.9999, 0.99999])
def test_bias_correction_is_within_a_few_ulps_of_float64_over_every_step(beta):
    steps = np.arange(1, 300_001, dtype=np.float32)
    got = np.asarray(update_rules.bias_correction(np.float32(beta), steps), np.float64)
    want = 1.0 - np.float64(np.float32(beta)) ** steps.astype(np.float64)
    ulps = np.abs(got - want) / want / np.finfo(np.float32).eps
    assert ulps.max() <= 4, (int(np.argmax(ulps)) + 1, ulps.max())


@pytest.mark.parametrize("step", [1, 2, 3, 5, 10, 100, 1000, 10_000, 100_000])
def test_adam_rows_match_float64_at_every_step(step):
    # 1 - beta2**step in float32 cancels to a few digits where beta2**step is near 1 (827 ulps at
    # beta2 = 0.9999, step 2); the update's error must stay at float32's rounding. Fresh slots, so
    # that the moments' own sums do not cancel.
    g = np.random.default_rng(step).standard_normal((6, 8)).astype(np.float32)
    w, m1, m2 = (np.zeros((6, 8), np.float32) for _ in range(3))
    # The hyperparameters as the kernels get them: float32 scalars.
    hp = {
        k: jnp.float32(v) for k, v in dict(learning_rate=1, beta1=0.9, beta2=0.9999, eps=1e-8, weight_decay=0).items()
    }
    new_w, _, _ = update_rules.ADAM.rows(g, w, m1, m2, **hp, step=jnp.float32(step), dtype=jnp.float32)
    b1, b2 = np.float64(hp["beta1"]), np.float64(hp["beta2"])
    g64 = g.astype(np.float64)
    m1_64 = b1 * m1 + (1 - b1) * g64
    m2_64 = b2 * m2 + (1 - b2) * g64 * g64
    want = -(m1_64 / (1 - b1**step)) / (np.sqrt(m2_64 / (1 - b2**step)) + np.float64(hp["eps"]))
    np.testing.assert_allclose(np.asarray(new_w, np.float64), want, rtol=16 * np.finfo(np.float32).eps, atol=0)
