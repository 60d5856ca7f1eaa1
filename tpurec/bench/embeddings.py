"""Embedding lookups swept over dim and pooling, against the memory-bandwidth bound.

``python -m tpurec.bench embeddings [--dims 32 64 128] [--ids-per-bag 1 4 20] [--plot DIR]``

For every (dim, ids per bag) pair, on one batch of the same KJT: the pooled
forward and one training step (forward + backward + row-wise Adagrad on the
touched rows) of the platform's kernel (``kernel``: the native FFI kernel on
XLA:CPU, the SparseCore or TensorCore kernel on a TPU, by chip; with the TensorCore
kernel also its two-pass variant, ``tensorcore_two_pass``, its optimizer step summing
rows on the MXU, ``tensorcore_mxu_row_sum``, and moving row slots by lane reductions,
``tensorcore_xlu_row_slots``), the plain-JAX
peer (``plain_jax``: gather + sum, sorted dedup, the update on the touched rows;
:mod:`tpurec.bench.jax_peer`), the JAX reference kernel, FBGEMM's TBE and
torchrec's ``FusedEmbeddingBagCollection`` (FBGEMM underneath, through
torchrec's module; both on the host's CPU). Each time is a median in ms, next to
the looked-up rows' bytes per second (``forward_rows_gb_s``) and the fraction of
the memory-bandwidth bound it reaches: the bytes the step must move divided by
the time, over the bandwidth of the memory the tables live in (a TPU's HBM, from
its generation in the planner's table; on the host, a copy measured in the same
run: ``np.copyto`` of a 256 MiB buffer, read + write).

Bytes moved (float32): forward = entries x (dim x 4 + 12 CSR bytes) + outputs
x dim x 4; training step = 2 x forward (the backward gathers the output
gradients the same way) + unique rows x (2 x dim x 4 + 8) (read and write of
each touched row and its accumulator).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

from tpurec import config
from tpurec.bench.sparse import _fbgemm, _jax_kernels, _median_ms, _plain_jax
from tpurec.cli import HelpFormatter, add_batch_size, add_flag, positive_int

LR, EPS = 0.01, 1e-8


def copy_bandwidth_gb_s(megabytes: int = 256, iters: int = 5) -> float:
    """Measured memory bandwidth of a large copy (bytes read + written per second, GB/s)."""
    src = np.ones(megabytes * 2**20 // 4, np.float32)
    dst = np.empty_like(src)
    ms = _median_ms(lambda: np.copyto(dst, src), iters, warmup=1)
    return 2 * src.nbytes / (ms * 1e-3) / 1e9


def _torchrec(kjt, num_tables: int, rows: int, dim: int, table: np.ndarray, iters: int) -> dict[str, float]:
    import torch
    from torchrec import EmbeddingBagConfig
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
    from torchrec.optim import RowWiseAdagrad

    configs = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"f{i}"])
        for i in range(num_tables)
    ]
    ebc = FusedEmbeddingBagCollection(configs, optimizer_type=RowWiseAdagrad, optimizer_kwargs={"lr": LR, "eps": EPS})
    with torch.no_grad():
        for i, w in enumerate(ebc.state_dict().values()):
            w.copy_(torch.from_numpy(table[i * rows : (i + 1) * rows]))

    def train():
        out = ebc(kjt).values()
        out.backward(out.detach() * 1e-3)

    with torch.no_grad():
        fwd_ms = _median_ms(lambda: ebc(kjt), iters)
    return {"forward_ms": fwd_ms, "train_step_ms": _median_ms(train, iters)}


def main(argv: list[str] | None = None, prog: str = "python -m tpurec.bench embeddings") -> dict:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--dims", type=positive_int, nargs="+", default=[32, 64, 128], help="embedding dimensions")
    add_flag(
        parser,
        "--ids-per-bag",
        "--pooling",
        dest="ids_per_bag",
        type=positive_int,
        nargs="+",
        default=[1, 4, 20],
        help="ids per bag (one run each)",
    )
    parser.add_argument("--tables", type=positive_int, default=8, help="embedding tables")
    parser.add_argument("--rows", type=positive_int, default=100_000, help="rows of each table")
    add_batch_size(parser, "samples per lookup", type=positive_int, default=2048)
    parser.add_argument("--iters", type=positive_int, default=5, help="timed calls per configuration")
    parser.add_argument("--partitions", type=positive_int, default=8, help="MOD partitions of the CSR input")
    parser.add_argument(
        "--threads", type=positive_int, default=None, help="CPU threads for native and FBGEMM (None: all)"
    )
    parser.add_argument("--skip-reference", action="store_true", help="skip the (slow) JAX reference kernel")
    parser.add_argument("--plot", metavar="DIR", help="write PNG charts into DIR")
    args = parser.parse_args(argv)
    if args.threads:
        config.update("TPUREC_CPU_THREADS", args.threads)

    import torch
    from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

    import jax

    from tpurec.sparse import ops
    from tpurec.sparse.kernels import native, reference, tensorcore, tpu
    from tpurec.sparse.planner.topology import generation_of_device_kind
    from tpurec.sparse.preprocess import preprocess_kjt  # the step being measured (not public API)

    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    # The platform's own kernel: native on XLA:CPU, SparseCore or TensorCore on a TPU (by chip).
    family = ops.kernel_family()
    platform_kernels = {"native": native, "tensorcore": tensorcore, "sparsecore": tpu, "reference": reference}[family]
    if family == "native":
        native.ensure_registered()  # build outside the timings
    # The bandwidth bound: the chip's HBM (its generation's figure) on a TPU, a measured copy on the host.
    device = jax.devices()[0]
    generation = generation_of_device_kind(str(device.device_kind)) if device.platform == "tpu" else None
    bandwidth = generation.hbm_bw_per_chip / 1e9 if generation is not None else copy_bandwidth_gb_s()
    rng = np.random.default_rng(0)
    runs = []
    for dim in args.dims:
        table = rng.uniform(-0.01, 0.01, (args.tables * args.rows, dim)).astype(np.float32)
        for bag in args.ids_per_bag:
            tables = [
                EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=args.rows, feature_names=[f"f{i}"])
                for i in range(args.tables)
            ]
            kjt = KeyedJaggedTensor.from_lengths_sync(
                keys=[f"f{i}" for i in range(args.tables)],
                values=torch.from_numpy(rng.integers(0, args.rows, args.tables * args.batch * bag)),
                lengths=torch.full((args.tables * args.batch,), bag),
            )
            csr_batch = preprocess_kjt(kjt, tables, args.partitions)
            (csr,) = (s.arrays() for s in csr_batch.stacks.values())
            (stats,) = csr_batch.stacks.values()
            entries, unique = int(stats.max_ids.sum()), int(stats.max_unique_ids.sum())
            outputs = args.tables * args.batch
            forward_bytes = entries * (dim * 4 + 12) + outputs * dim * 4
            train_bytes = 2 * forward_bytes + unique * (2 * dim * 4 + 8)
            times = {family: _jax_kernels(platform_kernels, csr, outputs, table, args.iters)}
            if family == "tensorcore":
                # The kernel the one-pass default replaced, in the same run (TPUREC_TENSORCORE_ONE_PASS=0).
                with config.override(tensorcore_one_pass=False):
                    times["tensorcore_two_pass"] = _jax_kernels(platform_kernels, csr, outputs, table, args.iters)
                # The experimental MXU row sum of the optimizer step (TPUREC_TENSORCORE_ROW_SUM=mxu).
                with config.override(tensorcore_row_sum="mxu"):
                    times["tensorcore_mxu_row_sum"] = _jax_kernels(platform_kernels, csr, outputs, table, args.iters)
                # Row slots of a lane-dense step moved by lane reductions (TPUREC_TENSORCORE_ROW_SLOTS=xlu).
                with config.override(tensorcore_row_slots="xlu"):
                    times["tensorcore_xlu_row_slots"] = _jax_kernels(platform_kernels, csr, outputs, table, args.iters)
            ids = (
                kjt.values().numpy().reshape(args.tables, args.batch, bag)
                + (np.arange(args.tables) * args.rows)[:, None, None]
            )
            times["plain_jax"] = _plain_jax(ids.reshape(outputs, bag), table, args.iters)
            if not args.skip_reference and family != "reference":
                times["reference"] = _jax_kernels(reference, csr, outputs, table, args.iters)
            times["fbgemm_tbe"] = _fbgemm(kjt, args.tables, args.rows, dim, table, args.iters)
            times["torchrec_ebc"] = _torchrec(kjt, args.tables, args.rows, dim, table, args.iters)
            run = {"dim": dim, "ids_per_bag": bag, "entries": entries, "unique_ids": unique}
            rows_bytes = args.tables * args.batch * bag * dim * 4  # the looked-up rows: the useful traffic
            for name, t in times.items():
                run[name] = {
                    **t,
                    "forward_rows_gb_s": round(rows_bytes / (t["forward_ms"] * 1e-3) / 1e9, 4),
                    "forward_bandwidth_fraction": round(forward_bytes / (t["forward_ms"] * 1e-3) / 1e9 / bandwidth, 3),
                    "train_bandwidth_fraction": round(train_bytes / (t["train_step_ms"] * 1e-3) / 1e9 / bandwidth, 3),
                }
            runs.append(run)
    result = {
        "benchmark": "embeddings",
        "config": {k: v for k, v in vars(args).items() if k != "plot"} | {"threads": threads},
        "kernel": family,
        "bandwidth_gb_s": round(bandwidth, 2),
        "bandwidth_source": f"HBM of a TPU {generation.name}" if generation is not None else "host memory copy",
        "runs": runs,
    }
    if args.plot:
        result["plots"] = _plot(result, args.plot)
    return result


def _plot(result: dict, directory: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    runs = result["runs"]
    labels = [f"d{r['dim']}/p{r['ids_per_bag']}" for r in runs]
    impls = [k for k in runs[0] if isinstance(runs[0][k], dict)]
    written = []
    for key, title in (("forward", "forward"), ("train", "forward + backward + row-wise Adagrad")):
        fig, ax = plt.subplots(figsize=(9, 3.5))
        width = 0.8 / len(impls)
        x = np.arange(len(runs))
        for i, impl in enumerate(impls):
            ax.bar(x + i * width, [r[impl][f"{key}_bandwidth_fraction"] for r in runs], width, label=impl)
        ax.set_xticks(x + width * (len(impls) - 1) / 2, labels, fontsize=8)
        ax.set_ylabel("fraction of copy bandwidth")
        ax.set_title(f"Embedding {title} (dim / ids per bag)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"embeddings_{key}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(str(path))
    return written


if __name__ == "__main__":
    import json

    print(json.dumps(main(), indent=2))
