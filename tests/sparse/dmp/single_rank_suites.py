"""TorchRec's single-rank DistributedModelParallel suites (``ModelParallelSparseOnlyBase`` and
``ModelParallelStateDictBase`` of ``torchrec.distributed.test_utils.test_model_parallel_base``), their
scenarios written again for the ``tpu`` device and checked against the same scenario on CPU.

``python single_rank_suites.py SCENARIO[,SCENARIO...]`` runs them in one process, a world of one
(``"cpu:gloo,tpu:tpu"``, as TorchRec's suites run a world of one on gloo), and writes
``$OUT/single_rank_suites.json``: ``{scenario: "passed" | the error}``.

Each scenario makes TorchRec's own checks on tpu (what its test asserts: module types, the state dict of a
model loaded from another, equal outputs of two models after the same steps, shard counts) and, for those that
train or look up, runs the same calls with the same starting state on CPU (FBGEMM's kernels over gloo):

* outputs, losses and predictions within 1e-5 relative and 1e-6 absolute (float32 sums over a batch);
* tables and optimizer states after the steps within 1e-5 relative and 1e-6 absolute (float32 updates of the
  same gradients).

Where TorchRec's tests assert equality between two models on one device (``torch.equal``), the tpu models are
held to it too. The tpu models start from the CPU model's state dict (each device initialises tables with its
own random numbers). Left out, as they demand CUDA (``skipIf(not torch.cuda.is_available())``):
``test_numerical_equivalence_between_kernel_types`` and ``test_rowwise_adagrad_numerical_equivalence``.
TorchRec's tests draw the ``fused_uvm`` and ``fused_uvm_caching`` kernels on a device that is not the CPU;
``load_state_dict.row_wise.fused_uvm`` runs one (tpurec runs it as ``fused``, with a warning), against
``fused`` on CPU.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import traceback
import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

import tpurec  # noqa: F401  (the tpu device and its process-group backend)

CPU, TPU = torch.device("cpu"), torch.device("tpu")
TOLERANCE: dict[str, Any] = {"rtol": 1e-5, "atol": 1e-6}
BATCH = 20
FLOAT_FEATURES = 10
SHARDING_TYPES = ("table_wise", "column_wise", "row_wise", "table_row_wise", "table_column_wise")


# --- TorchRec's pieces -------------------------------------------------------------------------------------


def _tables() -> tuple[list[Any], list[Any]]:
    """ModelParallelStateDictBase's tables: 4 plain and 2 weighted, dims (i + 1) * 4, rows (i + 1) * 10."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    def make(prefix: str, count: int) -> list[Any]:
        return [
            EmbeddingBagConfig(
                num_embeddings=(i + 1) * 10,
                embedding_dim=(i + 1) * 4,
                name=f"{prefix}table_{i}",
                feature_names=[f"{prefix}feature_{i}"],
            )  # fmt: skip
            for i in range(count)
        ]

    return make("", 4), make("weighted_", 2)


def _sharder(sharding_type: str, kernel: str, fused_params: dict[str, Any] | None = None) -> Any:
    """An EBC sharder offering one sharding type and one compute kernel (TorchRec's tests' ``TestEBCSharder``,
    learning rate 0.1 unless given)."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    class OneKindSharder(EmbeddingBagCollectionSharder):
        def sharding_types(self, compute_device_type: str) -> list[str]:
            return [sharding_type]

        def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
            return [kernel]

    return OneKindSharder(fused_params={"learning_rate": 0.1, **(fused_params or {})})


def _batch() -> Any:
    """One batch of TorchRec's ``TestSparseNN`` (CPU), the same on every call."""
    from torchrec.distributed.test_utils.test_model import ModelInput

    plain, weighted = _tables()
    _, local = ModelInput.generate(
        batch_size=BATCH, world_size=1, num_float_features=FLOAT_FEATURES, tables=plain, weighted_tables=weighted,
        random_seed=0,
    )  # fmt: skip
    return local[0]


