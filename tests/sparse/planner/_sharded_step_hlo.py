"""One tpurec.shard training step on 8 CPU devices; prints the collectives its programs hold.

Run as a script, ``python _sharded_step_hlo.py balanced|mixed``: XLA must dump
HLO (``--xla_dump_to``) from the start.

* ``balanced``: one table-wise table on every device, one row-wise table over
  all eight and one data-parallel table; every sample looks up ``3`` ids in
  each table-wise table, one id in each device's row block of the row-wise
  table and 4 in the data-parallel one, so every device sends every other
  exactly the same number of ids and the static capacity (16) is exact.
* ``mixed``: table-wise, column-wise, table-row-wise, row-wise and
  data-parallel tables of two widths with random ids and capacity 32: the
  buffers are padded, unevenly filled.

Prints JSON: the collectives (kind, bytes one device sends), the plan and the tables.
"""

import glob
import json
import os
import shutil
import sys
import tempfile

DUMP = tempfile.mkdtemp(prefix="tpurec_hlo_")
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=8 --xla_dump_to={DUMP} --xla_dump_hlo_as_text"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torchrec import EmbeddingBagCollection as TorchrecEBC  # noqa: E402
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor  # noqa: E402
from torchrec.distributed.sharding_plan import (  # noqa: E402
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingPlan  # noqa: E402

import tpurec  # noqa: E402
import tpurec.sparse as sp  # noqa: E402
from tpurec.sparse.planner import hlo_collectives, plan_to_json  # noqa: E402

DEVICES, LOCAL_BATCH = 8, 4


def _scenario(name: str):
    """(tables as (name, rows, dim, pooling, generator), capacity, id maker or None)."""
    if name == "balanced":
        tables = [(f"tw{i}", 50, 8, 3, table_wise(rank=i)) for i in range(DEVICES)]
        tables += [("rw", 64, 8, DEVICES, row_wise()), ("dp", 30, 16, 4, data_parallel())]

        def ids(rng, table, batch):
            if table[0] == "rw":
                block = table[1] // DEVICES  # one id in every device's row block
                return np.arange(DEVICES)[None, :] * block + rng.integers(0, block, (batch, DEVICES))
            return rng.integers(0, table[1], (batch, table[3]))

        # Per (source, destination): 12 table-wise ids + 4 row-wise = 16, a multiple of 8.
        return tables, 16, ids
    tables = [
        ("tw", 50, 8, 2, table_wise(rank=2)),
        ("cw", 40, 16, 1, column_wise(ranks=[1, 6])),
        ("twrw", 40, 8, 3, table_row_wise(host_index=1)),
        ("rw", 64, 16, 2, row_wise()),
        ("dp", 30, 8, 2, data_parallel()),
    ]
    return tables, 32, lambda rng, table, batch: rng.integers(0, table[1], (batch, table[3]))


def main() -> None:
    jax.config.update("jax_enable_compilation_cache", False)  # cached programs are not dumped
    tables, capacity, make_ids = _scenario(sys.argv[1])
    configs = [
        EmbeddingBagConfig(name=n, num_embeddings=r, embedding_dim=d, feature_names=[f"{n}_f"])
        for n, r, d, _, _ in tables
    ]
    meta = TorchrecEBC(tables=configs, device=torch.device("meta"))
    # local_size 4: table_row_wise(host_index=1) spreads rows over ranks 4..7.
    module_plan = construct_module_sharding_plan(
        meta, {t[0]: t[4] for t in tables}, local_size=4, world_size=DEVICES, device_type="cpu"
    )
    plan = ShardingPlan({"": module_plan})
    torch.manual_seed(0)
    ebc = sp.from_torchrec(
        TorchrecEBC(tables=configs), optimizer=sp.SGD(learning_rate=0.1), capacities=sp.Capacity(512)
    ).to("tpu")
    sharded = tpurec.shard(ebc, plan, capacity=capacity)

    batch = DEVICES * LOCAL_BATCH
    rng = np.random.default_rng(0)
    per_table = [make_ids(rng, t, batch) for t in tables]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"{t[0]}_f" for t in tables],
        values=torch.from_numpy(np.concatenate([x.reshape(-1) for x in per_table])).long(),
        lengths=torch.from_numpy(np.concatenate([np.full(batch, x.shape[1]) for x in per_table])).int(),
    )
    sharded(kjt).values().sum().backward()

    found = []
    for path in sorted(glob.glob(os.path.join(DUMP, "*.before_optimizations.txt"))):
        with open(path) as f:
            found += [[c.kind, c.sent_bytes] for c in hlo_collectives(f.read(), DEVICES)]
    shutil.rmtree(DUMP, ignore_errors=True)
    json.dump(
        {
            "collectives": found,
            "plan": plan_to_json(plan),
            "batch": batch,
            "capacity": capacity,
            "tables": [
                {
                    "name": n,
                    "num_embeddings": r,
                    "embedding_dim": d,
                    "pooling_factor": float(pf),
                    "feature_names": [f"{n}_f"],
                }
                for n, r, d, pf, _ in tables
            ],
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main()
