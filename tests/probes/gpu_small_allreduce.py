"""Does XLA:GPU compile a small all-reduce over a two-axis device group? A standing check
of the installed compiler, for the abort found on jax 0.12.0.1 (jax-cuda12-plugin
0.12.0.1): an LLVM fatal error in XLA:GPU's Triton all-reduce kernel ("size mismatch
when packing elements for LLVM struct") for a scalar pmax or psum over two mesh axes of
64 H200s (16 x 4 or 8 x 8), where 16, 32 and 128 devices over two axes, and one axis of
64, compile. jax 0.10.2 compiles every case.

    python tests/probes/gpu_small_allreduce.py     # every case, one process each

This project's exchanged block agreed on its round count with a scalar pmax, so on that
stack its step for 64 H200s at cp 2 and 4 did not compile. It now takes the max over
ROUND_COUNT_LANES copies of the count (layers/expert_parallel.py), which each case here
compiles too.
"""

from __future__ import annotations

import subprocess
import sys

# (devices, mesh shape, the axes reduced over)
CASES = (
    (16, (4, 4), ("fsdp", "context")),
    (32, (8, 4), ("fsdp", "context")),
    (64, (16, 4), ("fsdp",)),
    (64, (16, 4), ("fsdp", "context")),
    (64, (8, 8), ("fsdp", "context")),
    (128, (32, 4), ("fsdp", "context")),
)


def compile_case(chips: int, shape: tuple[int, int], axes: tuple[str, ...], lanes: int) -> None:
    """Compile one pmax of `lanes` int32 (1: a scalar) over `axes` for `chips` abstract
    H200s (this process)."""
    from checks.jax_start import prepare_process
    from checks.targets import devices
    from selector.targets import Target

    prepare_process("gpu", chips)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    target = Target("h200", chips)
    mesh = jax.sharding.Mesh(np.array(devices(target)).reshape(shape), ("fsdp", "context"))
    spec = P(("fsdp", "context"))

    def body(counts):
        local = jnp.max(counts)
        most = jax.lax.pmax(jnp.full((lanes,), local) if lanes > 1 else local, axes)
        return jnp.zeros_like(counts) + (most[0] if lanes > 1 else most)

    fn = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)
    arg = jax.ShapeDtypeStruct((4 * chips,), jnp.int32, sharding=NamedSharding(mesh, spec))
    jax.jit(fn).lower(arg).compile(target.compile_options())


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--case":
        chips, context, lanes = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[5])
        compile_case(chips, (chips // context, context), tuple(sys.argv[4].split(",")), lanes)
        print("compiled")
        return
    from layers.expert_parallel import ROUND_COUNT_LANES

    for chips, (_, context), axes in CASES:
        over = " x ".join(
            f"{a}={n}"
            for a, n in zip(("fsdp", "context"), (chips // context, context), strict=True)
            if a in axes
        )
        for lanes in (1, ROUND_COUNT_LANES):
            cmd = [sys.executable, __file__, "--case", str(chips)]
            cmd += [str(context), ",".join(axes), str(lanes)]
            got = subprocess.run(cmd, capture_output=True, text=True)
            ok = got.returncode == 0 and "compiled" in got.stdout
            last = (got.stderr.strip().splitlines() or [""])[-1]
            said = "compiles" if ok else f"fails: {last[:160]}"
            what = "a scalar" if lanes == 1 else f"{lanes} int32 (the exchange's round count)"
            print(f"{chips} H200s, pmax of {what} over {over}: {said}", flush=True)


if __name__ == "__main__":
    main()
