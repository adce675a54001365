"""The counted time (selector.timing): what a candidate's program does, counted by hand
here, and each part priced by the machine's constants."""

import dataclasses
import json
import math
import re
import statistics
from pathlib import Path

import pytest
from helpers import problem, typed

import selector
from bench.calibration.machine import GMM_PASS_CURVES, curve_point, pass_curve
from selector import Dispatch, Exchange, Hardware
from selector.problem import buffer_rows
from selector.tiles import exchanged_calls
from selector.timing import (
    PROGRAM_OPS,
    TimeParts,
    Work,
    _gmm_loops,
    count_work,
    matmul_rate,
    price,
    priced_by,
)

ROOT = Path(__file__).resolve().parents[2]


def _hw(**kw) -> Hardware:
    base = dict(
        matmul_tflops=1.0,
        hbm_bandwidth_gbps=2.0,
        gather_gbps=0.5,
        ici_bandwidth_gbps=4.0,
        dcn_bandwidth_gbps=1.0,
        collective_latency_us=10.0,
        launch_us=2.0,
        loop_trip_us=3.0,
        call_us=100.0,
    )
    return Hardware(**{**base, **kw})


def test_each_part_is_its_counts_over_its_constants():
    work = Work(
        dots=(("plain", 2e9, 3, 0.0), ("tile", 1e9, 2, 0.0)),
        memory_bytes=4e9,
        gather_bytes=1e9,
        collectives=5,
        ici_bytes=8e9,
        dcn_bytes=1e9,
        ops=1000,
        loop_trips=200,
    )
    parts = price(work, _hw())
    assert parts.compute == pytest.approx((3 * 2e9 + 2 * 1e9) / 1e12)
    assert parts.memory == pytest.approx(4e9 / 2e9 + 1e9 / 0.5e9)
    relaid = price(
        Work((), 0.0, 0.0, 0, 0.0, 0.0, 0, 0, relayout_bytes=3e9, transpose_bytes=1e9),
        _hw(relayout_gbps=1.5, transpose_gbps=0.25),
    )
    assert relaid.memory == pytest.approx(3e9 / 1.5e9 + 1e9 / 0.25e9)
    # Activations written in another layout: at their own rates, else the weights'
    # copy rates, else the HBM's.
    copied = Work(
        (),
        0.0,
        0.0,
        0,
        0.0,
        0.0,
        0,
        0,
        activation_relayout_bytes=3e9,
        activation_transpose_bytes=1e9,
    )
    own = _hw(
        relayout_gbps=1.5,
        transpose_gbps=0.25,
        activation_relayout_gbps=0.6,
        activation_transpose_gbps=0.2,
    )
    assert price(copied, own).memory == pytest.approx(3e9 / 0.6e9 + 1e9 / 0.2e9)
    assert price(copied, _hw(relayout_gbps=1.5, transpose_gbps=0.25)).memory == pytest.approx(
        3e9 / 1.5e9 + 1e9 / 0.25e9
    )
    assert price(copied, _hw()).memory == pytest.approx(4e9 / 2e9)
    assert parts.network == pytest.approx(5 * 10e-6 + 8e9 / 4e9 + 1e9 / 1e9)
    assert parts.overhead == pytest.approx((100 + 1000 * 2 + 200 * 3) * 1e-6)
    assert parts.total == pytest.approx(sum(parts.as_dict().values()))
    assert work.flops == 8e9 and work.dot_count == 5


def test_each_byte_count_is_priced_exactly_at_its_rate():
    """Bytes over GB/s, exact where the numbers are: 3e9 bytes at 1.5 GB/s are 2 s to the
    last bit, for each kind of bytes on its own (a rate off by a part in a billion
    shows here)."""
    rates = dict(
        hbm_bandwidth_gbps=1.5,
        gather_gbps=1.5,
        relayout_gbps=1.5,
        transpose_gbps=1.5,
        activation_relayout_gbps=1.5,
        activation_transpose_gbps=1.5,
        ici_bandwidth_gbps=1.5,
        dcn_bandwidth_gbps=1.5,
    )
    hw = _hw(collective_latency_us=None, launch_us=None, loop_trip_us=None, call_us=None, **rates)
    bare = dict(
        dots=(),
        memory_bytes=0.0,
        gather_bytes=0.0,
        collectives=0,
        ici_bytes=0.0,
        dcn_bytes=0.0,
        ops=0,
        loop_trips=0,
    )
    for field, part in (
        ("memory_bytes", "memory"),
        ("gather_bytes", "memory"),
        ("relayout_bytes", "memory"),
        ("transpose_bytes", "memory"),
        ("activation_relayout_bytes", "memory"),
        ("activation_transpose_bytes", "memory"),
        ("ici_bytes", "network"),
        ("dcn_bytes", "network"),
    ):
        parts = price(Work(**{**bare, field: 3e9}), hw)
        assert parts.as_dict()[part] == 2.0 and parts.total == 2.0, field
    in_place = _hw(**{**rates, "weight_gather_gbps": 1.5, "weight_scatter_gbps": 0.75})
    gathered = Work(**{**bare, "ici_bytes": 3e9, "weight_gather_bytes": 3e9})
    assert price(gathered, in_place).network == 2.0  # none left over ICI
    both = Work(
        **{**bare, "ici_bytes": 6e9, "weight_gather_bytes": 3e9, "weight_scatter_bytes": 3e9}
    )
    assert price(both, in_place).network == 6.0
    # A tiled_gmm call bigger than the cache streams its visits' bytes; one that fits,
    # or a machine without the cache's size or the streaming rate, none.
    calls = ((16 * 2**20 + 1, 3e9), (16 * 2**20, 5e9))
    streaming = dataclasses.replace(hw, cache_mib=16.0, gmm_streamed_gbps=1.5)
    parts = price(Work(**{**bare, "gmm_calls": calls}), streaming)
    assert parts.memory == 2.0 and parts.total == 2.0
    for missing in ("cache_mib", "gmm_streamed_gbps"):
        without = dataclasses.replace(streaming, **{missing: 0.0})
        assert price(Work(**{**bare, "gmm_calls": calls}), without).total == 0.0, missing