def _dmps(
    device: torch.device, sharders: list[Any], constraints: Any = None, count: int = 2, kernel: str | None = None
) -> list[Any]:
    """``count`` DMP models of ``TestSparseNN`` on ``device``, planned and made as TorchRec's suite makes them.

    ``kernel``: every table's compute kernel in the plan instead of the planner's (TorchRec's planner stops
    at the ``fused_uvm`` kernels in its cost estimate off CUDA, see docs/distributed.md).
    """
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.test_utils.test_model import TestSparseNN

    plain, weighted = _tables()
    planner = EmbeddingShardingPlanner(
        topology=Topology(local_world_size=1, world_size=1, compute_device=device.type), constraints=constraints
    )
    batch = _batch().to(device)
    models = []
    for _ in range(count):
        module = TestSparseNN(
            tables=plain, num_float_features=FLOAT_FEATURES, weighted_tables=weighted, dense_device=device,
            sparse_device=torch.device("meta"),
        )  # fmt: skip
        plan = planner.collective_plan(module, sharders, dist.GroupMember.WORLD)
        for module_plan in plan.plan.values() if kernel is not None else ():
            for parameter_sharding in cast(Any, module_plan).values():
                parameter_sharding.compute_kernel = kernel
        model = DistributedModelParallel(
            module=module, init_data_parallel=False, device=device, sharders=sharders, plan=plan
        )
        with torch.no_grad():
            model(batch)
            model.init_data_parallel()
        models.append(model)
    return models


# --- comparisons -------------------------------------------------------------------------------------------


def _pieces(value: Any) -> list[torch.Tensor]:
    """A state dict value as its local pieces on the host (a ShardedTensor's or DTensor's local shards)."""
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(value, ShardedTensor):
        return [s.tensor.detach().cpu() for s in value.local_shards()]
    if isinstance(value, DTensor):
        local = value._local_tensor
        shards = getattr(local, "local_shards", None)
        return [s.detach().cpu() for s in shards()] if shards is not None else [local.detach().cpu()]
    return [value.detach().cpu()] if isinstance(value, torch.Tensor) else []


def _piece_sizes(value: Any) -> list[tuple[int, ...]]:
    """The sizes of a state dict value's local pieces (also on ``meta``, which has no values to copy)."""
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(value, ShardedTensor):
        return [tuple(s.tensor.size()) for s in value.local_shards()]
    if isinstance(value, DTensor):
        local = value._local_tensor
        shards = getattr(local, "local_shards", None)
        return [tuple(s.size()) for s in shards()] if shards is not None else [tuple(local.size())]
    return [tuple(value.size())]


def _same_state(ours: dict[str, Any], theirs: dict[str, Any], exact: bool, what: str) -> None:
    """Every key of ``theirs`` in ``ours``, piece by piece equal (``exact``) or within TOLERANCE."""
    assert set(ours) == set(theirs), f"{what}: keys {sorted(set(ours) ^ set(theirs))} differ"
    for key, value in theirs.items():
        mine, reference = _pieces(ours[key]), _pieces(value)
        assert len(mine) == len(reference), f"{what}: {key} has {len(mine)} pieces, not {len(reference)}"
        for a, b in zip(mine, reference):
            if exact:
                assert torch.equal(a, b), f"{what}: {key} differs"
            else:
                torch.testing.assert_close(a, b, **TOLERANCE, msg=lambda m: f"{what}: {key}: {m}")


