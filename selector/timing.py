"""Time counted from what a candidate's program does on one device, priced by the
machine's constants. Nothing here is fitted to a candidate's timing.

A step is counted as `Work` (`count_work`), read off the layers' programs:

- dots: every matmul, by its size in FLOPs and the elements of the matrix it multiplies
  by (K x N; 0 where none is named): the grouped matmul's tiles as its tile plan
  visits them (`selector.tiles`), by tiled_gmm's pass (forward three dots a tile, two
  more in the exchange's backward, which recomputes the two input products; three
  input gradients and three weight gradients), the dense and capacity paths' einsums,
  the router and the shared experts;
- memory bytes: activations written and read back, and the expert weights read;
- gather bytes: rows moved by gathers and scatters (sorting the routed rows by expert,
  packing the exchange's round buffers, adding results back into the tokens);
- streamed bytes: a tiled_gmm call whose rows in and out and experts' matrices
  (`gmm_call_bytes`) do not fit in a device's cache streams each visit's tile rows and
  matrix (`gmm_visit_bytes`, per dot) from memory; a call that fits (an exchange's
  slots, mostly) runs at the gmm curve's rates alone, which are timed on calls that fit;
- activation copies: the dense path's (tokens, E, H) and (tokens, E, M) activations a
  compiler writes in another layout (`Traits.dense_activation_copies`), read and
  written once each, priced at the activation relayout and transpose rates;
- relayout and transpose bytes: the copies a compiler makes of a routed weight matrix
  gathered over the embed axes, to put it back in its layout (and of its gradient before
  the reduce-scatter), read and written once each way (`Traits.gather_relayouts`): the
  gate and up matrices' copy keeps the minor dim, the out matrix's changes it;
- collectives: how many the step issues (weight all-gathers and gradient
  reduce-scatters, the exchange's all-to-alls every round, the round count's pmax, the
  statistics' and hidden axes' sums) and the bytes each device moves over ICI and DCN;
- ops: the other ops the step issues, and loop trips: what XLA:CPU's compiled programs
  of the block issue outside their dots (`PROGRAM_OPS`, `TILE_OPS`, ...: read by hand
  in the compiled HLO of the entry computation and of each loop body, jax 0.10.2, tiny
  blocks; no test recounts them), per trip of each data-dependent loop (tiles,
  experts, exchange slots and rounds).

`price` turns work into four parts with the constants of `Hardware` (conf/hardware/):

    compute  = sum over dots of FLOPs / rate(dot size, matrix size)  (its kind's curve, or peak)
    memory   = memory bytes / HBM bandwidth + gather bytes / gather bandwidth
               + relayout bytes / relayout bandwidth + transpose bytes / transpose bandwidth
               + activation copies / their relayout and transpose bandwidths
               + streamed bytes (calls over the cache) / the streaming rate
    network  = collectives x latency + ICI bytes / ICI bandwidth + DCN bytes / DCN bandwidth
    overhead = call + ops x launch + loop trips x loop trip   (less tiled_gmm's
               loop-body ops and trips where a measured gmm curve holds them)

Where the machine has the in-place rates (`weight_gather_gbps`, `weight_scatter_gbps`:
measured on CPU), the routed weights gathered over the embed axes within a slice are
priced by them instead: their bytes received, less from the ICI bytes, and their
relayout and transpose copies not priced apart (the rates hold them).

The matmul curve is measured as the grouped matmul runs a tile (a dot in a loop, its
rows sliced and its product written in place), so a dot's own launch is in its rate.
The gmm curves time each of tiled_gmm's passes as a call adds it inside a loop of calls,
so a visit's loop-body ops are in their rates.

On CPU every constant is measured (`python -m bench.calibration.machine`); on TPU and GPU the
matmul peak and the bandwidths are the vendors' published figures, and the constants
nobody publishes (collective latency, launch and loop costs) are not counted (None in
those presets): `Hardware.uncounted` names them and the report
says so.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass

from .config import Dispatch, Exchange, Hardware
from .memory_model import routed_weight_elements
from .problem import Problem, buffer_rows
from .tiles import exchanged_calls, gathered_calls, routed_rows, tiled_gmm_visits

# Ops XLA:CPU's compiled block issues besides its dots, read in its HLO (ops of the entry
# computation, outside the loops; jax 0.10.2, tiny blocks on 8 devices).
PROGRAM_OPS = {
    ("megablox_gathered", True): 160,
    ("megablox_gathered", False): 120,
    ("megablox_exchanged", True): 55,
    ("megablox_exchanged", False): 36,
    ("dense", True): 71,
    ("dense", False): 37,
}
# Per trip of tiled_gmm's row-tile loop, with one or two weights, and per expert its
# weight gradient visits (plus per big tile, and per smaller tile or tail it takes).
TILE_OPS = {1: 8, 2: 11}
EXPERT_OPS = 14
BIG_TILE_OPS = 5
SMALL_TILE_OPS = 4
# Per round of the exchange and per slot (one sender's rows at their owner): forward,
# backward.
ROUND_OPS = (51, 75)
SLOT_OPS = (45, 74)
SORT_BYTES = 8  # a row's key and index, moved once per merge pass of the sort


@dataclass(frozen=True)
class Work:
    """What a candidate's program does on one device in one step, counted."""

    # (kind, FLOPs a dot, dots of that size, elements of the matrix it multiplies by: K x N,
    # 0 where not named)
    dots: tuple[tuple[str, float, float, float], ...]
    memory_bytes: float
    gather_bytes: float
    collectives: float
    ici_bytes: float
    dcn_bytes: float
    ops: float  # ops issued besides the dots
    loop_trips: float
    relayout_bytes: float = 0.0  # copies of gathered weights that keep the minor dim
    transpose_bytes: float = 0.0  # copies that change it
    # The routed weights' bytes a device receives by gathers over the embed axes alone
    # (within a slice), and its gradient's by their reduce-scatters; part of ici_bytes.
    weight_gather_bytes: float = 0.0
    weight_scatter_bytes: float = 0.0
    # Activations a fused pass writes in another layout (read and written), keeping the
    # minor dim and changing it (`Traits.dense_activation_copies`).
    activation_relayout_bytes: float = 0.0
    activation_transpose_bytes: float = 0.0
    # Of ops and loop_trips, those of tiled_gmm's loop bodies, a visit's: a measured gmm
    # curve times a visit with them (bench.calibration.machine), so they are priced
    # apart only where the machine has none.
    tile_visit_ops: float = 0.0
    tile_visit_trips: float = 0.0
    # tiled_gmm's calls: (the bytes a call works over, `gmm_call_bytes`; the bytes its
    # visits' dots move over the step, `gmm_visit_bytes`), one entry per call size. A
    # call too big for a device's cache streams its visits' bytes from memory
    # (`streamed_bytes`); one that fits runs them at the gmm curve's rates alone.
    gmm_calls: tuple[tuple[float, float], ...] = ()

    def streamed_bytes(self, cache_bytes: float) -> float:
        """The bytes tile visits move in calls bigger than `cache_bytes` (0: none)."""
        if not cache_bytes:
            return 0.0
        return sum(moved for call, moved in self.gmm_calls if call > cache_bytes)

    @property
    def flops(self) -> float:
        return sum(f * n for _, f, n, _ in self.dots)

    @property
    def dot_count(self) -> float:
        return sum(n for _, _, n, _ in self.dots)