def test_a_preset_without_a_figure_counts_nothing_for_it_and_says_so():
    """No gather figure: gathers at the HBM bandwidth. No per-op figures (None): those
    parts cost nothing and `uncounted` names them."""
    hw = _hw(
        gather_gbps=0.0, collective_latency_us=None, launch_us=None, loop_trip_us=None, call_us=None
    )
    work = Work((), 0.0, 2e9, 7, 0.0, 0.0, 1e6, 1e6)
    parts = price(work, hw)
    assert parts.memory == pytest.approx(2e9 / 2e9) and parts.network == 0
    assert parts.overhead == 0
    assert hw.uncounted == ("collective latency", "op launches", "loop trips", "the call")
    assert "not counted" in priced_by(hw)
    v5p = selector.to_config(selector.compose(["hardware=v5p"])).hardware
    assert set(v5p.uncounted) == set(hw.uncounted)
    cpu = selector.to_config(selector.compose(["model=tiny", "mesh=cpu_8"])).hardware
    assert cpu.uncounted == () and "not counted" not in priced_by(cpu)


def test_the_matmul_rate_follows_its_curve_log_log_and_flat_past_its_ends():
    hw = _hw(matmul_curve=[[1.0, 0.01], [100.0, 0.04]], gmm_curve=[[1.0, 0.002]])
    assert matmul_rate(1e6, hw) == pytest.approx(0.01e12)
    assert matmul_rate(1e8, hw) == pytest.approx(0.04e12)
    assert matmul_rate(1e7, hw) == pytest.approx(0.02e12)  # halfway in log size: sqrt
    assert matmul_rate(1e3, hw) == pytest.approx(0.01e12)
    assert matmul_rate(1e12, hw) == pytest.approx(0.04e12)
    assert matmul_rate(5e6, hw, "tile") == pytest.approx(0.002e12)  # its own curve
    assert matmul_rate(5e6, hw, "batched") == matmul_rate(5e6, hw)  # none: the plain one
    assert matmul_rate(5e6, _hw(matmul_tflops=459.0)) == 459e12  # no curve: the peak


def test_a_curve_measured_at_several_matrices_is_read_at_the_dots_rows_and_matrix():
    """Points that name their matrix (K x N elements): each matrix's points read at the
    dot's rows (its FLOPs scaled to that matrix), then log-log between the matrices;
    without a matrix, every point along the FLOPs alone."""
    small, big = 64 * 128, 192 * 384
    # Rows 32 and 64 at each matrix; the small matrix's rates double with rows, the big
    # one's are 4x the small's.
    hw = _hw(
        gmm_curve=[
            [2 * 32 * small / 1e6, 0.01, small],
            [2 * 64 * small / 1e6, 0.02, small],
            [2 * 32 * big / 1e6, 0.04, big],
            [2 * 64 * big / 1e6, 0.08, big],
        ]
    )
    assert matmul_rate(2 * 32 * small, hw, "tile", small) == pytest.approx(0.01e12)
    assert matmul_rate(2 * 64 * big, hw, "tile", big) == pytest.approx(0.08e12)
    # 32 rows by the big matrix has the FLOPs of 288 rows by the small one: read at its
    # own rows, not at the small matrix's last point.
    assert matmul_rate(2 * 32 * big, hw, "tile", big) == pytest.approx(0.04e12)
    middle = math.sqrt(small * big)  # halfway in log size: the geometric mean
    assert matmul_rate(2 * 32 * middle, hw, "tile", middle) == pytest.approx(0.02e12)
    assert matmul_rate(2 * 16 * small / 4, hw, "tile", small / 4) == pytest.approx(0.01e12)
    assert matmul_rate(2 * 128 * 4 * big, hw, "tile", 4 * big) == pytest.approx(0.08e12)
    # 128 rows by the small matrix: flat past its own last point. With no matrix named,
    # read along the FLOPs of every point, it falls between the small matrix's 64 rows
    # and the big one's 32.
    assert matmul_rate(2 * 128 * small, hw, "tile", small) == pytest.approx(0.02e12)
    assert 0.02e12 < matmul_rate(2 * 128 * small, hw, "tile") < 0.04e12


def test_each_tiled_gmm_pass_is_priced_on_its_own_curve_else_the_forwards():
    """A tile visit's input-gradient and weight-gradient dots each have a curve (a
    weight gradient's visit runs at about half a forward's on CPU); without one they
    take the forward's tile curve, and without that the plain one."""
    passes = _hw(
        matmul_curve=[[1.0, 0.01]],
        gmm_curve=[[1.0, 0.02]],
        gmm_input_grad_curve=[[1.0, 0.03]],
        gmm_weight_grad_curve=[[1.0, 0.004]],
    )
    assert matmul_rate(5e6, passes, "tile") == pytest.approx(0.02e12)
    assert matmul_rate(5e6, passes, "tile_input_grad") == pytest.approx(0.03e12)
    assert matmul_rate(5e6, passes, "tile_weight_grad") == pytest.approx(0.004e12)
    forward_only = _hw(matmul_curve=[[1.0, 0.01]], gmm_curve=[[1.0, 0.02]])
    assert matmul_rate(5e6, forward_only, "tile_weight_grad") == pytest.approx(0.02e12)
    plain_only = _hw(matmul_curve=[[1.0, 0.01]])
    assert matmul_rate(5e6, plain_only, "tile_input_grad") == pytest.approx(0.01e12)
    # Priced apart: 3 dots a pass of 1 MFLOP at 20, 30 and 4 GFLOP/s.
    work = Work(
        (
            ("tile", 1e6, 3, 0.0),
            ("tile_input_grad", 1e6, 3, 0.0),
            ("tile_weight_grad", 1e6, 3, 0.0),
        ),
        *(0.0,) * 7,
    )
    assert price(work, passes).compute == pytest.approx(3e6 / 20e9 + 3e6 / 30e9 + 3e6 / 4e9)


