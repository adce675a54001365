"""The walls between the packages, read from the import graph.

- `selector` imports neither jax, flax, `layers` nor `checks`, not even inside a
  function: validation runs anywhere, fast.
- `layers` takes from `selector` only the config's types, the findings and the sizes the
  plan prices (the plan itself as a type only, under TYPE_CHECKING), and never imports
  `checks`: importing every layer loads none of the selector's analysis (cost, rules,
  policy, plan), which a fresh interpreter shows.
- `checks` (compile and measure modes) may import both; the selector finds it by the
  `moe_cp.checks` entry points (`selector.plugins`). It never imports `bench`: the
  benchmarks sit above it and are not installed with the package.
- Compile support lives in `checks`, not in the jax-free core: no selector module sets
  up a jax process (XLA_FLAGS, JAX_PLATFORMS) or writes a compiler's target description;
  the CLI asks the `start` entry point to, before a mode starts jax.

Every module is parsed with `ast`, so an import inside a function counts, and so does
`importlib.import_module("...")` with a literal name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NEVER_IN_SELECTOR = {"jax", "jaxlib", "flax", "layers", "checks"}
# What the layers import from the selector: the config's enums and dataclasses, the
# findings they raise, and the sizes the plan prices that they allocate. The plan's own
# module only for type annotations (it imports the analysis).
PLAN_TYPES = {"selector.config", "selector.findings", "selector.plan_sizes"}
TYPE_ONLY = {"selector.plan"}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str, root: Path) -> bool:
    base = root.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imports_of(path: Path, root: Path, types: bool = False) -> set[str]:
    """Every module `path` imports, anywhere in it, as absolute dotted names
    (`from pkg import mod` names pkg.mod when mod is a module of the tree). Imports
    under `if TYPE_CHECKING:` are left out, or with types=True are all that is read."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    typed = [n for n in ast.walk(tree) if isinstance(n, ast.If) and _type_checking(n.test)]
    typed_nodes = {id(n) for block in typed for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if (id(node) in typed_nodes) != types:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            subs = [f"{source}.{a.name}" for a in node.names]
            found.update(s for s in subs if _is_module(s, root))
            if not all(_is_module(s, root) for s in subs):
                found.add(source)
        elif isinstance(node, ast.Call) and _dynamic_import(node):
            found.add(node.args[0].value)
    return found


def _type_checking(test: ast.expr) -> bool:
    return getattr(test, "id", getattr(test, "attr", None)) == "TYPE_CHECKING"


def _dynamic_import(node: ast.Call) -> bool:
    f = node.func
    named = (isinstance(f, ast.Attribute) and f.attr == "import_module") or (
        isinstance(f, ast.Name) and f.id in ("__import__", "import_module")
    )
    arg = node.args[0] if node.args else None
    return named and isinstance(arg, ast.Constant) and isinstance(arg.value, str)


def violations(root: Path) -> list[str]:
    """Each import that breaks a wall, as 'module imports name (why)'."""
    out = []
    for package in ("selector", "layers", "checks"):
        for path in sorted((root / package).rglob("*.py")):
            module = module_name(path, root)
            for imported in sorted(imports_of(path, root)):
                top = imported.split(".")[0]
                if package == "selector" and top in NEVER_IN_SELECTOR:
                    out.append(f"{module} imports {imported} (the selector stays jax-free)")
                if package == "layers" and top == "checks":
                    out.append(f"{module} imports {imported} (checks sit above the layers)")
                if package == "checks" and top == "bench":
                    out.append(f"{module} imports {imported} (the benchmarks sit above checks)")
                if package == "layers" and top == "selector":
                    if imported not in PLAN_TYPES:
                        out.append(f"{module} imports {imported} (layers take only plan types)")
            if package == "layers":
                for imported in sorted(imports_of(path, root, types=True)):
                    if (
                        imported.split(".")[0] == "selector"
                        and imported not in PLAN_TYPES | TYPE_ONLY
                    ):
                        out.append(f"{module} imports {imported} (layers take only plan types)")
    return out


def test_the_checkout_keeps_the_walls():
    assert violations(ROOT) == []


# What only a process about to start jax, or a compiler, reads: compile support.
JAX_SETUP = (
    "XLA_FLAGS",
    "JAX_PLATFORMS",
    "xla_force_host_platform_device_count",
    "GpuTargetConfig",
)


def jax_setup_in(root: Path) -> list[str]:
    """Each selector module that names what sets up jax or a compiler, as 'module names
    word'."""
    out = []
    for path in sorted((root / "selector").rglob("*.py")):
        text = path.read_text()
        out += [f"{module_name(path, root)} names {w}" for w in JAX_SETUP if w in text]
    return out


def test_compile_support_lives_outside_the_selector(tmp_path):
    """No selector module sets up jax or a compiler's target; a planted one is found."""
    assert jax_setup_in(ROOT) == []
    (tmp_path / "selector").mkdir()
    (tmp_path / "selector/start.py").write_text('import os\nos.environ["XLA_FLAGS"] = ""\n')
    assert jax_setup_in(tmp_path) == ["selector.start names XLA_FLAGS"]


def test_the_walls_are_read_from_every_kind_of_import(tmp_path):
    """The reader sees imports in functions, relative ones, `from pkg import module`,
    and import_module with a literal name; a clean module passes."""
    files = {
        "selector/__init__.py": "",
        "selector/plan.py": "",
        "selector/api.py": "",
        "selector/ok.py": "from .plan import x\nimport math\n",
        "selector/inner.py": "def f():\n    import jax.numpy as jnp\n",
        "selector/relative.py": "from ..layers import moe\n",
        "selector/dynamic.py": "import importlib\nimportlib.import_module('checks.compiled')\n",
        "layers/__init__.py": "",
        "layers/moe.py": "from selector import api\n",
        "layers/spec.py": "from selector import api, plan\n",
        "layers/router.py": "import selector\n",
        "layers/typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from selector.plan import DispatchPlan\n    from selector.cost import Estimate\n",
        "layers/runtime.py": "from selector.plan import DispatchPlan\n",
        "checks/__init__.py": "",
        "checks/ok.py": "from layers import moe\nfrom selector import api\n",
        "checks/study.py": "def main():\n    from bench.common import save\n",
        "bench/__init__.py": "",
        "bench/common.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = violations(tmp_path)
    assert found == [
        "selector.dynamic imports checks.compiled (the selector stays jax-free)",
        "selector.inner imports jax.numpy (the selector stays jax-free)",
        "selector.relative imports layers.moe (the selector stays jax-free)",
        "layers.moe imports selector.api (layers take only plan types)",
        "layers.router imports selector (layers take only plan types)",
        "layers.runtime imports selector.plan (layers take only plan types)",
        "layers.spec imports selector.api (layers take only plan types)",
        "layers.spec imports selector.plan (layers take only plan types)",
        "layers.typed imports selector.cost (layers take only plan types)",
        "checks.study imports bench.common (the benchmarks sit above checks)",
    ]


# What importing every layer may load of the selector (its package runs the Hydra edge
# on import; compose imports only config and findings).
LAYERS_LOAD = {
    "selector",
    "selector.compose",
    "selector.config",
    "selector.findings",
    "selector.plan_sizes",
}


def test_importing_the_layers_loads_none_of_the_analysis():
    """In a fresh interpreter, importing every module of `layers` loads only the
    selector's config, findings and plan sizes: not its cost, rules, policy or plan."""
    import json
    import subprocess
    import sys

    from subproc import probe_env

    code = (
        "import importlib, json, pkgutil, sys, layers\n"
        "for m in pkgutil.iter_modules(layers.__path__):\n"
        "    importlib.import_module('layers.' + m.name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'selector')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=probe_env(1), cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert set(json.loads(out.stdout.strip().splitlines()[-1])) == LAYERS_LOAD


def test_pyproject_registers_each_check_and_the_selector_finds_it():
    """The entry points name callables that exist, and `selector.plugins` loads the
    same ones (from this checkout's metadata or the installed package's)."""
    tomllib = pytest.importorskip("tomllib")
    from selector.plugins import GROUP, check_mode

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["entry-points"][GROUP]
    assert set(declared) == {"compile", "measure", "maxtext_compile", "start"}
    for name, target in declared.items():
        module, _, attr = target.partition(":")
        loaded = check_mode(name)
        assert (loaded.__module__, loaded.__name__) == (module, attr)


def test_a_missing_plugin_is_named_with_the_install_to_run(monkeypatch):
    import selector
    from selector import plugins

    monkeypatch.setattr(plugins.metadata, "distributions", lambda: [])
    config = selector.to_config(selector.compose(["model=tiny", "mesh=cpu_8", "compile=true"]))
    with pytest.raises(plugins.ChecksUnavailable, match=r"moe_cp\.checks:compile.*pip install"):
        selector.compile_check(config)


# The selector's edges: the targets it names, the live mesh check, MaxText's own keys,
# and the table itself. Everywhere else a compiler's or a jax release's behaviour is
# read from `selector.traits`, not branched on.
PLATFORM_EDGES = {"selector.traits", "selector.targets", "selector.api"}


def platform_branches(path: Path, root: Path) -> list[str]:
    """Comparisons that test a platform or a jax release: `x.platform == "gpu"`,
    `platform != "tpu"`, `release >= (0, 12)`, `platform in (...)`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        for side in (node.left, *node.comparators):
            name = side.attr if isinstance(side, ast.Attribute) else getattr(side, "id", "")
            if name in {"platform", "release", "jax_version"}:
                out.append(f"{module_name(path, root)}:{node.lineno} compares {name}")
    return out


def core_platform_branches(root: Path) -> list[str]:
    found = []
    for path in sorted((root / "selector").rglob("*.py")):
        name = module_name(path, root)
        if name in PLATFORM_EDGES or name.startswith("selector.maxtext"):
            continue
        found += platform_branches(path, root)
    return found


def test_compiler_differences_are_read_from_the_traits_table():
    assert core_platform_branches(ROOT) == []


def test_a_platform_branch_in_the_core_is_caught(tmp_path):
    """The check above bites: a core module that branches on the platform is named."""
    (tmp_path / "selector").mkdir()
    (tmp_path / "selector" / "__init__.py").write_text("")
    (tmp_path / "selector" / "cost.py").write_text(
        "def f(cfg, release):\n"
        "    if cfg.hardware.platform == 'gpu':\n"
        "        return 1\n"
        "    return 2 if release >= (0, 12) else 3\n"
    )
    assert core_platform_branches(tmp_path) == [
        "selector.cost:2 compares platform",
        "selector.cost:4 compares release",
    ]
