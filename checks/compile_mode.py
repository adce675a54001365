"""Compile mode (`compile=true`): the chosen candidate and the runner-up compiled for the
config's chips, XLA's memory beside the estimate's, and a choice that follows the
compiled numbers.

The estimate is a fitted model; XLA's memory analysis of the real program is the
answer. Each compiled candidate's per-device total is counted as the estimate counts
it (every MoE layer's state at rest plus this block's peak), from XLA's arguments,
outputs and temp. The choice is made again with the compiled candidates' numbers
(`policy.choose`, the same rule), compiling any new winner too, so a candidate the
estimate wrongly ruled out can win and one it wrongly admitted cannot.

The selector calls `check` through the `moe_cp.checks` entry point (`compile`). The
logic here is pure; compiling needs jax and the layers, imported only when the check
runs, after `checks.jax_start.prepare_process` (`compile_fn` defaults to
`checks.compiled.compile_candidate` on the plan's candidates). XLA:GPU does
not refuse a program larger than the GPU, so the comparison with the chip is ours.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from selector.checked import CompileCheck, CompiledCandidate, Key, StepCompiled
from selector.config import Config, Dispatch, Exchange, Mode
from selector.cost import Estimate, Memory, Verdict, with_memory
from selector.findings import Finding, error, errors_in, warning
from selector.plan import Candidate, DispatchPlan, analyse
from selector.policy import choose

from .jax_start import prepare_process

GIB = 2**30


def _compile_from(plan: DispatchPlan, progress: Callable[[str], None] | None = None):
    """compile_fn for the candidates of `plan`, built from the plan with that candidate
    forced (`checks.compiled.candidate_plan`), not from a new analysis: the whole
    training step of the decoder (`checks.step`) when training, the MoE block's forward
    when prefilling or decoding (the whole-step build is a training step)."""

    def compile_fn(config: Config, strategy: Dispatch, exchange: Exchange):
        if config.mode is Mode.train:
            from .step import compile_candidate_step  # jax only when compiling

            return compile_candidate_step(config, strategy, exchange, plan=plan, progress=progress)
        from .compiled import compile_candidate

        return compile_candidate(config, strategy, exchange, plan=plan)

    return compile_fn


def _step_of(numbers) -> StepCompiled | None:
    """XLA's whole-step memory when `numbers` are a whole step's (`checks.step.
    CompiledStep`), None when they are one block's."""
    if not hasattr(numbers, "optimizer"):
        return None
    return StepCompiled(
        *(float(getattr(numbers, f)) for f in ("arguments", "outputs", "temp", "alias")),
        params=float(numbers.params),
        optimizer=float(numbers.optimizer),
    )