def test_a_visits_loop_ops_are_priced_only_where_no_gmm_curve_holds_them():
    """The gmm curve times a visit with its loop body's ops, so a machine with one
    prices only the rest of the ops and trips; one without (TPU, GPU) prices them all."""
    work = Work(
        (("tile", 1e6, 3, 0.0),), *(0.0,) * 5, 1000, 100, tile_visit_ops=600, tile_visit_trips=40
    )
    bare = _hw(launch_us=2.0, loop_trip_us=3.0, call_us=0.0)
    measured = _hw(launch_us=2.0, loop_trip_us=3.0, call_us=0.0, gmm_curve=[[1.0, 0.01]])
    assert price(work, bare).overhead == pytest.approx((1000 * 2.0 + 100 * 3.0) * 1e-6)
    assert price(work, measured).overhead == pytest.approx((400 * 2.0 + 60 * 3.0) * 1e-6)


def test_gathered_tiled_gmm_dots_counted_by_hand():
    """tiny over fsdp 8 (8 experts, emb 64, hidden 128; 256 tokens a device, k=2, so 64
    rows an expert: one 64-row tile each): forward 3 dots a tile, the backward 6 more;
    the router one dot forward and two back. Training: 24 tile dots and 3 router dots."""
    over = ("ici_fsdp_parallelism=8", "ici_data_parallelism=1", "max_target_length=256")
    cfg, plan, p = problem(*over, "per_device_batch_size=1", "expert_exchange=gather")
    assert (p.T, p.k, p.E, p.M, p.H, p.train) == (256, 2, 8, 64, 128, True)
    work = plan.candidate(Dispatch.megablox, Exchange.gather).estimate.work
    tile = 2 * 64 * 64 * 128
    assert dict(((k, f, m), n) for k, f, n, m in work.dots) == {
        ("plain", 2 * 256 * 64 * 8, 64 * 8): 3,  # by the (emb, experts) router matrix
        ("tile", tile, 64 * 128): 8 * 3,  # gate, up and out
        ("tile_input_grad", tile, 64 * 128): 8 * 3,
        ("tile_weight_grad", tile, 64 * 128): 8 * 3,
    }
    # tiled_gmm's loop bodies, a visit's: 8 row trips in each of 4 row passes (gate and
    # up, out; their input gradients), 11 + 1 or 8 + 1 ops a trip; the weight
    # gradients' loop per expert (14 + 1 ops, and 4 for its tile under the big class),
    # 3 times; trips: 8 in each row pass, 8 experts in each weight gradient.
    assert work.tile_visit_ops == 8 * (12 + 9 + 9 + 12) + 3 * 8 * (15 + 4)
    assert work.tile_visit_trips == 8 * 4 + 3 * 8
    assert work.ops > work.tile_visit_ops  # the passes' setup and the program's own
    assert work.loop_trips == work.tile_visit_trips  # a gathered block loops over tiles only
    # One call over the 512 rows in (64 wide) and out (128 wide) and the 8 experts'
    # matrices; each of a visit's 9 dots moves its 64 rows in and out and its matrix.
    call = (512 * (64 + 128) + 8 * 64 * 128) * 4
    assert work.gmm_calls == ((call, 9 * 8 * (64 * (64 + 128) + 64 * 128) * 4),)
    # Rows taken and added back (forward) and their transposes (backward), the sort, and
    # the ids, weights and sizes.
    rows = 512
    sort = rows * 9 * 8
    assert work.gather_bytes == pytest.approx(4 * rows * 64 * 4 + sort + 4 * rows * 3)


def test_exchanged_rounds_counted_by_hand():
    """tiny exchanged over context 8 (8 experts, one a device; 256 tokens a device,
    k=2: 512 routed rows, B = 40 rows a slot, 3 rounds expected, 320 rows a round's
    buffers), training, float32. Per round: forward x and results moved (2 x 320 rows
    of 64 floats and their 4-byte ids/scales), backward 3 x; 4 collectives forward and
    6 back, plus the round count's pmax and the statistics' sum; the round loops' ops
    (51 + 8 x 45 forward, 75 + 8 x 74 back) and trips (1 + 8 each way) besides the
    tile loops'."""
    over = ("ici_context_parallelism=8", "ici_fsdp_parallelism=1", "ici_data_parallelism=1")
    cfg, plan, p = problem(
        *over, "max_target_length=2048", "per_device_batch_size=0.125", "expert_exchange=all_to_all"
    )
    estimate = plan.candidate(Dispatch.megablox, Exchange.all_to_all).estimate
    work = estimate.work
    assert (p.T, p.k, p.E, p.M, p.group, p.xb, estimate.rounds) == (256, 2, 8, 64, 8, 4, 3)
    sort, taken = 512 * 9 * 8, 4 * 512 * 3
    forward = 3 * (2 * 320 * 64 * 4 + 2 * 320 * 4)
    backward = 3 * (3 * 320 * 64 * 4 + 3 * 320 * 4)
    assert work.gather_bytes == sort + taken + forward + backward
    assert work.collectives == 1 + (3 * 4 + 1) + 3 * 6
    tiles = _gmm_loops(p.kernel, exchanged_calls(512, 8, 8, int(buffer_rows(p))), p, True)
    assert dict(tiles.tiles) == {32: 24}  # 8 slots a round of one expert's rows, 3 rounds
    # Each slot a call over its 40 rows and one expert's matrix; each of a visit's 11
    # dots (the recomputed forward's 2 among them) moves a 32-row tile and the matrix.
    slot = (40 * (64 + 128) + 64 * 128) * 4
    assert work.gmm_calls == tiles.calls == ((slot, 11 * 24 * (32 * (64 + 128) + 64 * 128) * 4),)
    rounds = 3 * (51 + 8 * 45) + 3 * (75 + 8 * 74)
    assert work.ops == tiles.ops + PROGRAM_OPS[("megablox_exchanged", True)] + rounds
    assert work.loop_trips == tiles.trips + 2 * 3 * (1 + 8)


