"""A collection sharded by ``tpurec.shard`` (8 host devices) looked up twice before one backward, against TorchRec
on CPU on the same batches, 5 steps.

* FBGEMM's semantics (a TorchRec ``FusedEmbeddingBagCollection`` converted by ``from_torchrec``, an explicit
  ``optimizer=`` given to ``tpurec.shard``, or an in-backward optimizer with ``optimizer_semantics = "fbgemm"``):
  FBGEMM's kernel updates once per lookup, in the order autograd runs the lookups' backwards (the second lookup's
  first); the reference is the ``FusedEmbeddingBagCollection`` itself. TorchRec's ``DistributedModelParallel``
  also updates once per lookup with an in-backward optimizer (on CPU, gloo, one rank, in-backward Adagrad at
  lr 0.5 and two lookups: its table equals the ``FusedEmbeddingBagCollection``'s exactly, FBGEMM's eps 1e-8
  included, and differs from the unsharded collection's one update on the summed gradient).
* An in-backward optimizer (``apply_optimizer_in_backward``, the converted module's ``"torch"`` semantics): TorchRec's
  unsharded collection makes one update on the step's summed gradient (its optimizer hooks the table's gradient
  accumulator), and so does the sharded collection (``programs.summed_backward``); the reference is TorchRec's
  ``EmbeddingBagCollection`` with the same in-backward optimizer (SGD, Adagrad, TorchRec's RowWiseAdagrad; the
  step count advances once a step), also with per-id weights that take a gradient.

Compared: the loss and the dense layer's gradient of every step (float32 sums over a batch: 1e-5 relative,
1e-6 absolute), the tables and the optimizer's state after the steps (float32 Adagrad updates of the same
gradients: 1e-5 relative, 1e-6 absolute).
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection as TorchrecEBC
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import tpurec
import tpurec.sparse as sp
from helpers import make_tables, random_kjt
from tpurec.sparse.sharding import ShardedEmbeddingBagCollection

STEPS = 5
BATCH = 16
TABLES = make_tables(dims=(8, 8, 4), rows=(40, 23, 17), features=(("f0", "f1"), ("f2",), ("f3",)))
TOLERANCE: dict[str, Any] = {"rtol": 1e-5, "atol": 1e-6}
PLAN = {"t0": row_wise(), "t1": column_wise(ranks=[2, 5]), "t2": data_parallel()}
# Row-wise Adagrad: a column shard keeps its own row accumulators (as TorchRec's sharded module), which the
# unsharded reference has not, so its table is placed whole.
ROW_WISE_ADAGRAD_PLAN = {"t0": row_wise(), "t1": table_wise(rank=5), "t2": data_parallel()}


class TwoLookups(nn.Module):
    """One collection looked up on two batches (e.g. a query and a candidate tower sharing tables)."""

    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc
        self.over = nn.Linear(28, 1)

    def forward(self, first, second) -> torch.Tensor:
        a = self.over(self.ebc(first).values())
        b = self.over(self.ebc(second).values())
        return (a * a).mean() + 2 * (a * b).mean() + (b * b * b).mean()


def _sharded(model: TwoLookups, table_plans: dict[str, Any] = PLAN, **kwargs: Any) -> Any:
    meta = TorchrecEBC(tables=TABLES, device=torch.device("meta"))
    plan = construct_module_sharding_plan(meta, table_plans, local_size=8, world_size=8, device_type="cpu")
    converted = sp.from_torchrec(model).to("tpu")
    sharded = tpurec.shard(converted, {"ebc": plan}, **kwargs)
    assert isinstance(sharded.ebc, ShardedEmbeddingBagCollection)
    return sharded


def _train_and_compare(reference: Any, sharded: Any) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    for step in range(STEPS):
        first, second = random_kjt(TABLES, BATCH, rng), random_kjt(TABLES, BATCH, rng)
        grads = []
        for model in (reference, sharded):
            model.over.zero_grad()
            loss = model(first, second)
            loss.backward()
            grads.append((loss.detach().cpu(), model.over.weight.grad.cpu(), model.over.bias.grad.cpu()))
        for what, ours, theirs in zip(("loss", "weight gradient", "bias gradient"), grads[1], grads[0]):
            torch.testing.assert_close(ours, theirs, **TOLERANCE, msg=f"{what} of step {step}")
        for model in (reference, sharded):
            with torch.no_grad():
                model.over.weight -= 0.1 * model.over.weight.grad
    tables, slots = sharded.ebc.full_tables()
    theirs = reference.ebc.state_dict()
    for cfg in TABLES:
        torch.testing.assert_close(
            torch.from_numpy(tables[cfg.name]), theirs[f"embedding_bags.{cfg.name}.weight"], **TOLERANCE, msg=cfg.name
        )
    return slots


def _fbgemm_slots(module: Any) -> dict[str, list[torch.Tensor]]:
    """FBGEMM's optimizer states per table (its split_optimizer_states, in table order)."""
    out: dict[str, list[torch.Tensor]] = {}
    for emb, tables in zip(module._emb_modules, module._key_to_tables.values()):
        for table, states in zip(tables, emb._emb_module.split_optimizer_states()):
            out[table.name] = list(states)
    return out


