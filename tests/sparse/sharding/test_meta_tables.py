"""Tables born sharded: tpurec.shard of a model whose tables are on meta creates each shard on its device.

The same seed gives the same tables under any plan; a meta-born DLRM trains exactly like the same model
built whole (with the values ``table_values`` gives) and sharded normally; an init_fn that cannot be applied
shard by shard is refused before anything changes; checkpoints save and load without gathering a table.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
import launcher
import torch
from jax.extend.random import threefry_2x32
from torchrec import EmbeddingBagConfig
from torchrec import EmbeddingBagCollection as TorchrecEBC
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingPlan
from torchrec.models.dlrm import DLRM

import tpurec
import tpurec.sparse as sp
from helpers import make_tables, random_kjt
from tpurec.sparse.sharding import ShardedEmbeddingBagCollection, checkpoint
from tpurec.sparse.table_init import table_init, table_values

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
EBC_PATH = "sparse_arch.embedding_bag_collection"
LAYERS = {"dense_in_features": 5, "dense_arch_layer_sizes": [16, 8], "over_arch_layer_sizes": [16, 1]}
TABLES = make_tables(
    dims=(8, 8, 8, 8, 8), rows=(40, 23, 17, 30, 64), features=(("f0", "f1"), ("f2",), ("f3",), ("f4",), ("f5",))
)
MIXED = {
    "t0": table_wise(rank=2),
    "t1": row_wise(),
    "t2": column_wise(ranks=[1, 6]),
    "t3": data_parallel(),
    "t4": table_row_wise(host_index=1),
}
SEED = 5


def _plan(generators: dict, tables=TABLES) -> ShardingPlan:
    meta = TorchrecEBC(tables=tables, device=torch.device("meta"))
    return ShardingPlan(
        {EBC_PATH: construct_module_sharding_plan(meta, generators, local_size=4, world_size=8, device_type="cpu")}
    )


def _dlrm(tables=TABLES, optimizer=None) -> Any:
    """A DLRM whose TorchRec tables are on meta (dense layers on the host, seeded)."""
    torch.manual_seed(0)
    model = DLRM(embedding_bag_collection=TorchrecEBC(tables=tables, device=torch.device("meta")), **LAYERS)
    return sp.from_torchrec(model, optimizer=optimizer or sp.Adagrad(learning_rate=0.1), device="meta")


def _normal(tables=TABLES, optimizer=None) -> Any:
    """The same DLRM built whole on tpu, its tables holding what a meta-born table gets."""
    torch.manual_seed(0)
    model: Any = DLRM(embedding_bag_collection=TorchrecEBC(tables=tables, device=torch.device("meta")), **LAYERS)
    model = sp.from_torchrec(model, optimizer=optimizer or sp.Adagrad(learning_rate=0.1)).to("tpu")
    with torch.no_grad():
        for cfg in tables:
            model.sparse_arch.embedding_bag_collection.table_weight(cfg.name).copy_(
                torch.from_numpy(table_values(cfg, SEED))
            )
    return model


def _shard(*args: Any, **kwargs: Any) -> Any:
    """``tpurec.shard``, typed loosely: tests reach into the sharded model's modules by attribute."""
    return tpurec.shard(*args, **kwargs)


def _step(model, optimizer, kjt, dense, labels) -> float:
    optimizer.zero_grad()
    logits = model(dense.to("tpu"), kjt).squeeze(-1)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.to("tpu"))
    loss.backward()
    optimizer.step()
    return loss.item()


def _batches(steps: int, tables=TABLES, batch: int = 16):
    rng = np.random.default_rng(0)
    for _ in range(steps):
        kjt = random_kjt(tables, batch, rng)
        dense = torch.from_numpy(rng.standard_normal((batch, 5)).astype(np.float32))
        labels = torch.from_numpy(rng.integers(0, 2, batch).astype(np.float32))
        yield kjt, dense, labels


# --- the generator ------------------------------------------------------------------------------