@pytest.mark.parametrize("hardware", ["cpu", "v5p"])
def test_gathered_weights_are_relaid_as_the_compiler_relays_them(hardware):
    """Gathered over the embed axes (fsdp 2 x context 4), each routed matrix the compiler
    relays is copied once each way, read and written (training: in and out): XLA:CPU
    the two (E, M, H) matrices and the (E, H, M) one, XLA:TPU only the latter. An
    exchange over every embed axis gathers none, so relays none; nor does a gather over
    the expert axis alone (the experts' dim is major)."""
    over = ("ici_fsdp_parallelism=2", "ici_context_parallelism=4", "per_device_batch_size=0.25")
    chip = [] if hardware == "cpu" else [f"hardware={hardware}"]
    cfg, plan, p = problem(*over, *chip, "num_experts=16", "expert_exchange=gather")
    work = plan.candidate(Dispatch.megablox, Exchange.gather).estimate.work
    matrix = 16 * 64 * 128 * p.xb
    assert p.embed_gathered == 8
    assert work.relayout_bytes == (2 * 2 * 2 * matrix if hardware == "cpu" else 0)
    assert work.transpose_bytes == 2 * 2 * matrix
    # The same gathers, as the in-place rates price them: the bytes a device receives
    # of the three matrices, in (the forward) and out (the gradient's reduce-scatter).
    assert work.weight_gather_bytes == pytest.approx(3 * matrix * (1 - 1 / 8))
    assert work.weight_scatter_bytes == work.weight_gather_bytes
    folded = typed(*over, *chip, "num_experts=16", "expert_group=expert_sequence_and_fsdp")
    exchanged = selector.resolve(folded).candidate(Dispatch.megablox, Exchange.all_to_all)
    assert exchanged.placement.embed_axes == ()
    assert exchanged.estimate.work.relayout_bytes == exchanged.estimate.work.transpose_bytes == 0
    cfg, plan, p = problem("ici_expert_parallelism=8", "ici_fsdp_parallelism=1", *chip)
    gathered = plan.candidate(Dispatch.megablox, Exchange.gather).estimate.work
    assert p.gathered == 8 and gathered.relayout_bytes == gathered.transpose_bytes == 0
    assert gathered.weight_gather_bytes == 0  # the in-place rates price embed gathers only
    cfg, plan, p = problem(*over, "num_experts=16", "expert_exchange=gather", "mode=prefill")
    work = plan.candidate(Dispatch.megablox, Exchange.gather).estimate.work
    assert work.weight_gather_bytes > 0 and work.weight_scatter_bytes == 0
    two = ("ici_fsdp_parallelism=2", "ici_data_parallelism=4", "num_experts=16")
    cfg, plan, p = problem(*two, "expert_exchange=gather")
    work = plan.candidate(Dispatch.megablox, Exchange.gather).estimate.work
    assert p.gathered == p.embed_gathered == 2  # the smallest gather: half received
    assert work.weight_gather_bytes == pytest.approx(3 * 16 * 64 * 128 * p.xb / 2)


def test_weights_gathered_in_place_are_priced_by_their_measured_rates():
    """With the in-place rates, the routed weights' gathers leave the ICI bytes and
    the relayout copies and are priced at their own rates; without them, as before."""
    work = Work(
        (),
        0.0,
        0.0,
        0,
        5e9,
        0.0,
        0,
        0,
        relayout_bytes=3e9,
        transpose_bytes=1e9,
        weight_gather_bytes=2e9,
        weight_scatter_bytes=1e9,
    )
    rated = _hw(relayout_gbps=1.5, transpose_gbps=0.25)
    plain = price(work, rated)
    assert plain.memory == pytest.approx(3e9 / 1.5e9 + 1e9 / 0.25e9)
    assert plain.network == pytest.approx(5e9 / 4e9)
    in_place = price(
        work,
        _hw(
            relayout_gbps=1.5, transpose_gbps=0.25, weight_gather_gbps=0.5, weight_scatter_gbps=0.25
        ),
    )
    assert in_place.memory == 0
    assert in_place.network == pytest.approx(2e9 / 4e9 + 2e9 / 0.5e9 + 1e9 / 0.25e9)
    half = price(work, _hw(relayout_gbps=1.5, transpose_gbps=0.25, weight_gather_gbps=0.5))
    assert half == plain  # both rates or neither: one alone prices as before
    cpu = selector.to_config(selector.compose(["model=tiny", "mesh=cpu_8"])).hardware
    assert "weights gathered in place" in priced_by(cpu)


def test_each_dot_is_priced_by_its_own_kinds_curve():
    """A tile is priced on the gmm curve and a plain dot on the matmul curve, each at
    its own size (the curves differ here by 4x)."""
    hw = _hw(matmul_curve=[[1.0, 0.04]], gmm_curve=[[1.0, 0.01]])
    tile = price(Work((("tile", 1e6, 1, 0.0),), 0.0, 0.0, 0, 0.0, 0.0, 0, 0), hw)
    plain = price(Work((("plain", 1e6, 1, 0.0),), 0.0, 0.0, 0, 0.0, 0.0, 0, 0), hw)
    assert tile.compute == pytest.approx(1e6 / 0.01e12)
    assert plain.compute == pytest.approx(1e6 / 0.04e12)


