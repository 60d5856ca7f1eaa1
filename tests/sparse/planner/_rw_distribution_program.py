"""A row-wise (MOD) embedding step as tpurec.shard distributes it, on 8 CPU devices; prints its HLO.

Run as a script (the device count must be set before JAX starts):
ids travel to their owning shard with one all_to_all (id, sample, gain packed
as int32), partial sums return with psum_scatter, and the backward's
transpose (all_gather) comes from jax.grad.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

WORLD, LOCAL_BATCH, POOLING, DIM, ROWS_PER_SHARD = 8, 16, 4, 16, 100
CAP = LOCAL_BATCH * POOLING // WORLD  # ids per destination with uniform MOD ids


def local_step(shard: jax.Array, packed: jax.Array) -> jax.Array:
    # packed: [WORLD * CAP, 3] int32 (global id, global sample, gain bits), grouped by destination.
    recv = jax.lax.all_to_all(packed, "d", 0, 0, tiled=True)
    rows = shard[recv[:, 0] // WORLD] * jax.lax.bitcast_convert_type(recv[:, 2], jnp.float32)[:, None]
    partial = jnp.zeros((WORLD * LOCAL_BATCH, DIM), jnp.float32).at[recv[:, 1]].add(rows)
    pooled = jax.lax.psum_scatter(partial, "d", scatter_dimension=0, tiled=True)
    return jax.lax.psum(jnp.sum(pooled * pooled), "d")


def main() -> None:
    mesh = Mesh(jax.devices(), ("d",))
    step = jax.shard_map(local_step, mesh=mesh, in_specs=(P("d"), P("d")), out_specs=P())
    table = jnp.zeros((WORLD * ROWS_PER_SHARD, DIM), jnp.float32)
    packed = jnp.zeros((WORLD * WORLD * CAP, 3), jnp.int32)
    lowered = jax.jit(jax.grad(step)).lower(table, packed)
    sys.stdout.write(lowered.as_text(dialect="hlo"))


if __name__ == "__main__":
    main()
