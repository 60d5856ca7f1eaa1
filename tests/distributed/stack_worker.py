"""One rank of the functional collectives, DTensor and FSDP2 tests on a ``"tpu"`` group.

``torchrun --nproc-per-node N stack_worker.py CHECKS OUT [ARGS]`` with CHECKS one of

* ``functional``: ``torch.distributed._functional_collectives`` on tpu tensors (eager and fused
  mode, and inside ``torch.compile(backend="tpu")``) equal the same calls on CPU copies through a
  gloo group;
* ``dtensor``: DTensor on ``init_device_mesh("tpu", (N,))`` equals plain CPU tensors;
* ``fsdp CKPT``: ``fully_shard`` on a 2-layer transformer trains STEPS steps (losses and final
  parameters to ``OUT.fsdp.npz``), then saves its state with ``torch.distributed.checkpoint``
  to CKPT;
* ``load CKPT REF``: a fresh ``fully_shard`` model loads CKPT and must equal the parameters in
  the npz file REF.

Every rank checks that no tpu collective went through gloo (the tpu group's gloo group for CPU
tensors was never made), writes ``OUT.<rank>`` (one line per check) when all passed, and ends
with a non-zero status on any failure.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import sys
from typing import Any

import numpy as np

STEPS = 10
GLOBAL_BATCH = 4
WIDTH = 8


def transformer():
    """The FSDP2 model: two ``nn.TransformerEncoderLayer`` (no dropout, so every run is deterministic)."""
    import torch

    torch.manual_seed(0)
    layers = [torch.nn.TransformerEncoderLayer(WIDTH, 2, 16, dropout=0.0, batch_first=True) for _ in range(2)]
    return torch.nn.Sequential(*layers)


def batches():
    import torch

    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        yield torch.randn(GLOBAL_BATCH, 3, WIDTH, generator=gen), torch.randn(GLOBAL_BATCH, 3, WIDTH, generator=gen)


def train(model, rank: int = 0, ranks: int = 1, device: str = "cpu") -> list[float]:
    """STEPS steps of SGD with momentum on this rank's slice of each global batch; the global losses."""
    import torch
    import torch.distributed as dist

    # SGD, not Adam: the attention key bias has a gradient of rounding noise only, which Adam would
    # scale up to full steps (so its values would follow the noise, different on any two devices).
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    local = GLOBAL_BATCH // ranks
    losses = []
    for x, y in batches():
        optimizer.zero_grad()
        part = slice(rank * local, (rank + 1) * local)
        loss = torch.nn.functional.mse_loss(model(x[part].to(device)), y[part].to(device))
        loss.backward()
        optimizer.step()
        if ranks > 1:  # each rank's loss is the mean over an equal slice: their mean is the global loss
            loss = loss.detach()
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    return losses


def reference() -> tuple[list[float], dict[str, np.ndarray]]:
    """One process on CPU, the whole batch: the losses and final parameters."""
    model = transformer()
    losses = train(model)
    return losses, {name: p.detach().numpy() for name, p in model.named_parameters()}


def no_gloo(group) -> None:
    """No tpu collective went through the group's gloo group (made only on a first CPU-tensor call)."""
    if group._cpu is not None:
        raise AssertionError("a collective of this run went through the tpu group's gloo group")


