"""MoE dispatch selector: inspects a mesh, a sequence length and a model, picks the MoE
dispatch that keeps the sequence sharded, and validates settings before launch.

Importing this package never imports jax, and no module of it imports jax or the layers:
compiling and timing (`compile=true`, `measure=true`, `compile_check`, `measure_check`)
run in the `checks` package, found by entry point (`selector.plugins`).
"""

from .api import compile_check, measure_check, register_resolvers, resolve, search, validate
from .checked import CompileCheck, CompiledCandidate
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
from .layout_search import Layout, SearchResult
from .maxtext import MaxTextError, MaxTextImport, from_maxtext
from .placement import WeightPlacement
from .plan import Candidate, DispatchPlan

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
