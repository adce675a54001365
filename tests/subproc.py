"""Run a probe module in a fresh Python with its own number of simulated CPU devices
(the test session itself is fixed at 8 before jax starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def probe_env(devices: int) -> dict:
    """Environment for a fresh process with `devices` simulated CPU devices."""
    return {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
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
