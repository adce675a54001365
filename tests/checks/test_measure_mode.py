"""Measure mode (`measure=true`, `selector.measure_check`): candidates timed on the 8
simulated CPU devices, a choice that follows the medians, and the timings saved beside
the counted times."""

import json

import pytest
from helpers import codes

import selector
from selector import Dispatch, Exchange
from selector.cli import main

SMALL = [
    "model=tiny",
    "mesh=cpu_8",
    "ici_context_parallelism=4",
    "ici_fsdp_parallelism=2",
    "per_device_batch_size=0.25",
    "max_target_length=256",
]


def _config(*extra):
    return selector.to_config(selector.compose([*SMALL, *extra]))


def test_timed_on_the_devices_and_the_fastest_median_chosen(jax_cpu8):
    """The real timer on 8 simulated devices: the estimate's choice and the others that
    fit are timed, each round; the plan's choice is the candidate with the smallest
    median, whatever the estimate said."""
    check = selector.measure_check(_config("measure_rounds=2"))
    timed = {c.name: c for c in check.measured}
    assert check.estimated_choice in timed and len(timed) >= 2
    assert all(len(c.times) == 2 and min(c.times) > 0 for c in timed.values())
    fastest = min(timed.values(), key=lambda c: c.median)
    assert check.plan.chosen_estimate.name == fastest.name
    chosen = [c for c in check.plan.candidates if c.chosen]
    assert len(chosen) == 1 and "measured" in chosen[0].verdict


def _fixed_times(times_by_name):
    def time_fn(config, keys, rounds):
        name = {
            (Dispatch.megablox, Exchange.gather): "megablox/gather",
            (Dispatch.megablox, Exchange.all_to_all): "megablox/all_to_all",
            (Dispatch.dense, Exchange.gather): "dense",
        }
        return {k: [times_by_name[name[k]]] * rounds for k in keys}

    return time_fn


NAMES = ("megablox/gather", "megablox/all_to_all", "dense")


def test_a_measurement_that_contradicts_the_estimate_wins_and_says_so():
    """Pure: timed slower than another candidate, the estimate's choice loses; the plan
    is the other one's, and MEASURED_CHOICE_DIFFERS gives both numbers. Timed faster, it
    stays."""
    config = _config()
    first = selector.resolve(config).chosen_estimate.name
    other = next(n for n in NAMES if n != first)
    times = {**dict.fromkeys(NAMES, 0.050), first: 0.020, other: 0.010}
    check = selector.measure_check(config, time_fn=_fixed_times(times))
    assert check.changed and check.plan.chosen_estimate.name == other
    assert "MEASURED_CHOICE_DIFFERS" in codes(check.findings)
    same = selector.measure_check(config, time_fn=_fixed_times({**times, first: 0.005}))
    assert not same.changed and "MEASURED_CHOICE_DIFFERS" not in codes(same.findings)


def test_saved_timings_sit_beside_the_counted_times(tmp_path):
    """measure_save writes every timed candidate's rounds and median beside its counted
    time and the parts of it; the estimates never read the file back."""
    path = tmp_path / "cpu_times.json"
    times = {"megablox/all_to_all": 0.020, "megablox/gather": 0.010, "dense": 0.050}
    check = selector.measure_check(_config(f"measure_save={path}"), time_fn=_fixed_times(times))
    saved = json.loads(path.read_text())
    assert saved["hardware"] == "cpu" and saved["choice"] == check.plan.chosen_estimate.name
    for row, c in zip(saved["candidates"], check.measured, strict=True):
        assert row["median_s"] == times[c.name] and row["estimated_s"] == c.estimate.time_s
        parts = row["estimated_parts_s"]
        assert sum(parts.values()) == pytest.approx(row["estimated_s"], rel=1e-12)


def test_a_time_calibration_is_no_longer_a_setting():
    """The fitted time calibration is gone: the key is refused as unknown."""
    with pytest.raises(selector.ConfigError, match="UNKNOWN_SETTING"):
        _config("time_calibration=cpu_times.json")


def test_measure_from_the_command_line(jax_cpu8, capsys):
    assert main([*SMALL, "measure=true", "measure_rounds=1"]) == 0
    out = capsys.readouterr().out
    assert "Timed on 8 cpu devices" in out and "median ms" in out


def test_each_timed_step_follows_a_step_of_the_same_program(monkeypatch):
    """A step's time depends on the program before it (a gathered block ran 37% slower
    after a dense one than after itself, docs/results/picks.md). With settle=1 every
    timed step follows an untimed step of the same call; without it, a timed step
    mostly follows another's. A fake clock charges 10 after another program, 1 after
    the same one."""
    import jax.numpy as jnp

    from checks import measured

    clock, last = [0.0], [None]

    def program(name):
        def run():
            clock[0] += 1.0 if last[0] == name else 10.0
            last[0] = name
            return jnp.zeros(())

        return run, ()

    monkeypatch.setattr(measured.time, "perf_counter", lambda: clock[0])
    fns = {n: program(n) for n in "abc"}
    settled = measured.interleaved(fns, runs=4, settle=1)
    assert settled == {n: [1.0] * 4 for n in "abc"}
    unsettled = measured.interleaved(fns, runs=4)
    assert sum(t == 10.0 for ts in unsettled.values() for t in ts) >= 9
