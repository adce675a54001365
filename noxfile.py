"""Task runner: the test suite on both supported stacks, and the docs.

    nox -s tests-3.11      # the machine's Python 3.11, ".[test,tpu,gpu,docs]" as pinned by pip
    nox -s tests-3.12      # Python 3.12, jax 0.12.0.1 + MaxText 0.2.5 (runs its RoutedMoE too)
    nox -s docs            # mkdocs build --strict
    nox -s mutate          # mutation testing (tools/mutate.py, mutmut), not in CI

Arguments after `--` replace the pytest arguments, e.g.
`nox -s tests-3.12 -- -x tests/layers/test_maxtext_routedmoe.py tests/layers/test_layers_parity.py`.

nox looks for `python3.11` / `python3.12` on PATH. Under pyenv both shims resolve only
when both versions are active: `PYENV_VERSION=3.11.7:3.12.1 nox -s tests-3.12` (or list
them in `pyenv global`/`pyenv local`; `.ci/run` does this). `-r` reuses the virtualenv
under .nox/ instead of reinstalling it.
"""

from __future__ import annotations

import nox

nox.options.sessions = ["tests-3.11", "tests-3.12", "docs"]  # `mutate` only when named
nox.options.default_venv_backend = "venv"

# The README's test command (8 simulated CPU devices are set by tests/conftest.py).
PYTEST = ("-q", "-n", "2", "--dist", "worksteal")

# The jax 0.12 stack, pinned first so the project's lower bounds keep it; MaxText 0.2.5
# and what it imports come with the project's `maxtext` extra.
JAX_012 = ("jax[tpu]==0.12.0.1", "jax[cuda12-local]==0.12.0.1", "flax==0.12.12")


@nox.session(name="tests-3.11", python="3.11")
def tests_311(session: nox.Session) -> None:
    """The README's install and test command on Python 3.11."""
    session.install(".[test,tpu,gpu,docs]")
    session.run("python", "-m", "pytest", *(session.posargs or PYTEST))


@nox.session(name="tests-3.12", python="3.12")
def tests_312(session: nox.Session) -> None:
    """The suite on jax 0.12.0.1 / flax 0.12.12 with MaxText 0.2.5 importable."""
    session.install(*JAX_012)
    # The project with its test, docs and maxtext extras; pip keeps the jax 0.12 stack
    # above (it satisfies pyproject's lower bounds).
    session.install(".[test,docs,maxtext]")
    session.run("python", "-c", "import maxtext.layers.moe, jax; print('jax', jax.__version__)")
    session.run("python", "-m", "pytest", *(session.posargs or PYTEST))


@nox.session(python="3.11")
def docs(session: nox.Session) -> None:
    """The docs site, with every warning an error."""
    session.install(".[docs]")
    session.run("mkdocs", "build", "--strict", "--site-dir", session.create_tmp() + "/site")


@nox.session(python="3.11")
def mutate(session: nox.Session) -> None:
    """Mutation testing (tools/mutate.py): the selector's cost, memory, placement and
    policy modules, and the layers' exchange and grouped matmul, each part against its
    own tests. Arguments after `--` go to tools.mutate, e.g.
    `nox -s mutate -- layers --sample 10`; without them, the selector part in full."""
    session.install(".[test,mutation]")
    session.run("python", "-m", "tools.mutate", *(session.posargs or ["selector"]))