def test_the_in_place_rates_are_their_studys_medians():
    """The rates cpu.yaml holds are the medians `weight_gather_rates` takes of the
    stored study's shapes: bytes received over the forward's time more, and over the
    training time more less the forward's; the picks page quotes the study as stored."""
    from bench.calibration.machine import weight_gather_rates

    study = json.loads((ROOT / "bench/results/machine_cpu.json").read_text())
    rows = study["weight_gathers"]
    assert len(rows) == 8 and [r["mode"] for r in rows[:2]] == ["forward", "train"]
    rates = weight_gather_rates(rows)
    hw = selector.to_config(selector.compose(["model=tiny", "mesh=cpu_8"])).hardware
    assert hw.weight_gather_gbps == pytest.approx(rates["weight_gather_gbps"], rel=5e-4)
    assert hw.weight_scatter_gbps == pytest.approx(rates["weight_scatter_gbps"], rel=5e-4)
    page = (ROOT / "docs/results/picks.md").read_text().replace("\n", " ")
    for name, value in rates.items():
        assert f"{value:.3g} GB/s" in page, name  # the rates the study page quotes
    for f, t in zip(rows[::2], rows[1::2], strict=True):
        row = (
            f"| {f['shape'].replace('x', ' x ')}, {f['rows_an_expert']} | {f['matrix_mb']:.1f} | "
            f"{f['ms_more']:.1f} | {f['counted_ms']:.1f} | {f['measured_over_counted']:.2f} | "
            f"{t['ms_more']:.1f} | {t['counted_ms']:.1f} | {t['measured_over_counted']:.2f} |"
        )
        assert row in page, row
    pairs = list(zip(rows[::2], rows[1::2], strict=True))
    gather = [f["received_mb"] / f["ms_more"] for f, _ in pairs]  # MB/ms = GB/s
    scatter = [f["received_mb"] / (t["ms_more"] - f["ms_more"]) for f, t in pairs]
    assert rates["weight_gather_gbps"] == pytest.approx(statistics.median(gather))
    assert rates["weight_scatter_gbps"] == pytest.approx(statistics.median(scatter))


@pytest.mark.parametrize("hardware", ["cpu", "h200", "v5p"])
def test_the_relayout_trait_is_what_the_compiled_program_does(hardware):
    """The gathered block compiled for 8 devices (fsdp 2 x context 4; XLA:CPU here,
    XLA:GPU and XLA:TPU ahead of time): the weights gathered along their middle dim (the
    gate and up matrices) or their minor dim (the out matrix) are copied into another
    layout exactly where `Traits.gather_relayouts` says. Each matrix is 32 MiB, past
    the size under which XLA:GPU combines the three gathers into one (as real models'
    matrices are)."""
    from hlo import relaid_gathers

    from checks.compiled import compile_plan
    from selector.traits import jax_release, traits

    chip = [] if hardware == "cpu" else [f"hardware={hardware}"]
    cfg = typed(
        *chip,
        "ici_fsdp_parallelism=2",
        "ici_context_parallelism=4",
        "per_device_batch_size=0.25",
        "max_target_length=1024",
        "num_experts=64",
        "base_emb_dim=256",
        "base_moe_mlp_dim=512",
        "dispatch=megablox",
        "expert_exchange=gather",
    )
    needs = {"h200": "jax_plugins.xla_cuda12", "v5p": "libtpu"}.get(hardware)
    if needs:
        pytest.importorskip(needs, reason=f"the compiler for {hardware} is not installed")
    _, program, _, _ = compile_plan(cfg, selector.resolve(cfg))
    said = traits(cfg.hardware.platform, jax_release(cfg.hardware.jax_version)).gather_relayouts
    expected = {dim for dim, name in ((1, "gate_up"), (2, "out")) if name in said}
    assert relaid_gathers(program.as_text()) == expected


# A dense block whose dims all differ, so a copy's minor dim is told by its size:
# 512 tokens a device, E 12, M 96, H 160.
DENSE_SHAPE = (
    "ici_context_parallelism=8",
    "per_device_batch_size=0.125",
    "max_target_length=4096",
    "num_experts=12",
    "num_experts_per_tok=3",
    "base_emb_dim=96",
    "base_moe_mlp_dim=160",
    "dispatch=dense",
)


@pytest.mark.parametrize("mode", ["train", "prefill"])
@pytest.mark.parametrize("hardware", ["cpu", "h200", "v5p"])
def test_the_dense_copies_trait_is_what_the_compiled_program_does(hardware, mode):
    """The dense block compiled for 8 devices (XLA:CPU here, XLA:GPU and XLA:TPU ahead
    of time) writes its (T, E, H) and (T, E, M) activations in another layout exactly
    as often as `Traits.dense_activation_copies` says, keeping or changing the minor
    dim."""
    from hlo import activation_copies

    from checks.compiled import compile_plan
    from selector.traits import jax_release, traits

    chip = [] if hardware == "cpu" else [f"hardware={hardware}"]
    cfg = typed(*chip, *DENSE_SHAPE, f"mode={mode}")
    needs = {"h200": "jax_plugins.xla_cuda12", "v5p": "libtpu"}.get(hardware)
    if needs:
        pytest.importorskip(needs, reason=f"the compiler for {hardware} is not installed")
    _, program, _, _ = compile_plan(cfg, selector.resolve(cfg))
    said = traits(cfg.hardware.platform, jax_release(cfg.hardware.jax_version))
    hidden_keep, hidden_change, out_keep, out_change = said.dense_activation_copies[mode == "train"]
    tokens, experts = 512, 12
    found = activation_copies(
        program.as_text(), {tokens * experts * 160: "hidden", tokens * experts * 96: "out"}
    )
    assert found == {
        key: n
        for key, n in (
            (("hidden", "keep"), hidden_keep),
            (("hidden", "change"), hidden_change),
            (("out", "keep"), out_keep),
            (("out", "change"), out_change),
        )
        if n
    }


