"""Validation rules: one small function per rule, each returning its findings with the
fixes it proposes (the plan keeps only those that pass the next check).

Three stages, because later ones need what earlier ones guarantee: settings (plain
values), layout (mesh and per-device numbers), strategy (the choice).
"""

from .layout import LAYOUT_RULES
from .model import MODEL_LAYOUT_RULES, MODEL_RULES
from .settings import SETTINGS_RULES
from .strategy import (
    capacity_costly,
    capacity_settings,
    capacity_too_small,
    decode_gathers_weights,
    exchange_settings,
    memory_fits,
    poisson_drop_fraction,
)

__all__ = [
    "LAYOUT_RULES",
    "MODEL_LAYOUT_RULES",
    "MODEL_RULES",
    "SETTINGS_RULES",
    "capacity_costly",
    "capacity_settings",
    "capacity_too_small",
    "decode_gathers_weights",
    "exchange_settings",
    "memory_fits",
    "poisson_drop_fraction",
]
