"""Probe run in a fresh process with 64 simulated CPU devices: build the
qwen3_next_80b_a3b preset's MoE block abstractly and compile its sharded init.

Prints one JSON object: the abstract parameters' shardings, the init program's
per-device output and temp bytes, and the full and at-rest sizes of each parameter.
"""

import json
import math

import jax
from flax import nnx

import layers
import selector
from layers.params import initialiser

MESH = {"fsdp": 8, "context": 4, "expert": 2}


def main() -> None:
    assert jax.device_count() == 64, jax.device_count()
    mesh = layers.make_mesh(MESH)
    cfg = selector.compose(
        [
            "model=qwen3_next_80b_a3b",
            "mesh=h200_8",
            "per_device_batch_size=0.25",
            "max_target_length=8192",
        ]
    )
    block = nnx.eval_shape(
        lambda: layers.MoEBlock(selector.resolve(cfg, mesh), mesh=mesh, rngs=nnx.Rngs(0))
    )
    names, shapes, shardings = block.param_layout()
    program = initialiser(tuple(shapes), block.param_dtype, tuple(shardings))
    keys = tuple(jax.random.key(i) for i in range(len(shapes)))
    memory = program.lower(keys).compile().memory_analysis()
    params = {}
    weights = block.weights()
    for name, shape, sharding in zip(names, shapes, shardings, strict=True):
        abstract = getattr(weights, name)
        itemsize = block.param_dtype.itemsize
        params[name] = {
            "abstract_type": type(abstract).__name__,
            "abstract_spec": str(abstract.sharding.spec),
            "layout_spec": str(sharding.spec),
            "full_bytes": math.prod(shape) * itemsize,
            "shard_bytes": math.prod(sharding.shard_shape(shape)) * itemsize,
        }
    print(
        json.dumps(
            {
                "devices": jax.device_count(),
                "output_bytes": memory.output_size_in_bytes,
                "temp_bytes": memory.temp_size_in_bytes,
                "params": params,
            }
        )
    )


if __name__ == "__main__":
    main()
