"""FP16 and BF16 tables train as TorchRec trains them on CPU, or are refused.

Reference for FP16: TorchRec's sharded EmbeddingBagCollection (DistributedModelParallel,
one gloo rank on CPU), which runs FBGEMM's TBE with ``weights_precision`` = the table's
data_type: float16 weights, float32 outputs and optimizer state, and FBGEMM's CPU update
(no stochastic rounding on CPU, whatever ``stochastic_rounding`` says).

FBGEMM has no BF16 CPU kernels (its forward raises "not implemented for 'BFloat16'"), so
BF16 tables have no TorchRec CPU run to compare with. Their reference is
:func:`_fbgemm_cpu_steps`, FBGEMM's CPU arithmetic written out in torch; the same function
with float16 is checked against TorchRec/FBGEMM bit for bit here, so it is FBGEMM's
arithmetic, and with bfloat16 it only changes where the values are rounded.

Tolerance: exact (0 ulp) for the FP16/BF16 weights and their pooled outputs: the rounding
is deterministic round-to-nearest-even and the float32 sums of a few fp16/bf16 rows are
exact in any order, so they may not differ by a bit (with per-id weights the outputs are
sums of float32 products, added in another order than FBGEMM's: 1e-5 relative). Float32 values keep the project's
tolerance, 1e-5 relative: the optimizer state (a row's gradient adds its bags in another
order than FBGEMM's, so a momentum may differ in its last bit) and the FP32 table next to
the low-precision ones (it must not share their stack).
"""

from __future__ import annotations


import numpy as np
import pytest
import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingBagCollection as TorchrecEBC
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import DataType

import tpurec
import tpurec.sparse as sp
from helpers import random_kjt

STEPS = 5
BATCH = 4
LR = 0.05

# (tpurec config, FBGEMM optimizer type and its kwargs)
OPTIMIZERS = {
    "sgd": (lambda: sp.SGD(learning_rate=LR), EmbOptimType.EXACT_SGD, {"learning_rate": LR}),
    "adagrad": (
        lambda: sp.Adagrad(learning_rate=LR, eps=1e-8),
        EmbOptimType.EXACT_ADAGRAD,
        {"learning_rate": LR, "eps": 1e-8},
    ),
    "rowwise-adagrad": (
        lambda: sp.RowWiseAdagrad(learning_rate=LR, eps=1e-8),
        EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        {"learning_rate": LR, "eps": 1e-8},
    ),
}
# Which FBGEMM slot holds which tpurec slot (momentum1 is [rows] for row-wise Adagrad).
SLOTS = {"sgd": (), "adagrad": ("momentum1",), "rowwise-adagrad": ("momentum1",)}


def _tables(data_type: DataType) -> list[EmbeddingBagConfig]:
    # Two dims (two stacks), a table with two features, and an FP32 table next to the
    # low-precision ones: stacks must not mix dtypes.
    return [
        EmbeddingBagConfig(
            name="t0", embedding_dim=4, num_embeddings=13, feature_names=["f0", "f1"], data_type=data_type
        ),
        EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=7, feature_names=["f2"], data_type=data_type),
        EmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=5, feature_names=["f3"], data_type=DataType.FP32),
    ]


def _initial_weights(tables, dtype_of) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {t.name: (torch.rand(t.num_embeddings, t.embedding_dim, generator=g) - 0.5).to(dtype_of(t)) for t in tables}


def _batches(tables, weighted: bool = False) -> list[KeyedJaggedTensor]:
    rng = np.random.default_rng(7)
    return [random_kjt(tables, BATCH, rng, max_len=3, weighted=weighted) for _ in range(STEPS)]


