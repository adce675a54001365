"""Parameters created directly in their at-rest sharding.

The initialiser runs under jit with the at-rest shardings as its outputs, so XLA
partitions the random-number generation and no device ever holds more than its shard
(plus that shard's random bits): a DeepSeek-V3 MoE layer (45 GB in float32) can be
created on devices that hold a 64th of it. JAX's partitionable threefry makes the
values independent of the mesh, so the same seed gives the same weights on every mesh.

Each variable also carries its sharding as Flax metadata (`out_sharding`, `mesh`), so
`nnx.eval_shape` of a block gives abstract parameters with their shardings and
`nnx.get_partition_spec` reads the layout back.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

INIT = nnx.initializers.lecun_normal()


@functools.cache
def initialiser(shapes: tuple, dtype, shardings: tuple[NamedSharding, ...]):
    """One jitted program creating every parameter of a block, cached per layout
    (`.lower(keys).compile().memory_analysis()` shows what creation costs a device)."""

    # Drawn in float32 and cast: sampling directly in float8 gives NaN, and this way a
    # bfloat16 or float8 block holds the rounding of the float32 block of the same seed.
    def init(keys):
        return tuple(
            INIT(k, shape, jnp.float32).astype(dtype) for k, shape in zip(keys, shapes, strict=True)
        )

    return jax.jit(init, out_shardings=shardings)


def create_sharded(keys, shapes, dtype, shardings) -> tuple[jax.Array, ...]:
    """Arrays of `shapes` in `dtype`, initialised shard by shard in `shardings`."""
    return initialiser(tuple(map(tuple, shapes)), dtype, tuple(shardings))(tuple(keys))


def param(value, sharding: NamedSharding) -> nnx.Param:
    """A Param carrying its at-rest sharding as metadata (the value is already placed)."""
    return nnx.Param(value, out_sharding=sharding.spec, mesh=sharding.mesh)
