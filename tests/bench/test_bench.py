"""The benchmarks a user runs still agree with what they stored: each `--check`
recomputes one cheap point and compares it with its bench/results JSON, so a change of
the count (or, on the stack the JSON was written with, of the compiled program) that
leaves a stored result stale fails here."""

from __future__ import annotations

import subprocess
import sys

import pytest
from subproc import ROOT, probe_env


def _check(study: str, devices: int) -> str:
    """`python -m bench.<study> --check` in a fresh process: its output, when it passed."""
    out = subprocess.run(
        [sys.executable, "-m", f"bench.{study}", "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=probe_env(devices),
        timeout=600,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    return out.stdout


@pytest.mark.parametrize("study", ["memory", "train_memory", "speed", "gmm", "compose"])
def test_benchmark_check_agrees_with_its_stored_json(study):
    assert "agree with" in _check(study, 8)


def test_a_stale_stored_number_fails_the_check(monkeypatch, capsys):
    """The comparison bites: a counted column that moved, or a row not stored, is named."""
    from bench import common

    stored = {"machine": {"jax": "none"}, "rows": [{"variant": "a", "cp": 2, "mib": 10.0}]}
    monkeypatch.setattr(common, "load", lambda study: stored)
    same = [{"variant": "a", "cp": 2, "mib": 10.0}]
    assert common.check_stored("x", same, ("variant", "cp"), ("mib",)) == 0
    moved = [{"variant": "a", "cp": 2, "mib": 10.5}]
    assert common.check_stored("x", moved, ("variant", "cp"), ("mib",)) == 1
    assert "mib of ['a', 2]: 10.5 now, 10 stored" in capsys.readouterr().out
    missing = [{"variant": "b", "cp": 2, "mib": 10.0}]
    assert common.check_stored("x", missing, ("variant", "cp"), ("mib",)) == 1
    # Compiled bytes are compared only on the stack the JSON was written with.
    assert common.check_stored("x", moved, ("variant", "cp"), (), ("mib",)) == 0


def test_the_readme_memory_table_is_read_from_memory_json():
    """The README's memory-against-cp table is the stored study's summary, as
    `bench.report` prints it: a re-run that moves a number makes the README stale here."""
    from bench.common import CP_RATIO_COLUMNS, load, table

    readme = (ROOT / "README.md").read_text()
    assert table(load("memory")["summary"], CP_RATIO_COLUMNS) in readme


@pytest.mark.parametrize(
    "study, page, columns",
    [
        ("memory", "docs/results/memory.md", "MEMORY_COLUMNS"),
        ("train_memory", "docs/results/train-memory.md", "TRAIN_COLUMNS"),
        ("speed", "docs/results/speed.md", "SPEED_COLUMNS"),
        ("gmm", "docs/results/gmm.md", "GMM_COLUMNS"),
    ],
)
def test_a_results_page_quotes_its_stored_json(study, page, columns):
    """A study's page shows its rows as `bench.report` prints them from the JSON."""
    from bench import common

    rows = common.load(study)["rows"]
    assert common.table(rows, getattr(common, columns)) in (ROOT / page).read_text()


@pytest.mark.parametrize(
    "study, page",
    [
        ("scale", "docs/results/scale.md"),
        *((s, "docs/results/scale-targets.md") for s in ("scale_gpu", "scale_tpu")),
        *((f"{s}_jax012", "docs/results/scale-targets.md") for s in ("scale_gpu", "scale_tpu")),
    ],
)
def test_the_scale_pages_quote_todays_count_of_their_compiles(study, page):
    """Each scale study's table (sequence 8192 on the CPU page) is on its page as the JSON
    gives it, and the JSON's predictions are today's count (`bench.scale --check`)."""
    from bench import common

    rows = [r for r in common.load(study)["rows"] if r["seq"] == 8192]
    assert common.table(rows, common.SCALE_COLUMNS) in (ROOT / page).read_text()


def test_bench_scale_check_recounts_every_stored_prediction():
    assert _check("scale", 64).count("agree with") == 5


def _stored(study: str) -> dict:
    from bench.common import load

    return load(study)


def _readme_prose() -> str:
    return " ".join((ROOT / "README.md").read_text().split())


def test_the_design_page_quotes_the_stored_compose_times():
    """docs/design.md's compose times are bench/results/compose.json's medians."""
    summary = _stored("compose")["summary"]
    page = " ".join((ROOT / "docs" / "design.md").read_text().split())
    quoted = (
        f"{summary['hydra_ms_median']:.0f} ms a compose by Hydra's whole path against "
        f"{summary['kept_ms_median']:.1f} ms, {summary['ratio_median']:.1f}x"
    )
    assert quoted in page


def test_the_readme_limits_quote_the_stored_results():
    """Each number the README's limits quote, recomputed from its result file: the CPU
    picks, the picks on the H200 then and rescored, the memory model held out per stack
    and chip, and the whole-step judge sets with the margin."""
    import collections

    readme = _readme_prose()
    picks = _stored("picks_cpu")["summary"]
    fastest, configs = picks["picks_fastest"].split(" of ")
    assert f"CPU picks: {fastest} of {configs} the measured fastest" in readme
    assert f"worst regret {picks['worst_regret']:.2f}" in readme
    study = _stored("picks_cpu")
    pooled, same = study["pooled"], study["earlier_timings"]["reproduced"]["same_fastest"]
    assert (
        f"pooled {pooled['summary']['picks_fastest']}, worst "
        f"{pooled['summary']['worst_regret']:.2f} (runs agree on the fastest in {same})"
    ) in readme

    then = _stored("on_device_h200")["summary"]
    now = _stored("on_device_h200_rescored")["summary"]
    assert f"worst {then['worst_regret']:.2f};" in readme
    assert (
        f"{now['picks_fastest']} of {now['pick_timed']}, worst {now['worst_regret']:.2f}" in readme
    )

    within, folded = collections.Counter(), collections.Counter()
    for r in _stored("memory_holdout")["rows"]:
        near = abs(float(r["error"].rstrip("%"))) <= 20
        if r["exchange"] == "all_to_all_fsdp":  # the fsdp-folded group's set, scored apart
            folded[r["stack"].split(",")[0]] += near
            continue
        within[(r["stack"].split(",")[0], r["chip"])] += near
    old, new = "jax 0.10.2", "jax 0.12.0.1"
    assert (
        f"{within[old, 'v5p']} and {within[old, 'h200']} of 40 points (jax 0.10.2), "
        f"{within[new, 'v5p']} and {within[new, 'h200']} of 40 (jax 0.12)"
    ) in readme
    assert f"expert group {folded[old]} and {folded[new]} of 42" in readme

    judged = _stored("margins")["judged"]
    maxtext = judged["tpu/maxtext"]
    errors = [r["error"] for r in maxtext["rows"]]
    near = sum(abs(e) <= 0.10 for e in errors)
    assert (
        f"{near} of {len(errors)} within 10% ({min(errors):+.0%} to {max(errors):+.0%})" in readme
    )
    under, over = maxtext["margin"]
    assert f"v5p, MaxText route: -{under:.0%}/+{over:.0%}" in readme

    def own(route: str, study: str) -> str:
        rows = [r for r in judged[route]["rows"] if r["study"] == study]
        return f"{sum(abs(r['error']) <= 0.15 for r in rows)} of {len(rows)}"

    v5p, h200 = own("tpu/native", "step_compile"), own("gpu/native", "step_compile_gpu")
    assert f"within 15% at {v5p} points on v5p and {h200} on H200" in readme


@pytest.mark.parametrize("study", ["picks_cpu", "picks_cpu_dev"])
def test_the_picks_studies_are_scored_by_todays_count(study):
    """The stored picks, regrets and estimates are what today's selector gives on the
    stored timings (`python -m bench.picks [--set dev]` re-scores them): a change of the
    time count that moves a pick leaves the JSON, and the numbers quoted from it, stale."""
    import json

    from bench.picks import count_error, score, summary

    stored = json.loads((ROOT / "bench" / "results" / f"{study}.json").read_text())
    decisions = score(stored["rows"])
    assert [(d["pick"], d["estimated_ms"]) for d in decisions] == [
        (d["pick"], d["estimated_ms"]) for d in stored["decisions"]
    ]
    assert summary(decisions) == stored["summary"]
    assert count_error(decisions) == stored["estimate_over_measured"]


def test_two_timing_runs_are_compared_by_their_fastest_and_relative_times():
    """`reproduced` says in how many configs two runs measured the same fastest, and how
    each other candidate's time relative to its config's fastest moved: a machine twice
    as slow overall moves nothing, a flipped order is counted."""
    from bench.picks import reproduced

    earlier = [
        {"label": "a", "times_s": {"x": [1.0], "y": [2.0]}},
        {"label": "b", "times_s": {"x": [1.0], "y": [1.5]}},
    ]
    slower = [
        {"label": r["label"], "times_s": {n: [2 * t[0]] for n, t in r["times_s"].items()}}
        for r in earlier
    ]
    assert reproduced(earlier, slower) == {
        "same_fastest": "2 of 2",
        "relative_time_ratio": [1.0, 1.0, 1.0],
    }
    flipped = [earlier[0], {"label": "b", "times_s": {"x": [1.5], "y": [1.0]}}]
    got = reproduced(earlier, flipped)
    assert got["same_fastest"] == "1 of 2"
    assert got["relative_time_ratio"][2] == 1.5  # x: 1.5 over the fastest, was 1


def test_runs_are_pooled_by_each_runs_order_not_its_speed():
    """`pooled` scales each run's rounds to its config's fastest median: a run twice as
    slow overall weighs the same as the first, so two runs that disagree on the order
    pool to the candidate ahead on the two together; a candidate or config that a run
    did not time is left out."""
    from bench.picks import pooled

    first = [
        {"label": "a", "times_s": {"x": [1.0, 1.0], "y": [1.2, 1.2]}},
        {"label": "b", "times_s": {"x": [1.0], "y": [2.0]}},
    ]
    # Twice as slow overall; in "a" y is now ahead, by less than x was.
    second = [
        {"label": "a", "times_s": {"x": [2.2, 2.2], "y": [2.0, 2.0], "z": [9.0, 9.0]}},
        {"label": "c", "times_s": {"x": [1.0], "y": [2.0]}},
    ]
    (a,) = pooled([first, second])
    assert a["label"] == "a" and set(a["times_s"]) == {"x", "y"}
    assert a["times_s"]["x"] == pytest.approx([1.0, 1.0, 1.1, 1.1])
    assert a["times_s"]["y"] == pytest.approx([1.2, 1.2, 1.0, 1.0])
    # x: median 1.05, y: 1.1 -> x ahead on the two runs together.
    medians = {n: sorted(t)[1:3] for n, t in a["times_s"].items()}
    assert sum(medians["x"]) < sum(medians["y"])


def test_the_targets_page_quotes_todays_count_of_its_compiles():
    """Both stacks' small-block tables are on the page as their JSON gives them, and the
    JSON's predictions are today's count (`bench.targets --check`)."""
    from bench import common
    from bench.targets import COLUMNS, check

    page = (ROOT / "docs/results/targets.md").read_text()
    for study in ("targets", "targets_jax012"):
        assert common.table(common.load(study)["small"], COLUMNS) in page, study
    assert check() == 0


def test_the_gmm_curve_credits_the_tiles_tiled_gmm_visits():
    """Each point of the CPU gmm curve times the tile it names: eight experts visit
    eight tiles of that size, 16 and 32 rows (arrays under 32 and 64 rows) included. Eight experts
    of 32 rows on a 256-row array run 64-row tail tiles, so a 32-row point laid out that
    way, credited with 32 rows, halves the rate of the visits it timed."""
    from bench.calibration.machine import GMM_EXPERTS, GMM_TILES, gmm_visits
    from selector.tiles import tiled_gmm_visits

    assert tiled_gmm_visits([32] * 8, 256).tiles == ((64, 8),)
    assert {16, 32} <= set(GMM_TILES)
    for tile in GMM_TILES:
        for experts in (GMM_EXPERTS, 4, 2, 1):
            assert gmm_visits(tile, experts) == (tile, experts)


def test_the_gmm_curve_times_calls_that_fit_in_the_cache():
    """Every stored gmm curve point was timed on a call whose arrays fit in the cache
    the machine study read (the count prices a bigger call's streaming apart, so a
    point that streamed would count it twice), with the most experts (8, 4, 2, 1) that
    fit. Points stored before the study kept their experts ran 8."""
    from bench import common
    from bench.calibration.machine import GMM_EXPERTS, _dims, gmm_experts, gmm_layout
    from selector.timing import gmm_call_bytes

    study = common.load("machine_cpu")
    cache = study["constants"]["cache_mib"]
    assert cache > 0
    fewer = 0
    for point in study["gmm_curve"]:
        tile, k, n = _dims(point["shape"])
        experts = point.get("experts", GMM_EXPERTS)
        assert experts == gmm_experts(tile, k, n, cache), point["shape"]
        call = gmm_call_bytes(gmm_layout(tile, experts)[1], experts, k, n, 4)
        assert call <= cache * 2**20 and call / 1e6 == pytest.approx(
            point.get("call_mb", call / 1e6)
        )
        fewer += experts < GMM_EXPERTS
    assert fewer == 6  # the 640 x 1280 points, tiles of 16 to 512 rows
    # 8 experts of 512 x 640 x 1280 (29 MB of rows and 26 MB of matrices) do not fit in
    # 16 MiB; two (14 MB) do. 8 of 512 x 192 x 384 (12 MB) do.
    assert gmm_experts(512, 640, 1280, 16.0) == 2 and gmm_experts(512, 192, 384, 16.0) == 8


def test_the_streaming_rate_is_a_visits_bytes_over_what_it_adds():
    """Per shape and pass: a visit's bytes over the median visit of the calls past twice
    the cache less that of the calls under half of it (the calls between left out);
    the median over shapes and passes. The stored study gives the rate cpu.yaml holds."""
    from bench import common
    from bench.calibration.machine import GMM_PASSES, gmm_streaming_rate

    def row(call_mb, ms):
        visit = {"forward": ms, "input_grad": ms / 2, "weight_grad": 2 * ms}
        return {
            "shape": "8x8x8",
            "call_mb": call_mb,
            "visit_mb": 2.0,
            "cache_mib": 10.0,
            "ms_a_visit": visit,
        }

    # cache 10 MiB = 10.49 MB: fits under 5.24, streams over 20.97
    rows = [row(1.0, 1.0), row(5.0, 3.0), row(15.0, 50.0), row(21.0, 5.0), row(40.0, 7.0)]
    # forward: 2 MB over (6 - 2) ms; input gradient over 2 ms; weight gradient over 8 ms
    assert gmm_streaming_rate(rows) == pytest.approx(0.5)
    study = common.load("machine_cpu")
    rows = study["gmm_streaming"]
    assert gmm_streaming_rate(rows) == pytest.approx(study["constants"]["gmm_streamed_gbps"])
    shapes = {r["shape"] for r in rows}
    assert len(shapes) == 3
    cache = study["constants"]["cache_mib"] * 2**20 / 1e6
    for shape in shapes:
        of = [r for r in rows if r["shape"] == shape]
        assert sum(r["call_mb"] <= cache / 2 for r in of) == 3
        assert sum(r["call_mb"] >= 2 * cache for r in of) == 2
        assert all(set(r["ms_a_visit"]) == set(GMM_PASSES) for r in of)


def test_a_gmm_points_reps_each_run_their_own_rows():
    """The gmm curve times a visit inside a loop of calls, so each rep must compute on
    its own slice of rows (a rep on the same rows would be loop invariant, and XLA may
    hoist it): the looped forward and input gradient are each slice's pass alone, one
    after another, and the weight gradient their sum."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench.calibration.machine import _gmm_passes

    tile, experts, k, n, reps = 32, 4, 8, 16, 3
    looped = _gmm_passes(tile, experts, k, n, reps)
    single = _gmm_passes(tile, experts, k, n, 1)
    keys = iter(jax.random.split(jax.random.key(0), 12))
    for i, ((body, *shapes), (alone, *_)) in enumerate(zip(looped, single, strict=True)):
        args = [jax.random.normal(next(keys), s, jnp.float32) for s in shapes]
        rows = shapes[0][0] // reps
        parts = [
            alone(*(a[r * rows : (r + 1) * rows] if a.shape[0] == reps * rows else a for a in args))
            for r in range(reps)
        ]
        whole = sum(parts) if i == 2 else jnp.concatenate(parts)
        np.testing.assert_allclose(body(*args), whole, rtol=1e-5, atol=1e-5)
        same_rows = reps * parts[0] if i == 2 else jnp.concatenate([parts[0]] * reps)
        assert not np.allclose(body(*args), same_rows, rtol=1e-5)


def test_the_gmm_pass_curves_come_from_each_points_passes():
    """conf/hardware's gradient curves are read off the points' per-pass rates; a point
    stored before the passes were kept apart gives none."""
    from bench.calibration.machine import GMM_PASS_CURVES, pass_curve

    points = [
        {
            "shape": "64x8x16",
            "mflops": 1.0,
            "tflops": 0.02,
            "passes": {"forward": 0.02, "input_grad": 0.03, "weight_grad": 0.01},
        },
        {"shape": "128x8x16", "mflops": 2.0, "tflops": 0.04},
    ]
    assert set(GMM_PASS_CURVES.values()) == {"input_grad", "weight_grad"}
    assert pass_curve(points, "weight_grad") == [
        {"shape": "64x8x16", "mflops": 1.0, "tflops": 0.01}
    ]