def test_counter_values_are_jax_threefry_blocks():
    """element_values' bits are Threefry-2x32 of (seed, crc32(name)) at counter (row, col), as JAX computes it."""
    cfg = EmbeddingBagConfig(
        name="t", embedding_dim=3, num_embeddings=5, feature_names=["f"], weight_init_min=0.0, weight_init_max=1.0
    )
    got = table_values(cfg, 9)
    import zlib

    key = jnp.array([9, zlib.crc32(b"t")], jnp.uint32)
    for row in range(5):
        for col in range(3):
            bits = np.asarray(threefry_2x32(key, jnp.array([row, col], jnp.uint32)))[0]
            want = np.float32(np.uint32((int(bits) >> 9) | 0x3F800000).view(np.float32)) - np.float32(1)
            assert got[row, col] == want, (row, col)


def test_default_init_is_torchrecs_uniform_range_and_other_inits_their_distribution():
    rows = 20000
    default = EmbeddingBagConfig(name="u", embedding_dim=4, num_embeddings=rows, feature_names=["f"])
    values = table_values(default, 0)
    bound = np.sqrt(1 / rows)
    assert values.min() >= -bound and values.max() < bound
    assert abs(values.mean()) < 0.02 * bound and abs(values.std() - 2 * bound / np.sqrt(12)) < 0.02 * bound
    normal = EmbeddingBagConfig(
        name="n",
        embedding_dim=4,
        num_embeddings=rows,
        feature_names=["f"],
        init_fn=functools.partial(torch.nn.init.normal_, mean=1.5, std=0.25),
    )
    values = table_values(normal, 0)
    assert abs(values.mean() - 1.5) < 0.01 and abs(values.std() - 0.25) < 0.01
    uniform = EmbeddingBagConfig(
        name="w",
        embedding_dim=4,
        num_embeddings=rows,
        feature_names=["f"],
        init_fn=functools.partial(torch.nn.init.uniform_, a=-2.0, b=-1.0),
    )
    values = table_values(uniform, 0)
    assert values.min() >= -2.0 and values.max() < -1.0 and abs(values.mean() + 1.5) < 0.01
    for init_fn, want in (
        (torch.nn.init.zeros_, 0.0),
        (torch.nn.init.ones_, 1.0),
        (functools.partial(torch.nn.init.constant_, val=0.5), 0.5),
    ):
        cfg = EmbeddingBagConfig(name="c", embedding_dim=2, num_embeddings=3, feature_names=["f"], init_fn=init_fn)
        assert np.all(table_values(cfg, 0) == want)
    # Another seed or another table name: other values; a row range: the same rows.
    assert not np.array_equal(table_values(default, 1), table_values(default, 0))
    renamed = EmbeddingBagConfig(name="u2", embedding_dim=4, num_embeddings=rows, feature_names=["f"])
    assert not np.array_equal(table_values(renamed, 0), table_values(default, 0))
    np.testing.assert_array_equal(table_values(default, 0, 100, 130), table_values(default, 0)[100:130])


@pytest.mark.parametrize(
    "init_fn",
    [
        torch.nn.init.xavier_uniform_,
        lambda t: t.fill_(1.0),
        functools.partial(torch.nn.init.uniform_, a=0.0, b=1.0, generator=torch.Generator()),
    ],
    ids=["xavier", "lambda", "generator"],
)
def test_an_init_fn_that_cannot_be_applied_per_shard_is_refused_before_anything_changes(init_fn):
    tables = make_tables(dims=(8, 8), rows=(40, 23), features=(("f0",), ("f1",)))
    tables[1] = EmbeddingBagConfig(
        name=tables[1].name, embedding_dim=8, num_embeddings=23, feature_names=["f1"], init_fn=init_fn
    )
    with pytest.raises(NotImplementedError, match=r"table 't1' has init_fn=.*cannot apply shard by shard"):
        table_init(tables[1])
    model = _dlrm(tables)
    before = {k: (v.device, tuple(v.shape)) for k, v in model.state_dict().items()}
    with pytest.raises(NotImplementedError, match=r"table 't1' has init_fn="):
        _shard(model, _plan({"t0": row_wise(), "t1": row_wise()}, tables), seed=SEED)
    assert isinstance(model.sparse_arch.embedding_bag_collection, sp.EmbeddingBagCollection)
    assert {k: (v.device, tuple(v.shape)) for k, v in model.state_dict().items()} == before


