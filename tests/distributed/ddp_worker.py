"""One rank of the DDP checks (run by test_ddp.py under torchrun): DDP's options on a ``"tpu"`` group.

``python ddp_worker.py OUT MODES SCENARIOS`` trains each scenario of :data:`SCENARIOS` for
:data:`STEPS` steps in each tpurec execution mode of ``MODES`` (comma-separated), with a
``DistributedDataParallel`` model on tpu built through DDP's public API; every rank trains on its
slice of each global batch. Rank 0 writes ``OUT.<scenario>.<mode>.npz`` (the global loss of each
step, the parameters after training, how often the communication hook ran, DDP's bucket count
on tpu and on the CPU over gloo); each rank writes ``OUT.<rank>`` (the checks it passed). The
test compares each file with :func:`reference`, the same scenario in one process on the CPU
over the whole batch.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import functools
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

GLOBAL_BATCH = 8
STEPS = 10
# Micro-batches per optimizer step in the no_sync scenario (all but the last under no_sync()).
MICRO_BATCHES = 3


class Branchy(torch.nn.Module):
    """A trunk and a head, and an ``extra`` head used only when the caller asks (an unused branch)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Linear(4, 8)
        self.head = torch.nn.Linear(8, 1)
        self.extra = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = self.trunk(x).tanh()
        y = self.head(h)
        return y + self.extra(h) if use_extra else y


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "branchy":
        return Branchy()
    # Three layers: six parameters, so a tiny bucket cap makes several buckets.
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
    )


def uses_extra(step: int, rank: int) -> bool:
    """Whether rank ``rank``'s slice takes the extra branch at ``step``.

    Some steps one rank uses it and the other does not (locally unused, globally used), and every
    fifth step no rank uses it (globally unused: its gradient stays None, SGD skips it).
    """
    return step % 5 != 4 and (step + rank) % 3 != 0


@dataclass(frozen=True)
class Scenario:
    """One DDP configuration: the model, DDP's keyword arguments and how the loop trains it."""

    model: str = "mlp"
    ddp: dict[str, Any] = field(default_factory=dict)
    hook: str | None = None
    micro_batches: int = 1
    optimizer: str = "sgd"
    # The batch stays on the CPU: DDP moves it to device_ids[0].
    inputs_on_cpu: bool = False


SCENARIOS: dict[str, Scenario] = {
    "device_ids_none": Scenario(ddp={"device_ids": None}),
    "device_ids": Scenario(ddp={"device_ids": [0]}, inputs_on_cpu=True),
    "no_sync": Scenario(micro_batches=MICRO_BATCHES),
    "find_unused": Scenario(model="branchy", ddp={"find_unused_parameters": True}),
    "static_graph": Scenario(ddp={"static_graph": True}),
    # About 10 bytes: every parameter past DDP's first bucket gets its own bucket.
    "small_buckets": Scenario(ddp={"bucket_cap_mb": 1e-5}),
    "bucket_view": Scenario(ddp={"gradient_as_bucket_view": True, "bucket_cap_mb": 1e-5}),
    "allreduce_hook": Scenario(hook="allreduce", ddp={"bucket_cap_mb": 1e-5}),
    "fp16_hook": Scenario(hook="fp16"),
    "adam_steplr": Scenario(optimizer="adam"),
}


def _batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS * MICRO_BATCHES):
        yield torch.randn(GLOBAL_BATCH, 4, generator=gen), torch.randn(GLOBAL_BATCH, 1, generator=gen)


def _optimizer(scenario: Scenario, params: Any) -> tuple[torch.optim.Optimizer, Any]:
    if scenario.optimizer == "adam":
        optimizer = torch.optim.Adam(params, lr=0.01)
        return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9), None


def _fp16_compressed_mean(model: torch.nn.Module, per_slice: list[list[torch.Tensor]]) -> None:
    """What DDP's fp16_compress_hook makes of each slice's gradients: sum_r fp16(g_r / n), as float32."""
    n = len(per_slice)
    for i, p in enumerate(model.parameters()):
        total = (per_slice[0][i] / n).half()
        for grads in per_slice[1:]:
            total = total + (grads[i] / n).half()  # a float16 sum, rounded once per addition
        p.grad = total.float()


