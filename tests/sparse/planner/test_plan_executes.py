"""Acceptance (issue 9): the plan `tpurec plan --topology v5p-16 ... --json plan.json` writes for a
small table set loads with load_plan and trains sharded on 8 CPU devices like the unsharded model."""

import json

import numpy as np
import pytest
import torch
from torchrec import EmbeddingBagCollection as TorchrecEBC

import tpurec
import tpurec.sparse as sp
from helpers import make_tables, random_kjt
from tpurec.sparse.planner import distribution_bytes, load_plan, validate_plan
from tpurec.sparse.planner.__main__ import main as cli_main

TABLES = make_tables(dims=(8, 16, 64), rows=(40, 300, 2000), features=(("f0", "f1"), ("f2",), ("f3",)))


# The planner picks row-wise for all three tables when offered it, column-wise (one table in two
# shards) without it, data-parallel when offered that: each plan trains.
@pytest.mark.parametrize(
    "allowed", ["table_wise,row_wise,column_wise", "table_wise,column_wise", "data_parallel,table_wise"]
)
def test_cli_plan_loads_and_trains_sharded_like_unsharded(tmp_path, allowed):
    spec = tmp_path / "tables.json"
    spec.write_text(
        json.dumps(
            {
                "tables": [
                    {
                        "name": t.name,
                        "num_embeddings": t.num_embeddings,
                        "embedding_dim": t.embedding_dim,
                        "feature_names": list(t.feature_names),
                        "pooling_factor": 2.0,
                    }
                    for t in TABLES
                ]
            }
        )
    )
    out = tmp_path / "plan.json"
    assert (
        cli_main(
            [
                "--topology",
                "v5p-16",
                "--tables",
                str(spec),
                "--batch-size",
                "4096",
                "--timeout",
                "5",
                "--sharding-types",
                allowed,
                "--json",
                str(out),
            ]
        )
        == 0
    )
    plan = load_plan(out)
    kinds = {ps.sharding_type for ps in plan.plan[""].values()}
    assert kinds and kinds <= set(allowed.split(","))

    torch.manual_seed(0)
    built = [TorchrecEBC(tables=TABLES) for _ in range(2)]
    built[1].load_state_dict(built[0].state_dict())
    reference, model = (
        sp.from_torchrec(m, optimizer=sp.Adagrad(learning_rate=0.1), capacities=sp.Capacity(512)).to("tpu")
        for m in built
    )
    validate_plan(plan, model, num_devices=8)
    sharded = tpurec.shard(model, plan)

    rng = np.random.default_rng(0)
    for step in range(5):
        kjt = random_kjt(TABLES, 16, rng)
        mix = torch.from_numpy(
            rng.standard_normal((16, sum(t.embedding_dim * len(t.feature_names) for t in TABLES))).astype(np.float32)
        )
        want = reference(kjt).values()
        got = sharded(kjt).values()
        np.testing.assert_allclose(got.detach().cpu().numpy(), want.detach().cpu().numpy(), atol=1e-5, rtol=0)
        (want * mix.to("tpu")).sum().backward()
        (got * mix.to("tpu")).sum().backward()
    tables, _ = sharded.full_tables()
    for cfg in TABLES:
        np.testing.assert_allclose(
            tables[cfg.name], reference.table_weight(cfg.name).detach().cpu().numpy(), atol=1e-5, rtol=0
        )
    # The planner counts traffic for every table: distribution for sharded ones, the gradient
    # all-reduce for data-parallel ones.
    comm = distribution_bytes(plan, TABLES, world_size=8, batch_size=16)
    assert set(comm.tables) == {t.name for t in TABLES}
    assert (comm.total.max_per_device > 0) == (kinds != {"data_parallel"})
    assert (max(comm.total.dense_grad) > 0) == ("data_parallel" in kinds)
