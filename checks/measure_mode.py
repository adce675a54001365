"""Measure mode (`measure=true`): the top candidates timed on this process's devices at
the configured shape, and a choice that follows the measured medians.

The estimate's time is a model; a user with devices can ask for the answer. The chosen
candidate and the others that fit (up to `MAX_TIMED`, fastest estimated first) are
compiled and run interleaved, round after round (one timed step of each per round, so
a noisy machine slows them alike, each after an untimed step of the same candidate),
and the fastest median among those that fit wins.
`measure_save=PATH` writes what was timed beside what was counted (JSON); the counted
model never reads it back: its constants are the machine's (`python -m bench.calibration.machine`).

The selector calls `check` through the `moe_cp.checks` entry point (`measure`). The
logic here is pure; timing needs jax and the layers, imported only when the check runs
(`time_fn` defaults to `checks.measured.time_candidates`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

from selector.checked import Key, MeasureCheck, MeasuredCandidate
from selector.config import Config, Dispatch
from selector.cost import Estimate
from selector.findings import Finding, errors_in, warning
from selector.plan import Candidate, DispatchPlan, analyse

from .compile_mode import replan

MAX_TIMED = 3  # candidates timed: the estimate's choice and the next that fit


def _default_time(config: Config, keys: list[Key], rounds: int) -> dict[Key, list[float]]:
    from .measured import time_candidates  # jax only when timing

    return time_candidates(config, keys, rounds)


def check(
    config: Config,
    live_shape: dict | None = None,
    *,
    time_fn: Callable[[Config, list[Key], int], dict[Key, list[float]]] | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[DispatchPlan | None, list[Finding], MeasureCheck | None]:
    """(plan, findings, measure check). A config with errors is not timed (None).

    `time_fn(config, keys, rounds)` returns each candidate's step times, run interleaved
    on this process's devices."""
    say = progress or (lambda _: None)
    plan, findings = analyse(config, live_shape)
    if plan is None or errors_in(findings):
        return plan, findings, None
    estimates: dict[Key, Estimate] = {(c.strategy, c.exchange): c.estimate for c in plan.candidates}
    first: Key = (plan.strategy, plan.placement.exchange)
    others = sorted(
        (k for k, e in estimates.items() if k != first and e.fits and timeable(config, k)),
        key=lambda k: estimates[k].time_s,
    )
    keys = [first, *others][:MAX_TIMED]
    names = ", ".join(estimates[k].name for k in keys)
    say(f"timing {names} on {plan.mesh.num_devices} devices, {config.measure_rounds} rounds ...")
    times = (time_fn or _default_time)(config, keys, config.measure_rounds)
    measured = {k: MeasuredCandidate(estimates[k], tuple(times[k])) for k in keys}
    for c in measured.values():
        say(f"  {c.name}: median {c.median * 1e3:.3g} ms ({c.estimate.time_s * 1e3:.3g} estimated)")
    fastest = min(measured, key=lambda k: measured[k].median)
    reason = (
        f"measured fastest on {plan.mesh.num_devices} devices: {measured[fastest].name} "
        f"{measured[fastest].median * 1e3:.3g} ms (median of {config.measure_rounds})"
    )
    new_plan, new_findings = replan(config, live_shape, plan, fastest, reason)
    if fastest != first:
        new_findings = [*new_findings, _differs(plan, measured, first, fastest)]
    new_plan = dataclasses.replace(
        new_plan,
        findings=tuple(new_findings),
        candidates=tuple(_verdict(c, measured, fastest) for c in plan.candidates),
    )
    result = MeasureCheck(
        hardware=config.hardware.name,
        devices=plan.mesh.num_devices,
        plan=new_plan,
        estimated_choice=plan.chosen_estimate.name,
        measured=tuple(measured.values()),
    )
    if config.measure_save:
        Path(config.measure_save).write_text(json.dumps(result.as_dict(), indent=1) + "\n")
        say(f"wrote the timings {config.measure_save}")
    return new_plan, new_findings, result


def _verdict(c: Candidate, measured, fastest: Key) -> Candidate:
    """The candidate marked as chosen by the measurement, its verdict the median."""
    key = (c.strategy, c.exchange)
    if key not in measured:
        return dataclasses.replace(c, chosen=False)
    median = f"measured {measured[key].median * 1e3:.3g} ms"
    verdict = f"chosen ({median}, fastest)" if key == fastest else f"slower ({median})"
    return dataclasses.replace(c, verdict=verdict, chosen=key == fastest)


def timeable(config: Config, key: Key) -> bool:
    """A candidate that can run as configured (forcing it raises no error: the capacity
    path needs capacity_factor > 0) and whose dense work is modest (E/k <= 8)."""
    strategy, exchange = key
    if strategy is Dispatch.dense and config.num_experts > 8 * config.num_experts_per_tok:
        return False
    _, found = analyse(config.replace(dispatch=strategy, expert_exchange=exchange))
    return not errors_in(found)


def _differs(plan: DispatchPlan, measured, first: Key, fastest: Key) -> Finding:
    a, b = measured[first], measured[fastest]
    return warning(
        "MEASURED_CHOICE_DIFFERS",
        "measure",
        f"Timed on {plan.mesh.num_devices} devices, the estimate's choice {a.name} took "
        f"{a.median * 1e3:.3g} ms a step (estimated {a.estimate.time_s * 1e3:.3g}) and "
        f"{b.name} {b.median * 1e3:.3g} ms (estimated {b.estimate.time_s * 1e3:.3g}): the "
        f"choice follows the measurement ({b.name}). On a machine whose constants the "
        "hardware preset does not hold, measure them (python -m bench.calibration.machine) and give "
        "them as hardware.* overrides.",
    )