def train(
    scenario: Scenario,
    model: torch.nn.Module,
    slices: list[int],
    ranks: int,
    device: str,
    no_sync: Callable[[], Any] = contextlib.nullcontext,
) -> list[torch.Tensor]:
    """STEPS optimizer steps on the rows of ``slices`` (of ``ranks`` equal slices) of each global batch.

    Args:
        scenario: what to train.
        model: the model (a DDP module on the ranks, the plain model for the reference).
        slices: which slices of each global batch this process trains on (its rank; every slice
            for the one-process reference).
        ranks: how many slices a global batch has.
        device: where the batch goes.
        no_sync: DDP's ``no_sync`` for all but the last micro-batch of a step.

    Returns:
        The loss of each step over the rows of ``slices`` (the last micro-batch's), on ``device``.
    """
    optimizer, scheduler = _optimizer(scenario, model.parameters())
    local = GLOBAL_BATCH // ranks
    batches = _batches()
    # The one-process reference of the fp16 hook: each slice's gradients apart, then compressed.
    separate = scenario.hook == "fp16" and len(slices) > 1
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        for micro in range(scenario.micro_batches):
            x, y = next(batches)
            batch_device = "cpu" if scenario.inputs_on_cpu else device
            preds = []
            for r in slices:
                xs = x[r * local : (r + 1) * local].to(batch_device)
                preds.append(model(xs, uses_extra(step, r)) if scenario.model == "branchy" else model(xs))
            target = [y[r * local : (r + 1) * local].to(device) for r in slices]
            if separate:
                per_slice = []
                for pred, t in zip(preds, target):
                    model.zero_grad()
                    torch.nn.functional.mse_loss(pred, t).backward()
                    per_slice.append([p.grad.clone() for p in model.parameters()])  # pyright: ignore[reportOptionalMemberAccess]
                _fp16_compressed_mean(model, per_slice)
            loss = torch.nn.functional.mse_loss(torch.cat(preds), torch.cat(target))
            if not separate:
                with contextlib.nullcontext() if micro == scenario.micro_batches - 1 else no_sync():
                    loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.detach())  # pyright: ignore[reportPossiblyUnboundVariable] (micro_batches >= 1)
    return losses


def reference(name: str, ranks: int = 2) -> tuple[list[float], list[np.ndarray]]:
    """Scenario ``name`` in one process on the CPU over every slice: the losses and final parameters."""
    scenario = SCENARIOS[name]
    model = _model(scenario.model)
    losses = train(scenario, model, list(range(ranks)), ranks, "cpu")
    return [float(v) for v in losses], [p.detach().numpy() for p in model.parameters()]


def _hook(name: str, calls: list[int]) -> Callable[..., Any]:
    """DDP's own hook ``name``, counting its calls."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hook = {"allreduce": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook}[name]

    # wraps: DDP checks the hook's signature (its annotations), which it finds through __wrapped__.
    @functools.wraps(hook)
    def counted(state: Any, bucket: Any) -> Any:
        calls.append(bucket.index())
        return hook(state, bucket)

    return counted


_gloo_group: Any = None


def _gloo() -> Any:
    """A gloo group of every rank, for the checks on CPU copies."""
    global _gloo_group
    if _gloo_group is None:
        _gloo_group = dist.new_group(backend="gloo")
    return _gloo_group


def _buckets(ddp: torch.nn.parallel.DistributedDataParallel) -> int:
    return len(ddp.reducer._get_zeros_like_grad_buckets())


def cpu_gloo_buckets(scenario: Scenario) -> int:
    """How many buckets DDP makes for the scenario's model on the CPU over gloo (after its rebuild)."""
    model = _model(scenario.model)
    kwargs = {k: v for k, v in scenario.ddp.items() if k != "device_ids"}
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=_gloo(), **kwargs)
    for step in range(2):  # DDP rebuilds its buckets in the order of the first backward
        x = torch.ones(2, 4)
        out = ddp(x, uses_extra(step, dist.get_rank())) if scenario.model == "branchy" else ddp(x)
        out.sum().backward()
    return _buckets(ddp)


