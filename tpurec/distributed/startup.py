"""JAX's multi-controller start-up: join this process to the job (see :mod:`tpurec.distributed`)."""

from __future__ import annotations

import atexit
import errno
import os
import socket
from typing import Any
from collections.abc import Sequence

import jax

from tpurec import config
from tpurec.distributed import coordinator, peers

__all__ = [
    "CoordinatorPortInUse",
    "initialize",
    "is_initialized",
    "process_count",
    "process_index",
    "torchrun_settings",
]


class CoordinatorPortInUse(RuntimeError):
    """Another program listens on the port JAX's coordinator needs (process 0 checks before it starts)."""


def check_coordinator_port(address: str) -> None:
    """Raises :class:`CoordinatorPortInUse` when the coordinator could not listen on ``address``'s port.

    JAX's coordinator listens on every interface; a port that another program holds makes it
    crash (SIGSEGV) with no Python error, and the other processes wait out their start-up timeout.

    Args:
        address: the coordinator's ``host:port``.
    """
    port = int(address.rpartition(":")[2])
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this host
            continue
        with probe:
            # As the coordinator does: a port left in TIME_WAIT by an earlier run (an elastic restart) is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as error:
                if error.errno != errno.EADDRINUSE:
                    continue
                raise CoordinatorPortInUse(
                    f"port {port} for JAX's coordinator (process 0, {address}) is already in use by another program; "
                    "free it, or choose another one: torchrun --master-port (tpurec uses MASTER_PORT + 1) or "
                    "TPUREC_COORDINATOR_PORT"
                ) from None
            return


_initialized = False


