"""The checks that need a compiler, found as a plugin.

Compile mode and measure mode build and run the layers, so they live in the `checks`
package, above both the selector and the layers. The selector never imports it: it
loads them by the entry points pyproject.toml declares in the `moe_cp.checks` group
(`compile`, `measure`, `maxtext_compile`, and `start`, which sets the process up
before a mode starts jax), so `pip install moe-cp` (or `pip install -e .` in a
checkout) is what makes them available.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import metadata

from .targets import TargetUnavailable

GROUP = "moe_cp.checks"


class ChecksUnavailable(TargetUnavailable):
    """No installed distribution registers the check asked for."""


def check_mode(name: str) -> Callable:
    """The function registered as `name` in the `moe_cp.checks` group: a mode's check
    ("compile", "measure": check(config, live_shape=None, *, progress=None, ...) ->
    (plan, findings, result); "maxtext_compile"), or "start" (start(config), the set-up
    before a mode starts jax)."""
    # Every distribution is read, not metadata.entry_points()'s one per name: a stale
    # moe_cp.egg-info in a checkout on sys.path would otherwise hide the installed one.
    found = [
        ep
        for dist in metadata.distributions()
        for ep in dist.entry_points
        if ep.group == GROUP and ep.name == name
    ]
    if not found:
        raise ChecksUnavailable(
            f"{name}=true needs the checks package, registered by the entry point "
            f"{GROUP}:{name}, and no installed distribution registers it. Install the "
            'project (pip install "moe-cp", or pip install -e . in a checkout) and run again.'
        )
    return found[0].load()
