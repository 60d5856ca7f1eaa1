"""JAX's multi-controller start-up: join this process to the job (see :mod:`tpurec.distributed`)."""

from __future__ import annotations

import os
from typing import Any
from collections.abc import Sequence

import jax

from tpurec import config

__all__ = ["initialize", "is_initialized", "process_count", "process_index", "torchrun_settings"]

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

    Raises:
        ValueError: arguments are given only in part, or the environment is incomplete.
        RuntimeError: JAX's devices were already in use (initialize must come first).
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
    # Without settings JAX detects the cluster (Cloud TPU metadata, SLURM, ...).
    jax.distributed.initialize(initialization_timeout=initialization_timeout, **kwargs)
    _initialized = True


def is_initialized() -> bool:
    """:func:`initialize` has run in this process."""
    return _initialized


def process_index() -> int:
    """This process's rank."""
    return jax.process_index()


def process_count() -> int:
    """Processes in the job."""
    return jax.process_count()
