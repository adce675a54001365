"""The wheel ships every Python package of the checkout.

A package missing from pyproject's explicit list imports fine from the checkout (the
tests put it on sys.path) and breaks only after `pip install .`, which is how CI found
`selector.rules` missing. This test reads the list and the tree, so it fails here first.
"""

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
    """Data the library reads at run time (the GPU target descriptions, the memory
    calibration) is matched by a package-data pattern, so the wheel carries it."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = data["package-data"]
    for package, path in (
        ("selector", "targets_data/gpu.json"),
        ("selector", "memory_calibration.json"),
    ):
        assert (ROOT / package / path).is_file(), path
        assert any(Path(path).match(p) for p in patterns.get(package, [])), path
