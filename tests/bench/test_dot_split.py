"""bench.calibration.dot_split times a candidate without its tile dots: the stand-in must
be what the timed program runs, and leave the rest of the program as it was."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

# A small training block, the gathered weights: E=8, k=2, 64 tokens a device.
POINT = ({"context": 8}, 8, 2, 512, 64, 128, "train")


def _dots(fn, args) -> int:
    return fn.lower(*args).as_text().count("dot_general")


def test_the_stand_in_dots_keep_each_tiles_shape_and_dtype(jax_cpu8):
    from bench.calibration.dot_split import rank_one_dot, rank_one_xt_dy
    from layers import grouped_matmul

    x, w, dy = (jnp.ones(s, jnp.bfloat16) for s in ((64, 32), (32, 48), (64, 48)))
    for a, b, t in ((x, w, False), (dy, w, True)):
        real, stand_in = grouped_matmul._dot(a, b, t), rank_one_dot(a, b, t)
        assert (stand_in.shape, stand_in.dtype) == (real.shape, real.dtype)
    real, stand_in = grouped_matmul._xt_dy(x, dy), rank_one_xt_dy(x, dy)
    assert (stand_in.shape, stand_in.dtype) == (real.shape, real.dtype)


def test_the_step_without_dots_runs_the_stand_in_and_only_there(jax_cpu8):
    """Compiled while the stand-ins are in place (a step traced after they are put back
    would time the real dots twice): it lowers to fewer dot_generals than the real step
    but some (the tile dots go, the router's stay), it runs to finite values, and the
    module's real dots are back afterwards."""
    from bench import picks
    from bench.calibration.dot_split import without_dots
    from checks.measured import _step
    from layers import grouped_matmul

    config = picks.config_of(POINT)
    real_dot = grouped_matmul._dot
    stand_in = without_dots(config)
    assert grouped_matmul._dot is real_dot
    whole = _step(config, config.dispatch, config.expert_exchange)
    without, with_all = _dots(*stand_in), _dots(*whole)
    assert 0 < without < with_all
    out = jax.tree.leaves(stand_in[0](*stand_in[1]))
    assert all(bool(jnp.isfinite(v).all()) for v in out)


def test_the_split_quoted_on_the_picks_page_is_the_studys():
    """docs/results/picks.md quotes the stored study's table whole, row by row."""
    import json

    from subproc import ROOT

    from bench.calibration.dot_split import COLUMNS, STUDY
    from bench.common import table

    rows = json.loads((ROOT / f"bench/results/{STUDY}.json").read_text())["rows"]
    page = (ROOT / "docs/results/picks.md").read_text()
    assert rows and table(rows, COLUMNS) in page


def test_the_counted_parts_add_up_to_the_estimate():
    import selector
    from bench import picks
    from bench.calibration.dot_split import counted

    config = picks.config_of(POINT)
    dots, rest = counted(config)
    assert dots > 0 and rest > 0
    assert dots + rest == pytest.approx(selector.resolve(config).chosen_estimate.time_s)


def test_the_stored_split_is_counted_by_todays_selector():
    """The stored counted columns are today's count of the stored timings
    (`python -m bench.calibration.dot_split --score` counts them again): a change of
    the count that leaves the study stale fails here."""
    import json

    from subproc import ROOT

    from bench.calibration.dot_split import STUDY, recounted

    rows = json.loads((ROOT / f"bench/results/{STUDY}.json").read_text())["rows"]
    for stored, now in zip(rows, recounted(rows), strict=True):
        for key in ("counted_dots_ms", "counted_rest_ms", "dots_ratio", "rest_ratio"):
            assert now[key] == pytest.approx(stored[key], rel=1e-9), (stored["config"], key)


def test_the_numbers_the_picks_page_draws_from_the_split_are_the_studys():
    """The prose under the split's table: the count over the measured step by kind
    (median, range), the dots' and the rest's medians, the megablox picks on this run's
    timings, and how many candidates' dots are counted within 25%, each recomputed from
    the stored study."""
    import json
    import statistics

    from subproc import ROOT

    from bench.calibration.dot_split import STUDY

    rows = json.loads((ROOT / f"bench/results/{STUDY}.json").read_text())["rows"]
    page = " ".join((ROOT / "docs/results/picks.md").read_text().split())

    def kind(name):
        return [r for r in rows if name in r["candidate"]]

    whole = {}
    for name in ("gather", "all_to_all"):
        ratios = [
            (r["counted_dots_ms"] + r["counted_rest_ms"]) / r["measured_ms"] for r in kind(name)
        ]
        whole[name] = f"{statistics.median(ratios):.2f} ({min(ratios):.2f} to {max(ratios):.2f})"
    assert (
        f"the count is {whole['gather']} of the gathered programs' time and "
        f"{whole['all_to_all']} of the exchanged ones'"
    ) in page
    dots = {
        n: statistics.median(r["dots_ratio"] for r in kind(n)) for n in ("gather", "all_to_all")
    }
    rest = {
        n: statistics.median(r["rest_ratio"] for r in kind(n)) for n in ("gather", "all_to_all")
    }
    assert (
        f"Dots: counted {dots['gather']:.2f} (gathered) and {dots['all_to_all']:.2f} (exchanged)"
    ) in page
    assert f"the rest {rest['gather']:.2f} and {rest['all_to_all']:.2f}" in page
    by_config: dict[int, list[dict]] = {}
    for r in rows:
        by_config.setdefault(r["dev"], []).append(r)
    choices = [c for c in by_config.values() if len(c) > 1]
    right = sum(
        min(c, key=lambda r: r["counted_dots_ms"] + r["counted_rest_ms"])
        is min(c, key=lambda r: r["measured_ms"])
        for c in choices
    )
    assert f"picks the fastest megablox candidate in {right} of {len(choices)} configs" in page
    near = sum(0.8 <= r["dots_ratio"] <= 1.25 for r in rows)
    assert f"within 25% of what they take for {near} (" in page
    assert f"({len(rows)} candidates of the 20 dev configs)" in page
