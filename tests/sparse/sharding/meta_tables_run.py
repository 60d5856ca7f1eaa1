"""One run of tests/sparse/sharding/test_meta_tables.py's DLRM, in a process of its own.

``python meta_tables_run.py OUT MODE ROWS [CAP_SLACK_MB]``: MODE ``meta`` builds the
model with its tables on ``meta`` and shards them from there; ``normal`` builds
them whole on the host with the same values (``table_values``) and shards those.
Both train ``STEPS`` steps and write a sharded checkpoint to ``OUT/ckpt`` (shard
by shard), then load it back; ``OUT/result.json`` gets the losses and the
address-space figures. With ``CAP_SLACK_MB`` the address space (RLIMIT_AS, a
soft limit) is capped while the model is built and sharded, at what the process
has mapped once JAX is up plus one copy of the big table (its shards live in this
process: 8 host devices) plus that slack; the limit is lifted again for training,
whose first step's temporaries are the sharded programs' own.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor  # noqa: E402
from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise  # noqa: E402
from torchrec.distributed.types import ShardingPlan  # noqa: E402
from torchrec.models.dlrm import DLRM  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection as TorchrecEBC  # noqa: E402

import tpurec  # noqa: E402
import tpurec.sparse as sp  # noqa: E402
from tpurec.sparse.table_init import table_values  # noqa: E402

STEPS = 4
BATCH = 32
SEED = 11
DIM = 64
EBC_PATH = "sparse_arch.embedding_bag_collection"
LAYERS = {"dense_in_features": 4, "dense_arch_layer_sizes": [16, DIM], "over_arch_layer_sizes": [16, 1]}


def tables(rows: int) -> list[EmbeddingBagConfig]:
    """The big table (``rows`` x 64, default uniform init) and two small ones."""
    return [
        EmbeddingBagConfig(name="big", embedding_dim=DIM, num_embeddings=rows, feature_names=["f_big"]),
        EmbeddingBagConfig(name="cols", embedding_dim=DIM, num_embeddings=50, feature_names=["f_cols"]),
        EmbeddingBagConfig(name="small", embedding_dim=DIM, num_embeddings=30, feature_names=["f_small"]),
    ]


def plan(rows: int) -> ShardingPlan:
    meta = TorchrecEBC(tables=tables(rows), device=torch.device("meta"))
    generators = {"big": row_wise(), "cols": column_wise(ranks=[2, 6]), "small": table_wise(rank=5)}
    return ShardingPlan(
        {EBC_PATH: construct_module_sharding_plan(meta, generators, local_size=8, world_size=8, device_type="cpu")}
    )


def build(rows: int, meta: bool) -> Any:
    """The DLRM; its tables on meta (``meta``) or whole on tpu with the values a meta-born table gets."""
    torch.manual_seed(0)  # the dense layers (built on the host)
    model: Any = DLRM(embedding_bag_collection=TorchrecEBC(tables=tables(rows), device=torch.device("meta")), **LAYERS)
    optimizer = sp.RowWiseAdagrad(learning_rate=0.05)
    if meta:
        return sp.from_torchrec(model, optimizer=optimizer, device="meta")
    model = sp.from_torchrec(model, optimizer=optimizer).to("tpu")
    ebc = model.sparse_arch.embedding_bag_collection
    with torch.no_grad():
        for cfg in tables(rows):
            ebc.table_weight(cfg.name).copy_(torch.from_numpy(table_values(cfg, SEED)))
    return model


def batches(rows: int):
    rng = np.random.default_rng(0)
    sizes = {"f_big": rows, "f_cols": 50, "f_small": 30}
    for _ in range(STEPS):
        lengths = rng.integers(0, 4, (len(sizes), BATCH))
        values = np.concatenate([rng.integers(0, n, lengths[i].sum()) for i, n in enumerate(sizes.values())])
        kjt = KeyedJaggedTensor(
            keys=list(sizes), values=torch.from_numpy(values), lengths=torch.from_numpy(lengths.reshape(-1))
        )
        dense = torch.from_numpy(rng.standard_normal((BATCH, 4)).astype(np.float32))
        labels = torch.from_numpy(rng.integers(0, 2, BATCH).astype(np.float32))
        yield kjt, dense, labels


def address_space() -> dict[str, int]:
    """VmSize and VmPeak of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("VmSize", "VmPeak", "VmHWM")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


def main(out: str, mode: str, rows: int, slack_mb: int | None) -> None:
    from tpurec.sparse.sharding import checkpoint

    result: dict = {"mode": mode, "rows": rows, "table_bytes": rows * DIM * 4}
    # JAX up and every program shape of the run compiled once on a small copy, so the cap
    # measures the tables, not the compiler.
    warm = tpurec.shard(build(rows=64, meta=True), plan(64), seed=SEED)
    warm_opt = torch.optim.Adagrad(warm.parameters(), lr=0.05)
    for kjt, dense, labels in batches(64):
        step(warm, warm_opt, kjt, dense, labels)
    del warm, warm_opt
    result["before"] = address_space()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if slack_mb is not None:
        # A soft limit, raised again once the model is sharded: the cap covers building and
        # sharding, where the normal path holds the big table whole on the host.
        cap = result["before"]["VmSize"] + result["table_bytes"] + slack_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
        result["cap"] = cap
    try:
        model = tpurec.shard(build(rows, meta=mode == "meta"), plan(rows), seed=SEED)
    except Exception as error:  # an allocation that the cap refused (MemoryError, XLA's RESOURCE_EXHAUSTED)
        result["error"] = f"{type(error).__name__}: {error}"[:2000]
        json.dump(result, open(os.path.join(out, "result.json"), "w"))
        return
    result["sharded"] = address_space()
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    result["sharded"] = address_space()
    dense_opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
    result["losses"] = [step(model, dense_opt, *batch) for batch in batches(rows)]
    result["trained"] = address_space()
    checkpoint.save(model, os.path.join(out, "ckpt"))
    result["saved"] = address_space()
    checkpoint.load(model, os.path.join(out, "ckpt"))
    result["loaded"] = address_space()
    json.dump(result, open(os.path.join(out, "result.json"), "w"))


def step(model, optimizer, kjt, dense, labels) -> float:
    optimizer.zero_grad()
    logits = model(dense.to("tpu"), kjt).squeeze(-1)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels.to("tpu"))
    loss.backward()
    optimizer.step()
    return loss.item()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else None)
