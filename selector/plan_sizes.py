"""Sizes the plan prices and the layers build, one formula each.

The cost model counts the shared experts' width and the exchange's round buffers; the
layers allocate them. Both read these functions, so the estimate and the program cannot
drift apart. They live apart from `selector.problem` (the cost model's view, which
needs the config, mesh and placement) because `layers` may import only the plan's
types: this module is part of that surface, and imports nothing.
"""

from __future__ import annotations

import math

ROUND_ALIGN = 8  # exchange buffers hold a multiple of 8 rows per owner


def shared_width(shared_experts: int, hidden: float, gated: bool) -> float:
    """The shared experts' hidden width, as MaxText 0.2.5 builds them (read in its
    source): RoutedAndSharedMoE (DeepSeek) one MlpBlock of shared_experts x the expert
    width; Qwen3-Next's gated shared expert one MlpBlock of the expert width, whatever
    shared_experts > 0 says (models/qwen3.py: intermediate_dim=cfg.moe_mlp_dim)."""
    if shared_experts <= 0:
        return 0
    return hidden if gated else shared_experts * hidden


def exchange_buffer_rows(rows: float, group: int, buffer_factor: float) -> int:
    """B: rows a device may send each owner per round, `buffer_factor` x the even share
    of its `rows`, rounded up to a multiple of ROUND_ALIGN. The one formula: the layers
    size their buffers with it and the cost model prices them with it."""
    share = buffer_factor * rows / group
    return max(ROUND_ALIGN, ROUND_ALIGN * math.ceil(share / ROUND_ALIGN - 1e-9))
