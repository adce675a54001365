"""Run a probe module in a fresh Python with its own number of simulated CPU devices
(the test session itself is fixed at 8 before jax starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# XLA flags of every jax process the tests start (set by conftest for the session).
# XLA:CPU may approximate transcendental functions by the CPU it runs on ("platform
# dependent math"). jax 0.12.0.1 does on an AMD EPYC with AVX-512: the skewed-routing
# parity tests (test_expert_parallel) were 1.2e-5 of scale off the float32 reference,
# 3.5e-7 with it off, and jax 0.10.2 5e-7 either way. The parity tests check this
# project's arithmetic, not the compiler's approximations, so they run without them.
# LLVM's optimisation of the CPU code XLA emits is off (level 0): the tests check what
# programs compute and what the compilers make of them (HLO, buffer assignment, memory
# analysis), which XLA's own passes decide before LLVM runs, and no test compares
# times. Most of the suite's time is XLA:CPU compiling, which level 0 makes shorter
# than it makes the runs longer. A block compiled for v5p, H100 and CPU gave the same
# HLO text and memory analysis at level 0 as at the default (2026-12-07, jax 0.10.2).
TEST_XLA_FLAGS = "--xla_cpu_enable_platform_dependent_math=false --xla_backend_optimization_level=0"


def probe_env(devices: int) -> dict:
    """Environment for a fresh process with `devices` simulated CPU devices."""
    return {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {TEST_XLA_FLAGS}",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }


def probe_command(module: str, *args: str) -> list[str]:
    return [sys.executable, str(ROOT / "tests" / "probes" / f"{module}.py"), *args]


def run_probe(module: str, devices: int, *args: str, timeout: int = 600) -> dict:
    """`python tests/probes/<module>.py args` with `devices` CPU devices; its JSON."""
    out = subprocess.run(
        probe_command(module, *args),
        capture_output=True,
        text=True,
        env=probe_env(devices),
        cwd=ROOT,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
