"""One rank of the c10d backend tests (``torchrun --nproc-per-node N c10d_worker.py BACKEND OUT [quick]``).

Every collective runs on tpu tensors through the ``BACKEND`` group ("tpu" or "cpu:gloo,tpu:tpu")
and on CPU copies of the same tensors through a gloo group of the same ranks; the results must be
equal (exactly for integers and for reductions of two ranks, within 1e-6 relative for float sums
of more ranks, whose order may differ). Each rank writes ``OUT.<rank>`` (one line per check) when
all passed; any failure raises and ends the rank with a non-zero status.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import sys
import time

import numpy as np

GLOBAL_BATCH = 8
STEPS = 10


def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _batches():
    import torch

    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        yield torch.randn(GLOBAL_BATCH, 4, generator=gen), torch.randn(GLOBAL_BATCH, 1, generator=gen)


def train(model, rank: int = 0, ranks: int = 1, device: str = "cpu") -> list[float]:
    """STEPS steps of SGD with momentum on this rank's slice of each global batch; the global losses."""
    import torch
    import torch.distributed as dist

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    local = GLOBAL_BATCH // ranks
    for x, y in _batches():
        optimizer.zero_grad()
        sl = slice(rank * local, (rank + 1) * local)
        loss = torch.nn.functional.mse_loss(model(x[sl].to(device)), y[sl].to(device))
        loss.backward()
        optimizer.step()
        if ranks > 1:  # every rank's loss is the mean over its (equal) slice: their mean is the global loss
            loss = loss.detach()
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    return losses


def reference() -> tuple[list[float], list[np.ndarray]]:
    """One process, the whole batch, on CPU: the losses and final parameters."""
    model = _model()
    losses = train(model)
    return losses, [p.detach().numpy() for p in model.parameters()]


