"""Rows the grouped-matmul kernels compute, counted from their own tile plans.

A grouped matmul does not compute exactly the routed rows: it walks each expert's rows
in tiles and a tile that a group only partly fills is computed whole. How much that
costs depends on the kernel's walk, so each kernel gets its own count, written to mirror
the kernel step by step (tests/selector/test_tiles.py checks each against the kernel's own plan):

- `pallas_rows`: JAX's Pallas megablox `gmm`/`tgmm`
  (`jax.experimental.pallas.ops.tpu.megablox.gmm.make_group_metadata`): a group visits
  every `tm`-row tile from the one holding its first row to the one holding its last,
  so a tile shared by two groups is computed once for each;
- `tiled_gmm_rows`: ours (`layers.grouped_matmul.tile_plan`): per expert, full tiles of
  the largest class, then each smaller class at most once, then one masked tail tile
  of the smallest class.

And the layouts the block hands them (`gathered_calls`, `exchanged_calls`): the group
sizes of each kernel call a device makes under uniform routing.

Pure Python: the selector imports neither jax nor the layers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .plan_sizes import pallas_kn_tile

# The Pallas kernel's row tile (layers/pallas_gmm.py ROW_TILE: the `tm` the block passes).
PALLAS_ROW_TILE = 128
# tiled_gmm's full-tile classes, largest first (layers/grouped_matmul.py TILE_ROWS).
TILED_GMM_TILE_ROWS = (512, 256, 128, 64)

Call = tuple[tuple[int, ...], int]  # (group sizes, rows of the array the kernel reads)


def uniform_group_sizes(rows: int, experts: int) -> tuple[int, ...]:
    """`rows` split over `experts` as evenly as integer counts allow (the first
    `rows % experts` experts take one more)."""
    if experts <= 0:
        return ()
    base, extra = divmod(max(int(rows), 0), experts)
    return tuple(base + (1 if e < extra else 0) for e in range(experts))


def pallas_tiles(group_sizes: Sequence[int], tm: int, *, visit_empty: bool = False) -> int:
    """m-tiles `make_group_metadata` schedules for `group_sizes` (its `num_tiles`).

    A non-empty group visits the tiles from floor(start / tm) to ceil(end / tm); an
    empty one visits none, or one with `visit_empty` (as `tgmm` asks, to zero its
    output; `tgmm` skips the dot there, so those visits compute nothing)."""
    tiles, start = 0, 0
    for size in group_sizes:
        end = start + size
        if size > 0:
            tiles += -(-end // tm) - start // tm
        elif visit_empty:
            tiles += 1
        start = end
    return tiles


def pallas_expected_tiles(group_sizes: Sequence[int], tm: int) -> float:
    """`pallas_tiles` on average over where each group starts within its first tile, as
    routed groups start (the sizes before each vary from step to step): a group of s
    rows starting at a uniform row of a tile visits 1 + (s - 1) / tm tiles. An even
    split instead puts every start at a few fixed rows (40-row groups in 32-row tiles
    start at 0, 8, 16, 24) and counts 10% under sampled routing there."""
    return sum(1 + (s - 1) / tm for s in group_sizes if s > 0)


def pallas_rows(group_sizes: Sequence[int], tm: int = PALLAS_ROW_TILE) -> int:
    """Rows the Pallas kernels compute: the tiles that do a dot, times `tm`. `gmm`
    (forward and input gradient) and `tgmm` (weight gradient) compute the same tiles:
    `tgmm`'s extra visits to empty groups skip the dot."""
    return pallas_tiles(group_sizes, tm) * tm


def tiled_gmm_classes(array_rows: int) -> tuple[int, ...]:
    """Tile classes tiled_gmm uses on an array of `array_rows` rows (a tile never
    exceeds the array; below the smallest class, one power of two under the rows)."""
    fits = tuple(t for t in TILED_GMM_TILE_ROWS if t <= array_rows)
    return fits or (1 << (max(array_rows, 1).bit_length() - 1),)


def tiled_gmm_rows(group_sizes: Sequence[int], array_rows: int) -> int:
    """Rows tiled_gmm computes over an array of `array_rows` rows: its tile plan's full
    tiles, plus one tail tile of the smallest class for each expert with rows left.
    Forward, input gradient and weight gradient walk the same plan."""
    return sum(t * n for t, n in tiled_gmm_visits(group_sizes, array_rows).tiles)