@dataclass(frozen=True)
class TimeParts:
    """Seconds a step takes on one device, by what prices them."""

    compute: float
    memory: float
    network: float
    overhead: float

    @property
    def total(self) -> float:
        return self.compute + self.memory + self.network + self.overhead

    def as_dict(self) -> dict:
        return {
            "compute": self.compute,
            "memory": self.memory,
            "network": self.network,
            "overhead": self.overhead,
        }


# Which measured curve prices a dot of each kind (selector.config.Hardware), and the
# curve a kind falls back on where the machine has none of its own.
CURVES = {
    "plain": "matmul_curve",
    "tile": "gmm_curve",
    "tile_input_grad": "gmm_input_grad_curve",
    "tile_weight_grad": "gmm_weight_grad_curve",
    "batched": "einsum_curve",
}
FALLBACK = {
    "tile_input_grad": "tile",
    "tile_weight_grad": "tile",
    "tile": "plain",
    "batched": "plain",
}


def _log_log(x: float, curve: list[tuple[float, float]]) -> float:
    """The curve's value at `x`: log-log between its points, flat past its ends."""
    curve = sorted(curve)
    sizes = [s for s, _ in curve]
    i = bisect_left(sizes, x)
    if i == 0:
        return curve[0][1]
    if i == len(curve):
        return curve[-1][1]
    (s0, r0), (s1, r1) = curve[i - 1], curve[i]
    w = (math.log(x) - math.log(s0)) / (math.log(s1) - math.log(s0))
    return math.exp(math.log(r0) + w * (math.log(r1) - math.log(r0)))