def test_the_dense_copies_are_counted_and_priced_at_the_activation_rates():
    """The dense count's activation copies, by hand: each (T, E, H) or (T, E, M) array
    read and written once a copy, as many as the compiler's trait says (XLA:CPU: 5 and
    3 hidden, 2 per-expert outputs changing the minor dim, training; 1 and 1 forward),
    none on TPU; priced in the memory part at the activation rates."""
    for mode, (keep, change, out_change) in (("train", (5, 3, 2)), ("prefill", (0, 1, 1))):
        cfg = typed(*DENSE_SHAPE, f"mode={mode}")
        est = selector.resolve(cfg).chosen_estimate
        hidden = 2 * 512 * 12 * 160 * 4
        out = 2 * 512 * 12 * 96 * 4
        assert est.work.activation_relayout_bytes == keep * hidden
        assert est.work.activation_transpose_bytes == change * hidden + out_change * out
        hw = cfg.hardware
        uncopied = dataclasses.replace(
            est.work, activation_relayout_bytes=0.0, activation_transpose_bytes=0.0
        )
        bare = price(uncopied, hw)
        more = keep * hidden / (hw.activation_relayout_gbps * 1e9)
        more += (change * hidden + out_change * out) / (hw.activation_transpose_gbps * 1e9)
        assert est.time_parts.memory - bare.memory == pytest.approx(more)
    tpu = selector.resolve(typed("hardware=v5p", *DENSE_SHAPE, "mode=train")).chosen_estimate
    assert tpu.work.activation_relayout_bytes == tpu.work.activation_transpose_bytes == 0


def test_the_activation_copy_rates_are_their_studys_medians():
    """cpu.yaml's activation rates are the medians of the stored study's shapes: twice
    the array's bytes over the time the copy adds, keeping the minor dim and changing
    it."""
    study = json.loads((ROOT / "bench/results/machine_cpu.json").read_text())
    rows = study["activation_copies"]
    assert len(rows) == 10
    hw = selector.to_config(selector.compose(["model=tiny", "mesh=cpu_8"])).hardware
    for name, minor in (
        ("activation_relayout_gbps", "keep"),
        ("activation_transpose_gbps", "change"),
    ):
        rates = []
        for r in rows:
            if r["minor_dim"] == minor:
                t, e, h = (int(d) for d in r["shape"].split("x"))
                rates.append(2 * 4 * t * e * h / (r["ms_more"] * 1e-3) / 1e9)
        assert len(rates) == 5
        assert getattr(hw, name) == pytest.approx(statistics.median(rates), rel=5e-4), name


PASSES = ("tile", "tile_input_grad", "tile_weight_grad")


def test_the_exchange_recomputes_its_forward_in_the_backward():
    """Exchanged, a tile visit does 11 dots over the step: the backward recomputes the
    two input products (8 there, not 6). Its rounds issue 4 collectives forward and 6
    back, and the round count's pmax one."""
    over = ("ici_fsdp_parallelism=2", "ici_context_parallelism=4", "per_device_batch_size=0.25")
    cfg = typed(
        *over,
        "max_target_length=2048",
        "expert_exchange=all_to_all",
        "expert_group=expert_and_sequence",
    )
    plan = selector.resolve(cfg)
    est = plan.chosen_estimate

    def by_pass(work):
        return {k: sum(n for kind, _, n, _ in work.dots if kind == k) for k in PASSES}

    exchanged = by_pass(est.work)
    visits = exchanged["tile_input_grad"] / 3
    assert visits > 0 and exchanged == {
        "tile": 5 * visits,  # the forward's 3 and the recomputed gate and up
        "tile_input_grad": 3 * visits,
        "tile_weight_grad": 3 * visits,
    }
    gathered = selector.resolve(cfg.replace(expert_exchange=Exchange.gather)).chosen_estimate
    passes = by_pass(gathered.work)
    assert passes["tile"] == passes["tile_input_grad"] == passes["tile_weight_grad"] > 0
    # Weights of the expert axis group's embed split (fsdp) are gathered: 3 routed
    # matrices in and out, the router in and out; the stats' sum.
    assert est.work.collectives == est.rounds * 10 + 1 + 1 + 6 + 2


def test_work_counts_the_block_program_the_layers_compile():
    """What the count reads from the kernels agrees with what the plan reports: the
    FLOPs are the dots', and the estimate's time is its parts' sum."""
    for strategy in (Dispatch.megablox, Dispatch.dense, Dispatch.subgroup_capacity):
        plan = selector.resolve(
            typed("ici_fsdp_parallelism=8", "capacity_factor=1.25", f"dispatch={strategy.value}")
        )
        est = plan.chosen_estimate
        assert est.flops == est.work.flops > 0
        assert isinstance(est.time_parts, TimeParts) and est.time_s == est.time_parts.total
        d = est.as_dict()
        assert d["time_parts"] == est.time_parts.as_dict() and d["work"]["flops"] == est.flops


def test_count_work_uses_the_traffic_it_is_given():
    """count_work takes its network bytes from the cost model's traffic and its memory
    bytes as given (no second formula)."""
    _, plan, p = problem("ici_fsdp_parallelism=8", "expert_exchange=gather")
    est = plan.chosen_estimate
    work = count_work(est.strategy, est.exchange, p, est.traffic, est.rounds, 123.0)
    assert work.memory_bytes == 123.0
    assert (work.ici_bytes, work.dcn_bytes) == (est.traffic.ici, est.traffic.dcn)


