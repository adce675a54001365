"""Compile mode: the chosen candidate and the runner-up compiled for the config's chips,
XLA's memory beside the estimate, and a choice that follows the compiled numbers.

The CPU cases compile on this process's 8 simulated devices; the TPU case compiles for
8 abstract v5p chips through libtpu in a subprocess, through the CLI as a user runs it.
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from subproc import ROOT

import selector
from checks.compile_mode import check

SMALL = [
    "model=tiny",
    "mesh=cpu_8",
    "ici_fsdp_parallelism=2",
    "ici_context_parallelism=4",
    "max_target_length=2048",
    "per_device_batch_size=0.25",
    "context_parallel_load_balance=false",
]


def small(*more: str) -> selector.Config:
    return selector.to_config(selector.compose([*SMALL, *more]))


@pytest.fixture(scope="module")
def compiled_small(jax_cpu8):
    """The small config's check, with every compile it made recorded."""
    from checks.compiled import compile_candidate

    made = {}

    def recording(config, strategy, exchange):
        made[(strategy, exchange)] = compile_candidate(config, strategy, exchange)
        return made[(strategy, exchange)]

    plan, findings, result = check(small(), compile_fn=recording)
    return plan, findings, result, made


def test_chosen_and_runner_up_compiled_with_xla_numbers(compiled_small, jax_cpu8):
    """The chosen candidate and the runner-up are compiled; each row holds what XLA's
    memory analysis says of a block built from the returned plan."""
    from flax import nnx

    import layers
    from layers.programs import compile_fwd_bwd

    plan, findings, result, made = compiled_small
    assert len(result.compiled) == 2 and not result.changed
    assert result.compiled[0].name == plan.chosen_estimate.name
    runner_up = result.compiled[1].name
    assert runner_up != result.compiled[0].name
    # The plan the check returns builds the block that was compiled.
    mesh = layers.make_mesh({a: s for a, s in plan.mesh.sizes if s > 1})
    block = nnx.eval_shape(lambda: layers.MoEBlock(small(), mesh=mesh, plan=plan, rngs=nnx.Rngs(0)))
    memory = compile_fwd_bwd(block, 2, 2048).memory_analysis()
    assert result.compiled[0].compiled.temp == memory.temp_size_in_bytes
    assert result.compiled[0].compiled.arguments == memory.argument_size_in_bytes
    for c in result.compiled:
        assert c.flops > 0 and c.bytes_accessed > 0  # XLA's cost analysis, read
        assert c.device_bytes > c.compiled.temp


def test_choice_follows_compiled_memory_when_estimate_is_wrong(compiled_small):
    """A compiler whose program for the estimated choice is 50x larger than estimated
    (XLA's own numbers, scaled): with a chip between the two candidates' compiled
    totals, the estimate's choice no longer fits, the runner-up does, and the check
    switches to it and says why."""
    plan, _, result, made = compiled_small
    first, second = result.compiled
    key_first = next(k for k, v in made.items() if v.name == first.name)

    def inflating(config, strategy, exchange):
        numbers = made[(strategy, exchange)]
        if (strategy, exchange) == key_first:
            return dataclasses.replace(numbers, temp=numbers.temp * 50)
        return numbers

    limit_gib = (second.device_bytes + first.compiled.temp * 10) / 2**30
    config = small(f"hardware.memory_gib={limit_gib}")
    new_plan, findings, changed = check(config, compile_fn=inflating)
    assert changed.changed and new_plan.chosen_estimate.name == second.name
    codes = [f.code for f in findings]
    assert "COMPILED_FIT_DIFFERS" in codes and "COMPILED_MEMORY_EXCEEDED" not in codes
    assert new_plan.reason.startswith("compiled for cpu, 8 simulated devices")
    # Without the inflation the estimate's choice stands.
    same_plan, _, same = check(config, compile_fn=lambda c, s, e: made[(s, e)])
    assert not same.changed and same_plan.strategy is plan.strategy


def test_compiled_program_that_does_not_fit_is_an_error(compiled_small):
    """With a chip smaller than every compiled candidate: COMPILED_MEMORY_EXCEEDED, an
    error, and resolve-by-compile raises it."""
    _, _, _, made = compiled_small
    config = small("hardware.memory_gib=0.0001")
    plan, findings, result = check(
        config, compile_fn=lambda c, s, e: made.get((s, e)) or _real(c, s, e)
    )
    assert "COMPILED_MEMORY_EXCEEDED" in [f.code for f in findings]
    assert all(not c.fits for c in result.compiled)


def _real(config, strategy, exchange):
    from checks.compiled import compile_candidate

    return compile_candidate(config, strategy, exchange)


def test_missing_plugin_exits_2_naming_the_extra(monkeypatch, capsys):
    from selector import cli, targets

    def unavailable(config, live_shape=None, **_):
        raise targets.TargetUnavailable('install it with pip install "moe-cp[tpu]"')

    monkeypatch.setattr("selector.cli.check_mode", lambda name: unavailable)
    assert cli.main(["model=tiny", "compile=true"]) == 2
    err = capsys.readouterr().err
    assert "moe-cp[tpu]" in err and "Traceback" not in err


def test_cli_compiles_for_v5p_and_reports_both(tmp_path):
    """`python -m selector ... compile=true` for 8 v5p chips: progress on stderr, the
    compiled table on stdout, JSON with XLA's numbers."""
    pytest.importorskip("libtpu", reason='needs the tpu extra: pip install ".[tpu]"')
    args = [
        "model=tiny",
        "hardware=v5p",
        "num_devices=8",
        "ici_fsdp_parallelism=2",
        "ici_context_parallelism=4",
        "max_target_length=2048",
        "per_device_batch_size=0.25",
        "dtype=bfloat16",
        "compile=true",
        "output=json",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "selector", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "compiling" in out.stderr and "Traceback" not in out.stderr
    report = json.loads(out.stdout)
    compiled = report["compiled"]
    assert compiled["target"] == "v5p, 8 chips (2x2x2)"
    assert len(compiled["candidates"]) == 2
    for c in compiled["candidates"]:
        assert c["compiled"]["temp"] > 0 and c["flops"] > 0
    assert report["plan"]["candidates"]  # the plan after compiling
    # A training config compiles the whole step; a megablox step on TPU runs tiled_gmm
    # (Pallas does not lower in the checkpointed scan), and the report says so.
    assert all(c["step"]["optimizer"] > 0 for c in compiled["candidates"])
    megablox = [c for c in compiled["candidates"] if c["name"].startswith("megablox")]
    codes = [f["code"] for f in report["findings"]]
    assert ("STEP_COMPILED_WITH_OTHER_GMM" in codes) == bool(megablox)