def matmul_rate(flops: float, hw: Hardware, kind: str = "plain", matrix: float = 0.0) -> float:
    """FLOP/s a device sustains on a dot of `flops` FLOPs of `kind` (plain; a tiled_gmm
    tile visit in its forward, input-gradient or weight-gradient pass; an einsum
    batched over experts) whose matrix has `matrix` elements (K x N; 0: not named).

    Its measured curve, else the curve of the kind it falls back on (`FALLBACK`), else
    the published peak. A curve's points are [MFLOPs a dot, TFLOP/s], or [MFLOPs a dot,
    TFLOP/s, K x N] where it was measured at several matrix sizes: a dot's rate depends
    on its matrix as well as its FLOPs (on XLA:CPU tiles by a 64 x 128 matrix run at
    about half the rate of tiles by a 192 x 384 one of the same FLOPs), so a dot with a
    named matrix reads each measured size's points at the dot's own rows, then between
    the sizes around its matrix; all log-log, flat past the ends. Otherwise every point
    is read along the FLOPs alone.

    >>> hw = Hardware(name="x", platform="cpu", memory_gib=1, matmul_tflops=1,
    ...               hbm_bandwidth_gbps=1, ici_bandwidth_gbps=1, dcn_bandwidth_gbps=1,
    ...               gmm_curve=[[1.0, 0.01, 100.0], [1.0, 0.04, 10000.0]])
    >>> round(matmul_rate(1e6, hw, "tile", 1000.0) / 1e9)  # halfway in log matrix size
    20
    """
    points = getattr(hw, CURVES[kind])
    while not points and kind in FALLBACK:
        kind = FALLBACK[kind]
        points = getattr(hw, CURVES[kind])
    if not points:
        return hw.matmul_tflops * 1e12
    if matrix and all(len(point) > 2 for point in points):
        by_matrix: dict[float, list[tuple[float, float]]] = {}
        for mflops, tflops, elements in points:
            by_matrix.setdefault(float(elements), []).append((mflops * 1e6, tflops * 1e12))
        # Each size read at the dot's rows (its FLOPs scaled to that matrix), then
        # between the sizes.
        at_rows = [(m, _log_log(flops * m / matrix, c)) for m, c in by_matrix.items()]
        return _log_log(matrix, at_rows)
    return _log_log(flops, [(float(m) * 1e6, float(t) * 1e12) for m, t, *_ in points])