def _loss(values: torch.Tensor) -> torch.Tensor:
    return values.pow(2).sum()


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    """One gloo rank, for TorchRec's DistributedModelParallel on CPU."""
    if dist.is_initialized():  # pragma: no cover - another module left one
        yield
        return
    store = dist.FileStore(str(tmp_path_factory.mktemp("gloo") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


_TORCHREC_RUNS: dict[str, dict] = {}


def _torchrec_fp16_run(name: str, output_dtype: torch.dtype = torch.float32, weighted: bool = False) -> dict:
    """TorchRec's sharded training of the FP16 tables on CPU: tables, slots and outputs per step."""
    key = f"{name}/{output_dtype}/{weighted}"
    if key in _TORCHREC_RUNS:
        return _TORCHREC_RUNS[key]
    from fbgemm_gpu.split_embedding_configs import SparseType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingType

    tables = _tables(DataType.FP16)
    _, optim_type, optim_kwargs = OPTIMIZERS[name]
    ebc = TorchrecEBC(tables, is_weighted=weighted, device=torch.device("meta"))
    # stochastic_rounding=True is TorchRec's default; FBGEMM's CPU kernels ignore it.
    sharder = EmbeddingBagCollectionSharder(
        fused_params={
            "optimizer": optim_type,
            **optim_kwargs,
            "stochastic_rounding": True,
            "output_dtype": {torch.float32: SparseType.FP32, torch.float16: SparseType.FP16}[output_dtype],
        }
    )
    constraints = {t.name: ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value]) for t in tables}
    plan = EmbeddingShardingPlanner(
        topology=Topology(world_size=1, compute_device="cpu"), constraints=constraints
    ).plan(ebc, [sharder])
    model = DistributedModelParallel(
        ebc, device=torch.device("cpu"), plan=plan, sharders=[sharder], init_data_parallel=False
    )
    state = model.state_dict()
    start = _initial_weights(tables, lambda t: state[f"embedding_bags.{t.name}.weight"].local_tensor().dtype)
    with torch.no_grad():
        for t in tables:
            local = state[f"embedding_bags.{t.name}.weight"].local_tensor()
            assert local.dtype == (torch.float32 if t.data_type == DataType.FP32 else torch.float16)
            local.copy_(start[t.name])  # a view of FBGEMM's weights
    outputs = []
    for kjt in _batches(tables, weighted):
        values = model(kjt).values()
        assert values.dtype == output_dtype
        outputs.append(values.detach().clone())
        _loss(values).backward()
    state = model.state_dict()
    weights = {t.name: state[f"embedding_bags.{t.name}.weight"].local_tensor().detach().clone() for t in tables}
    optim_state = model.fused_optimizer.state_dict()["state"]
    slots = {
        t.name: {
            s: optim_state[f"embedding_bags.{t.name}.weight"][f"{t.name}.{s}"].local_tensor().detach().clone()
            for s in SLOTS[name]
        }
        for t in tables
    }
    _TORCHREC_RUNS[key] = {"start": start, "weights": weights, "slots": slots, "outputs": outputs}
    return _TORCHREC_RUNS[key]