def torchrun_settings(environ: dict[str, str] | None = None) -> dict[str, object] | None:
    """``jax.distributed.initialize`` arguments from torchrun's environment, or None outside torchrun.

    Args:
        environ: the environment (default ``os.environ``).

    Raises:
        ValueError: some of torchrun's variables are set but not all, or not numbers.
    """
    env = os.environ if environ is None else environ
    names = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
    present = [n for n in names if n in env]
    if not present:
        return None
    missing = [n for n in names if n not in env]
    if missing:
        raise ValueError(f"torchrun environment incomplete: {present} are set but {missing} are not")
    # From the environment given (the variable is a tpurec flag, parsed as tpurec.config does).
    port = (
        config.get("TPUREC_COORDINATOR_PORT")
        if environ is None
        else config.parse("TPUREC_COORDINATOR_PORT", env.get("TPUREC_COORDINATOR_PORT"))
    )
    try:
        port = port or int(env["MASTER_PORT"]) + 1
        world, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
    except ValueError as error:
        raise ValueError(f"torchrun environment: MASTER_PORT, WORLD_SIZE and RANK must be integers ({error})") from None
    if not 0 <= rank < world:
        raise ValueError(f"torchrun environment: RANK={rank} is outside [0, WORLD_SIZE={world})")
    return {"coordinator_address": f"{env['MASTER_ADDR']}:{port}", "num_processes": world, "process_id": rank}


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: int | Sequence[int] | None = None,
    *,
    initialization_timeout: int = 300,
) -> None:
    """Joins this process to the job (call once, before any tpu tensor is made).

    Args:
        coordinator_address: ``host:port`` of process 0's coordinator.
        num_processes: processes in the job.
        process_id: this process's rank in ``[0, num_processes)``.
        local_device_ids: the local devices this process uses (default all).
        initialization_timeout: seconds to wait for every process.

    With several processes, each then watches the others (:mod:`tpurec.distributed.peers`):
    a process that dies, is stopped, fails or finishes early ends every other process within
    ``TPUREC_PEER_TIMEOUT`` seconds with an error naming it and its step. Process 0 also when it
    is the one lost: it runs JAX's coordination service in a child process
    (:mod:`tpurec.distributed.coordinator`) that outlives it that long.

    Raises:
        ValueError: arguments are given only in part, or the environment is incomplete.
        RuntimeError: JAX's devices were already in use (initialize must come first).
        CoordinatorPortInUse: (process 0) another program listens on the coordinator's port.
    """
    global _initialized
    if _initialized:
        return
    given = {"coordinator_address": coordinator_address, "num_processes": num_processes, "process_id": process_id}
    if any(v is not None for v in given.values()):
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise ValueError(
                f"initialize: give all of coordinator_address, num_processes and process_id (missing {missing})"
            )
        settings: dict[str, object] | None = given
    else:
        settings = torchrun_settings()
        if settings is not None:
            # torchrun stops the workers of a failed attempt with SIGTERM (then restarts them with
            # --max-restarts); JAX's preemption notifier would catch it and keep the process running.
            jax.config.update("jax_enable_preemption_service", False)
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "tpurec.distributed.initialize() must run before the first tpu tensor or JAX computation "
            "(JAX's devices are already in use in this process)"
        )
    platforms = (os.environ.get("JAX_PLATFORMS") or getattr(jax.config, "jax_platforms", None) or "").lower()
    if "cpu" in platforms.split(","):
        # XLA:CPU collectives between processes need an implementation; gloo ships with jaxlib.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs: dict[str, Any] = dict(settings or {})
    if local_device_ids is not None:
        kwargs["local_device_ids"] = local_device_ids
    peer_timeout, step_timeout = config.get("TPUREC_PEER_TIMEOUT"), config.get("TPUREC_STEP_TIMEOUT")
    # JAX's own heartbeat limit stays above tpurec's, so that tpurec's message (naming the process) comes first.
    heartbeat_timeout = max(100, 3 * peer_timeout)
    service = None
    address = kwargs.get("coordinator_address")
    if kwargs.get("process_id") == 0 and address:
        coordinator.end_stale(str(address))
        check_coordinator_port(str(address))
    if kwargs.get("process_id") == 0 and address and int(kwargs.get("num_processes") or 1) > 1:
        # The coordination service runs in a child that outlives a lost process 0 (long enough for
        # the others to read its last heartbeat); JAX's in-process one binds an unused local port.
        service = coordinator.start(
            str(address), int(kwargs["num_processes"]), heartbeat_timeout, linger=peer_timeout + _LINGER_GRACE
        )
        kwargs["coordinator_bind_address"] = "127.0.0.1:0"
    # Without settings JAX detects the cluster (Cloud TPU metadata, SLURM, ...); process 0 then runs
    # the service itself, as JAX does.
    try:
        jax.distributed.initialize(
            initialization_timeout=initialization_timeout, heartbeat_timeout_seconds=heartbeat_timeout, **kwargs
        )
    except BaseException:
        if service is not None:
            service.release()
        raise
    _initialized = True
    if service is not None:
        # Registered before the peers' exit hook, so it runs after it (last in, first out), and only
        # when the job finished (a failure ends the process there): JAX's shutdown barrier, which
        # waits for every process's client, then the service.
        atexit.register(_shut_down, service)
    if jax.process_count() > 1:
        from jax._src import distributed as jax_distributed

        peers.start(
            jax_distributed.global_state.client, jax.process_index(), jax.process_count(), peer_timeout, step_timeout
        )


# Seconds the service outlives a lost process 0 beyond TPUREC_PEER_TIMEOUT: the others find it lost
# a few heartbeat intervals (at most 2 s each) after that, then post their own failure and end.
_LINGER_GRACE = 15


def _shut_down(service: coordinator.Coordinator) -> None:
    """Process 0's end of a finished job: JAX's shutdown (its barrier waits for every process), then the service."""
    try:
        jax.distributed.shutdown()
    finally:
        service.release()


def is_initialized() -> bool:
    """:func:`initialize` has run in this process."""
    return _initialized


def process_index() -> int:
    """This process's rank."""
    return jax.process_index()


def process_count() -> int:
    """Processes in the job."""
    return jax.process_count()