def price(work: Work, hw: Hardware) -> TimeParts:
    """The four parts of `work`'s time under `hw`'s constants (the module docstring)."""
    compute = sum(n * f / matmul_rate(f, hw, kind, kn) for kind, f, n, kn in work.dots)
    hbm = hw.hbm_bandwidth_gbps
    ici, relayout, transpose = work.ici_bytes, work.relayout_bytes, work.transpose_bytes
    in_place = 0.0
    if hw.weight_gather_gbps and hw.weight_scatter_gbps and work.weight_gather_bytes:
        # Measured where the grouped matmul consumes them: the gathers, the copies
        # around them and the slicing, in one rate each way.
        in_place = work.weight_gather_bytes / (hw.weight_gather_gbps * 1e9)
        in_place += work.weight_scatter_bytes / (hw.weight_scatter_gbps * 1e9)
        ici -= work.weight_gather_bytes + work.weight_scatter_bytes
        relayout = transpose = 0.0
    memory = (
        work.memory_bytes / (hbm * 1e9)
        + work.gather_bytes / ((hw.gather_gbps or hbm) * 1e9)
        + relayout / ((hw.relayout_gbps or hbm) * 1e9)
        + transpose / ((hw.transpose_gbps or hbm) * 1e9)
        + work.activation_relayout_bytes
        / ((hw.activation_relayout_gbps or hw.relayout_gbps or hbm) * 1e9)
        + work.activation_transpose_bytes
        / ((hw.activation_transpose_gbps or hw.transpose_gbps or hbm) * 1e9)
    )
    network = (
        work.collectives * (hw.collective_latency_us or 0.0) * 1e-6
        + ici / (hw.ici_bandwidth_gbps * 1e9)
        + work.dcn_bytes / (hw.dcn_bandwidth_gbps * 1e9)
        + in_place
    )
    if hw.gmm_streamed_gbps:
        memory += work.streamed_bytes(hw.cache_mib * 2**20) / (hw.gmm_streamed_gbps * 1e9)
    launch, trip = hw.launch_us or 0.0, hw.loop_trip_us or 0.0
    ops, trips = work.ops, work.loop_trips
    if hw.gmm_curve:  # a visit's loop ops are in its measured time
        ops, trips = ops - work.tile_visit_ops, trips - work.tile_visit_trips
    overhead = (hw.call_us or 0.0) + ops * launch + trips * trip
    overhead *= 1e-6
    return TimeParts(compute, memory, network, overhead)


def gmm_call_bytes(rows: float, experts: int, k: float, n: float, itemsize: int) -> float:
    """The bytes one tiled_gmm call works over: its rows in (rows, k) and out
    (rows, n), and the (k, n) matrices of its experts that have rows."""
    return (rows * (k + n) + experts * k * n) * itemsize


def gmm_visit_bytes(tile: int, k: float, n: float, itemsize: int) -> float:
    """The bytes one dot of a tile visit moves: the tile's rows in and out, and its
    expert's (k, n) matrix."""
    return (tile * (k + n) + k * n) * itemsize


@dataclass(frozen=True)
class _Loops:
    """A grouped matmul's tile visits and the ops and loop trips its loops cost."""

    tiles: tuple[tuple[int, float], ...]  # (rows a tile, visits), one pass over the rows
    ops: float = 0.0
    trips: float = 0.0
    visit_ops: float = 0.0  # of ops and trips, the loop bodies' (Work.tile_visit_ops)
    visit_trips: float = 0.0
    calls: tuple[tuple[float, float], ...] = ()  # Work.gmm_calls


