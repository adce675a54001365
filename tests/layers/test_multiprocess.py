"""Several processes on JAX's own distributed runtime: 2 processes x 4 CPU devices
(gloo collectives over loopback) give the same block as 1 process x 8 devices."""

import json
import socket
import subprocess

import numpy as np
from subproc import ROOT, probe_command, probe_env, run_probe


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_processes(out, strategies: str) -> list[dict]:
    port = str(free_port())
    procs = [
        subprocess.Popen(
            probe_command("multiprocess", str(out), strategies, str(i), "2", port),
            env=probe_env(4),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    reports = []
    for p in procs:
        stdout, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-4000:]
        reports.append(json.loads(stdout.strip().splitlines()[-1]))
    return reports


STRATEGIES = ("megablox", "subgroup_capacity", "megablox_exchanged")


def test_two_processes_match_one(tmp_path):
    """Gathered weights (megablox, subgroup_capacity), and expert parallelism whose row
    exchange crosses the process boundary (every context group spans both processes).
    One start of each process runs every strategy."""
    one, two = tmp_path / "one", tmp_path / "two"
    assert run_probe("multiprocess", 8, str(one), ",".join(STRATEGIES))["processes"] == 1
    reports = two_processes(two, ",".join(STRATEGIES))
    assert all(r["processes"] == 2 and r["devices"] == 8 for r in reports)
    assert all(r["processes_per_context_group"]["megablox_exchanged"] == [2] for r in reports)
    errors = {}
    for strategy in STRATEGIES:
        a = np.load(f"{one}.{strategy}.npz")
        b = np.load(f"{two}.{strategy}.npz")
        assert sorted(a.files) == sorted(b.files) and "dwi_0_EMH" in a.files, strategy
        for key in a.files:
            scale = max(float(np.max(np.abs(a[key]))), 1e-30)
            errors[f"{strategy} {key}"] = float(np.max(np.abs(a[key] - b[key]))) / scale
    worst = {k: e for k, e in errors.items() if e > 1e-6}
    assert not worst, worst