def _run(model: Any, batch: Any, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward (and backward when ``train``): TorchRec's ``_train_models`` / ``_eval_models`` step."""
    device = CPU if str(model.device) == "cpu" else TPU
    if train:
        loss, pred = model(batch.to(device))
        loss.backward()
    else:
        with torch.no_grad():
            loss, pred = model(batch.to(device))
    return loss.detach().cpu(), pred.detach().cpu()


def _equal_outputs(m1: Any, m2: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """TorchRec's ``_eval_models`` with ``is_deterministic``: both models' loss and predictions equal."""
    loss1, pred1 = _run(m1, batch, train=False)
    loss2, pred2 = _run(m2, batch, train=False)
    assert torch.equal(loss1, loss2) and torch.equal(pred1, pred2), "the two models' outputs differ"
    return loss1, pred1


def _close_outputs(ours: tuple[torch.Tensor, ...], theirs: tuple[torch.Tensor, ...], what: str) -> None:
    for name, a, b in zip(("loss", "predictions"), ours, theirs):
        torch.testing.assert_close(a, b, **TOLERANCE, msg=lambda m: f"{what} {name}: {m}")


def _pairs(sharders: list[Any], constraints: Any = None, tpu_kernel: str | None = None) -> tuple[Any, Any, Any, Any]:
    """(CPU m1, CPU m2, tpu m1, tpu m2); the tpu models start from CPU m1's state (each device draws its own
    initial tables), the CPU m2 keeps its own. ``tpu_kernel``: the tpu models' tables on that kernel."""
    c1, c2 = _dmps(CPU, sharders, constraints)
    t1, t2 = _dmps(TPU, sharders, constraints, kernel=tpu_kernel)
    t1.load_state_dict(c1.state_dict())
    return c1, c2, t1, t2


# --- ModelParallelSparseOnlyBase ------------------------------------------------------------------------------


def _large_table_ebc(fused: bool = False) -> nn.Module:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

    tables = [
        EmbeddingBagConfig(name="large_table", embedding_dim=128, num_embeddings=256, feature_names=["my_feature"])
    ]
    if fused:
        return FusedEmbeddingBagCollection(
            tables=tables, device=torch.device("meta"), optimizer_type=torch.optim.SGD, optimizer_kwargs={"lr": 0.02}
        )
    return EmbeddingBagCollection(tables=tables, device=torch.device("meta"))


def _my_feature_kjt(keys: tuple[str, ...] = ("my_feature",)) -> Any:
    from torchrec import KeyedJaggedTensor

    values, lengths = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([1, 2, 0, 2])
    if len(keys) > 1:  # TorchRec's invalid batch: one feature named twice
        return KeyedJaggedTensor(keys=list(keys), values=values, lengths=lengths, offsets=torch.tensor([0, 1, 3, 3, 5]))
    return KeyedJaggedTensor(keys=list(keys), values=values, lengths=lengths)


def _sharded_large_table(device: torch.device, fused: bool = False) -> Any:
    from torchrec.distributed.model_parallel import DistributedModelParallel

    return DistributedModelParallel(_large_table_ebc(fused), device=device)


def sparse_only_ebc_as_top_level() -> None:
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    theirs, ours = _sharded_large_table(CPU), _sharded_large_table(TPU)
    assert isinstance(ours.module, ShardedEmbeddingBagCollection), type(ours.module)
    ours.load_state_dict(theirs.state_dict())
    kjt = _my_feature_kjt()
    with torch.no_grad():
        want = theirs(kjt).wait().values()
        got = ours(kjt.to(TPU)).wait().values().cpu()
    torch.testing.assert_close(got, want, **TOLERANCE)


def sparse_only_fused_ebc_as_top_level() -> None:
    from torchrec.distributed.fused_embeddingbag import ShardedFusedEmbeddingBagCollection

    theirs, ours = _sharded_large_table(CPU, fused=True), _sharded_large_table(TPU, fused=True)
    assert isinstance(ours.module, ShardedFusedEmbeddingBagCollection), type(ours.module)
    ours.load_state_dict(theirs.state_dict())
    mix = torch.linspace(-1, 1, 128)
    for model, device in ((theirs, CPU), (ours, TPU)):  # the fused SGD step runs in the backward
        (model(_my_feature_kjt().to(device)).wait().values() * mix.to(device)).sum().backward()
    _same_state(ours.state_dict(), theirs.state_dict(), exact=False, what="after a fused SGD step")


def sparse_only_input_validation() -> None:
    for device in (CPU, TPU):
        model = _sharded_large_table(device)
        try:
            model(_my_feature_kjt(("my_feature", "my_feature")).to(device))
        except ValueError as error:
            assert "keys must be unique" in str(error), error
        else:
            raise AssertionError(f"a KJT naming a feature twice did not raise on {device}")


def sparse_only_validate_input_only_once() -> None:
    from torchrec.distributed.embeddingbag import logger

    counted: list[str] = []

    class Count(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            counted.append(record.getMessage())

    handler, level = Count(level=logging.INFO), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        model = _sharded_large_table(TPU)
        kjt = _my_feature_kjt().to(TPU)
        for _ in range(3):
            model(kjt)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    validated = [m for m in counted if "Validating input features..." in m]
    assert len(validated) == 1, counted


def sparse_only_initialize_torch_state_error_names_the_table() -> None:
    """A failure building a table's ShardedTensor names the table (TorchRec's message, on tpu)."""
    from unittest import mock

    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    with mock.patch.object(ShardedEmbeddingBagCollection, "_initialize_torch_state", lambda self, **kwargs: None):
        model = _sharded_large_table(TPU)
    collection = model.module
    assert isinstance(collection, ShardedEmbeddingBagCollection)
    original = ShardedTensor._init_from_local_shards_and_global_metadata
    calls = 0

    def fail_on_second_call(cls: type, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls > 1:
            raise RuntimeError("Number of local shards (0) does not match")
        return original.__func__(cls, *args, **kwargs)

    ShardedTensor._init_from_local_shards_and_global_metadata = classmethod(fail_on_second_call)  # type: ignore[assignment]
    try:
        collection._initialize_torch_state()
    except RuntimeError as error:
        assert "large_table" in str(error) and "Number of local shards (0) does not match" in str(error), error
    else:
        raise AssertionError("the failing ShardedTensor did not raise")
    finally:
        ShardedTensor._init_from_local_shards_and_global_metadata = original  # type: ignore[assignment]


# --- ModelParallelStateDictBase ------------------------------------------------------------------------------


def state_dict_parameter_init() -> None:
    from torchrec.distributed.model_parallel import DistributedModelParallel

    class OneParameter(nn.Module):
        def __init__(self, device: str, value: float) -> None:
            super().__init__()
            self.p = nn.Parameter(torch.empty(3, dtype=torch.float32, device=device))
            self.value = value
            self.reset_parameters()

        def reset_parameters(self) -> None:
            nn.init.constant_(self.p, self.value)

    for module, want in ((OneParameter("tpu", 3.2), 3.2), (OneParameter("meta", 7.5), 7.5)):
        sharded = DistributedModelParallel(module, device=TPU)
        parameter = next(sharded.parameters())
        assert parameter.device.type == "tpu", parameter.device
        assert torch.equal(parameter.detach().cpu(), torch.full((3,), want)), parameter


def state_dict_meta_device_dmp_state_dict() -> None:
    from torchrec.distributed.model_parallel import DistributedModelParallel, get_default_sharders
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.test_utils.test_model import TestSparseNN
    from torchrec.distributed.types import ShardingEnv

    env = ShardingEnv.from_process_group(cast(Any, dist.GroupMember.WORLD))
    plain, weighted = _tables()
    sizes = []
    for device in (TPU, torch.device("meta")):
        module = TestSparseNN(
            tables=plain, num_float_features=FLOAT_FEATURES, weighted_tables=weighted, dense_device=TPU,
            sparse_device=torch.device("meta"),
        )  # fmt: skip
        plan = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="tpu")).plan(
            module, get_default_sharders()
        )
        model = DistributedModelParallel(
            module=module, init_data_parallel=False, init_parameters=False, sharders=get_default_sharders(),
            device=device, env=env, plan=plan,
        )  # fmt: skip
        sizes.append(
            {
                key: _piece_sizes(value)
                for key, value in model.state_dict().items()
                if not isinstance(value, nn.parameter.UninitializedParameter)
            }
        )
    on_tpu, on_meta = sizes
    for key, value in on_meta.items():
        assert on_tpu[key] == value, (key, on_tpu[key], value)


def _load_state_dict(sharding_type: str, kernel: str = "fused", prefix: str = "", train: bool = True) -> None:
    """TorchRec's test_load_state_dict (and _prefix): m2 loads m1's state dict; after a training step both
    give equal outputs and states; on tpu as on CPU."""
    batch = _batch()
    on_host = kernel.startswith("fused_uvm")  # the tpu models' kernel; CPU runs "fused" (TorchRec's assume())
    sharders = [_sharder(sharding_type, "fused" if on_host else kernel)]
    c1, c2, t1, t2 = _pairs(sharders, tpu_kernel=kernel if on_host else None)
    for m1, m2 in ((c1, c2), (t1, t2)):
        if prefix:
            m2.load_state_dict(m1.state_dict(prefix=prefix), prefix=prefix)
        else:
            m2.load_state_dict(m1.state_dict())
    outputs = []
    for m1, m2 in ((c1, c2), (t1, t2)):
        if train:
            _run(m1, batch, train=True)
            _run(m2, batch, train=True)
        outputs.append(_equal_outputs(m1, m2, batch))
        _same_state(m2.state_dict(), m1.state_dict(), exact=True, what=f"m2 against m1 on {m1.device}")
    _close_outputs(outputs[1], outputs[0], "tpu against CPU")
    _same_state(t1.state_dict(), c1.state_dict(), exact=False, what="tpu against CPU")


def _optimizer_load_state_dict(sharding_type: str) -> None:
    """TorchRec's test_optimizer_load_state_dict (row-wise Adagrad): models loaded from a trained one diverge
    until the fused optimizer's state is loaded too; on tpu as on CPU."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    sharder = _sharder(sharding_type, "fused", {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD})
    batch = _batch()
    c1, c2, t1, t2 = _pairs([sharder])
    for m1, m2 in ((c1, c2), (t1, t2)):
        _run(m1, batch, train=True)
        _run(m1, batch, train=True)
        m2.load_state_dict(m1.state_dict())
        _run(m1, batch, train=True)
        _run(m2, batch, train=True)
        try:
            _equal_outputs(m1, m2, batch)
        except AssertionError:
            pass
        else:
            raise AssertionError(f"on {m1.device}, a model with zero optimizer state trained as the other")
        m2.load_state_dict(m1.state_dict())
        m1.fused_optimizer.load_state_dict(m2.fused_optimizer.state_dict())  # as TorchRec's test does
        _run(m1, batch, train=True)
        _run(m2, batch, train=True)
        _equal_outputs(m1, m2, batch)
        _same_state(m2.state_dict(), m1.state_dict(), exact=True, what=f"m2 against m1 on {m1.device}")
    _close_outputs(_run(t1, batch, train=False), _run(c1, batch, train=False), "tpu against CPU")
    _same_state(t1.state_dict(), c1.state_dict(), exact=False, what="tpu against CPU")
    _same_state(
        t1.fused_optimizer.state_dict()["state"], c1.fused_optimizer.state_dict()["state"], exact=False,
        what="optimizer state, tpu against CPU",
    )  # fmt: skip


def state_dict_load_state_dict_dp() -> None:
    _load_state_dict("data_parallel", kernel="dense")


def state_dict_params_and_buffers() -> None:
    for sharding_type in ("table_wise", "column_wise", "row_wise"):
        (model,) = _dmps(TPU, [_sharder(sharding_type, "fused")], count=1)
        keys = set(model.state_dict())
        named = set(dict(model.named_parameters())) | set(dict(model.named_buffers()))
        assert keys == named, (sharding_type, sorted(keys ^ named))


def state_dict_load_state_dict_cw_multiple_shards() -> None:
    """TorchRec's test_load_state_dict_cw_multiple_shards: column-wise shards of 4 columns (min_partition=4),
    row-wise Adagrad at 0.2; the state dict and the fused optimizer's state load shard by shard."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.planner import ParameterConstraints

    plain, weighted = _tables()
    constraints: Any = defaultdict(ParameterConstraints)
    shards = {}
    for table in plain + weighted:
        constraints[table.name].min_partition = 4
        shards[table.name] = table.embedding_dim // 4
    sharder = _sharder("column_wise", "fused", {"learning_rate": 0.2, "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD})
    batch = _batch()
    # tpurec's fused kernel holds one column shard of a table per rank: it refuses, naming the table.
    try:
        _dmps(TPU, [sharder], constraints, count=1)
    except NotImplementedError as error:
        assert "column shards of table" in str(error) and "one column shard of a table per rank" in str(error), error
    else:
        raise AssertionError("several column shards of a table on one tpu rank did not raise")
    # TorchRec's checks, on CPU (FBGEMM): the refusal above is of a plan TorchRec runs.
    m1, m2 = _dmps(CPU, [sharder], constraints)
    m2.load_state_dict(m1.state_dict())
    m2.fused_optimizer.load_state_dict(m1.fused_optimizer.state_dict())
    _run(m1, batch, train=True)
    _run(m2, batch, train=True)
    _equal_outputs(m1, m2, batch)
    for key, value in m2.state_dict().items():
        table = key.split(".")[-2] if "." in key else ""
        if table in shards:
            assert len(_pieces(value)) == shards[table], (key, len(_pieces(value)))
    _same_state(m2.state_dict(), m1.state_dict(), exact=True, what="m2 against m1 on CPU")
    for group in m2.fused_optimizer.state_dict()["state"].values():
        for key, state in group.items():
            table = key.split(".")[-2] if "." in key else ""
            if table in shards and not isinstance(state, (int, float)) and len(_pieces(state)) > 1:
                assert len(_pieces(state)) == shards[table], (key, len(_pieces(state)))


SCENARIOS: dict[str, Callable[[], None]] = {
    "sparse_only.ebc_as_top_level": sparse_only_ebc_as_top_level,
    "sparse_only.fused_ebc_as_top_level": sparse_only_fused_ebc_as_top_level,
    "sparse_only.input_validation": sparse_only_input_validation,
    "sparse_only.validate_input_only_once": sparse_only_validate_input_only_once,
    "sparse_only.initialize_torch_state_error_names_the_table": sparse_only_initialize_torch_state_error_names_the_table,
    "state_dict.parameter_init": state_dict_parameter_init,
    "state_dict.meta_device_dmp_state_dict": state_dict_meta_device_dmp_state_dict,
    **{f"state_dict.load_state_dict.{t}": (lambda t=t: _load_state_dict(t)) for t in SHARDING_TYPES},
    "state_dict.load_state_dict.row_wise.fused_uvm": lambda: _load_state_dict("row_wise", kernel="fused_uvm"),
    "state_dict.load_state_dict.table_wise.eval_only": lambda: _load_state_dict("table_wise", train=False),
    **{
        f"state_dict.optimizer_load_state_dict.{t}": (lambda t=t: _optimizer_load_state_dict(t))
        for t in ("table_wise", "column_wise", "row_wise")
    },
    "state_dict.load_state_dict_dp": state_dict_load_state_dict_dp,
    "state_dict.load_state_dict_prefix": lambda: _load_state_dict("table_row_wise", prefix="alpha"),
    "state_dict.params_and_buffers": state_dict_params_and_buffers,
    "state_dict.load_state_dict_cw_multiple_shards": state_dict_load_state_dict_cw_multiple_shards,
}


def main() -> None:
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(SCENARIOS)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("cpu:gloo,tpu:tpu", rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))
    warnings.simplefilter("ignore")
    results: dict[str, str] = {}
    try:
        for name in names:
            try:
                SCENARIOS[name]()
                results[name] = "passed"
            except Exception:  # noqa: BLE001  (every scenario reports, the next one runs)
                results[name] = traceback.format_exc()[-3000:]
            print(name, "passed" if results[name] == "passed" else "FAILED", flush=True)
    finally:
        dist.destroy_process_group()
        with open(os.path.join(os.environ.get("OUT", "."), "single_rank_suites.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