def _gmm_loops(kernel: str, calls, p: Problem, exchanged: bool) -> _Loops:
    """Tile visits of one pass of the grouped matmul over `calls`, and (tiled_gmm) the
    ops and trips of all its passes in the step: forward (a call with two weights, one
    with one), and training's input gradients (the same) and three weight gradients;
    the exchange's backward recomputes the two-weight forward first."""
    if kernel != "tiled_gmm":
        rows = sum(sum(sizes) for sizes, _ in calls)
        if kernel == "pallas_megablox":
            return _Loops(((p.tile, rows / p.tile),))
        return _Loops(((max(rows, 1), 1.0),))
    tiles: dict[int, float] = {}
    moved: dict[float, float] = {}  # a call's bytes: what its visits' dots move
    dots = sum(_dots_per_visit(p, exchanged).values())
    ops = visit_ops = visit_trips = 0.0
    for sizes, array_rows in calls:
        visits = tiled_gmm_visits(sizes, array_rows)
        size = gmm_call_bytes(array_rows, sum(s > 0 for s in sizes), p.M, p.H, p.xb)
        moved[size] = moved.get(size, 0.0) + dots * sum(
            n * gmm_visit_bytes(t, p.M, p.H, p.xb) for t, n in visits.tiles
        )
        loops = len(visits.classes) + 1
        row_trips = sum(n for _, n in visits.tiles)
        for t, n in visits.tiles:
            tiles[t] = tiles.get(t, 0.0) + n
        row_passes = [TILE_OPS[2], TILE_OPS[1]]  # forward: gate and up, then out
        grads = 0
        if p.train:
            row_passes += [TILE_OPS[1], TILE_OPS[2]]  # input gradients
            row_passes += [TILE_OPS[2]] if exchanged else []  # the recomputed forward
            grads = 3
        row_ops = sum(row_trips * (body + 1) for body in row_passes)
        expert = visits.experts * (EXPERT_OPS + 1) + visits.big * BIG_TILE_OPS
        expert += visits.small * SMALL_TILE_OPS
        visit_ops += row_ops + grads * expert
        visit_trips += row_trips * len(row_passes) + grads * (visits.experts + visits.big)
        ops += row_ops + 2 * loops * len(row_passes) + grads * (expert + 2)
    trips = visit_trips
    return _Loops(
        tuple(sorted(tiles.items())),
        ops,
        trips,
        visit_ops,
        visit_trips,
        tuple(sorted(moved.items())),
    )


def _dots_per_visit(p: Problem, exchanged: bool) -> dict[str, int]:
    """Dots a tile visit does over the step, by tiled_gmm's pass: 3 forward (gate, up
    and out); training adds 3 input gradients and 3 weight gradients, and the
    exchange's backward recomputes gate and up first (2 more forward)."""
    if not p.train:
        return {"tile": 3}
    return {"tile": 5 if exchanged else 3, "tile_input_grad": 3, "tile_weight_grad": 3}


def _ffn_dots(kind: str, rows: float, p: Problem, dots: float) -> tuple[str, float, float, float]:
    """`dots` dots of `rows` rows through one expert matrix (2 rows M H FLOPs each)."""
    return (kind, 2 * rows * p.M * p.H, dots, p.M * p.H)


