"""One tpurec.shard training step on 8 CPU devices; prints the collectives its programs hold.

Run as a script: XLA must dump HLO (``--xla_dump_to``) from the start. The
plan puts one table-wise table on every device, one row-wise table over all
eight and one data-parallel table; every sample looks up ``POOLING`` ids in
each table-wise table, in the row-wise table one id in each device's row
block, and ``DP_POOLING`` ids in the data-parallel one, so every device sends
every other exactly the same number of ids and the static capacity (16) is
exact.
Prints JSON: ``{"collectives": [[kind, sent_bytes], ...]}`` per device.
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
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingPlan  # noqa: E402

import tpurec  # noqa: E402
import tpurec.sparse as sp  # noqa: E402
from tpurec.sparse.planner import hlo_collectives, plan_to_json  # noqa: E402

DEVICES, LOCAL_BATCH, POOLING, DIM, TW_ROWS, RW_ROWS = 8, 4, 3, 8, 50, 64
DP_POOLING, DP_DIM, DP_ROWS = 4, 16, 30


def main() -> None:
    # A program found in tpurec's persistent compilation cache is not compiled, so not dumped.
    jax.config.update("jax_enable_compilation_cache", False)
    tables = [
        EmbeddingBagConfig(name=f"tw{i}", num_embeddings=TW_ROWS, embedding_dim=DIM, feature_names=[f"f{i}"])
        for i in range(DEVICES)
    ] + [
        EmbeddingBagConfig(name="rw", num_embeddings=RW_ROWS, embedding_dim=DIM, feature_names=["g"]),
        EmbeddingBagConfig(name="dp", num_embeddings=DP_ROWS, embedding_dim=DP_DIM, feature_names=["h"]),
    ]
    meta = TorchrecEBC(tables=tables, device=torch.device("meta"))
    generators = {f"tw{i}": table_wise(rank=i) for i in range(DEVICES)}
    generators["rw"] = row_wise()
    generators["dp"] = data_parallel()
    module_plan = construct_module_sharding_plan(
        meta, generators, local_size=DEVICES, world_size=DEVICES, device_type="cpu"
    )
    plan = ShardingPlan({"": module_plan})
    torch.manual_seed(0)
    ebc = sp.from_torchrec(
        TorchrecEBC(tables=tables), optimizer=sp.SGD(learning_rate=0.1), capacities=sp.Capacity(512)
    ).to("tpu")
    # Per (source, destination): 12 TW ids + one RW id per sample = 16, a multiple of the
    # 8-entry alignment, so the static buffers hold exactly the payload.
    capacity = LOCAL_BATCH * POOLING + LOCAL_BATCH
    sharded = tpurec.shard(ebc, plan, capacity=capacity)

    batch = DEVICES * LOCAL_BATCH
    rng = np.random.default_rng(0)
    block = RW_ROWS // DEVICES
    tw_ids = rng.integers(0, TW_ROWS, (DEVICES, batch, POOLING))
    rw_ids = np.arange(DEVICES)[None, :] * block + rng.integers(0, block, (batch, DEVICES))
    dp_ids = rng.integers(0, DP_ROWS, (batch, DP_POOLING))
    values = np.concatenate([tw_ids.reshape(-1), rw_ids.reshape(-1), dp_ids.reshape(-1)])
    lengths = np.concatenate(
        [np.full(DEVICES * batch, POOLING), np.full(batch, DEVICES), np.full(batch, DP_POOLING)]
    )
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(DEVICES)] + ["g", "h"],
        values=torch.from_numpy(values).long(),
        lengths=torch.from_numpy(lengths).int(),
    )
    pooled = sharded(kjt).values()
    pooled.sum().backward()

    found = []
    for path in sorted(glob.glob(os.path.join(DUMP, "*.before_optimizations.txt"))):
        with open(path) as f:
            found += [[c.kind, c.sent_bytes] for c in hlo_collectives(f.read(), DEVICES)]
    shutil.rmtree(DUMP, ignore_errors=True)
    json.dump(
        {"collectives": found, "plan": plan_to_json(plan), "batch": batch, "rw_pooling": DEVICES,
         "tw_pooling": POOLING, "dim": DIM, "tw_rows": TW_ROWS, "rw_rows": RW_ROWS, "capacity": capacity,
         "dp_pooling": DP_POOLING, "dp_dim": DP_DIM, "dp_rows": DP_ROWS},
        sys.stdout,
    )


if __name__ == "__main__":
    main()