@dataclass(frozen=True)
class TiledVisits:
    """How tiled_gmm walks one call (`layers.grouped_matmul.tile_plan`): the tiles its
    row loops visit, and what its weight gradient's per-expert loop visits."""

    classes: tuple[int, ...]  # the tile classes of the array, largest first
    tiles: tuple[tuple[int, int], ...]  # (rows a tile, tiles of that size), tails included
    experts: int  # experts with rows: the weight gradient's loop trips
    big: int  # tiles of the largest class: its inner loop's trips
    small: int  # tiles of the smaller classes and tails: its branches taken


def tiled_gmm_visits(group_sizes: Sequence[int], array_rows: int) -> TiledVisits:
    """`TiledVisits` of a call over `group_sizes` on an array of `array_rows` rows (the
    same walk `tiled_gmm_rows` counts rows of)."""
    classes = tiled_gmm_classes(array_rows)
    counts = dict.fromkeys(classes, 0)
    tails = 0
    for size in group_sizes:
        used = 0
        for tile in classes:
            count = (size - used) // tile
            counts[tile] += count
            used += count * tile
        tails += size > used
    counts[classes[-1]] += tails
    tiles = tuple((t, n) for t, n in counts.items() if n)
    big = counts[classes[0]] - (tails if len(classes) == 1 else 0)
    visited = sum(n for _, n in tiles)
    return TiledVisits(
        classes=classes,
        tiles=tiles,
        experts=sum(1 for s in group_sizes if s > 0),
        big=big,
        small=visited - big,
    )


def kernel_rows(
    kernel: str, calls: Iterable[Call], tm: int = PALLAS_ROW_TILE, *, expected: bool = False
) -> float:
    """Rows `kernel` ("pallas_megablox" or "tiled_gmm") computes over `calls`; `tm`:
    the Pallas kernels' row tile (tiled_gmm walks its own classes); `expected`: the
    Pallas tiles on average over where groups start (`pallas_expected_tiles`)."""
    if kernel == "pallas_megablox" and expected:
        return sum(pallas_expected_tiles(sizes, tm) for sizes, _ in calls) * tm
    if kernel == "pallas_megablox":
        return sum(pallas_rows(sizes, tm) for sizes, _ in calls)
    if kernel == "tiled_gmm":
        return sum(tiled_gmm_rows(sizes, rows) for sizes, rows in calls)
    raise ValueError(f"no tile plan for kernel {kernel!r}")


