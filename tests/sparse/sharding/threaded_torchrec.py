"""Runs TorchRec's own sharded modules on N ranks in this process: one thread per rank.

TorchRec's sharded modules need a process group of N ranks. torch's threaded process group
(``torch.testing._internal.distributed.multi_threaded_pg``, the one torch's own distributed tests
use) gives each thread its own rank; its collectives exchange tensors in memory. TorchRec's
input dist, sharded compute and output dist then run unchanged, on CPU, in a second or two,
with no subprocess. The threads share this process's torch random generator: build everything
random before :func:`run_ranks`, and give the ranks only deterministic work.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg, _uninstall_threaded_pg

__all__ = ["run_ranks"]


def run_ranks(world_size: int, rank_fn: Callable[[int], Any], timeout_s: float = 120.0) -> list[Any]:
    """Runs ``rank_fn(rank)`` for every rank in its own thread, with a threaded process group.

    Args:
        world_size: ranks (threads).
        rank_fn: the work of one rank; ``torch.distributed``'s default group is its rank's.
        timeout_s: how long to wait for the ranks.

    Returns:
        Each rank's return value, in rank order.

    Raises:
        RuntimeError: a rank raised (the first error is chained) or did not finish in time.
    """
    results: list[Any] = [None] * world_size
    errors: list[tuple[int, BaseException]] = []
    store = dist.HashStore()  # pyright: ignore[reportPrivateImportUsage] (torch's stubs)
    _install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # pyright: ignore[reportAttributeAccessIssue]

    def worker(rank: int) -> None:
        try:
            dist.init_process_group(backend="threaded", rank=rank, world_size=world_size, store=store)
            try:
                results[rank] = rank_fn(rank)
            finally:
                dist.destroy_process_group()
        except BaseException as error:  # noqa: BLE001 (reported below, with its rank)
            errors.append((rank, error))
            from torch.testing._internal.distributed.multi_threaded_pg import ProcessLocalGroup

            ProcessLocalGroup.exception_handle(error)  # wakes the ranks waiting in a collective

    threads = [threading.Thread(target=worker, args=(rank,), daemon=True) for rank in range(world_size)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout_s)
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)  # pyright: ignore[reportAttributeAccessIssue]
        _uninstall_threaded_pg()
    if errors:
        rank, error = errors[0]
        raise RuntimeError(f"rank {rank} of the threaded TorchRec run failed: {error!r}") from error
    late = [rank for rank, thread in enumerate(threads) if thread.is_alive()]
    if late:
        raise RuntimeError(f"ranks {late} of the threaded TorchRec run did not finish in {timeout_s} s")
    return results