def test_a_bad_seed_is_refused():
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*32\)"):
        _shard(_dlrm(), _plan(MIXED), seed=-1)


def test_an_unsharded_collection_on_meta_refuses_a_lookup():
    ebc = sp.EmbeddingBagCollection(TABLES, optimizer=sp.SGD(0.1), device="meta")
    assert ebc.device.type == "meta" and all(p.device.type == "meta" for p in ebc.parameters())
    kjt = random_kjt(TABLES, 4, np.random.default_rng(0))
    with pytest.raises(RuntimeError, match=r"are on 'meta' and have no values: shard the model with tpurec.shard"):
        ebc(kjt)


# --- born sharded ------------------------------------------------------------------------------


def test_the_same_seed_gives_the_same_tables_under_any_plan():
    plans = [
        MIXED,
        {t.name: row_wise() for t in TABLES},
        {t.name: table_wise(rank=7 - i) for i, t in enumerate(TABLES)},
    ]
    seen = []
    for generators in plans:
        sharded = _shard(_dlrm(), _plan(generators), seed=SEED)
        tables, slots = sharded.sparse_arch.embedding_bag_collection.full_tables()
        seen.append(tables)
        for cfg in TABLES:
            np.testing.assert_array_equal(tables[cfg.name], table_values(cfg, SEED))
            assert all(not value.any() for value in slots[cfg.name].values())
    other = _shard(_dlrm(), _plan(MIXED), seed=SEED + 1).sparse_arch.embedding_bag_collection.full_tables()[0]
    assert not np.array_equal(other["t0"], seen[0]["t0"])


@pytest.mark.parametrize(
    "optimizer",
    [sp.Adagrad(learning_rate=0.1), sp.RowWiseAdagrad(learning_rate=0.1), sp.Adam(learning_rate=0.05)],
    ids=["adagrad", "rowwise", "adam"],
)
def test_meta_born_dlrm_trains_exactly_like_the_model_built_whole(optimizer):
    born = _shard(_dlrm(optimizer=optimizer), _plan(MIXED), seed=SEED)
    assert isinstance(born.sparse_arch.embedding_bag_collection, ShardedEmbeddingBagCollection)
    # The dense part moved to tpu, as DMP moves it to its device.
    assert all(t.device.type == "tpu" for t in list(born.parameters()) + list(born.buffers()))
    normal = _shard(_normal(optimizer=optimizer), _plan(MIXED))
    opt_born = torch.optim.Adagrad(born.parameters(), lr=0.05)
    opt_normal = torch.optim.Adagrad(normal.parameters(), lr=0.05)
    for kjt, dense, labels in _batches(6):
        assert _step(born, opt_born, kjt, dense, labels) == _step(normal, opt_normal, kjt, dense, labels)
    got, got_slots = born.sparse_arch.embedding_bag_collection.full_tables()
    want, want_slots = normal.sparse_arch.embedding_bag_collection.full_tables()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        for slot in want_slots[name]:
            np.testing.assert_array_equal(got_slots[name][slot], want_slots[name][slot], err_msg=f"{name}/{slot}")
    a, b = born.state_dict(), normal.state_dict()
    for key in b:
        torch.testing.assert_close(a[key].cpu(), b[key].cpu(), atol=0, rtol=0, msg=key)


def test_tpurec_collection_built_on_meta_and_sequence_collection_are_born_sharded():
    ebc = sp.EmbeddingBagCollection(TABLES, optimizer=sp.SGD(0.1), device="meta")
    sharded = _shard(ebc, _plan(MIXED).plan[EBC_PATH], seed=SEED)
    tables, _ = sharded.full_tables()
    for cfg in TABLES:
        np.testing.assert_array_equal(tables[cfg.name], table_values(cfg, SEED))
    from torchrec import EmbeddingConfig

    configs = [EmbeddingConfig(name="s0", embedding_dim=8, num_embeddings=30, feature_names=["q0"])]
    holder = torch.nn.Module()
    holder.ec = sp.EmbeddingCollection(configs, optimizer=sp.SGD(0.1), device="meta")
    from torchrec import EmbeddingCollection as TorchrecEC

    plan = construct_module_sharding_plan(
        TorchrecEC(configs, device=torch.device("meta")),
        {"s0": row_wise()},
        local_size=8,
        world_size=8,
        device_type="cpu",
    )
    sharded_holder = _shard(holder, {"ec": plan}, seed=SEED)
    bags = sharded_holder.ec._bags
    bag_config = bags.embedding_bag_configs()[0]
    np.testing.assert_array_equal(bags.full_tables()[0]["s0"], table_values(bag_config, SEED))


