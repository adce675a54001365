"""MoE dispatch selector: inspects a mesh, a sequence length and a model, picks the MoE
dispatch that keeps the sequence sharded, and validates settings before launch.

Importing this package never imports jax, and no module of it imports jax or the layers:
compiling and timing (`compile=true`, `measure=true`, `compile_check`, `measure_check`)
run in the `checks` package, found by entry point (`selector.plugins`).
"""

import importlib
import importlib.util

# Eager: the config types, the findings and the Hydra edge (which imports nothing else
# of the selector; imported here first so that `selector.compose` stays the function,
# not the module of the same name).
from .compose import compose, conf_dir, to_config
from .config import (
    MESH_AXES,
    AxisRules,
    CapacityRounding,
    Config,
    ContextStrategy,
    Dispatch,
    Exchange,
    ExpertGroup,
    Hardware,
    Mode,
    ScoreFunc,
)
from .findings import ConfigError, Finding, Fix, Severity

# The analysis and what it returns, imported on first use (PEP 562): the layers take
# the config types and a plan object, and so never load the cost, rules or policy.
_WHERE = {
    **dict.fromkeys(
        ["compile_check", "measure_check", "register_resolvers", "resolve", "search", "validate"],
        "api",
    ),
    **dict.fromkeys(["CompileCheck", "CompiledCandidate"], "checked"),
    **dict.fromkeys(["Layout", "SearchResult"], "layout_search"),
    **dict.fromkeys(["MaxTextError", "MaxTextImport", "from_maxtext"], "maxtext"),
    "WeightPlacement": "placement",
    **dict.fromkeys(["Candidate", "DispatchPlan"], "plan"),
}


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    elif importlib.util.find_spec(f"{__name__}.{name}") is not None:  # selector.api, ...
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'selector' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])


__all__ = [
    "MESH_AXES",
    "AxisRules",
    "CapacityRounding",
    "Candidate",
    "CompileCheck",
    "CompiledCandidate",
    "Config",
    "ConfigError",
    "ContextStrategy",
    "Dispatch",
    "DispatchPlan",
    "Exchange",
    "ExpertGroup",
    "Finding",
    "Fix",
    "Hardware",
    "Layout",
    "MaxTextError",
    "MaxTextImport",
    "Mode",
    "ScoreFunc",
    "SearchResult",
    "Severity",
    "WeightPlacement",
    "compile_check",
    "measure_check",
    "compose",
    "conf_dir",
    "from_maxtext",
    "register_resolvers",
    "resolve",
    "search",
    "to_config",
    "validate",
]
