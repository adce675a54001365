"""Every Python block in the README runs as written, each in a fresh process (as a new
user pastes it), and the README's MaxText command does what its sentences say."""

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


MAXTEXT_COMMAND = re.search(
    r"```bash\n(python -m selector maxtext_config=path/to/maxtext/configs/base.yml.*?)```",
    README,
    re.S,
).group(1)


def _run_shell(command: str, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        ["bash", "-c", command.replace("python ", f"{sys.executable} ", 1)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
    )


def test_maxtext_command_does_what_the_readme_says(maxtext_dir, tmp_path):
    """The README's MaxText command, with the path to MaxText 0.2.5's real base.yml: 'The
    reported case exits 1 with LOCAL_BATCH_INFLATION'; '-c job prints the config the
    route imports'."""
    command = MAXTEXT_COMMAND.replace(
        "path/to/maxtext/configs/base.yml", str(maxtext_dir / "configs" / "base.yml")
    )
    out = _run_shell(command, tmp_path)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "ERROR LOCAL_BATCH_INFLATION" in out.stdout and "Traceback" not in out.stderr
    job = _run_shell(command.strip() + " -c job", tmp_path)
    assert job.returncode == 0, job.stderr[-2000:]
    assert "num_experts: 512" in job.stdout and "ici_context_parallelism: 4" in job.stdout
