"""MoE dispatch selector: inspects a mesh, a sequence length and a model, picks the MoE
dispatch that keeps the sequence sharded, and validates settings before launch.

Importing this package never imports jax.
"""

from .api import register_resolvers, resolve, validate
from .compose import compose, conf_dir, to_config
from .config import MESH_AXES, AxisRules, Config, Dispatch, Hardware, Mode
from .findings import ConfigError, Finding, Severity
from .maxtext import MaxTextError, MaxTextImport, from_maxtext
from .plan import Candidate, DispatchPlan

__all__ = [
    "MESH_AXES",
    "AxisRules",
    "Candidate",
    "Config",
    "ConfigError",
    "Dispatch",
    "DispatchPlan",
    "Finding",
    "Hardware",
    "MaxTextError",
    "MaxTextImport",
    "Mode",
    "Severity",
    "compose",
    "conf_dir",
    "from_maxtext",
    "register_resolvers",
    "resolve",
    "to_config",
    "validate",
]