def count_work(
    strategy: Dispatch,
    exchange: Exchange,
    p: Problem,
    traffic,
    rounds: int,
    memory_bytes: float,
) -> Work:
    """What one device does in one step of `strategy` (see the module docstring).
    `traffic` is the cost model's `Traffic` (network bytes), `rounds` the exchange's
    expected rounds, `memory_bytes` the HBM bytes (`selector.cost.memory_bytes`)."""
    exchanged = strategy is Dispatch.megablox and exchange is Exchange.all_to_all
    bwd = 2 if p.train else 0  # a dot's backward: two more of its size
    routed = routed_rows(p.T, p.k)
    dots: list[tuple[str, float, float, float]] = []
    if strategy is not Dispatch.mlp:
        dots.append(("plain", 2 * p.T * p.M * p.E, 1 + bwd, p.M * p.E))  # router logits
    if p.Hs:
        dots.append(("plain", 2 * p.T * p.M * p.Hs, 3 * (1 + bwd), p.M * p.Hs))  # shared experts
    ops = trips = gather = visit_ops = visit_trips = copied_keep = copied_change = 0.0
    gmm_calls: tuple[tuple[float, float], ...] = ()
    collectives = 1.0  # the statistics' sum over the token axes
    collectives += (1 + (p.train)) * (p.hidden_shards > 1)  # hidden axes' partial sums
    # Weight all-gathers in (reduce-scatters out): the three routed matrices over the
    # gathered axes, the shared experts and the router over their own.
    collectives += 3 * (1 + p.train) * (p.gathered > 1)
    collectives += (4 if p.Hs else 1) * (1 + p.train) * (p.gate_shards > 1)
    sort = routed * max(math.ceil(math.log2(max(routed, 2))), 1) * SORT_BYTES
    if strategy is Dispatch.megablox:
        b = buffer_rows(p)  # rows an exchange slot holds
        if p.gmm_dense:  # ragged_dot off TPU: every group's work on every row
            loops = _Loops(((routed * p.E_c, 1.0),))  # priced as plain dots below
        elif exchanged:
            loops = _gmm_loops(p.kernel, exchanged_calls(routed, p.E, p.group, int(b)), p, True)
        else:
            loops = _gmm_loops(p.kernel, gathered_calls(routed, p.E), p, False)
        per_visit = _dots_per_visit(p, exchanged)
        if p.kernel != "tiled_gmm" or p.gmm_dense:  # no pass curves: plain dots
            per_visit = {"plain": sum(per_visit.values())}
        dots += [
            _ffn_dots(kind, t, p, n * d) for t, n in loops.tiles for kind, d in per_visit.items()
        ]
        ops += loops.ops
        trips += loops.trips
        visit_ops, visit_trips = loops.visit_ops, loops.visit_trips
        gmm_calls = loops.calls
        key = "megablox_exchanged" if exchanged else "megablox_gathered"
        ops += PROGRAM_OPS[(key, p.train)]
        gather += sort + 4 * routed * 3  # the sort, the ids and weights taken, the sizes
        if exchanged:
            slots = p.group * b  # rows of one round's buffers
            fwd, back = ROUND_OPS, SLOT_OPS
            ops += rounds * (fwd[0] + p.group * back[0])
            trips += rounds * (1 + p.group)
            gather += rounds * (2 * slots * p.M * p.xb + 2 * slots * 4)
            collectives += rounds * 4 + 1  # x, ids, scales out and results back; the pmax
            if p.train:
                ops += rounds * (fwd[1] + p.group * back[1])
                trips += rounds * (1 + p.group)
                gather += rounds * (3 * slots * p.M * p.xb + 3 * slots * 4)
                collectives += rounds * 6
            collectives += 1 if p.ragged else 0  # the receive counts, once
        else:
            gather += (2 + bwd) * routed * p.M * p.xb  # rows taken, results added back
    elif strategy is Dispatch.dense:
        dots.append(_ffn_dots("batched", p.T * p.E_c, p, 3 * (1 + bwd)))
        dots.append(("batched", 2 * p.T * p.E_c * p.M, 1 + bwd, 0.0))  # the combine
        ops += PROGRAM_OPS[("dense", p.train)]
        hidden_keep, hidden_change, out_keep, out_change = p.dense_copies
        hidden = 2 * p.T * p.E_c * p.H * p.xb  # a (T, E, H) activation read and written
        out = 2 * p.T * p.E_c * p.M * p.xb  # a (T, E, M) one
        copied_keep = hidden_keep * hidden + out_keep * out
        copied_change = hidden_change * hidden + out_change * out
    elif strategy is Dispatch.mlp:
        dots.append(_ffn_dots("plain", p.T, p, 3 * (1 + bwd)))
        ops += PROGRAM_OPS[("dense", p.train)]
    else:  # subgroup_capacity: dispatch and combine einsums around the experts'
        slots = p.G * p.E * p.C
        dots.append(("batched", 2 * slots * p.S * p.M, 2 * (1 + bwd), 0.0))
        dots.append(_ffn_dots("batched", slots, p, 3 * (1 + bwd)))
        ops += PROGRAM_OPS[("dense", p.train)]
    # One matrix gathered over the embed axes, copied once each way (read and written).
    relaid = 2 * routed_weight_elements(strategy, p) / 3 * p.xb * (1 + p.train)
    relaid *= p.embed_gathered > 1
    # Gathered over the embed axes alone, within a slice: what the in-place rates price.
    received = routed_weight_elements(strategy, p) * p.xb * (1 - 1 / p.gathered)
    received *= p.embed_gathered == p.gathered > 1 and p.gathered_dcn == 1
    return Work(
        dots=tuple(dots),
        memory_bytes=memory_bytes,
        gather_bytes=gather,
        collectives=collectives,
        ici_bytes=traffic.ici,
        dcn_bytes=traffic.dcn,
        ops=ops,
        loop_trips=trips,
        relayout_bytes=2 * relaid * ("gate_up" in p.relayouts),
        transpose_bytes=relaid * ("out" in p.relayouts),
        weight_gather_bytes=received,
        weight_scatter_bytes=received * p.train,
        tile_visit_ops=visit_ops,
        tile_visit_trips=visit_trips,
        activation_relayout_bytes=copied_keep,
        activation_transpose_bytes=copied_change,
        gmm_calls=gmm_calls,
    )