def functional(rank: int, n: int, done: list[str]) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    import tpurec
    from tpurec.distributed.agreement import CollectiveMismatch

    # Any: torch's stubs type these as optional; both are groups here.
    world: Any = dist.group.WORLD
    gloo: Any = dist.new_group(backend="gloo")
    gen = torch.Generator().manual_seed(100 + rank)

    def same(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if got.device.type != "tpu":
            raise AssertionError(f"{name}: the result is on {got.device}, not on tpu")
        torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6, msg=name)
        done.append(name)

    for mode in ("eager", "fused"):
        with tpurec.mode(mode):
            x = torch.randn(4, 6, generator=gen)
            t = x.to("tpu")
            for op in ("sum", "avg", "max", "min"):
                got = funcol.all_reduce(t, op, world)
                want = funcol.all_reduce(x, "sum" if op == "avg" else op, gloo)
                same(f"{mode} all_reduce {op}", got, want / n if op == "avg" else want)
            same(
                f"{mode} all_gather_tensor", funcol.all_gather_tensor(t, 0, world), funcol.all_gather_tensor(x, 0, gloo)
            )
            same(
                f"{mode} all_gather_tensor dim 1",
                funcol.all_gather_tensor(t, 1, world),
                funcol.all_gather_tensor(x, 1, gloo),
            )
            same(
                f"{mode} reduce_scatter_tensor",
                funcol.reduce_scatter_tensor(t, "sum", 0, world),
                funcol.reduce_scatter_tensor(x, "sum", 0, gloo),
            )
            same(f"{mode} broadcast", funcol.broadcast(t, 1, world), funcol.broadcast(x, 1, gloo))
            # Uneven splits: rank r sends r + j + 1 rows to rank j (rows of 3).
            sends = [rank + j + 1 for j in range(n)]
            gets = [j + rank + 1 for j in range(n)]
            rows = torch.randn(sum(sends), 3, generator=gen)
            same(
                f"{mode} all_to_all_single uneven",
                funcol.all_to_all_single(rows.to("tpu"), gets, sends, world),
                funcol.all_to_all_single(rows, gets, sends, gloo),
            )
            even = torch.randn(2 * n, 2, generator=gen)
            same(
                f"{mode} all_to_all_single even",
                funcol.all_to_all_single(even.to("tpu"), None, None, world),
                funcol.all_to_all_single(even, None, None, gloo),
            )
            # The ops DTensor and compiled graphs call, with their explicit wait.
            out = torch.ops._c10d_functional.all_reduce(t, "sum", world.group_name)
            out = torch.ops._c10d_functional.wait_tensor(out)
            same(f"{mode} _c10d_functional.all_reduce + wait_tensor", out, funcol.all_reduce(x, "sum", gloo))
            # Ranks that disagree fail on every rank with the mismatch named, and the group goes on.
            try:
                funcol.all_reduce(torch.ones(3 + rank, device="tpu"), "sum", world)
            except CollectiveMismatch as error:
                if "rank 0 called all_reduce (shapes [[3]]" not in str(error):
                    raise
            else:
                raise AssertionError("a functional all_reduce with shapes that differ between ranks did not raise")
            done.append(f"{mode} mismatch detected")
            # Coalesced form (FSDP-style bucketing of several tensors in one call).
            pair = [t, t * 2]
            outs = funcol.all_gather_into_tensor_coalesced(pair, world)
            wants = funcol.all_gather_into_tensor_coalesced([x, x * 2], gloo)
            for i, (o, w) in enumerate(zip(outs, wants, strict=True)):
                same(f"{mode} all_gather_into_tensor_coalesced {i}", o, w)