def _fbgemm_cpu_steps(
    tables, name: str, start: dict[str, torch.Tensor], output_dtype: torch.dtype = torch.float32
) -> dict:
    """FBGEMM's CPU TBE training written out in torch (the BF16 reference; see the module doc).

    Forward: rows widened to float32 and summed, rounded to ``output_dtype``. Backward: per touched row
    the float32 sum of its bags' gradients. Update in float32 from the widened weight, with
    FBGEMM's C++ rounding: SGD and Adagrad compute ``w -= update`` on an ``at::Half`` /
    ``at::BFloat16`` weight, which rounds ``update`` to the weight's type before the
    subtraction and the difference after it; row-wise Adagrad assigns one float32
    expression, rounded once. Momenta are float32.
    """
    weights = {k: v.clone() for k, v in start.items()}
    slots = (
        {
            t.name: {
                "momentum1": torch.zeros(t.num_embeddings)
                if name == "rowwise-adagrad"
                else torch.zeros(t.num_embeddings, t.embedding_dim)
            }
            for t in tables
        }
        if name != "sgd"
        else {t.name: {} for t in tables}
    )
    outputs = []
    for kjt in _batches(tables):
        per_feature = kjt.to_dict()
        leaves, blocks = {}, []
        for t in tables:
            w = weights[t.name].to(torch.float32, copy=True).requires_grad_(True)
            leaves[t.name] = w
            for f in t.feature_names:
                jt = per_feature[f]
                samples = torch.repeat_interleave(torch.arange(BATCH), jt.lengths().long())
                blocks.append(torch.zeros(BATCH, t.embedding_dim).index_add(0, samples, w[jt.values().long()]))
        values = torch.cat(blocks, dim=1).to(output_dtype)
        outputs.append(values.detach().clone())
        _loss(values).backward()
        for t in tables:
            dtype, w, g = weights[t.name].dtype, leaves[t.name].detach(), leaves[t.name].grad
            touched = torch.zeros(t.num_embeddings, dtype=torch.bool)
            for f in t.feature_names:
                touched[per_feature[f].values().long()] = True
            if name == "sgd":
                new = w - (LR * g).to(dtype).float()
            elif name == "adagrad":
                m = slots[t.name]["momentum1"]
                m[touched] += g[touched] * g[touched]
                new = w - (LR * g / (m.sqrt() + 1e-8)).to(dtype).float()
            else:
                m = slots[t.name]["momentum1"]
                m[touched] += (g[touched] * g[touched]).mean(dim=1)
                new = w - g * (LR / (m.sqrt() + 1e-8))[:, None]
            weights[t.name] = torch.where(touched[:, None], new.to(dtype), weights[t.name])
    return {"weights": weights, "slots": slots, "outputs": outputs}


def _train_tpurec(
    tables, name: str, start, device: str, mode: str, output_dtype: torch.dtype = torch.float32, weighted: bool = False
) -> dict:
    ebc = sp.EmbeddingBagCollection(
        tables, is_weighted=weighted, optimizer=OPTIMIZERS[name][0](), device=device, output_dtype=output_dtype
    )
    ebc.load_state_dict({f"embedding_bags.{k}.weight": v for k, v in start.items()})
    outputs = []
    with tpurec.mode(mode):
        for kjt in _batches(tables, weighted):
            values = ebc(kjt).values()
            outputs.append(values.detach().cpu().clone())
            _loss(values).backward()
    state = ebc.state_dict()
    opt = ebc.optimizer_state_dict()["state"]
    return {
        "weights": {t.name: state[f"embedding_bags.{t.name}.weight"].detach().cpu() for t in tables},
        "slots": {
            t.name: {s: v.detach().cpu() for s, v in opt[f"embedding_bags.{t.name}.weight"].items()} for t in tables
        },
        "outputs": outputs,
    }


def _tolerance(t: EmbeddingBagConfig) -> dict[str, float]:
    return {"atol": 0.0, "rtol": 0.0} if t.data_type != DataType.FP32 else {"atol": 1e-6, "rtol": 1e-5}


def _assert_same_run(ours: dict, theirs: dict, tables, exact_outputs: bool = True) -> None:
    assert len(ours["outputs"]) == len(theirs["outputs"]) == STEPS
    for step, (a, b) in enumerate(zip(ours["outputs"], theirs["outputs"])):
        assert a.dtype == b.dtype
        column = 0
        for t in tables:
            width = t.embedding_dim * len(t.feature_names)
            tolerance = _tolerance(t) if exact_outputs else {"atol": 1e-6, "rtol": 1e-5}
            torch.testing.assert_close(
                a[:, column : column + width],
                b[:, column : column + width],
                **tolerance,
                msg=f"output of table {t.name} at step {step}",
            )
            column += width
    for t in tables:
        a, b = ours["weights"][t.name], theirs["weights"][t.name]
        assert a.dtype == b.dtype, t.name
        torch.testing.assert_close(a, b, **_tolerance(t), msg=f"table {t.name}")
        for slot, value in theirs["slots"][t.name].items():
            mine = ours["slots"][t.name][slot]
            assert mine.dtype == torch.float32, (t.name, slot)
            # float32 state: the row's gradient sums its bags in another order than FBGEMM.
            torch.testing.assert_close(
                mine.reshape(value.shape), value, atol=1e-6, rtol=1e-5, msg=f"{slot} of {t.name}"
            )


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fbgemm_arithmetic_written_out_is_torchrecs_fp16_training(process_group, name):
    # Validates the BF16 reference: with float16 it is TorchRec's own run, bit for bit.
    tables = _tables(DataType.FP16)
    theirs = _torchrec_fp16_run(name)
    _assert_same_run(_fbgemm_cpu_steps(tables, name, theirs["start"]), theirs, tables)


