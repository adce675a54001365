"""Does XLA:GPU compile a small all-reduce over a two-axis device group? A standing check
of the installed compiler, for the abort found on jax 0.12.0.1 (jax-cuda12-plugin
0.12.0.1): an LLVM fatal error in XLA:GPU's Triton all-reduce kernel ("size mismatch
when packing elements for LLVM struct") for a scalar pmax or psum over (fsdp, context) of
64 H200s, where 16 and 32 devices, and one axis of 64, compile.

    python -m checks.gpu_small_allreduce            # every case, one process each

This project's exchanged block agrees on its round count with such a pmax, and sums its
routing statistics with such psums, so on that stack its step for 64 H200s at cp 2 and 4
does not compile (`bench.step_compile --target gpu`, docs/results/whole-step.md).
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
)


def compile_case(chips: int, shape: tuple[int, int], axes: tuple[str, ...]) -> None:
    """Compile one scalar pmax over `axes` for `chips` abstract H200s (this process)."""
    from checks.targets import devices
    from selector.targets import Target, prepare_process

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
        most = jax.lax.pmax(jnp.max(counts), axes)
        return jnp.zeros_like(counts) + most

    fn = jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)
    arg = jax.ShapeDtypeStruct((4 * chips,), jnp.int32, sharding=NamedSharding(mesh, spec))
    jax.jit(fn).lower(arg).compile(target.compile_options())


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--case":
        chips, rows = int(sys.argv[2]), int(sys.argv[2]) // 4
        compile_case(chips, (rows, 4), tuple(sys.argv[3].split(",")))
        print("compiled")
        return
    from bench.common import failure_line

    for chips, _, axes in CASES:
        cmd = [sys.executable, "-m", "checks.gpu_small_allreduce", "--case", str(chips)]
        got = subprocess.run([*cmd, ",".join(axes)], capture_output=True, text=True)
        ok = got.returncode == 0 and "compiled" in got.stdout
        said = "compiles" if ok else f"fails: {failure_line(got.stderr)[:160]}"
        print(f"{chips} H200s, pmax over {' x '.join(axes)}: {said}", flush=True)


if __name__ == "__main__":
    main()