# --- checkpoints: shard by shard --------------------------------------------------------------


def _gathers(text: str) -> list[int]:
    """Element counts of the results of every all-gather in compiled HLO text."""
    counts = []
    for match in re.finditer(r"= \(?([a-z0-9]+)\[([0-9,]*)\][^ ]* all-gather(?:-start)?\(", text):
        dims = [int(d) for d in match.group(2).split(",") if d]
        counts.append(int(np.prod(dims)) if dims else 1)
    return counts


def test_checkpoint_moves_no_row_of_a_row_wise_table_and_round_trips(tmp_path):
    """Saving and loading lay a row-wise table out with device-local copies: the compiled programs gather
    nothing of its size (only the small table-wise / column-wise tables' rows), and the values come back."""
    tables = make_tables(dims=(8, 8, 8), rows=(4000, 30, 50), features=(("f0",), ("f1",), ("f2",)))
    generators = {"t0": row_wise(), "t1": table_wise(rank=3), "t2": column_wise(ranks=[1, 6])}
    model = _shard(_dlrm(tables, sp.RowWiseAdagrad(learning_rate=0.1)), _plan(generators, tables), seed=SEED)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for batch in _batches(2, tables):
        _step(model, opt, *batch)
    module = model.sparse_arch.embedding_bag_collection
    L = module.layout
    weights, slots = module._arrays("shard", len(L.groups))
    dp_weights, dp_slots = module._arrays("dp", len(L.dp_groups))
    # The programs save() and load() run. Before the canonical layout was computed per device, the save
    # program all-gathered the whole width-8 stack (34304 elements: every table's rows on every device).
    save_program = checkpoint._canonical_program(module)
    save_text = save_program.lower(weights, slots, dp_weights, dp_slots).compile().as_text()
    big = 4000 * 8 // 8  # one device's share of the row-wise table's weights
    # Every all-gather is parsed (none missed), and the small tables' rows still travel.
    assert len(re.findall(r" all-gather(?:-start)?\(", save_text)) == len(_gathers(save_text)) > 0
    assert all(n < big for n in _gathers(save_text)), _gathers(save_text)
    canonical = save_program(weights, slots, dp_weights, dp_slots)
    load_text = checkpoint._stacked_program(module).lower(canonical).compile().as_text()
    assert all(n < big for n in _gathers(load_text)), _gathers(load_text)

    tables_before, slots_before = module.full_tables()
    checkpoint.save(model, tmp_path / "ckpt")
    other = _shard(
        _dlrm(tables, sp.RowWiseAdagrad(learning_rate=0.1)),
        _plan({t.name: row_wise() for t in tables}, tables),
        seed=SEED + 1,
    )
    checkpoint.load(other, tmp_path / "ckpt")
    tables_after, slots_after = other.sparse_arch.embedding_bag_collection.full_tables()
    for name in tables_before:
        np.testing.assert_array_equal(tables_after[name], tables_before[name])
        for slot in slots_before[name]:
            np.testing.assert_array_equal(slots_after[name][slot], slots_before[name][slot])


# --- a table the process could not hold twice -----------------------------------------------------

BIG_ROWS = 1 << 20  # x 64 float32: 256 MiB
SLACK_MB = 384  # 1.5 of the big table over what its shards take