def test_the_cpu_constants_are_the_machine_studys():
    """conf/hardware/cpu.yaml holds what `python -m bench.calibration.machine --write` measured
    (bench/results/machine_cpu.json), to the 4 digits it writes."""
    study = json.loads((ROOT / "bench/results/machine_cpu.json").read_text())
    hw = selector.to_config(selector.compose(["model=tiny", "mesh=cpu_8"])).hardware
    for name, value in study["constants"].items():
        assert getattr(hw, name) == pytest.approx(value, rel=5e-4, abs=1e-9), name
    curves = {name: study[name] for name in ("matmul_curve", "gmm_curve", "einsum_curve")}
    curves |= {name: pass_curve(study["gmm_curve"], grad) for name, grad in GMM_PASS_CURVES.items()}
    for name, curve in curves.items():
        stored = [x for p in curve for x in curve_point(p)]
        held = [x for point in getattr(hw, name) for x in point]
        assert stored and held == pytest.approx(stored, rel=5e-4), name


def test_each_tpu_and_gpu_figure_cites_its_source():
    """Every TPU and GPU preset names the page its figures come from, and the figures the
    comment quotes are the ones it sets."""
    for path in sorted((ROOT / "conf/hardware").glob("*.yaml")):
        text = path.read_text()
        if "platform: cpu" in text:
            continue
        assert re.search(r"https://(cloud\.google\.com|www\.nvidia\.com)/\S+", text), path.name
        hw = selector.to_config(selector.compose([f"hardware={path.stem}"])).hardware
        assert f"{hw.matmul_tflops:g}" in text.split("name:")[0].replace(",", ""), path.name
        assert hw.source and hw.uncounted, path.name


def test_the_picks_numbers_quoted_are_the_studys():
    """The README and the study page quote the judge set's scores as stored."""
    study = json.loads((ROOT / "bench/results/picks_cpu.json").read_text())
    now, before = study["summary"], study["baseline"]["summary"]
    readme = (ROOT / "README.md").read_text()
    page = (ROOT / "docs/results/picks.md").read_text()
    pooled = [study["pooled"]["summary"]] if "pooled" in study else []
    for summary in (now, before, *(row["summary"] for row in study["earlier"]), *pooled):
        row = (
            f"| {summary['picks_fastest']} | {summary['within_noise']} | "
            f"{summary['worst_regret']:.2f} | {summary['median_regret']:.2f} | "
            f"{summary['regret_over_1.10']} | {summary['median_spearman']:.2f} |"
        )
        assert row in page, row
    for name, path in (("dev", "picks_cpu_dev.json"), ("judge", "picks_cpu.json")):
        errors = json.loads((ROOT / "bench/results" / path).read_text())["estimate_over_measured"]
        cells = " | ".join(
            f"{errors[k][0]:.2f} ({errors[k][1]:.2f} to {errors[k][2]:.2f}), {errors[k][3]}"
            for k in ("gathered", "exchanged", "dense")
        )
        assert f"| {name} | {cells} |" in page, name
    assert now["picks_fastest"].replace(" of ", " of ") in readme.replace("\n  ", " ")
    assert f"worst regret {now['worst_regret']:.2f}" in readme.replace("\n  ", " ")


def test_auto_weighs_every_expert_group_by_the_same_count():
    """With expert_group=auto the exchange's candidate is the fastest of the groups the
    layers can run that fits (the context devices; with fsdp too), each priced by the
    same count; the report lists each, and re-planning at another shape keeps the
    group that won."""
    from selector.report import render_text

    cfg = typed(
        "ici_fsdp_parallelism=2",
        "ici_context_parallelism=4",
        "per_device_batch_size=0.25",
        "max_target_length=2048",
        "num_experts=16",
    )
    plan = selector.resolve(cfg)
    cand = plan.candidate(Dispatch.megablox, Exchange.all_to_all)
    groups = {p.group_axes: est for p, est in cand.groups}
    assert set(groups) == {("context",), ("fsdp", "context")}
    best = min(groups, key=lambda g: groups[g].time_s)
    assert cand.placement.group_axes == best and cand.estimate is groups[best]
    for axes, est in groups.items():
        forced = "expert_sequence_and_fsdp" if "fsdp" in axes else "expert_and_sequence"
        alone = selector.resolve(cfg.replace(expert_group=selector.ExpertGroup(forced)))
        assert alone.candidate(Dispatch.megablox, Exchange.all_to_all).estimate.time_s == (
            est.time_s
        )
    text = render_text(cfg, plan, list(plan.findings))
    assert "expert groups weighed: context " in text and "fsdp+context " in text
    if plan.placement.exchange is Exchange.all_to_all:
        assert plan.shaped_config(2, 4096).expert_group is plan.placement.group


