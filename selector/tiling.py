"""The grouped matmul's row tile, chosen per candidate from the rows an expert gets.

A smaller row tile computes fewer padding rows (a group's last tile is computed whole,
and a tile two groups share once for each: `selector.tiles`), but the Pallas `gmm`
reads the visited expert's whole weight for every row tile it visits, so more, smaller
tiles read more weight bytes. Each tile the kernel supports (`pallas_row_tiles`) is
priced as the cost model prices time, compute plus HBM:

    time(tm) = 2 x rows(tm) x (M H + M H + H M) x passes / peak
               + pallas_hbm_bytes(tm) / HBM bandwidth

rows(tm) counted from `make_group_metadata`'s tiles at tm, on average over where each
group starts in its tile (`pallas_expected_tiles`: under routed traffic a group starts
anywhere), the bytes from the kernels' grids (`selector.tiles.pallas_hbm_bytes`), on
the same calls the candidate's rows are counted on (`gathered_calls`,
`exchanged_calls`), at the hardware's published peak and bandwidth, as the counted
time prices them (selector.timing; the chosen tile's bytes are the candidate's grouped
matmul bytes there). No per-grid-step overhead is priced: no figure is published.

tiled_gmm keeps its own classes (512, 256, 128, 64; a 64-row masked tail): on XLA:CPU,
where it runs, per-tile dots below 32 rows slow down (README, "Grouped matmul on CPU");
its visits are priced by the measured tiled_gmm curve (conf/hardware/cpu.yaml). ragged_dot is XLA's lowering, whose tiles we have not
read. Their tiling is reported, not chosen.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .plan_sizes import GmmTiling, pallas_row_tile_ok, pallas_row_tiles
from .tiles import (
    PALLAS_ROW_TILE,
    TILED_GMM_TILE_ROWS,
    exchanged_calls,
    gathered_calls,
    kernel_rows,
    pallas_hbm_bytes,
)

AUTO = 0  # gmm_row_tile: the selector chooses


@dataclass(frozen=True)
class TileOption:
    """One row tile, priced: the rows the kernels compute, their HBM bytes, and time."""

    tm: int
    rows: float
    flops: float
    hbm_bytes: float
    compute_s: float
    hbm_s: float

    @property
    def time_s(self) -> float:
        return self.compute_s + self.hbm_s


@dataclass(frozen=True)
class TileShape:
    """What the tiles are priced on: a device's routed rows and how the block lays them
    out (one gathered call, or exchange slots of `buffer` rows over `group` owners)."""

    routed: int
    experts: int
    group: int
    buffer: int
    emb: int
    hidden: int
    itemsize: int
    train: bool


@functools.lru_cache(maxsize=256)
def _calls(shape: TileShape):
    if shape.group > 1:
        return tuple(exchanged_calls(shape.routed, shape.experts, shape.group, shape.buffer))
    return tuple(gathered_calls(shape.routed, shape.experts))


@functools.lru_cache(maxsize=1024)
def price(shape: TileShape, tm: int, peak_flops: float, hbm_bytes_s: float) -> TileOption:
    """The Pallas kernels at row tile `tm` on `shape`, priced (see the module docstring)."""
    calls = _calls(shape)
    rows = kernel_rows("pallas_megablox", calls, tm, expected=True)
    m, h = shape.emb, shape.hidden
    matmuls = ((m, h), (m, h), (h, m))  # SwiGLU: wi_0, wi_1, wo
    passes = 3 if shape.train else 1
    flops = 2.0 * rows * sum(k * n for k, n in matmuls) * passes
    hbm = pallas_hbm_bytes(calls, tm, matmuls, shape.itemsize, shape.train, expected=True)
    return TileOption(tm, rows, flops, hbm, flops / peak_flops, hbm / hbm_bytes_s)


def choose(
    kernel: str, shape: TileShape, forced: int, peak_flops: float, hbm_bytes_s: float
) -> tuple[GmmTiling, tuple[TileOption, ...]]:
    """The candidate's tiling and, for the Pallas kernels, every tile priced.

    `forced` > 0 (gmm_row_tile, or MaxText's wi_tile_fwd_batch_seq) is taken as it is
    when the kernel supports it (rules.settings says when it does not); else the
    cheapest tile (the smaller on a tie)."""
    if kernel == "tiled_gmm":
        classes = "/".join(str(t) for t in TILED_GMM_TILE_ROWS)
        return GmmTiling(kernel, TILED_GMM_TILE_ROWS[-1], f"tiled_gmm's classes {classes}"), ()
    if kernel != "pallas_megablox":
        return GmmTiling(kernel, PALLAS_ROW_TILE, "XLA's lowering (tiles not read)"), ()
    tms = pallas_row_tiles(shape.itemsize)
    if forced > 0 and pallas_row_tile_ok(forced, shape.itemsize) and forced not in tms:
        tms = tuple(sorted((*tms, forced)))
    options = tuple(price(shape, tm, peak_flops, hbm_bytes_s) for tm in tms)
    if forced > 0 and pallas_row_tile_ok(forced, shape.itemsize):
        return GmmTiling(kernel, forced, "gmm_row_tile"), options
    best = min(options, key=lambda o: (o.time_s, o.tm))
    return GmmTiling(kernel, best.tm, "priced"), options
