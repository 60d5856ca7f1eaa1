"""One process of the fault-tolerance tests (tests/distributed/test_faults.py): a tiny sharded DLRM.

Run with torchrun's environment (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``), set by
the test or by torchrun, on 4 XLA:CPU devices per process. Settings come from the environment, with
``FAULT_<NAME>_<RANK>`` winning over ``FAULT_<NAME>`` so one process can differ:

* ``ROWS`` (40): rows of table t0; ``PLAN`` (mixed | row_wise); ``BATCH`` (8): local batch size;
  ``STEPS`` (6): steps to run;
* ``SIGNAL_AT`` (``STEP:SIGNAL[:mid]``): this process sends itself SIGNAL (KILL, STOP) before that
  step, or (``mid``) after its forward, while the others go on into its backward's collectives;
* ``CKPT``: a folder: save a sharded checkpoint after every ``CKPT_EVERY`` (2) steps (``step-N``) and,
  when one exists, resume from the last committed one (the DLRM example's ``--resume``);
* ``OUT``: process 0 writes the losses and final tables there (``.npz``).

Each process prints ``step N`` lines (flushed) so the tests can see where it is.
"""

from __future__ import annotations

import os
import signal
import sys

import numpy as np

LOCAL_DEVICES = 4


def setting(name: str, default: str) -> str:
    rank = os.environ.get("RANK", "0")
    return os.environ.get(f"FAULT_{name}_{rank}", os.environ.get(f"FAULT_{name}", default))


def build(rows: int, plan_kind: str):
    import torch
    from torchrec import EmbeddingBagCollection as TorchrecEBC
    from torchrec import EmbeddingBagConfig
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.models.dlrm import DLRM

    import tpurec
    import tpurec.sparse as sp

    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=n, feature_names=[f"f{i}"])
        for i, n in enumerate((rows, 23, 17))
    ]
    meta = TorchrecEBC(tables=tables, device=torch.device("meta"))
    generators = (
        {"t0": table_wise(rank=6), "t1": row_wise(), "t2": column_wise(ranks=[1, 5])}
        if plan_kind == "mixed"
        else {t.name: row_wise() for t in tables}
    )
    module_plan = construct_module_sharding_plan(meta, generators, local_size=4, world_size=8, device_type="cpu")
    torch.manual_seed(0)
    model = DLRM(embedding_bag_collection=TorchrecEBC(tables), dense_in_features=5, dense_arch_layer_sizes=[16, 8],
                 over_arch_layer_sizes=[16, 1])  # fmt: skip
    model = sp.from_torchrec(model, optimizer=sp.Adagrad(learning_rate=0.1)).to("tpu")
    return tables, tpurec.shard(model, ShardingPlan({"sparse_arch.embedding_bag_collection": module_plan}))


def batch(tables, step: int, rank: int, local: int):
    """Step ``step``'s samples of process ``rank`` (the same in every run, whatever the restarts)."""
    import torch
    from torchrec import KeyedJaggedTensor

    rng = np.random.default_rng([step, rank])
    lengths = [rng.integers(0, 4, local) for _ in tables]
    values = [rng.integers(0, min(t.num_embeddings, 17), int(ls.sum())) for t, ls in zip(tables, lengths)]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[t.feature_names[0] for t in tables],
        values=torch.from_numpy(np.concatenate(values)),
        lengths=torch.from_numpy(np.concatenate(lengths)),
    )
    dense = torch.from_numpy(rng.standard_normal((local, 5)).astype(np.float32))
    labels = torch.from_numpy(rng.integers(0, 2, local).astype(np.float32))
    return dense, kjt, labels


def main() -> None:
    import tpurec
    import tpurec.distributed

    tpurec.distributed.initialize()
    print("joined the job", flush=True)
    import jax
    import torch

    from tpurec.sparse.checkpoint import list_checkpoints
    from tpurec.sparse.checkpoint import sharded as checkpoint
    from tpurec.sparse.sharding import distribute_batch

    rank = jax.process_index()
    tables, model = build(int(setting("ROWS", "40")), setting("PLAN", "mixed"))
    # Dense SGD keeps no state, so the sharded checkpoint (tables, slots, dense parameters) is all there is to resume.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    steps, local = int(setting("STEPS", "6")), int(setting("BATCH", "8"))
    signal_at = setting("SIGNAL_AT", "")
    folder = setting("CKPT", "")
    every = int(setting("CKPT_EVERY", "2"))
    start, losses = 0, []
    committed = [
        int(p.name.removeprefix("step-")) for p in (list_checkpoints(folder) if folder and os.path.isdir(folder) else [])
        if os.path.exists(os.path.join(folder, f"losses-{p.name.removeprefix('step-')}.npy"))
    ]  # fmt: skip
    if committed:  # --resume from the last committed checkpoint
        start = max(committed)
        checkpoint.load(model, os.path.join(folder, f"step-{start}"))
        losses = list(np.load(os.path.join(folder, f"losses-{start}.npy")))
        print(f"resumed after step {start}", flush=True)
    for step in range(start + 1, steps + 1):
        fault = signal_at.split(":") if signal_at else []
        # (only on the first attempt of an elastic job)
        if fault and int(fault[0]) == step and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            where = fault[2] if len(fault) > 2 else "before"
        else:
            where = None
        if where == "before":
            print(f"sending SIG{fault[1]} to myself before step {step}", flush=True)
            os.kill(os.getpid(), getattr(signal, "SIG" + fault[1]))
        dense, kjt, labels = batch(tables, step, rank, local)
        optimizer.zero_grad()
        logits = model(dense, kjt).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, distribute_batch(labels, model.mesh))
        if where == "mid":  # the others go on into the backward's collectives
            print(f"sending SIG{fault[1]} to myself in step {step}", flush=True)
            os.kill(os.getpid(), getattr(signal, "SIG" + fault[1]))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        print(f"step {step} loss {losses[-1]:.6f}", flush=True)
        if folder and step % every == 0:
            checkpoint.save(model, os.path.join(folder, f"step-{step}"))
            if rank == 0:
                np.save(os.path.join(folder, f"losses-{step}.npy"), np.array(losses))
    out = setting("OUT", "")
    if out:  # every process gathers (a collective), process 0 writes
        full, slots = model.sparse_arch.embedding_bag_collection.full_tables()
        arrays = {"losses": np.array(losses), **{f"table/{k}": v for k, v in full.items()}}
        arrays.update({f"slot/{k}/{s}": v for k, d in slots.items() for s, v in d.items()})
        arrays.update(
            {f"dense/{k}": v.cpu().numpy() for k, v in model.state_dict().items() if "embedding_bag" not in k}
        )
        if rank == 0:
            np.savez(out, **arrays)
    print("done", flush=True)


if __name__ == "__main__":
    import faulthandler

    faulthandler.dump_traceback_later(float(os.environ.get("FAULT_HANG_SECONDS", "300")), exit=True)
    main()
    sys.stdout.flush()
