"""Sizes the plan prices and the layers build, one formula each.

The cost model counts the shared experts' width and the exchange's round buffers; the
layers allocate them. Both read these functions, so the estimate and the program cannot
drift apart. They live apart from `selector.problem` (the cost model's view, which
needs the config, mesh and placement) because `layers` may import only the plan's
types: this module is part of that surface, and imports nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


# The Pallas megablox kernels' row tiles the selector considers: a multiple of the
# sublane tile (8 rows of a 32-bit dtype; 16-bit dtypes pack two rows a sublane, so 16),
# doubling up to MaxText 0.2.5's default (`wi_tile_fwd_batch_seq: 512`, base.yml).
PALLAS_MAX_ROW_TILE = 512


def pallas_sublane_rows(itemsize: int) -> int:
    """The smallest row tile of the Pallas kernels for a dtype of `itemsize` bytes: a
    block's second-to-last dim must fill whole (8 x 32-bit) sublanes."""
    return 8 * 4 // max(1, min(int(itemsize), 4))


def pallas_row_tiles(itemsize: int) -> tuple[int, ...]:
    """Row tiles the selector prices for the Pallas kernels, smallest first."""
    tiles, tm = [], pallas_sublane_rows(itemsize)
    while tm <= PALLAS_MAX_ROW_TILE:
        tiles.append(tm)
        tm *= 2
    return tuple(tiles)


def pallas_row_tile_ok(tm: int, itemsize: int) -> bool:
    """Whether the Pallas kernels take `tm` rows a tile in a dtype of `itemsize` bytes."""
    return tm > 0 and tm % pallas_sublane_rows(itemsize) == 0


def pallas_kn_tile(dim: int) -> int:
    """The Pallas kernels' tile of a contraction or output dim (layers/pallas_gmm.py
    passes it; the selector prices it): 128 lanes when it divides, else the whole dim."""
    return 128 if dim % 128 == 0 else dim


@dataclass(frozen=True)
class GmmTiling:
    """The grouped matmul's row tile, as the plan chose it for one candidate.

    `kernel` is the backend; `tm` the rows a tile (the Pallas kernels' `tm`; tiled_gmm's
    smallest class, its masked tail); `source` says where it came from: priced (the
    cheapest of the tiles the kernel supports), gmm_row_tile, or MaxText's
    wi_tile_fwd_batch_seq."""

    kernel: str
    tm: int
    source: str
