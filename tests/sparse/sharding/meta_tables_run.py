"""One run of tests/sparse/sharding/test_meta_tables.py's DLRM, in a process of its own.

``python meta_tables_run.py OUT MODE ROWS [CAP_SLACK_MB] [--lift]``: MODE ``meta``
builds the model with its tables on ``meta`` and shards them from there;
``normal`` builds them whole on the host with the same values (``table_values``)
and shards those. Both train ``STEPS`` steps (the dense optimizer updates the
dense parameters only), write a sharded checkpoint to ``OUT/ckpt`` (shard by
shard) and load it back; ``OUT/resultR.json`` (R the process) gets the losses
and the address-space figures. Under torchrun (``torchrun --nproc-per-node 2
meta_tables_run.py ...``, 4 devices each) every process feeds its half of each
batch and holds half of the big table.

With ``CAP_SLACK_MB`` the address space (RLIMIT_AS, a soft limit) is capped, once
JAX is up and the programs are compiled on a small copy, at what the process has
mapped plus its share of the big table (its shards live in this process's host
devices) plus that slack, while the model is built, sharded and trained
(``--lift``: only built and sharded); the checkpoint is written and read after.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

if "RANK" in os.environ:  # under torchrun: before anything touches JAX's devices
    from tpurec.distributed import initialize

    initialize()

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


def batches(rows: int, lo: int = 0, hi: int = BATCH):
    """The global batches' samples ``[lo, hi)`` (a process's share under torchrun; all by default)."""
    rng = np.random.default_rng(0)
    sizes = {"f_big": rows, "f_cols": 50, "f_small": 30}
    for _ in range(STEPS):
        lengths = rng.integers(0, 4, (len(sizes), BATCH))
        values = [rng.integers(0, n, lengths[i].sum()) for i, n in enumerate(sizes.values())]
        starts = [np.concatenate([[0], np.cumsum(ls)]) for ls in lengths]
        kjt = KeyedJaggedTensor(
            keys=list(sizes),
            values=torch.from_numpy(np.concatenate([v[st[lo] : st[hi]] for v, st in zip(values, starts)])),
            lengths=torch.from_numpy(lengths[:, lo:hi].reshape(-1)),
        )
        dense = torch.from_numpy(rng.standard_normal((BATCH, 4)).astype(np.float32))
        labels = torch.from_numpy(rng.integers(0, 2, BATCH).astype(np.float32))
        yield kjt, dense[lo:hi], labels[lo:hi]


def address_space() -> dict[str, int]:
    """VmSize and VmPeak of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("VmSize", "VmPeak", "VmHWM")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


def main(out: str, mode: str, rows: int, slack_mb: int | None, lift: bool = False) -> None:
    import jax

    from tpurec.sparse.checkpoint import sharded as checkpoint

    rank, count = jax.process_index(), jax.process_count()
    lo, hi = rank * BATCH // count, (rank + 1) * BATCH // count
    result: dict = {"mode": mode, "rows": rows, "table_bytes": rows * DIM * 4, "processes": count}
    # JAX up and every program shape of the run compiled once on a small copy, so the cap
    # measures the tables, not the compiler.
    warm = tpurec.shard(build(rows=64, meta=True), plan(64), seed=SEED)
    warm_opt = torch.optim.Adagrad(dense_parameters(warm), lr=0.05)
    for kjt, dense, labels in batches(64, lo, hi):
        step(warm, warm_opt, kjt, dense, labels)
    del warm, warm_opt
    result["before"] = address_space()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if slack_mb is not None:
        # A soft limit (``lift``: raised again once the model is sharded). This process's
        # devices hold 1/count of the big table.
        cap = result["before"]["VmSize"] + result["table_bytes"] // count + slack_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
        result["cap"] = cap
    try:
        model = tpurec.shard(build(rows, meta=mode == "meta"), plan(rows), seed=SEED)
    except Exception as error:  # an allocation that the cap refused (MemoryError, XLA's RESOURCE_EXHAUSTED)
        result["error"] = f"{type(error).__name__}: {error}"[:2000]
        json.dump(result, open(os.path.join(out, f"result{rank}.json"), "w"))
        return
    result["sharded"] = address_space()
    if lift:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    dense_opt = torch.optim.Adagrad(dense_parameters(model), lr=0.05)
    result["losses"] = [step(model, dense_opt, *batch) for batch in batches(rows, lo, hi)]
    result["trained"] = address_space()
    # Orbax (imported on first use, its threads and TensorStore's) runs without the cap; that the
    # save and load gather no table is checked on their compiled programs (test_meta_tables.py).
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    checkpoint.save(model, os.path.join(out, "ckpt"))
    result["saved"] = address_space()
    checkpoint.load(model, os.path.join(out, "ckpt"))
    result["loaded"] = address_space()
    json.dump(result, open(os.path.join(out, f"result{rank}.json"), "w"))


def dense_parameters(model: Any) -> list[torch.nn.Parameter]:
    """The parameters a dense optimizer updates (not the tables: torch's Adagrad would allocate its
    state for them too, a table-sized array on every device)."""
    return [p for name, p in model.named_parameters() if not name.startswith(EBC_PATH + ".")]


def step(model, optimizer, kjt, dense, labels) -> float:
    from tpurec.sparse.sharding import distribute_batch

    optimizer.zero_grad()
    logits = model(dense, kjt).squeeze(-1)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, distribute_batch(labels, model.mesh))
    loss.backward()
    optimizer.step()
    return loss.item()


if __name__ == "__main__":
    numbers = [a for a in sys.argv[3:] if not a.startswith("--")]
    main(sys.argv[1], sys.argv[2], int(numbers[0]), int(numbers[1]) if len(numbers) > 1 else None, "--lift" in sys.argv)
