"""Several processes on JAX's own distributed runtime: 2 processes x 4 CPU devices
(gloo collectives over loopback) give the same block as 1 process x 8 devices."""

import socket
import subprocess

import numpy as np
import pytest
from subproc import ROOT, probe_command, probe_env, run_probe


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_processes(out, strategy: str) -> None:
    port = str(free_port())
    procs = [
        subprocess.Popen(
            probe_command("multiprocess", str(out), strategy, str(i), "2", port),
            env=probe_env(4),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-4000:]


@pytest.mark.parametrize("strategy", ["megablox", "subgroup_capacity"])
def test_two_processes_match_one(tmp_path, strategy):
    one, two = tmp_path / "one.npz", tmp_path / "two.npz"
    assert run_probe("multiprocess", 8, str(one), strategy)["processes"] == 1
    two_processes(two, strategy)
    a, b = np.load(one), np.load(two)
    assert sorted(a.files) == sorted(b.files) and "dwi_0_EMH" in a.files
    for key in a.files:
        scale = max(float(np.max(np.abs(a[key]))), 1e-30)
        err = float(np.max(np.abs(a[key] - b[key]))) / scale
        assert err <= 1e-6, f"{key}: {err:.3g}"