def main(backend: str, out_path: str, full: bool = True) -> None:
    import torch
    import torch.distributed as dist

    import tpurec  # noqa: F401 (registers the "tpu" backend)
    from tpurec.distributed import collectives
    from tpurec.distributed.agreement import CollectiveMismatch, CollectiveTimeout

    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=60))
    rank, n = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    done: list[str] = []

    def same(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if got.device.type != "tpu":
            raise AssertionError(f"{name}: the result is on {got.device}, not on tpu")
        got = got.cpu()
        if got.dtype.is_floating_point and n > 2:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=name)
        else:
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
        done.append(name)

    gen = torch.Generator().manual_seed(100 + rank)

    def values(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if dtype.is_floating_point:
            return torch.randn(*shape, generator=gen, dtype=dtype)
        return torch.randint(-5, 6, shape, generator=gen, dtype=dtype)

    # all_reduce: every op, float and int; AVG against gloo's SUM / n (gloo has no AVG).
    # The quick run (more processes) checks one dtype and fewer variants of each collective.
    for dtype in (torch.float32, torch.int64) if full else (torch.float32,):
        for op in ("SUM", "AVG", "MAX", "MIN", "PRODUCT") if full else ("SUM", "PRODUCT"):
            if op == "AVG" and not dtype.is_floating_point:
                continue
            x = values(3, 4, dtype=dtype)
            t = x.to("tpu")
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
            ref = x.clone()
            dist.all_reduce(ref, op=dist.ReduceOp.SUM if op == "AVG" else getattr(dist.ReduceOp, op), group=gloo)
            same(f"all_reduce {op} {dtype}", t, ref / n if op == "AVG" else ref)
    if full:  # views, broadcast, all_gather, reduce_scatter
        # A 0-d tensor and a strided view are written in place.
        s = torch.tensor(float(rank + 1))
        ts = s.to("tpu")
        dist.all_reduce(ts)
        same("all_reduce 0-d", ts, torch.tensor(float(n * (n + 1) // 2)))
        base = values(4, 6)
        tb = base.to("tpu")
        view = tb[:, ::2]
        dist.all_reduce(view)
        ref = base.clone()
        part = ref[:, ::2].contiguous()
        dist.all_reduce(part, group=gloo)
        ref[:, ::2] = part
        same("all_reduce strided view", tb, ref)

        # broadcast from every root.
        for src in range(n) if full else (n - 1,):
            x = values(5)
            t = x.to("tpu")
            dist.broadcast(t, src)
            dist.broadcast(x, src, group=gloo)
            same(f"broadcast src={src}", t, x)

        # all_gather (list) and all_gather_into_tensor.
        x = values(2, 3)
        outs = [torch.empty(2, 3, device="tpu") for _ in range(n)]
        dist.all_gather(outs, x.to("tpu"))
        refs = [torch.empty(2, 3) for _ in range(n)]
        dist.all_gather(refs, x, group=gloo)
        for i in range(n):
            same(f"all_gather [{i}]", outs[i], refs[i])
        out = torch.empty(2 * n, 3, device="tpu")
        dist.all_gather_into_tensor(out, x.to("tpu"))
        ref = torch.empty(2 * n, 3)
        dist.all_gather_into_tensor(ref, x, group=gloo)
        same("all_gather_into_tensor", out, ref)

        # reduce_scatter_tensor.
        for op in ("SUM", "MAX", "MIN") if full else ("SUM",):
            x = values(2 * n, 3)
            out = torch.empty(2, 3, device="tpu")
            dist.reduce_scatter_tensor(out, x.to("tpu"), op=getattr(dist.ReduceOp, op))
            ref = torch.empty(2, 3)
            dist.reduce_scatter_tensor(ref, x, op=getattr(dist.ReduceOp, op), group=gloo)
            same(f"reduce_scatter_tensor {op}", out, ref)
        # reduce_scatter (a list per rank): the reference is gloo's all_reduce of the stacked list.
        parts = [values(2) for _ in range(n)]
        out = torch.empty(2, device="tpu")
        dist.reduce_scatter(out, [p.to("tpu") for p in parts])
        ref = torch.stack(parts)
        dist.all_reduce(ref, group=gloo)
        same("reduce_scatter", out, ref[rank])
        # reduce to the last rank.
        x = values(3)
        t = x.to("tpu")
        dist.reduce(t, dst=n - 1, op=dist.ReduceOp.MAX)
        dist.reduce(x, dst=n - 1, op=dist.ReduceOp.MAX, group=gloo)
        if rank == n - 1:
            same("reduce", t, x)

    # all_to_all_single: even, then uneven with random split matrices (zeros included, the same
    # matrix on every rank: each rank uses its row as input splits and its column as output splits).
    x = values(3 * n, 2)
    out = torch.empty(3 * n, 2, device="tpu")
    dist.all_to_all_single(out, x.to("tpu"))
    ref = torch.empty(3 * n, 2)
    dist.all_to_all_single(ref, x, group=gloo)
    same("all_to_all_single even", out, ref)
    shared = np.random.default_rng(7)
    for trial in range(4 if full else 2):
        matrix = shared.integers(0, 4, (n, n))
        matrix[shared.random((n, n)) < 0.3] = 0
        if trial == 1:
            matrix[n - 1] = 0  # a rank that sends nothing
            matrix[:, 0] = 0  # and one that gets nothing
        if trial == 2:
            matrix[:] = 0  # nobody sends anything
        ins, outs_ = matrix[rank].tolist(), matrix[:, rank].tolist()
        for dtype in (torch.float32, torch.int32) if full else (torch.float32,):
            x = values(sum(ins), 3, dtype=dtype)
            out = torch.empty(sum(outs_), 3, dtype=dtype, device="tpu")
            dist.all_to_all_single(out, x.to("tpu"), outs_, ins)
            ref = torch.empty(sum(outs_), 3, dtype=dtype)
            dist.all_to_all_single(ref, x, outs_, ins, group=gloo)
            same(f"all_to_all_single uneven trial {trial} {dtype}", out, ref)

    if full:  # all_to_all, gather, scatter, async work, program cache
        # all_to_all (lists of tensors of different lengths).
        sizes = [[(i + j) % 3 for j in range(n)] for i in range(n)]
        ins = [values(sizes[rank][j], 2) for j in range(n)]
        outs = [torch.empty(sizes[j][rank], 2, device="tpu") for j in range(n)]
        dist.all_to_all(outs, [t.to("tpu") for t in ins])
        # gloo has no list all_to_all: its all_to_all_single of the concatenated lists is the reference.
        ref = torch.empty(sum(sizes[j][rank] for j in range(n)), 2)
        dist.all_to_all_single(ref, torch.cat(ins), [sizes[j][rank] for j in range(n)], sizes[rank], group=gloo)
        refs = ref.split([sizes[j][rank] for j in range(n)])
        for j in range(n):
            same(f"all_to_all [{j}]", outs[j], refs[j])

        # gather and scatter to/from the last rank.
        root = n - 1
        x = values(3)
        gathered = [torch.empty(3, device="tpu") for _ in range(n)] if rank == root else None
        dist.gather(x.to("tpu"), gathered, dst=root)
        refs = [torch.empty(3) for _ in range(n)] if rank == root else None
        dist.gather(x, refs, dst=root, group=gloo)
        if rank == root:
            for i in range(n):
                same(f"gather [{i}]", gathered[i], refs[i])
        parts = [values(2, 2) for _ in range(n)]
        out = torch.empty(2, 2, device="tpu")
        dist.scatter(out, [p.to("tpu") for p in parts] if rank == root else None, src=root)
        ref = torch.empty(2, 2)
        dist.scatter(ref, parts if rank == root else None, src=root, group=gloo)
        same("scatter", out, ref)

        # async_op: the work waits for the result.
        x = values(64)
        t = x.to("tpu")
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        if not work.is_completed():
            raise AssertionError("async all_reduce: is_completed() is False after wait()")
        dist.all_reduce(x, group=gloo)
        same("all_reduce async_op", t, x)
        fut = dist.all_reduce(t, async_op=True).get_future()
        fut.wait()
        dist.all_reduce(x, group=gloo)
        same("all_reduce async future", t, x)

        dist.barrier()
        done.append("barrier")

        # A training loop's repeated collectives reuse their compiled programs.
        t = torch.ones(8, device="tpu")
        dist.all_reduce(t)
        before = collectives.cached_program_count()
        for _ in range(3):
            dist.all_reduce(t)
        if collectives.cached_program_count() != before:
            raise AssertionError("repeated all_reduce of one shape built new programs")
        same("all_reduce repeated", t, torch.full((8,), float(n**4)))

    # No collective on tpu tensors so far went through gloo: the tpu group's gloo group for CPU
    # tensors is made on the first CPU call, just below.
    if dist.distributed_c10d._get_default_group()._cpu is not None:
        raise AssertionError("a collective on tpu tensors used the gloo group")
    # CPU tensors on the tpu group go to gloo (as in "cpu:gloo,tpu:tpu").
    c = torch.full((3,), float(rank))
    dist.all_reduce(c)
    torch.testing.assert_close(c, torch.full((3,), float(n * (n - 1) // 2)), rtol=0, atol=0)
    done.append("cpu tensor through gloo")

    # Sub-groups: the odd ranks (every rank takes part in new_group).
    odd = [r for r in range(n) if r % 2]
    sub = dist.new_group(odd)
    sub_gloo = dist.new_group(odd, backend="gloo")
    if rank in odd:
        x = values(4)
        t = x.to("tpu")
        dist.all_reduce(t, group=sub)
        dist.all_reduce(x, group=sub_gloo)
        same("all_reduce sub-group", t, x)
        out = torch.empty(4 * len(odd), device="tpu")
        dist.all_gather_into_tensor(out, t, group=sub)
        ref = torch.empty(4 * len(odd))
        dist.all_gather_into_tensor(ref, x, group=sub_gloo)
        same("all_gather_into_tensor sub-group", out, ref)

    if full:  # point-to-point, mismatch and timeout errors (ranks-independent)
        # Point-to-point: a clear error naming the alternative.
        try:
            dist.send(torch.ones(2, device="tpu"), dst=(rank + 1) % n)
        except NotImplementedError as error:
            if "all_to_all_single" not in str(error):
                raise
            done.append("send refused")
        else:
            raise AssertionError("send on tpu tensors did not raise")

        # A mismatched call (shapes differ between ranks) fails on every rank, naming the collective;
        # the group still works afterwards.
        try:
            dist.all_reduce(torch.ones(3 + rank, device="tpu"))
        except CollectiveMismatch as error:
            if (
                "called all_reduce (shapes [[3]], dtype float32, arguments [0]) but rank 1 called all_reduce (shapes [[4]]"
                not in str(error)
            ):
                raise
            done.append("mismatch detected")
        else:
            raise AssertionError("all_reduce with shapes that differ between ranks did not raise")
        t = torch.ones(2, device="tpu")
        dist.all_reduce(t)
        same("all_reduce after a mismatch", t, torch.full((2,), float(n)))

        # A rank that never makes the call (here: only rank 0 calls on a group with a 3 s timeout)
        # ends the call on the others with an error naming the collective and the missing ranks.
        lonely = dist.new_group(timeout=datetime.timedelta(seconds=3))
        if rank == 0:
            start = time.monotonic()
            try:
                dist.broadcast(torch.ones(2, device="tpu"), 0, group=lonely)
            except CollectiveTimeout as error:
                if f"broadcast: waited 3 s for group rank(s) {list(range(1, n))}" not in str(error):
                    raise
                if time.monotonic() - start > 30:
                    raise AssertionError(f"the timeout took {time.monotonic() - start:.0f} s") from None
            else:
                raise AssertionError("a broadcast that only rank 0 made did not raise")
        done.append("timeout detected")

    # DDP over the tpu group: each rank trains on its slice of every global batch.
    model = torch.nn.parallel.DistributedDataParallel(_model().to("tpu"))
    losses = train(model, rank, n, "tpu")
    if rank == 0:
        params = {f"param{i}": p.detach().cpu().numpy() for i, p in enumerate(model.module.parameters())}
        np.savez(f"{out_path}.ddp.npz", losses=np.array(losses), **params)
    done.append("ddp")

    dist.barrier()
    dist.destroy_process_group()
    with open(f"{out_path}.{rank}", "w") as f:
        f.write("\n".join(done) + "\n")


if __name__ == "__main__":
    # A hung collective ends this rank with every thread's stack instead of stalling the test.
    faulthandler.dump_traceback_later(float(os.environ.get("TPUREC_TEST_HANG_SECONDS", "150")), exit=True)
    main(sys.argv[1], sys.argv[2], full=sys.argv[3:] != ["quick"])