def run(name: str, mode: str, out: str, done: list[str]) -> None:
    """Trains scenario ``name`` under DDP on tpu in tpurec's ``mode``; rank 0 saves the results."""
    import tpurec

    scenario = SCENARIOS[name]
    rank, n = dist.get_rank(), dist.get_world_size()
    with tpurec.mode(mode):
        model = _model(scenario.model).to("tpu")
        ddp = torch.nn.parallel.DistributedDataParallel(model, **scenario.ddp)
        calls: list[int] = []
        if scenario.hook is not None:
            ddp.register_comm_hook(None, _hook(scenario.hook, calls))
        losses = train(scenario, ddp, [rank], n, "tpu", ddp.no_sync)
        # Each rank's loss is the mean over its (equal) slice: their mean is the global loss.
        stacked = torch.stack(losses)
        dist.all_reduce(stacked, op=dist.ReduceOp.AVG)
        params = [p.detach().cpu() for p in model.parameters()]
    # Every rank holds the same parameters after each step (DDP's invariant).
    for i, p in enumerate(params):
        gathered = [torch.empty(p.shape) for _ in range(n)]
        dist.all_gather(gathered, p, group=_gloo())
        if not all(torch.equal(other, gathered[0]) for other in gathered):
            raise AssertionError(f"{name} {mode}: parameter {i} differs between ranks")
    if rank == 0:
        arrays: dict[str, np.ndarray] = {
            "losses": stacked.cpu().numpy(),
            "hook_calls": np.array(len(calls)),
            "buckets": np.array(_buckets(ddp)),
            "cpu_buckets": np.array(cpu_gloo_buckets(scenario)),
        }
        arrays.update({f"param{i}": p.numpy() for i, p in enumerate(params)})
        np.savez(f"{out}.{name}.{mode}.npz", **arrays)  # pyright: ignore[reportArgumentType] (numpy stubs: **arrays vs allow_pickle)
    else:
        cpu_gloo_buckets(scenario)  # every rank takes part in the CPU DDP's collectives
    done.append(f"{name} {mode}")


def check_no_sync_skips_the_all_reduce(mode: str, done: list[str]) -> None:
    """Under ``no_sync()`` each rank keeps its own gradients; the next backward outside it averages them."""
    import tpurec

    rank, n = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(n, 2, 4, generator=gen) for _ in range(2)]
    with tpurec.mode(mode):
        ddp = torch.nn.parallel.DistributedDataParallel(_model("mlp").to("tpu"))
        with ddp.no_sync():
            ddp(xs[0][rank].to("tpu")).sum().backward()
        local = [p.grad.cpu() for p in ddp.parameters()]  # pyright: ignore[reportOptionalMemberAccess]
        ddp(xs[1][rank].to("tpu")).sum().backward()
        synced = [p.grad.cpu() for p in ddp.parameters()]  # pyright: ignore[reportOptionalMemberAccess]
    # The reference on the CPU: this rank's gradient of the first input, then the mean over the
    # ranks of both inputs' gradients (DDP averages the accumulated gradients).
    model = _model("mlp")
    params = list(model.parameters())
    mine: list[torch.Tensor] = []
    mean = [torch.zeros_like(p) for p in params]
    for r in range(n):
        for batch in range(2):
            model.zero_grad()
            model(xs[batch][r]).sum().backward()
            grads = [p.grad.clone() for p in params]  # pyright: ignore[reportOptionalMemberAccess]
            if batch == 0 and r == rank:
                mine = grads
            for m, g in zip(mean, grads):
                m += g / n
    for i, (got, want) in enumerate(zip(local, mine)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"no_sync {mode}: local gradient {i}")
    for i, (got, want) in enumerate(zip(synced, mean)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"no_sync {mode}: synced gradient {i}")
    done.append(f"no_sync local gradients {mode}")


def main(out: str, modes: list[str], names: list[str]) -> None:
    import tpurec  # noqa: F401 (registers the "tpu" backend)

    dist.init_process_group("tpu", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    done: list[str] = []
    for mode in modes:
        check_no_sync_skips_the_all_reduce(mode, done)
        for name in names:
            run(name, mode, out, done)
    dist.barrier()
    dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as f:
        f.write("\n".join(done) + "\n")


if __name__ == "__main__":
    # A hung collective ends this rank with every thread's stack instead of stalling the test.
    faulthandler.dump_traceback_later(float(os.environ.get("TPUREC_TEST_HANG_SECONDS", "150")), exit=True)
    main(sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(","))
