"""Rows the grouped-matmul kernels compute, counted from their own tile plans.

A grouped matmul does not compute exactly the routed rows: it walks each expert's rows
in tiles and a tile that a group only partly fills is computed whole. How much that
costs depends on the kernel's walk, so each kernel gets its own count, written to mirror
the kernel step by step (tests/test_tiles.py checks each against the kernel's own plan):

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
    classes = tiled_gmm_classes(array_rows)
    computed = 0
    for size in group_sizes:
        used = 0
        for tile in classes:
            count = (size - used) // tile
            used += count * tile
        computed += used + (classes[-1] if size > used else 0)
    return computed


def kernel_rows(kernel: str, calls: Iterable[Call]) -> int:
    """Rows `kernel` ("pallas_megablox" or "tiled_gmm") computes over `calls`."""
    if kernel == "pallas_megablox":
        return sum(pallas_rows(sizes) for sizes, _ in calls)
    if kernel == "tiled_gmm":
        return sum(tiled_gmm_rows(sizes, rows) for sizes, rows in calls)
    raise ValueError(f"no tile plan for kernel {kernel!r}")


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
