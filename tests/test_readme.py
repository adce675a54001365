"""Every Python block in the README and in the documentation (docs/**/*.md) runs as
written, each in a fresh process (as a new user pastes it); the MaxText command does what
its sentences say; the README stays short and its links resolve; and the documentation
site builds with every warning an error."""

import os
import re
import subprocess
import sys

import pytest
from subproc import ROOT

PAGES = {
    path.relative_to(ROOT).as_posix(): path.read_text()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
}
README = PAGES["README.md"]
PYTHON_BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def _distinct(pattern: re.Pattern) -> dict[str, str]:
    """Each distinct block once, named by the first page (README first) it is on: a block
    the README copies from a guide runs once, and a copy that drifts runs on its own."""
    where = {}
    for page, text in PAGES.items():
        for index, code in enumerate(pattern.findall(text)):
            where.setdefault(code, f"{page}:{index}")
    return {name: code for code, name in where.items()}


BLOCKS = _distinct(PYTHON_BLOCK)


def test_the_readme_and_the_docs_have_python_blocks():
    assert PYTHON_BLOCK.search(README), "the README's training-script use has no Python block"
    assert len(BLOCKS) >= 3, sorted(BLOCKS)


@pytest.mark.parametrize("name", list(BLOCKS))
def test_python_block_runs_as_written(name, tmp_path):
    code = BLOCKS[name]
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


MAXTEXT_COMMAND = re.compile(
    r"```bash\n(python -m selector maxtext_config=path/to/maxtext/configs/base.yml.*?)```",
    re.S,
)
MAXTEXT_COMMANDS = _distinct(MAXTEXT_COMMAND)


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


def test_the_readme_shows_the_maxtext_command():
    assert MAXTEXT_COMMAND.search(README)


@pytest.mark.parametrize("name", list(MAXTEXT_COMMANDS))
def test_maxtext_command_does_what_the_readme_says(name, maxtext_dir, tmp_path):
    """The MaxText command, with the path to MaxText 0.2.5's real base.yml: 'The
    reported case exits 1 with LOCAL_BATCH_INFLATION'; '-c job prints the config the
    route imports'."""
    command = MAXTEXT_COMMANDS[name].replace(
        "path/to/maxtext/configs/base.yml", str(maxtext_dir / "configs" / "base.yml")
    )
    out = _run_shell(command, tmp_path)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "ERROR LOCAL_BATCH_INFLATION" in out.stdout and "Traceback" not in out.stderr
    job = _run_shell(command.strip() + " -c job", tmp_path)
    assert job.returncode == 0, job.stderr[-2000:]
    assert "num_experts: 512" in job.stdout and "ici_context_parallelism: 4" in job.stdout


def _github_anchor(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_the_readme_stays_short_and_its_links_resolve():
    """At most 250 lines (everything else lives in docs/); every #anchor names one of its
    headings and every relative link names a file of the repository."""
    assert len(README.splitlines()) <= 250
    prose = re.sub(r"```.*?```", "", README, flags=re.S)
    anchors = {_github_anchor(h) for h in re.findall(r"^#+ (.*)$", prose, re.M)}
    targets = re.findall(r"\]\(([^)\s]+)\)", prose)
    assert targets
    for target in targets:
        if target.startswith("#"):
            assert target[1:] in anchors, f"{target}: no such heading"
        elif "://" not in target:
            assert (ROOT / target.split("#")[0]).exists(), f"{target}: no such file"


def test_the_docs_site_builds_with_warnings_as_errors(tmp_path):
    """`mkdocs build --strict`: a broken link or anchor, a page left out of the nav, or a
    docstring mkdocstrings cannot read fails it; the API pages carry the docstrings."""
    pytest.importorskip("mkdocs", reason='needs the docs extra: pip install ".[docs]"')
    pytest.importorskip("mkdocstrings", reason='needs the docs extra: pip install ".[docs]"')
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    api = (site / "api" / "selector" / "index.html").read_text()
    assert "selector.api.resolve" in api and "DispatchPlan" in api
    assert "MoEBlock" in (site / "api" / "layers" / "index.html").read_text()
    assert (site / "img" / "memory.png").exists()
