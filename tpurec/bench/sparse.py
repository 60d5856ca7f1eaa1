"""Sparse op set on CPU: native FFI kernel vs JAX reference kernel vs FBGEMM TBE.

``python -m tpurec.bench sparse [--small] [--iters N] [--partitions P] [--threads T]``

Measures, in one run and on the same batch, the pooled forward and one
training step (forward + backward + row-wise Adagrad on the touched rows) of
the default configuration: batch 2048, 26 tables x 100k rows x dim 64, 4 ids per bag.
The JAX kernels run under ``jax.jit`` with the table and accumulator donated
(updates in place); FBGEMM is ``SplitTableBatchedEmbeddingBagsCodegen`` on CPU
with ``EXACT_ROWWISE_ADAGRAD``. Times are medians in milliseconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import numpy as np

from tpurec import config
from tpurec.cli import HelpFormatter, positive_int

LR, EPS = 0.01, 1e-8


def _median_ms(fn: Callable[[], object], iters: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 3)


def _jax_kernels(kernels, csr, batch_size: int, table: np.ndarray, iters: int) -> dict[str, float]:
    import jax
    import jax.numpy as jnp

    from tpurec.sparse.kernels import tensorcore

    csr = tuple(jnp.asarray(a) for a in csr)
    # The table as tpurec's collections store it on the device: lane-dense lines for the
    # TensorCore kernels (tensorcore.stored_shape), which the kernels read without a copy.
    shape = tuple(table.shape)
    stored = tensorcore.stored_shape(*shape) if kernels is tensorcore else shape
    # A new function each call: flags read while tracing (TPUREC_TENSORCORE_ONE_PASS) then apply.
    forward = jax.jit(
        lambda *args, batch_size: kernels.sparse_dense_matmul(
            *args[:-1], args[-1].reshape(shape), batch_size=batch_size
        ),
        static_argnames="batch_size",
    )

    def step(csr, kept, acc):
        table = kept.reshape(shape)
        out = kernels.sparse_dense_matmul(*csr, table, batch_size=batch_size)
        grad = out * 1e-3  # d/d(out) of 0.5e-3 * |out|^2: depends on the forward, as in training
        table, acc = kernels.sparse_dense_matmul_grad_with_rowwise_adagrad(
            *csr, grad, table, acc, learning_rate=LR, eps=EPS, weight_decay=0.0
        )
        return table.reshape(stored), acc

    train = jax.jit(step, donate_argnums=(1, 2))
    # Owned copies (a numpy-backed array cannot be donated).
    state = [jnp.asarray(table).reshape(stored) * 1, jnp.zeros(table.shape[0], jnp.float32)]

    def run_train():
        state[:] = train(csr, *state)
        jax.block_until_ready(state)

    fwd_ms = _median_ms(lambda: forward(*csr, state[0], batch_size=batch_size).block_until_ready(), iters)
    train_ms = _median_ms(run_train, iters)
    del state[:]
    return {"forward_ms": fwd_ms, "train_step_ms": train_ms}


def _plain_jax(ids: np.ndarray, table: np.ndarray, iters: int) -> dict[str, float]:
    """The plain-JAX peer (:mod:`tpurec.bench.jax_peer`) on ``ids`` ``[bags, ids_per_bag]`` of ``table``:
    the same forward and row-wise Adagrad step as :func:`_jax_kernels`."""
    import jax
    import jax.numpy as jnp

    from tpurec.bench.jax_peer import plain_jax_lookup, plain_jax_rowwise_adagrad

    ids_d = jnp.asarray(ids.astype(np.int32))
    forward = jax.jit(plain_jax_lookup)

    def step(ids, table, acc):
        grad = plain_jax_lookup(table, ids) * 1e-3
        return plain_jax_rowwise_adagrad(table, acc, ids, grad, learning_rate=LR, eps=EPS)

    train = jax.jit(step, donate_argnums=(1, 2))
    state = [jnp.asarray(table) * 1, jnp.zeros(table.shape[0], jnp.float32)]

    def run_train():
        state[:] = train(ids_d, *state)
        jax.block_until_ready(state)

    fwd_ms = _median_ms(lambda: forward(state[0], ids_d).block_until_ready(), iters)
    train_ms = _median_ms(run_train, iters)
    del state[:]
    return {"forward_ms": fwd_ms, "train_step_ms": train_ms}


def _fbgemm(kjt, num_tables: int, rows: int, dim: int, table: np.ndarray, iters: int) -> dict[str, float]:
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * num_tables,
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=LR,
        eps=EPS,
        pooling_mode=PoolingMode.SUM,
    )
    with torch.no_grad():
        tbe.weights_host.copy_(torch.from_numpy(table.reshape(-1)))
    indices, offsets = kjt.values().long(), kjt.offsets().long()

    def train():
        out = tbe(indices, offsets)
        out.backward(out.detach() * 1e-3)

    with torch.no_grad():
        fwd_ms = _median_ms(lambda: tbe(indices, offsets), iters)
    return {"forward_ms": fwd_ms, "train_step_ms": _median_ms(train, iters)}


def main(argv: list[str] | None = None, prog: str = "python -m tpurec.bench sparse") -> dict:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--small", action="store_true", help="4 tables x 10k rows x dim 32, batch 256 (a quick run)")
    parser.add_argument("--iters", type=positive_int, default=10, help="timed calls per kernel")
    parser.add_argument("--partitions", type=positive_int, default=8, help="MOD partitions of the CSR input")
    parser.add_argument(
        "--threads", type=positive_int, default=None, help="CPU threads for native and FBGEMM (None: all)"
    )
    parser.add_argument("--skip-reference", action="store_true", help="skip the (slow) JAX reference kernel")
    args = parser.parse_args(argv)
    if args.threads:
        config.update("TPUREC_CPU_THREADS", args.threads)  # read by the native kernels on each call

    import torch
    from torchrec import EmbeddingBagConfig

    import tpurec.sparse as sp
    from tpurec.sparse.kernels import native, reference
    from tpurec.sparse.preprocess import preprocess_kjt  # the step being measured (not public API)

    num_tables, rows, dim, batch, bag = (4, 10_000, 32, 256, 4) if args.small else (26, 100_000, 64, 2048, 4)
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)

    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"f{i}"])
        for i in range(num_tables)
    ]
    rng = np.random.default_rng(0)
    from torchrec import KeyedJaggedTensor

    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(num_tables)],
        values=torch.from_numpy(rng.integers(0, rows, num_tables * batch * bag)),
        lengths=torch.full((num_tables * batch,), bag),
    )
    # Capacities sized to this batch (the shapes of capacities=None), then the
    # native and the numpy (reference) preprocessing timed on them.
    fit = next(iter(preprocess_kjt(kjt, tables, args.partitions).stacks.values()))
    capacity = sp.Capacity(int(fit.max_ids.max()), int(fit.max_unique_ids.max()))
    preprocess_ms, batches = {}, {}
    for backend in ("native", "numpy"):
        with config.override(preprocess=backend):
            batches[backend] = preprocess_kjt(kjt, tables, args.partitions, capacity)
            preprocess_ms[backend] = _median_ms(
                lambda: preprocess_kjt(kjt, tables, args.partitions, capacity), args.iters, warmup=1
            )
    identical = all(
        a.tobytes() == b.tobytes()
        for x, y in zip(batches["native"].stacks.values(), batches["numpy"].stacks.values())
        for a, b in zip(x.arrays(), y.arrays())
    )
    (csr,) = (s.arrays() for s in batches["native"].stacks.values())
    table = rng.uniform(-0.01, 0.01, (num_tables * rows, dim)).astype(np.float32)

    native.ensure_registered()  # build outside the timings
    results = {"native": _jax_kernels(native, csr, num_tables * batch, table, args.iters)}
    if not args.skip_reference:
        results["reference"] = _jax_kernels(reference, csr, num_tables * batch, table, args.iters)
    results["fbgemm"] = _fbgemm(kjt, num_tables, rows, dim, table, args.iters)

    ratios = {}
    for other in ("reference", "fbgemm"):
        if other in results:
            for key in ("forward_ms", "train_step_ms"):
                ratios[f"{other}/native {key[:-3]}"] = round(results[other][key] / results["native"][key], 2)
    return {
        "config": {
            "tables": num_tables,
            "rows": rows,
            "dim": dim,
            "batch": batch,
            "ids_per_bag": bag,
            "partitions": args.partitions,
            "threads": threads,
            "iters": args.iters,
        },
        "preprocess_ms": preprocess_ms,
        "preprocess_native_equals_numpy": identical,
        "times": results,
        "speedup": ratios,
    }


if __name__ == "__main__":
    import json

    print(json.dumps(main(), indent=2))