def check(
    config: Config,
    live_shape: dict | None = None,
    *,
    compile_fn: Callable[[Config, Dispatch, Exchange], Any] | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[DispatchPlan | None, list[Finding], CompileCheck | None]:
    """(plan, findings, compile check). When the config has errors other than the
    estimate's MEMORY_EXCEEDED (which compiling may overturn), nothing is compiled and
    the check is None.

    `compile_fn(config, strategy, exchange)` returns XLA's numbers for one candidate
    (attributes arguments, outputs, temp, flops, bytes_accessed, seconds); a missing
    compiler plugin raises `selector.targets.TargetUnavailable` from it. By default each
    candidate's block is built from the plan analysed here."""
    say = progress or (lambda _: None)
    plan, findings = analyse(config, live_shape)
    blocking = [f for f in errors_in(findings) if f.code != "MEMORY_EXCEEDED"]
    if plan is None or blocking:  # compile what could run; an estimate's misfit may not
        return plan, findings, None
    if compile_fn is None:
        prepare_process(config.hardware.platform, plan.mesh.num_devices)
        compile_fn = _compile_from(plan, say)
    estimates: dict[Key, Estimate] = {(c.strategy, c.exchange): c.estimate for c in plan.candidates}
    first: Key = (plan.strategy, plan.placement.exchange)
    todo = [first]
    rest = {k: e for k, e in estimates.items() if k != first}
    if rest:
        todo.append(choose(config, rest)[0])  # the runner-up: the choice without the first
    compiled: dict[Key, CompiledCandidate] = {}
    substituted: dict[str, str] = {}  # candidate -> the grouped matmul its step ran
    while todo:
        key = todo.pop(0)
        if key in compiled:
            continue
        est = estimates[key]
        what = "the whole training step with" if config.mode is Mode.train else "the block"
        say(f"compiling {what} {est.name} for {plan.target} ...")
        numbers = compile_fn(config, *key)
        if getattr(numbers, "gmm_substituted", ""):
            substituted[est.name] = numbers.gmm_substituted
        step = _step_of(numbers)
        if step is None:  # one block: the step around it stays the estimate's
            memory = Memory(float(numbers.arguments), float(numbers.outputs), float(numbers.temp))
            as_compiled = with_memory(est, memory, config.hardware)
        else:  # the whole step: its peak is what a device holds, no margin
            fits = step.peak <= config.hardware.memory_gib * GIB
            as_compiled = dataclasses.replace(
                est,
                compiled_step_bytes=step.peak,
                fits=fits,
                verdict=Verdict.yes if fits else Verdict.no,
            )
        c = compiled[key] = CompiledCandidate(
            estimate=est,
            as_compiled=as_compiled,
            flops=float(numbers.flops),
            bytes_accessed=float(numbers.bytes_accessed),
            seconds=float(numbers.seconds),
            step=step,
        )
        if step is None:
            say(
                f"  {est.name}: temp {c.compiled.temp / GIB:.3g} GiB compiled "
                f"({est.memory.temp / GIB:.3g} estimated), {c.device_bytes / GIB:.3g} GiB a "
                f"device in all, {numbers.seconds:.0f} s"
            )
        else:
            say(
                f"  {est.name}, whole step: {step.peak / GIB:.3g} GiB a device compiled "
                f"(arguments {step.arguments / GIB:.3g}, temp {step.temp / GIB:.3g}), "
                f"{est.device_bytes / GIB:.3g} GiB estimated, {numbers.seconds:.0f} s"
            )
        if not todo:  # choose again with what compiling showed; compile a new winner
            winner = choose(config, _with_compiled(estimates, compiled))[0]
            if winner not in compiled:
                todo.append(winner)
    final = _with_compiled(estimates, compiled)
    (strategy, exchange), reason, verdicts = choose(config, final)
    new_plan, new_findings = replan(
        config, live_shape, plan, (strategy, exchange), f"compiled for {plan.target}: {reason}"
    )
    extra = _compile_findings(config, plan, compiled, (strategy, exchange))
    extra += _substitutions(plan, substituted)
    kept = [f for f in new_findings if f.code != "MEMORY_EXCEEDED"]
    new_findings = kept + extra
    new_plan = dataclasses.replace(
        new_plan,
        candidates=_candidates(plan, final, verdicts, (strategy, exchange)),
        findings=tuple(new_findings),
    )
    result = CompileCheck(
        target=plan.target,
        plan=new_plan,
        estimated_choice=plan.chosen_estimate.name,
        compiled=tuple(compiled.values()),
    )
    return new_plan, new_findings, result


def _candidates(plan: DispatchPlan, final, verdicts, chosen: Key) -> tuple[Candidate, ...]:
    out = []
    for c in plan.candidates:
        key = (c.strategy, c.exchange)
        out.append(Candidate(final[key], c.placement, verdicts[key], key == chosen))
    return tuple(out)


def _with_compiled(estimates, compiled) -> dict[Key, Estimate]:
    """The estimates with each compiled candidate's memory and fit as compiled."""
    return {**estimates, **{key: c.as_compiled for key, c in compiled.items()}}


def replan(config, live_shape, plan: DispatchPlan, chosen: Key, reason: str):
    """The plan for a choice made after the estimate (compiled or measured): the same
    analysis with that choice forced, so its placement and findings are the forced
    candidate's; `reason` says why. The estimate's own choice keeps its plan."""
    if chosen == (plan.strategy, plan.placement.exchange):
        return plan, list(plan.findings)
    forced = config.replace(dispatch=chosen[0], expert_exchange=chosen[1])
    new_plan, findings = analyse(forced, live_shape)
    assert new_plan is not None  # the same config, one candidate forced
    new_plan = dataclasses.replace(
        new_plan, requested=plan.requested, reason=reason, candidates=plan.candidates
    )
    return new_plan, findings


def _substitutions(plan: DispatchPlan, substituted: dict[str, str]) -> list[Finding]:
    """A whole step compiled with another grouped matmul than the plan's is said, not
    hidden (checks.step.compile_candidate_step says why)."""
    if not substituted:
        return []
    which = ", ".join(f"{name} with {gmm}" for name, gmm in substituted.items())
    return [
        warning(
            "STEP_COMPILED_WITH_OTHER_GMM",
            "gmm_backend",
            f"The whole step was compiled for {plan.target} as {which}, not the plan's "
            f"{plan.gmm_backend}: JAX's Pallas megablox kernels do not lower inside the "
            "scanned, checkpointed decoder layers here (a varying-axes check in the "
            "rematerialised kernel call). The compiled bytes are the step's with that "
            "grouped matmul; the block alone compiles with the plan's.",
        )
    ]


def _compile_findings(config: Config, plan: DispatchPlan, compiled, chosen: Key) -> list[Finding]:
    out: list[Finding] = []
    wrong = [c for c in compiled.values() if c.fits != c.estimate.fits]
    if wrong:
        said = "; ".join(
            f"{c.name} was estimated at {c.estimate.device_bytes / GIB:.3g} GiB a device "
            f"({'fits' if c.estimate.fits else 'does not fit'}) and compiles to "
            f"{c.device_bytes / GIB:.3g} GiB ({'fits' if c.fits else 'does not fit'})"
            for c in wrong
        )
        out.append(
            warning(
                "COMPILED_FIT_DIFFERS",
                "compile",
                f"Compiling for {plan.target} showed the estimate wrong about what fits in "
                f"the {config.hardware.memory_gib:g} GiB of a {config.hardware.name}: {said}. "
                f"The choice follows the compiled numbers: {compiled[chosen].name}.",
            )
        )
    c = compiled[chosen]
    if not c.fits and c.step is not None:
        out.append(
            error(
                "COMPILED_MEMORY_EXCEEDED",
                "compile",
                f"The whole training step with {c.name} compiled for {plan.target} needs "
                f"{c.device_bytes / GIB:.3g} GiB per device (arguments "
                f"{c.step.arguments / GIB:.3g} GiB, of them parameters "
                f"{c.step.params / GIB:.3g} and optimizer state {c.step.optimizer / GIB:.3g}; "
                f"temporaries {c.step.temp / GIB:.3g} GiB; the estimate said "
                f"{c.estimate.device_bytes / GIB:.3g}), more than the "
                f"{config.hardware.memory_gib:g} GiB of a {config.hardware.name}, and no "
                "compiled candidate fits. Shard the state over more devices (more fsdp or "
                "expert devices), lower per_device_batch_size or raise cp, save less for "
                "the backward (remat_policy=full), or tile the loss (num_vocab_tiling).",
            )
        )
    elif not c.fits:
        out.append(
            error(
                "COMPILED_MEMORY_EXCEEDED",
                "compile",
                f"{c.name} compiled for {plan.target} needs {c.device_bytes / GIB:.3g} GiB "
                f"per device ({c.compiled.temp / GIB:.3g} GiB of it the block's temporaries, "
                f"{c.estimate.state_bytes / GIB:.3g} GiB every MoE layer's state at rest), "
                f"more than the {config.hardware.memory_gib:g} GiB of a "
                f"{config.hardware.name}, and no compiled candidate fits. Shard the state "
                "over more devices (more fsdp or expert devices), lower "
                "per_device_batch_size or raise cp, or store weights in bfloat16 "
                "(param_dtype=bfloat16).",
            )
        )
    return out