def test_the_gmm_loops_ops_and_trips_counted_by_hand():
    """tiled_gmm's loops over one call, by hand (`TILE_OPS` 11 and 8 a trip with two or
    one weights, + 1 each; 2 ops a loop's setup, 5 loops on an array of 4 classes and a
    tail; the weight gradient 14 + 1 an expert, 5 a big tile, 4 a smaller one, + 2):
    serving runs two row passes; training four more row passes' worth when exchanged
    (the recomputed gate and up) and three weight gradients; the other kernels visit
    rows, not tiles."""
    from types import SimpleNamespace

    dims = dict(M=64, H=128, xb=4)
    serve = SimpleNamespace(tile=128, train=False, **dims)
    train = SimpleNamespace(tile=128, train=True, **dims)
    eight = [([64] * 8, 512)]  # 8 experts of one 64-row tile: under the big class
    loops = _gmm_loops("tiled_gmm", eight, serve, False)
    assert loops.tiles == ((64, 8),)
    assert (loops.visit_ops, loops.ops) == (8 * (12 + 9), 8 * (12 + 9) + 2 * 5 * 2)
    assert loops.visit_trips == loops.trips == 8 * 2
    loops = _gmm_loops("tiled_gmm", eight, train, True)
    rows = 8 * (12 + 9 + 9 + 12 + 12)  # forward, input gradients, recomputed gate and up
    weight_grads = 3 * (8 * 15 + 8 * 4)
    assert loops.visit_ops == rows + weight_grads
    assert loops.ops == rows + 2 * 5 * 5 + weight_grads + 3 * 2
    assert loops.visit_trips == loops.trips == 8 * 5 + 3 * 8
    one = [([1024], 1024)]  # one expert of two 512-row tiles: the big class
    loops = _gmm_loops("tiled_gmm", one, train, False)
    assert loops.tiles == ((512, 2),)
    assert loops.visit_ops == 2 * (12 + 9 + 9 + 12) + 3 * (15 + 2 * 5)
    assert loops.ops == loops.visit_ops + 2 * 5 * 4 + 3 * 2
    assert loops.visit_trips == 2 * 4 + 3 * (1 + 2)
    # Calls add up (an exchange's slots are many calls).
    both = _gmm_loops("tiled_gmm", eight + one, train, True)
    apart = [_gmm_loops("tiled_gmm", c, train, True) for c in (eight, one)]
    for field in ("ops", "trips", "visit_ops", "visit_trips"):
        assert getattr(both, field) == sum(getattr(a, field) for a in apart), field
    assert both.calls == tuple(sorted(apart[0].calls + apart[1].calls))
    twice = _gmm_loops("tiled_gmm", eight + eight, train, True).calls  # one size, summed
    assert twice == ((apart[0].calls[0][0], 2 * apart[0].calls[0][1]),)
    # A call's matrices are those of its experts with rows: one of 1 row counts, an
    # empty one does not.
    sparse = _gmm_loops("tiled_gmm", [([64, 0, 1], 128)], serve, False).calls
    assert [size for size, _ in sparse] == [(128 * (64 + 128) + 2 * 64 * 128) * 4]
    # Pallas visits `tile`-row tiles over the rows; ragged_dot one dot over them all.
    pallas = SimpleNamespace(tile=64, train=False)
    assert _gmm_loops("pallas_megablox", [([100, 28], 128)], pallas, False).tiles == ((64, 2.0),)
    assert _gmm_loops("ragged_dot", [([100, 28], 128)], serve, False).tiles == ((128, 1.0),)
    assert _gmm_loops("ragged_dot", [([0, 0], 16)], serve, False).tiles == ((1, 1.0),)
    assert _gmm_loops("ragged_dot", [([0, 0], 16)], serve, False).ops == 0


def test_a_gathered_call_past_the_cache_streams_its_visits_and_the_report_says_so():
    """Training over context 8 with E=24, k=6, 8,192 tokens, emb 192, hidden 384 (float32):
    the gathered block's one call works over 6,144 routed rows in and out and 24
    matrices, 21.2 MB, past the machine's 16 MiB, so each of a visit's 9 dots streams its
    tile's rows and its matrix at the measured rate; the exchange's slots fit and stream
    nothing. The report names the gathered block's streamed GB, the exchange's none."""
    from selector.report import render_time
    from selector.tiles import tiled_gmm_visits, uniform_group_sizes

    over = (
        "ici_context_parallelism=8",
        "ici_fsdp_parallelism=1",
        "ici_data_parallelism=1",
        "base_emb_dim=192",
        "base_moe_mlp_dim=384",
        "num_experts=24",
        "num_experts_per_tok=6",
        "max_target_length=8192",
        "per_device_batch_size=0.125",
        "capacity_factor=0",
    )
    cfg, plan, p = problem(*over)
    hw = cfg.hardware
    assert (p.T, p.E, p.k, p.M, p.H, p.xb, hw.cache_mib) == (1024, 24, 6, 192, 384, 4, 16.0)
    gathered = plan.candidate(Dispatch.megablox, Exchange.gather).estimate
    call = (6144 * (192 + 384) + 24 * 192 * 384) * 4
    assert call == 21_233_664 > 16 * 2**20
    visits = tiled_gmm_visits(uniform_group_sizes(6144, 24), 6144).tiles
    moved = 9 * sum(n * (t * (192 + 384) + 192 * 384) * 4 for t, n in visits)
    assert gathered.work.gmm_calls == ((call, moved),)
    assert gathered.work.streamed_bytes(hw.cache_mib * 2**20) == moved
    bare = price(dataclasses.replace(gathered.work, gmm_calls=()), hw)
    assert gathered.time_parts.memory - bare.memory == pytest.approx(
        moved / (hw.gmm_streamed_gbps * 1e9)
    )
    exchanged = plan.candidate(Dispatch.megablox, Exchange.all_to_all).estimate.work
    assert exchanged.gmm_calls and exchanged.streamed_bytes(hw.cache_mib * 2**20) == 0
    text = " ".join(" ".join(render_time(cfg, plan)).split())  # one line, single spaces
    gather_part = text.split("megablox/gather", 1)[1].split("megablox/all_to_all", 1)[0]
    assert f"{moved / 1e9:.3g} GB of tile visits streamed past the cache" in gather_part
    exchange_part = text.split("megablox/all_to_all", 1)[1].split(" dense ", 1)[0]
    assert "streamed" not in exchange_part
    assert f"streamed {hw.gmm_streamed_gbps:g} GB/s" in priced_by(hw)
