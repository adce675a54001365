"""The benchmarks a user runs still agree with what they stored: each `--check`
recomputes one cheap point and compares it with its bench/results JSON, so a change of
the count (or, on the stack the JSON was written with, of the compiled program) that
leaves a stored result stale fails here."""

from __future__ import annotations

import subprocess
import sys

import pytest
from subproc import ROOT, probe_env


@pytest.mark.parametrize("study", ["memory", "train_memory"])
def test_benchmark_check_agrees_with_its_stored_json(study):
    out = subprocess.run(
        [sys.executable, "-m", f"bench.{study}", "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=probe_env(8),
        timeout=600,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "agree with" in out.stdout


def test_a_stale_stored_number_fails_the_check(monkeypatch, capsys):
    """The comparison bites: a counted column that moved, or a row not stored, is named."""
    from bench import common

    stored = {"machine": {"jax": "none"}, "rows": [{"variant": "a", "cp": 2, "mib": 10.0}]}
    monkeypatch.setattr(common, "load", lambda study: stored)
    same = [{"variant": "a", "cp": 2, "mib": 10.0}]
    assert common.check_stored("x", same, ("variant", "cp"), ("mib",)) == 0
    moved = [{"variant": "a", "cp": 2, "mib": 10.5}]
    assert common.check_stored("x", moved, ("variant", "cp"), ("mib",)) == 1
    assert "mib of ['a', 2]: 10.5 now, 10 stored" in capsys.readouterr().out
    missing = [{"variant": "b", "cp": 2, "mib": 10.0}]
    assert common.check_stored("x", missing, ("variant", "cp"), ("mib",)) == 1
    # Compiled bytes are compared only on the stack the JSON was written with.
    assert common.check_stored("x", moved, ("variant", "cp"), (), ("mib",)) == 0


def test_the_readme_memory_table_is_read_from_memory_json():
    """The README's memory-against-cp table is the stored study's summary, as
    `bench.report` prints it: a re-run that moves a number makes the README stale here."""
    from bench.common import CP_RATIO_COLUMNS, load, table

    readme = (ROOT / "README.md").read_text()
    assert table(load("memory")["summary"], CP_RATIO_COLUMNS) in readme


@pytest.mark.parametrize(
    "study, page, columns",
    [
        ("memory", "docs/results/memory.md", "MEMORY_COLUMNS"),
        ("train_memory", "docs/results/train-memory.md", "TRAIN_COLUMNS"),
    ],
)
def test_a_results_page_quotes_its_stored_json(study, page, columns):
    """A study's page shows its rows as `bench.report` prints them from the JSON."""
    from bench import common

    rows = common.load(study)["rows"]
    assert common.table(rows, getattr(common, columns)) in (ROOT / page).read_text()