def priced_by(hw: Hardware) -> str:
    """One line naming the constants that priced a time and where they come from."""
    curves = [hw.matmul_curve, hw.gmm_curve, hw.einsum_curve]
    matmul = (
        f"matmul curves measured at {sum(len(c) for c in curves)} dot sizes"
        if any(curves)
        else f"matmul {hw.matmul_tflops:g} TFLOP/s"
    )
    parts = [
        matmul,
        f"memory {hw.hbm_bandwidth_gbps:g} GB/s",
        f"gathers {hw.gather_gbps or hw.hbm_bandwidth_gbps:g} GB/s",
        f"relayouts {hw.relayout_gbps or hw.hbm_bandwidth_gbps:g} GB/s",
        f"transposes {hw.transpose_gbps or hw.hbm_bandwidth_gbps:g} GB/s",
        *(
            [
                f"activations relaid {hw.activation_relayout_gbps:g} GB/s, transposed"
                f" {hw.activation_transpose_gbps:g} GB/s"
            ]
            if hw.activation_relayout_gbps and hw.activation_transpose_gbps
            else []
        ),
        *(
            [
                f"tile visits of calls over the {hw.cache_mib:g} MiB cache streamed"
                f" {hw.gmm_streamed_gbps:g} GB/s"
            ]
            if hw.cache_mib and hw.gmm_streamed_gbps
            else []
        ),
        *(
            [
                f"weights gathered in place {hw.weight_gather_gbps:g} GB/s, their"
                f" gradients reduce-scattered {hw.weight_scatter_gbps:g} GB/s"
            ]
            if hw.weight_gather_gbps and hw.weight_scatter_gbps
            else []
        ),
        f"ICI {hw.ici_bandwidth_gbps:g} GB/s",
        f"DCN {hw.dcn_bandwidth_gbps:g} GB/s",
    ]
    for name, value, unit in (
        ("collective latency", hw.collective_latency_us, "us"),
        ("launch", hw.launch_us, "us an op"),
        ("loop trip", hw.loop_trip_us, "us"),
        ("call", hw.call_us, "us a step"),
    ):
        if value is not None:
            parts.append(f"{name} {value:.3g} {unit}")
    text = f"{', '.join(parts)} ({hw.source})"
    if hw.uncounted:
        text += f"; not counted (no figure for {hw.name}): {', '.join(hw.uncounted)}"
    return text


__all__ = ["TimeParts", "Work", "count_work", "matmul_rate", "price", "priced_by"]