@pytest.mark.parametrize("source", ["fused_collection", "optimizer_given_to_shard", "in_backward_opted_in"])
@pytest.mark.parametrize("optimizer", ["adagrad", "sgd"])
def test_two_lookups_before_backward_train_as_fbgemm_when_sharded(optimizer, source):
    torch_class = {"adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}[optimizer]
    # An in-backward Adagrad keeps torch's eps (1e-10, see docs/torchrec_semantics.md) where FBGEMM's default
    # is 1e-8: the reference is given the same.
    kwargs: dict[str, Any] = (
        {"lr": 0.1, "eps": 1e-10} if (source, optimizer) == ("in_backward_opted_in", "adagrad") else {"lr": 0.1}
    )
    torch.manual_seed(0)
    reference: Any = TwoLookups(
        FusedEmbeddingBagCollection(TABLES, optimizer_type=torch_class, optimizer_kwargs=kwargs)
    )
    if source == "optimizer_given_to_shard":
        ours = TwoLookups(TorchrecEBC(TABLES))
        ours.load_state_dict(reference.state_dict())
        config = {"adagrad": sp.Adagrad(learning_rate=0.1), "sgd": sp.SGD(learning_rate=0.1)}[optimizer]
        sharded = _sharded(ours, optimizer=config)
    elif source == "in_backward_opted_in":
        # An in-backward optimizer with FBGEMM's semantics chosen: what TorchRec's DMP makes of it (it fuses
        # the optimizer into FBGEMM's kernel; on CPU its sharded module equals the FusedEmbeddingBagCollection).
        ours = TwoLookups(TorchrecEBC(TABLES))
        ours.load_state_dict(reference.state_dict())
        apply_optimizer_in_backward(torch_class, ours.ebc.parameters(), kwargs)
        sharded = _sharded(ours)
        assert sharded.ebc.optimizer_semantics == "torch"
        sharded.ebc.optimizer_semantics = "fbgemm"
    else:
        sharded = _sharded(copy.deepcopy(reference))
    assert sharded.ebc.optimizer_semantics == "fbgemm"
    slots = _train_and_compare(reference, sharded)
    for name, states in _fbgemm_slots(reference.ebc).items():
        assert len(states) == len(slots[name])
        for state, ours in zip(states, slots[name].values()):
            torch.testing.assert_close(torch.from_numpy(ours).reshape(state.shape), state, **TOLERANCE, msg=name)


def _in_backward_state(module: Any) -> dict[str, list[torch.Tensor]]:
    """The in-backward optimizer's state tensors per table (torch's state order), from TorchRec's module."""
    out: dict[str, list[torch.Tensor]] = {}
    for name, param in module.embedding_bags.named_parameters():
        (optimizer,) = param._in_backward_optimizers
        state = optimizer.state[param]
        out[name.split(".")[0]] = [v for k, v in state.items() if k != "step"]
    return out


IN_BACKWARD = {
    "sgd": (torch.optim.SGD, {"lr": 0.1}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
    "rowwise_adagrad": (RowWiseAdagrad, {"lr": 0.1}),
}


@pytest.mark.parametrize("optimizer", list(IN_BACKWARD))
def test_two_lookups_before_backward_with_an_in_backward_optimizer_train_as_torchrec_when_sharded(optimizer):
    optimizer_class, kwargs = IN_BACKWARD[optimizer]
    torch.manual_seed(0)
    reference: Any = TwoLookups(TorchrecEBC(TABLES))
    ours = copy.deepcopy(reference)
    for model in (reference, ours):
        apply_optimizer_in_backward(optimizer_class, model.ebc.parameters(), kwargs)
    sharded = _sharded(ours, ROW_WISE_ADAGRAD_PLAN if optimizer == "rowwise_adagrad" else PLAN)
    assert sharded.ebc.optimizer_semantics == "torch"
    slots = _train_and_compare(reference, sharded)
    steps = sharded.ebc.optimizer_state_dict()["steps"]
    assert steps == [STEPS], steps  # one update a step, not one a lookup
    for name, states in _in_backward_state(reference.ebc).items():
        assert len(states) == len(slots[name]), (name, list(slots[name]))
        for state, ours_state in zip(states, slots[name].values()):
            torch.testing.assert_close(torch.from_numpy(ours_state).reshape(state.shape), state, **TOLERANCE, msg=name)


class WeightedTwoLookups(nn.Module):
    """A weighted collection looked up twice; the per-id weights of both batches take a gradient."""

    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc
        self.over = nn.Linear(28, 1)

    def forward(self, first, second) -> torch.Tensor:
        a = self.over(self.ebc(first).values())
        b = self.over(self.ebc(second).values())
        return (a * a).mean() + 2 * (a * b).mean() + (b * b * b).mean()


def _weighted(kjt: KeyedJaggedTensor, rng: np.random.Generator) -> KeyedJaggedTensor:
    weights = torch.from_numpy(rng.uniform(0.5, 1.5, kjt.values().numel()).astype(np.float32)).requires_grad_()
    return KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(), weights=weights)


def test_two_weighted_lookups_before_backward_give_torchrecs_weight_gradients_and_summed_update():
    torch.manual_seed(0)
    reference: Any = WeightedTwoLookups(TorchrecEBC(TABLES, is_weighted=True))
    ours = copy.deepcopy(reference)
    for model in (reference, ours):
        apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.parameters(), {"lr": 0.1})
    meta = TorchrecEBC(tables=TABLES, is_weighted=True, device=torch.device("meta"))
    plan = construct_module_sharding_plan(meta, PLAN, local_size=8, world_size=8, device_type="cpu")
    sharded = tpurec.shard(sp.from_torchrec(ours).to("tpu"), {"ebc": plan})
    rng = np.random.default_rng(1)
    for step in range(STEPS):
        batches = [_weighted(random_kjt(TABLES, BATCH, rng), rng) for _ in range(2)]
        gradients = []
        for model in (reference, sharded):
            copies = [
                KeyedJaggedTensor(
                    keys=k.keys(), values=k.values(), lengths=k.lengths(), weights=k.weights().detach().requires_grad_()
                )
                for k in batches
            ]
            model(*copies).backward()
            gradients.append([c.weights().grad for c in copies])
        for ours_grad, theirs_grad in zip(gradients[1], gradients[0]):
            torch.testing.assert_close(ours_grad, theirs_grad, **TOLERANCE, msg=f"weight gradient of step {step}")
    tables, _ = sharded.ebc.full_tables()
    theirs = reference.ebc.state_dict()
    for cfg in TABLES:
        torch.testing.assert_close(
            torch.from_numpy(tables[cfg.name]), theirs[f"embedding_bags.{cfg.name}.weight"], **TOLERANCE, msg=cfg.name
        )