def _run(tmp_path: Path, mode: str, slack_mb: int | None, name: str | None = None) -> dict:
    out = tmp_path / (name or mode)
    out.mkdir()
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
        # Few malloc arenas: each thread's arena would otherwise reserve 64 MiB of address space.
        "MALLOC_ARENA_MAX": "2",
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    command = [sys.executable, str(HERE / "meta_tables_run.py"), str(out), mode, str(BIG_ROWS)]
    command += [] if slack_mb is None else [str(slack_mb)]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=800)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads((out / "result0.json").read_text())


@pytest.mark.slow
def test_a_table_born_sharded_under_an_address_space_cap_trains_like_the_one_built_whole(tmp_path):
    """One process, 8 devices: the big table is built, sharded row-wise from meta and trained within a cap
    (RLIMIT_AS: what the process had mapped, plus the table, which its devices hold, plus 384 MiB) that
    building the same model whole exceeds; it trains and checkpoints exactly like the model built whole and
    sharded normally (losses and every table, slot and dense value equal)."""
    born = _run(tmp_path, "meta", SLACK_MB)
    assert "error" not in born, born["error"]
    refused = _run(tmp_path, "normal", SLACK_MB, name="normal-capped")
    assert "error" in refused and re.search(
        r"MemoryError|RESOURCE_EXHAUSTED|can.t allocate memory|Unable to allocate", refused["error"]
    ), refused
    normal = _run(tmp_path, "normal", None)
    assert born["losses"] == normal["losses"]
    _compare_checkpoints(tmp_path / "meta" / "ckpt", tmp_path / "normal" / "ckpt", atol=0)


def _compare_checkpoints(a: Path, b: Path, atol: float) -> None:
    """Both checkpoints (written shard by shard) load into one model here: equal tables, slots, dense."""
    import meta_tables_run

    states = []
    for folder in (a, b):
        model = _shard(meta_tables_run.build(BIG_ROWS, meta=True), meta_tables_run.plan(BIG_ROWS), seed=1)
        checkpoint.load(model, folder)
        tables, slots = model.sparse_arch.embedding_bag_collection.full_tables()
        states.append((tables, slots, {k: v.cpu() for k, v in model.state_dict().items() if "embedding_bags" not in k}))
        del model
    (ta, sa, da), (tb, sb, db) = states
    for name in tb:
        np.testing.assert_allclose(ta[name], tb[name], atol=atol, rtol=0, err_msg=name)
        for slot in sb[name]:
            np.testing.assert_allclose(sa[name][slot], sb[name][slot], atol=atol, rtol=0, err_msg=f"{name}/{slot}")
    for key in db:
        torch.testing.assert_close(da[key], db[key], atol=atol, rtol=0, msg=key)


MULTI_SLACK_MB = 96  # each process may map its half of the big table plus 96 MiB: less than the table


@pytest.mark.slow
def test_two_processes_each_unable_to_hold_the_table_shard_it_from_meta_and_train_like_one(tmp_path):
    """2 processes x 4 devices, each capped (RLIMIT_AS) at what it had mapped plus half the big table plus
    96 MiB, so neither could hold the 256 MiB table: sharded row-wise from meta over the 8 devices, they
    train like the model built whole in one process (losses and checkpointed state, atol 1e-5: gloo's
    reductions sum in another order)."""
    out = tmp_path / "two"
    out.mkdir()
    env = launcher.environment(devices=4, MALLOC_ARENA_MAX="2")
    launcher.run(HERE / "meta_tables_run.py", 2, str(out), "meta", str(BIG_ROWS), str(MULTI_SLACK_MB), env=env,
                 seconds=800)  # fmt: skip
    results = [json.loads((out / f"result{r}.json").read_text()) for r in range(2)]
    for result in results:
        assert "error" not in result, result["error"]
        assert result["processes"] == 2
        # The cap: less free address space than the whole table.
        assert result["cap"] - result["before"]["VmSize"] < result["table_bytes"]
    assert results[0]["losses"] == results[1]["losses"]
    normal = _run(tmp_path, "normal", None)
    np.testing.assert_allclose(results[0]["losses"], normal["losses"], atol=1e-5, rtol=0)
    _compare_checkpoints(out / "ckpt", tmp_path / "normal" / "ckpt", atol=1e-5)