def pallas_m_tiles(
    group_sizes: Sequence[int], tm: int, array_rows: int, *, visit_empty: bool = False
) -> int:
    """Distinct m tiles `make_group_metadata`'s schedule visits on an array of
    `array_rows` rows (padded to `tm`; its `m_tile_ids` run in order, each tile's visits
    together); an empty group's visit (`visit_empty`) lands on the tile holding its
    offset, or the array's last tile for an offset past it."""
    last = max(-(-array_rows // tm), 1) - 1
    spans = []  # [first, end) tile ranges, one a visited group: as many as groups, not rows
    start = 0
    for size in group_sizes:
        end = start + size
        if size > 0:
            spans.append((start // tm, -(-end // tm)))
        elif visit_empty:
            tile = min(start // tm, last)
            spans.append((tile, tile + 1))
        start = end
    distinct, covered = 0, 0  # tiles counted; every tile below `covered` is counted
    for first, stop in sorted(spans):
        distinct += max(stop - max(first, covered), 0)
        covered = max(covered, stop)
    return distinct


def _gmm_fetches(visits: int, m_tiles: int, groups: int, tiles_k: int, tiles_n: int):
    """(lhs, rhs, out) block transfers of `gmm`'s grid (n, visit, k), k innermost: a
    block moves whenever its index differs from the previous step's. With more than one
    k tile the (tm, tk) rows and the (tk, tn) weight move on every step; with one, the
    rows move when the m tile changes (and not across an n step when only one m tile is
    visited) and the weight when the group changes."""
    if tiles_k > 1:
        lhs = rhs = tiles_n * visits * tiles_k
    else:
        lhs = tiles_n * m_tiles - (tiles_n - 1) * (m_tiles == 1)
        rhs = tiles_n * groups
    return lhs, rhs, tiles_n * m_tiles


def _tgmm_fetches(m_tiles: int, groups: int, tiles_k: int, tiles_n: int):
    """(lhs, rhs, out) block transfers of `tgmm`'s grid (n, k, visit), visits innermost:
    the (tm, tk) rows and the (tm, tn) cotangent move with the m tile, and across an
    outer step only when their own outer index changes or more than one m tile is
    visited; the (tk, tn) gradient is written once per group and outer step."""
    outer = tiles_n * tiles_k
    one = m_tiles == 1
    lhs = outer * m_tiles - (tiles_n - 1) * (tiles_k == 1 and one)
    rhs = outer * m_tiles - tiles_n * (tiles_k - 1) * one
    return lhs, rhs, outer * groups


def pallas_hbm_bytes(
    calls: Sequence[Call],
    tm: int,
    matmuls: Sequence[tuple[int, int]],
    itemsize: int,
    train: bool,
    *,
    expected: bool = False,
) -> float:
    """HBM bytes the Pallas kernels' grids move over `calls`, for each (K, N) weight of
    `matmuls` (all in the compute dtype, `itemsize` bytes), at row tile `tm`: `gmm`
    forward; training adds the input gradient (`gmm` against the transposed weight: K and
    N swap roles) and `tgmm` (which also visits empty groups). Counted from the grids
    step by step, as Pallas's TPU pipeline moves a block only when its index changes
    (`_gmm_fetches`, `_tgmm_fetches`); K and N tiles are `pallas_kn_tile`'s, as the
    layers pass them. So the forward reads a visited expert's whole (K, N) weight for
    every m tile it visits whenever K spans more than one tile. `expected`: the visits
    on average over where groups start (`pallas_expected_tiles`)."""
    total = 0.0
    for sizes, rows in calls:
        visits = pallas_expected_tiles(sizes, tm) if expected else pallas_tiles(sizes, tm)
        m_tiles = pallas_m_tiles(sizes, tm, rows)
        groups = sum(1 for s in sizes if s > 0)
        for k, n in matmuls:
            tk, tn = pallas_kn_tile(k), pallas_kn_tile(n)
            tiles_k, tiles_n = -(-k // tk), -(-n // tn)
            lhs, rhs, out = _gmm_fetches(visits, m_tiles, groups, tiles_k, tiles_n)
            total += lhs * tm * tk + rhs * tk * tn + out * tm * tn
            if not train:
                continue
            lhs, rhs, out = _gmm_fetches(visits, m_tiles, groups, tiles_n, tiles_k)
            total += lhs * tm * tn + rhs * tn * tk + out * tm * tk
            m_all = pallas_m_tiles(sizes, tm, rows, visit_empty=True)
            lhs, rhs, out = _tgmm_fetches(m_all, len(sizes), tiles_k, tiles_n)
            total += lhs * tm * tk + rhs * tm * tn + out * tk * tn
    return total * itemsize


def gathered_calls(rows: int, experts: int) -> list[Call]:
    """The gathered block: one call over all of a device's routed rows, sorted by
    expert."""
    return [(uniform_group_sizes(rows, experts), int(rows))]


def exchanged_calls(rows: int, experts: int, group: int, buffer: int) -> list[Call]:
    """The exchanged block's calls, averaged over the devices of the expert group.

    Each device sends its rows for owner o (the run of its sorted rows on o's
    `experts // group` experts) in rounds of at most `buffer` rows, and the owner
    runs one call per (sender, round) slot of `buffer` rows, sorted by local expert,
    empty rows last. Under uniform routing every sender's slot to o is the same, so an
    owner's calls are `group` copies of its own slots; one copy of every owner's slots
    is then what a device computes on average. A slot lists only its non-empty groups:
    an empty group computes nothing in either kernel."""
    local = experts // group
    sizes = uniform_group_sizes(rows, experts)
    calls: list[Call] = []
    for owner in range(group):
        run = sizes[owner * local : (owner + 1) * local]
        calls += [(slot, int(buffer)) for slot in _slots(run, buffer)]
    return calls


def _slots(run: Sequence[int], buffer: int) -> list[tuple[int, ...]]:
    """The non-empty group sizes of each `buffer`-row window of a run sorted by group
    (windows [0, B), [B, 2B), ... up to the run's last row)."""
    slots: list[tuple[int, ...]] = []
    current: list[int] = []
    room = buffer
    for size in run:
        while size > 0:
            take = min(size, room)
            current.append(take)
            size -= take
            room -= take
            if room == 0:
                slots.append(tuple(current))
                current, room = [], buffer
    if current:
        slots.append(tuple(current))
    return slots


def routed_rows(tokens: float, k: int) -> int:
    """A device's routed rows as whole rows (tokens per device can be fractional when
    the batch does not split evenly)."""
    return int(math.floor(tokens * k + 0.5))