def test_a_fused_collection_with_fp16_configs_shards_as_the_float32_tables_it_holds():
    # TorchRec's FusedEmbeddingBagCollection ignores data_type (FBGEMM's module gets no weights_precision):
    # its FP16 tables are float32, from_torchrec converts them as such, and tpurec.shard shards them.
    import dataclasses

    from torchrec.modules.embedding_configs import DataType

    half = [dataclasses.replace(cfg, data_type=DataType.FP16) for cfg in TABLES]
    torch.manual_seed(0)
    reference: Any = TwoLookups(
        FusedEmbeddingBagCollection(half, optimizer_type=torch.optim.Adagrad, optimizer_kwargs={"lr": 0.1})
    )
    assert {w.dtype for w in reference.ebc.state_dict().values()} == {torch.float32}
    sharded = _sharded(copy.deepcopy(reference))
    assert {cfg.data_type for cfg in sharded.ebc.embedding_bag_configs()} == {DataType.FP32}
    _train_and_compare(reference, sharded)


@pytest.mark.parametrize("mode", ["eager", "fused"])
def test_a_staged_lookup_and_a_routed_one_make_one_summed_update(mode):
    # The first batch is staged (its lookup reads the staged entry tensors, as under TrainPipeline), the second
    # routed in the forward: both gradients join the one update at the end of the backward pass.
    torch.manual_seed(0)
    reference: Any = TwoLookups(TorchrecEBC(TABLES))
    ours = copy.deepcopy(reference)
    for model in (reference, ours):
        apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.parameters(), {"lr": 0.1})
    sharded = _sharded(ours)
    rng = np.random.default_rng(0)
    with tpurec.mode(mode):
        for step in range(STEPS):
            first, second = random_kjt(TABLES, BATCH, rng), random_kjt(TABLES, BATCH, rng)
            sharded.ebc.stage(first)
            losses = []
            for model in (reference, sharded):
                loss = model(first, second)
                loss.backward()
                losses.append(loss.detach().cpu())
            torch.testing.assert_close(losses[1], losses[0], **TOLERANCE, msg=f"loss of step {step}")
    assert sharded.ebc.optimizer_state_dict()["steps"] == [STEPS]
    tables, _ = sharded.ebc.full_tables()
    theirs = reference.ebc.state_dict()
    for cfg in TABLES:
        torch.testing.assert_close(
            torch.from_numpy(tables[cfg.name]), theirs[f"embedding_bags.{cfg.name}.weight"], **TOLERANCE, msg=cfg.name
        )


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("a backward that fails")


def test_a_backward_pass_that_raises_leaves_no_gradient_for_the_next_pass():
    # The second lookup's backward runs first and waits for the pass's end; the pass then raises, so its
    # update never runs (as a failed backward accumulates nothing for an in-backward optimizer to apply). The
    # next pass must update with its own gradient only.
    torch.manual_seed(0)
    base: Any = TwoLookups(TorchrecEBC(TABLES))
    ours, fresh = copy.deepcopy(base), copy.deepcopy(base)
    for model in (ours, fresh):
        apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.parameters(), {"lr": 0.1})
    sharded, untouched = _sharded(ours), _sharded(fresh)
    rng = np.random.default_rng(0)
    first, second, third = (random_kjt(TABLES, BATCH, rng) for _ in range(3))
    a = _RaiseInBackward.apply(sharded.ebc(first).values())
    b = sharded.ebc(second).values()
    with pytest.raises(RuntimeError, match="a backward that fails"):
        (a.sum() + b.sum()).backward()
    for model in (sharded, untouched):
        model.ebc(third).values().sum().backward()
    got, want = sharded.ebc.full_tables()[0], untouched.ebc.full_tables()[0]
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