@pytest.mark.parametrize("mode", ["eager", "fused"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fp16_tables_train_as_torchrec(process_group, name, mode):
    tables = _tables(DataType.FP16)
    theirs = _torchrec_fp16_run(name)
    ours = _train_tpurec(tables, name, theirs["start"], "tpu", mode)
    _assert_same_run(ours, theirs, tables)
    assert not torch.equal(ours["weights"]["t0"], theirs["start"]["t0"])  # it trained


@pytest.mark.parametrize("mode", ["eager", "fused"])
@pytest.mark.parametrize("name", ["sgd", "rowwise-adagrad"])
def test_fp16_output_dtype_trains_as_torchrec(process_group, name, mode):
    # fused_params["output_dtype"] = FP16: the float32 sums rounded once; float16 gradients.
    tables = _tables(DataType.FP16)
    theirs = _torchrec_fp16_run(name, torch.float16)
    _assert_same_run(_fbgemm_cpu_steps(tables, name, theirs["start"], torch.float16), theirs, tables)
    ours = _train_tpurec(tables, name, theirs["start"], "tpu", mode, output_dtype=torch.float16)
    _assert_same_run(ours, theirs, tables)


@pytest.mark.parametrize("name", ["sgd", "rowwise-adagrad"])
def test_fp16_tables_with_per_id_weights_train_as_torchrec(process_group, name):
    # Weighted bags: float32 products summed in another order than FBGEMM's, so the pooled
    # outputs agree to float32 rounding (1e-5); the FP16 weights still come out exact.
    tables = _tables(DataType.FP16)
    theirs = _torchrec_fp16_run(name, weighted=True)
    ours = _train_tpurec(tables, name, theirs["start"], "tpu", "fused", weighted=True)
    _assert_same_run(ours, theirs, tables, exact_outputs=False)


def test_bf16_output_dtype_rounds_the_float32_sums_once():
    tables = _tables(DataType.BF16)
    start = _initial_weights(tables, lambda t: torch.float32 if t.data_type == DataType.FP32 else torch.bfloat16)
    ours = _train_tpurec(tables, "adagrad", start, "tpu", "fused", output_dtype=torch.bfloat16)
    _assert_same_run(ours, _fbgemm_cpu_steps(tables, "adagrad", start, torch.bfloat16), tables)


def test_unsupported_output_dtype_is_refused():
    with pytest.raises(ValueError, match="output_dtype=torch.float64"):
        sp.EmbeddingBagCollection(_tables(DataType.FP16), optimizer=sp.SGD(0.1), output_dtype=torch.float64)


@pytest.mark.parametrize("mode", ["eager", "fused"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_bf16_tables_train_as_fbgemms_cpu_arithmetic(name, mode):
    tables = _tables(DataType.BF16)
    start = _initial_weights(tables, lambda t: torch.float32 if t.data_type == DataType.FP32 else torch.bfloat16)
    ours = _train_tpurec(tables, name, start, "tpu", mode)
    _assert_same_run(ours, _fbgemm_cpu_steps(tables, name, start), tables)


@pytest.mark.parametrize("data_type", [DataType.FP16, DataType.BF16], ids=["fp16", "bf16"])
def test_cpu_tables_update_in_place_with_the_same_rounding(data_type):
    # The module's CPU path writes the touched rows in place (touched_rows_update_cpu).
    tables = _tables(data_type)
    low = torch.float16 if data_type == DataType.FP16 else torch.bfloat16
    start = _initial_weights(tables, lambda t: torch.float32 if t.data_type == DataType.FP32 else low)
    for name in OPTIMIZERS:
        _assert_same_run(
            _train_tpurec(tables, name, start, "cpu", "eager"), _fbgemm_cpu_steps(tables, name, start), tables
        )


@pytest.mark.parametrize("data_type", [DataType.FP16, DataType.BF16], ids=["fp16", "bf16"])
def test_weights_state_dict_and_stacks_keep_the_table_dtype(data_type):
    low = torch.float16 if data_type == DataType.FP16 else torch.bfloat16
    ebc = sp.EmbeddingBagCollection(_tables(data_type), optimizer=sp.RowWiseAdagrad(0.1), device="tpu")
    # t0 (low, dim 4), t1 (low, dim 8), t2 (fp32, dim 4): three stacks, one dtype each.
    assert [[t.name for t in st.tables] for st in ebc.stacks] == [["t0"], ["t1"], ["t2"]]
    assert [ebc.stacked_weight(i).dtype for i in range(3)] == [low, low, torch.float32]
    state = ebc.state_dict()
    assert list(state) == ["embedding_bags.t0.weight", "embedding_bags.t1.weight", "embedding_bags.t2.weight"]
    assert [v.dtype for v in state.values()] == [low, low, torch.float32]
    slots = ebc.optimizer_state_dict()["state"]
    assert all(s.dtype == torch.float32 for table in slots.values() for s in table.values())


def test_adam_on_low_precision_tables_is_refused():
    with pytest.raises(ValueError, match=r"tables \['t0', 't1'\] are FP16/BF16 and the optimizer is Adam"):
        sp.EmbeddingBagCollection(_tables(DataType.FP16), optimizer=sp.Adam(learning_rate=0.1))
    sp.EmbeddingBagCollection(_tables(DataType.FP32), optimizer=sp.Adam(learning_rate=0.1))  # FP32 tables: fine


@pytest.mark.parametrize("data_type", [DataType.INT8, DataType.INT4, DataType.NFP8])
def test_quantized_tables_are_refused_naming_the_table(data_type):
    tables = [
        EmbeddingBagConfig(name="q0", embedding_dim=4, num_embeddings=10, feature_names=["f0"], data_type=data_type)
    ]
    with pytest.raises(ValueError, match=f"table 'q0' has data_type={data_type.name}"):
        sp.EmbeddingBagCollection(tables, optimizer=sp.SGD(0.1))


def test_sharding_low_precision_tables_with_adam_raises_at_shard_time():
    # tpurec.shard trains FP16/BF16 tables as the unsharded collection does
    # (tests/sparse/sharding/test_sharded_half_tables.py), and refuses Adam for them as it does: FBGEMM has
    # no CPU kernel of it to follow. The module is left as it was.
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise

    tables = _tables(DataType.FP16)
    ebc = sp.EmbeddingBagCollection(tables, optimizer=sp.SGD(0.1), device="tpu")
    meta = TorchrecEBC(tables, device=torch.device("meta"))
    plan = construct_module_sharding_plan(
        meta, {t.name: table_wise(rank=0) for t in tables}, local_size=8, world_size=8, device_type="cpu"
    )
    before = {k: v.cpu().clone() for k, v in ebc.state_dict().items()}
    with pytest.raises(
        ValueError, match=r"tables \['t0 \(FP16\)', 't1 \(FP16\)'\] are FP16/BF16 and the optimizer is Adam"
    ):
        tpurec.shard(ebc, plan, optimizer=sp.Adam(0.1))
    for key, value in ebc.state_dict().items():
        assert torch.equal(value.cpu(), before[key]), key


@pytest.mark.parametrize("data_type", [DataType.FP16, DataType.BF16], ids=["fp16", "bf16"])
def test_checkpoint_resumes_low_precision_tables_exactly(data_type, tmp_path):
    from tpurec.sparse import checkpoint

    tables = _tables(data_type)
    batches = _batches(tables)
    torch.manual_seed(0)
    ebc = sp.EmbeddingBagCollection(tables, optimizer=sp.RowWiseAdagrad(learning_rate=LR), device="tpu")
    for kjt in batches[:2]:
        _loss(ebc(kjt).values()).backward()
    checkpoint.save(tmp_path / "ckpt", ebc)
    resumed = sp.EmbeddingBagCollection(tables, optimizer=sp.RowWiseAdagrad(learning_rate=LR), device="tpu")
    checkpoint.load(tmp_path / "ckpt", resumed)
    for kjt in batches[2:]:
        for module in (ebc, resumed):
            _loss(module(kjt).values()).backward()
    for key, value in ebc.state_dict().items():
        mine = resumed.state_dict()[key]
        assert mine.dtype == value.dtype, key
        torch.testing.assert_close(mine.cpu(), value.cpu(), atol=0, rtol=0, msg=key)


@pytest.mark.parametrize("low", [True, False], ids=["fp16-tables", "fp16-output"])
def test_export_of_low_precision_collections_is_refused(low):
    tables = _tables(DataType.FP16 if low else DataType.FP32)
    ebc = sp.EmbeddingBagCollection(tables, device="tpu", output_dtype=torch.float32 if low else torch.float16).eval()
    kjt = _batches(tables)[0]
    with pytest.raises(
        NotImplementedError, match="FP16/BF16 tables \\['t0', 't1'\\]" if low else "output_dtype=torch.float16"
    ):
        torch.export.export(ebc, (kjt,))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_ops_pool_half_tables_into_float32_and_refuse_adam(dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode

    import jax.numpy as jnp
    from tpurec.sparse.kernels import reference, tensorcore, tpu
    from tpurec.sparse.ops import kernel_for

    tables = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=12, feature_names=["a"])]  # for the CSR only
    kjt = random_kjt(tables, 3, np.random.default_rng(0), max_len=3)
    csr = [torch.from_numpy(a) for a in sp.preprocess_kjt(kjt, tables, 1, sp.Capacity(16)).stacks["t"].arrays()]
    table = (torch.rand(12, 4) - 0.5).to(dtype)
    out = torch.ops.tpurec.sparse_dense_matmul(*csr, table, batch_size=3)
    expected = torch.zeros(3, 4).index_add(
        0, torch.repeat_interleave(torch.arange(3), kjt.lengths().long()), table.float()[kjt.values().long()]
    )
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    with FakeTensorMode() as mode:
        fake = torch.ops.tpurec.sparse_dense_matmul(
            *[mode.from_tensor(t) for t in csr], mode.from_tensor(table), batch_size=3
        )
        assert fake.dtype == torch.float32
    # SparseCore primitives and native kernels hold float32 rows: on a TPU half tables take the
    # TensorCore kernel (the reference's rounding, XLA gathers), on XLA:CPU the reference.
    half = jnp.dtype(str(dtype).removeprefix("torch."))
    assert kernel_for("sparse_dense_matmul", "tpu", half, device_kind="TPU v5") is tensorcore.sparse_dense_matmul
    assert kernel_for("sparse_dense_matmul", "cpu", half) is reference.sparse_dense_matmul
    assert kernel_for("sparse_dense_matmul", "tpu", jnp.float32, device_kind="TPU v5") is tpu.sparse_dense_matmul
    with pytest.raises(TypeError, match="table has no FBGEMM CPU adam update"):
        torch.ops.tpurec.sparse_dense_matmul_grad_with_adam(
            *csr,
            out,
            table,
            torch.zeros(12, 4),
            torch.zeros(12, 4),
            learning_rate=0.1,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.0,
            step=1.0,
        )
