"""The wheel ships every Python package of the checkout.

A package missing from pyproject's explicit list imports fine from the checkout (the
tests put it on sys.path) and breaks only after `pip install .`, which is how CI found
`selector.rules` missing. This test reads the list and the tree, so it fails here first.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11; CI runs 3.11

ROOT = Path(__file__).resolve().parent.parent


def declared_packages() -> tuple[set[str], dict[str, str]]:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return set(setuptools["packages"]), setuptools["package-dir"]


def test_every_python_package_in_the_tree_is_declared():
    packages, package_dir = declared_packages()
    for top, source in package_dir.items():
        if top == "selector.conf":
            continue  # configs, checked below
        for init in (ROOT / source).rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            rel = init.parent.relative_to(ROOT / source).parts
            name = ".".join((top, *rel))
            assert name in packages, f"{name} is not in pyproject [tool.setuptools] packages"


def test_every_config_group_is_declared_with_its_yaml():
    packages, package_dir = declared_packages()
    conf = ROOT / package_dir["selector.conf"]
    for group in (p for p in conf.iterdir() if p.is_dir() and any(p.glob("*.yaml"))):
        assert f"selector.conf.{group.name}" in packages, f"config group {group.name} not shipped"


def test_package_data_files_are_declared():
    """Data the library reads at run time (the GPU target descriptions) is matched by a
    package-data pattern, so the wheel carries it."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = data["package-data"]
    for package, path in (("selector", "targets_data/gpu.json"),):
        assert (ROOT / package / path).is_file(), path
        assert any(Path(path).match(p) for p in patterns.get(package, [])), path


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel of a copy of this checkout (a build leaves build/ and egg-info behind),
    installed without its dependencies into a folder of its own: the test's python
    brings jax, flax and Hydra; the package's own files come only from the wheel."""
    tmp = tmp_path_factory.mktemp("wheel")
    skip = shutil.ignore_patterns(
        ".git", "__pycache__", "build", "*.egg-info", "results", "outputs", ".*cache"
    )
    shutil.copytree(ROOT, tmp / "src", ignore=skip)
    pip = [sys.executable, "-m", "pip", "--quiet", "--disable-pip-version-check"]
    built = subprocess.run(
        [*pip, "wheel", "--no-deps", "-w", str(tmp / "dist"), str(tmp / "src")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("moe_cp-*.whl")
    target = tmp / "site"
    got = subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert got.returncode == 0, got.stderr[-3000:]
    return target


def test_the_installed_example_trains_from_any_directory(installed, tmp_path):
    """`moe-train` and `python -m examples.train` after a (non-editable) install, run from
    a directory that is not the checkout: the example, its package and its config
    (selector/conf/train.yaml) all come from the wheel."""
    pytest.importorskip("optax", reason='needs the examples extra: pip install ".[examples]"')
    env = {**os.environ, "PYTHONPATH": str(installed)}
    where = subprocess.run(
        [sys.executable, "-c", "import examples.train as t, selector; print(t.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert where.returncode == 0, where.stderr[-2000:]
    assert Path(where.stdout.strip()).is_relative_to(installed)
    out_dir = tmp_path / "run"
    trained = subprocess.run(
        [
            str(installed / "bin" / "moe-train"),
            *("train.steps=2", "train.layers=1", "train.vocab=32", "max_target_length=128"),
            *("train.plot=false", f"hydra.run.dir={out_dir}"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "loss " in trained.stdout
    assert len(json.loads((out_dir / "run.json").read_text())["steps"]) == 2
    # The module route composes the same packaged config; a config the selector
    # rejects stops before jax starts, so this one is cheap.
    rejected = subprocess.run(
        [sys.executable, "-m", "examples.train", "ici_context_parallelism=4"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert rejected.returncode == 1, rejected.stderr[-3000:]
    assert "LOCAL_BATCH_INFLATION" in rejected.stdout and "nothing was compiled" in rejected.stderr