def compiled(rank: int, n: int, done: list[str]) -> None:
    """Functional collectives inside ``torch.compile(backend="tpu")``: forward and backward == gloo on CPU."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    world: Any = dist.group.WORLD
    gloo: Any = dist.new_group(backend="gloo")
    gen = torch.Generator().manual_seed(200 + rank)

    def step(x: torch.Tensor, group: Any) -> torch.Tensor:
        y = torch.tanh(x) * 2
        y = funcol.all_reduce(y, "sum", group)
        z = funcol.all_gather_tensor(y + 1, 0, group)
        return funcol.reduce_scatter_tensor(z * z, "sum", 0, group)

    compiled_step = torch.compile(step, backend="tpu", fullgraph=True)
    for trial in range(2):  # the second call reuses the compiled pieces
        x = torch.randn(2, 3, generator=gen)
        got = compiled_step(x.to("tpu"), world)
        torch.testing.assert_close(got.cpu(), step(x, gloo), rtol=1e-6, atol=1e-6)
        done.append(f"compiled collectives {trial}")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    twin = torch.nn.Linear(3, 2)
    twin.load_state_dict(model.state_dict())
    model = model.to("tpu")

    def loss_of(m: torch.nn.Module, x: torch.Tensor, group: Any) -> torch.Tensor:
        return funcol.all_reduce(m(x), "sum", group).pow(2).sum()

    x = torch.randn(4, 3, generator=gen)
    loss = torch.compile(loss_of, backend="tpu")(model, x.to("tpu"), world)
    loss.backward()
    want = loss_of(twin, x, gloo)
    want.backward()
    torch.testing.assert_close(loss.detach().cpu(), want.detach(), rtol=1e-6, atol=1e-6)
    assert model.weight.grad is not None and twin.weight.grad is not None
    torch.testing.assert_close(model.weight.grad.cpu(), twin.weight.grad, rtol=1e-6, atol=1e-6)
    done.append("compiled collective backward")
    # The c10d call form inside a compiled function (Dynamo rewrites it to a functional collective).

    def c10d_step(x: torch.Tensor) -> torch.Tensor:
        x = x * 2
        dist.all_reduce(x)
        return x + 1

    x = torch.randn(3, generator=gen)
    want = x * 2
    dist.all_reduce(want, group=gloo)
    got = torch.compile(c10d_step, backend="tpu")(x.to("tpu"))
    torch.testing.assert_close(got.cpu(), want + 1, rtol=1e-6, atol=1e-6)
    done.append("compiled c10d all_reduce")


def dtensor(rank: int, n: int, done: list[str]) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor

    mesh = init_device_mesh("tpu", (n,))
    if mesh.device_type != "tpu":
        raise AssertionError(f"the mesh is on {mesh.device_type}")
    gen = torch.Generator().manual_seed(7)  # the same values on every rank, as distribute_tensor expects
    a = torch.randn(2 * n, 3 * n, generator=gen)
    b = torch.randn(3 * n, n, generator=gen)

    def same(name: str, got, want: torch.Tensor, rtol: float = 1e-6, atol: float = 1e-6) -> None:
        full = got.full_tensor() if isinstance(got, DTensor) else got
        if full.device.type != "tpu":
            raise AssertionError(f"{name}: the result is on {full.device}, not on tpu")
        if isinstance(got, DTensor) and got.to_local().device.type != "tpu":
            raise AssertionError(f"{name}: the local shard is on {got.to_local().device}")
        torch.testing.assert_close(full.cpu(), want, rtol=rtol, atol=atol, msg=name)
        done.append(name)

    placements = {"Shard(0)": Shard(0), "Shard(1)": Shard(1), "Replicate": Replicate()}
    da = {name: distribute_tensor(a.to("tpu"), mesh, [p]) for name, p in placements.items()}
    for name, d in da.items():
        local = d.to_local().cpu()
        if name == "Shard(0)":
            torch.testing.assert_close(local, a.chunk(n, 0)[rank], rtol=0, atol=0)
        elif name == "Shard(1)":
            torch.testing.assert_close(local, a.chunk(n, 1)[rank], rtol=0, atol=0)
        same(f"distribute_tensor {name}", d, a, rtol=0, atol=0)
    # Every redistribute between Shard(0), Shard(1) and Replicate.
    for src, d in da.items():
        for dst, p in placements.items():
            if src != dst:
                moved = d.redistribute(mesh, [p])
                if moved.placements != (p,):
                    raise AssertionError(f"redistribute {src} -> {dst} gave {moved.placements}")
                same(f"redistribute {src} -> {dst}", moved, a, rtol=0, atol=0)
    # Partial: each rank holds a part of a sum.
    part = torch.randn(2, n, generator=torch.Generator().manual_seed(50 + rank))
    parts = [torch.randn(2, n, generator=torch.Generator().manual_seed(50 + r)) for r in range(n)]
    dp = DTensor.from_local(part.to("tpu"), mesh, [Partial()])
    total = torch.stack(parts).sum(0)
    same("redistribute Partial -> Replicate", dp.redistribute(mesh, [Replicate()]), total)
    same("redistribute Partial -> Shard(1)", dp.redistribute(mesh, [Shard(1)]), total)
    same("distribute_tensor Partial", distribute_tensor(a.to("tpu"), mesh, [Partial()]), a, rtol=0, atol=0)
    # Matmul in the placements DTensor's sharding rules pick (row-, column-, contraction-sharded).
    db = {name: distribute_tensor(b.to("tpu"), mesh, [p]) for name, p in placements.items()}
    for left, right in (("Shard(0)", "Replicate"), ("Replicate", "Shard(1)"), ("Shard(1)", "Shard(0)")):
        same(f"matmul {left} @ {right}", da[left] @ db[right], a @ b, rtol=1e-5, atol=1e-5)
    same("mm Shard(0) x Replicate", torch.mm(da["Shard(0)"], db["Replicate"]), a @ b, rtol=1e-5, atol=1e-5)
    # Elementwise ops, with broadcasting and a scalar.
    c = torch.randn(2 * n, 3 * n, generator=gen)
    dc = distribute_tensor(c.to("tpu"), mesh, [Shard(0)])
    same("elementwise Shard(0)", (da["Shard(0)"] * dc + 1).relu() - dc.exp(), (a * c + 1).relu() - c.exp())
    same("elementwise Shard(1) tanh", torch.tanh(da["Shard(1)"]) * 0.5, torch.tanh(a) * 0.5)
    # Reductions over a sharded and an unsharded dimension, and over everything.
    for name in ("Shard(0)", "Shard(1)"):
        d = da[name]
        same(f"sum {name}", d.sum(), a.sum(), rtol=1e-5, atol=1e-5)
        same(f"sum dim 0 {name}", d.sum(0), a.sum(0), rtol=1e-5, atol=1e-5)
        same(f"mean dim 1 {name}", d.mean(1), a.mean(1), rtol=1e-5, atol=1e-5)
        same(f"amax dim 1 {name}", d.amax(1), a.amax(1), rtol=0, atol=0)
    same("softmax Shard(0) dim 1", torch.softmax(da["Shard(0)"], 1), torch.softmax(a, 1))
    # distribute_module: a Linear with its weight sharded by rows (column parallel), replicated input.
    torch.manual_seed(3)
    linear = torch.nn.Linear(3 * n, 2 * n)
    x = torch.randn(5, 3 * n, generator=gen)
    want = linear(x).detach()

    def shard_rows(name: str, module: torch.nn.Module, mesh) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            dparam = torch.nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]))
            module.register_parameter(pname, dparam)

    def replicate_input(module, inputs, mesh):
        return tuple(DTensor.from_local(i, mesh, [Replicate()]) for i in inputs)

    dmodule: Any = distribute_module(linear.to("tpu"), mesh, shard_rows, input_fn=replicate_input)  # pyright: ignore[reportArgumentType] (stubs: input_fn returns None)
    if dmodule.weight.to_local().shape[0] != 2:
        raise AssertionError(f"weight shard {tuple(dmodule.weight.to_local().shape)}")
    same("distribute_module Linear", dmodule(x.to("tpu")).detach(), want, rtol=1e-5, atol=1e-5)


def fsdp(rank: int, n: int, done: list[str], out_path: str, checkpoint: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("tpu", (n,))
    model = transformer().to("tpu")
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    param: Any = next(model.parameters())
    if not isinstance(param, DTensor) or param.to_local().device.type != "tpu":
        raise AssertionError(f"fully_shard left a {type(param).__name__} on {param.device}")
    losses = train(model, rank, n, "tpu")
    named: list[tuple[str, Any]] = list(model.named_parameters())  # DTensors
    params = {name: p.full_tensor().detach().cpu().numpy() for name, p in named}
    if rank == 0:
        np.savez(f"{out_path}.fsdp.npz", losses=np.array(losses), **params)
    no_gloo(dist.group.WORLD)  # before the checkpoint, which exchanges its plans (Python objects) on the CPU
    done.append("fsdp trained")
    save(get_model_state_dict(model), checkpoint_id=checkpoint)
    dist.barrier()
    done.append("dcp saved")


def load(rank: int, n: int, done: list[str], checkpoint: str, ref: str) -> None:
    import torch
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as load_checkpoint
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("tpu", (n,))
    model = transformer().to("tpu")
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = get_model_state_dict(model)
    load_checkpoint(state, checkpoint_id=checkpoint)
    set_model_state_dict(model, state)
    saved = np.load(ref)
    named: list[tuple[str, Any]] = list(model.named_parameters())  # DTensors
    for name, p in named:
        if p.to_local().device.type != "tpu":
            raise AssertionError(f"{name} loaded onto {p.to_local().device}")
        torch.testing.assert_close(p.full_tensor().cpu(), torch.from_numpy(saved[name]), rtol=0, atol=0, msg=name)
    done.append("dcp loaded")
    # The loaded model trains on: one more step through the new sharding.
    x, y = next(batches())
    local = GLOBAL_BATCH // n
    loss = torch.nn.functional.mse_loss(
        model(x[rank * local : (rank + 1) * local].to("tpu")), y[rank * local : (rank + 1) * local].to("tpu")
    )
    loss.backward()
    done.append("dcp loaded trains")


def main(checks: str, out_path: str, *args: str) -> None:
    import torch.distributed as dist

    import tpurec  # noqa: F401 (registers the "tpu" backend)
    from tpurec.distributed.backend import TpuBackend

    dist.init_process_group("tpu", timeout=datetime.timedelta(seconds=60))
    rank, n = dist.get_rank(), dist.get_world_size()
    world = dist.group.WORLD
    assert isinstance(world, TpuBackend)
    done: list[str] = []
    if checks == "functional":
        functional(rank, n, done)
        compiled(rank, n, done)
    elif checks == "dtensor":
        dtensor(rank, n, done)
    elif checks == "fsdp":
        fsdp(rank, n, done, out_path, args[0])
    elif checks == "load":
        load(rank, n, done, args[0], args[1])
    else:
        raise SystemExit(f"unknown checks {checks!r}")
    if checks in ("functional", "dtensor"):
        no_gloo(world)
    dist.barrier()
    dist.destroy_process_group()
    with open(f"{out_path}.{rank}", "w") as f:
        f.write("\n".join(done) + "\n")


if __name__ == "__main__":
    # A hung collective ends this rank with every thread's stack instead of stalling the test.
    faulthandler.dump_traceback_later(float(os.environ.get("TPUREC_TEST_HANG_SECONDS", "150")), exit=True)
    main(*sys.argv[1:])
