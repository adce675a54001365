"""analyse: the pure core of the selector (no jax). Typed config in, plan and findings out."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from . import rules, targets
from .config import Config, Dispatch, Exchange, Mode, past_max_int
from .cost import Estimate, estimate
from .findings import Finding, Fix, Severity, errors_in, ranked_fixes, warning
from .mesh import MeshView, build_mesh_view
from .per_device import PerDevice
from .placement import WeightPlacement, describe
from .policy import best_group, candidate_placements, choose, exchange_backend
from .problem import config_problem
from .step_memory import step_outside


@dataclass(frozen=True)
class Candidate:
    """One (dispatch, exchange) the plan weighed: its estimate at the placement that
    won among the expert groups weighed (`groups`: each group's placement and
    estimate, the winner included; empty when only one placement was possible), the
    verdict and whether it was chosen.

    Attributes:
      estimate: the counted memory, traffic and time of its program (`cost.Estimate`).
      placement: where its expert weights rest and how they meet the tokens.
      verdict: why it was or was not chosen, in words.
      chosen: whether the plan runs it.
      groups: each expert group weighed, with its placement and estimate.

    Examples:
      >>> import selector
      >>> plan = selector.resolve(selector.compose(["model=tiny", "mesh=cpu_8",
      ...     "ici_context_parallelism=4", "per_device_batch_size=0.25"]))
      >>> [(c.name, c.chosen) for c in plan.candidates][:2]
      [('subgroup_capacity', False), ('megablox/gather', True)]
    """

    estimate: Estimate
    placement: WeightPlacement
    verdict: str
    chosen: bool
    groups: tuple[tuple[WeightPlacement, Estimate], ...] = ()

    @property
    def strategy(self) -> Dispatch:
        return self.estimate.strategy

    @property
    def exchange(self) -> Exchange:
        return self.estimate.exchange

    @property
    def name(self) -> str:
        return self.estimate.name


@dataclass(frozen=True)
class DispatchPlan:
    """The selector's answer: what the MoE block runs, on which axes, and why
    (`selector.resolve` returns it; `layers.MoEBlock` builds from it).

    Attributes:
      strategy, reason, requested: the dispatch chosen, why, and what was asked for.
      mesh, per_device: the mesh's axes and what a device holds (tokens, batch, ...).
      candidates: every (dispatch, exchange) weighed, each with its estimate.
      findings: every finding, each with its verified fixes.
      gmm_backend, exchange_backend, placement: how the block runs it.
      target, training: the chips it is for; whether the step trains.
      config, live_shape: what it was resolved from (the layers re-plan from them).

    Examples:
      >>> import selector
      >>> plan = selector.resolve(selector.compose(["model=tiny", "mesh=cpu_8",
      ...     "ici_context_parallelism=4", "per_device_batch_size=0.25"]))
      >>> plan.strategy.value, plan.cp, plan.per_device.tokens_per_device
      ('megablox', 4, 512.0)
      >>> plan.at_shape(4, 64)[0].per_device.tokens_per_device  # another input shape
      32.0
    """

    strategy: Dispatch
    reason: str
    requested: Dispatch
    mesh: MeshView
    per_device: PerDevice
    candidates: tuple[Candidate, ...]
    findings: tuple[Finding, ...]
    gmm_backend: str
    placement: WeightPlacement  # where expert weights rest and how they meet the tokens
    exchange_backend: str  # the collective moving routed rows when they are exchanged
    target: str = ""  # the chips the plan is for, as selector.targets compiles for them
    training: bool = True  # fwd+bwd (mode=train); prefill and decode run forward only
    # What the plan was resolved from: the typed config and the live mesh's axis sizes
    # (None: the config's mesh knobs). The layers build from `config` and re-plan other
    # input shapes with `at_shape`, so they never call the selector's entry points.
    config: Config | None = dataclasses.field(default=None, compare=False, repr=False)
    live_shape: Mapping[str, int] | None = dataclasses.field(
        default=None, compare=False, repr=False
    )

    @property
    def expert_weights(self) -> str:
        """What the block does with the expert weights, in one sentence."""
        return describe(self.placement, self.mesh, self.training)

    @property
    def gmm_tiling(self):
        """The chosen candidate's grouped-matmul tiling (`GmmTiling`; None when the
        chosen dispatch runs no grouped matmul): what the layers pass the kernel."""
        return self.chosen_estimate.tiling

    @property
    def cp(self) -> int:
        return self.per_device.cp

    @property
    def sequence_axes(self) -> tuple[str, ...]:
        return self.mesh.sequence_axes

    @property
    def batch_axes(self) -> tuple[str, ...]:
        return self.mesh.batch_axes

    @property
    def errors(self) -> list[Finding]:
        return errors_in(self.findings)

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity is Severity.warning]

    @property
    def chosen_estimate(self) -> Estimate:
        return next(c.estimate for c in self.candidates if c.chosen)

    def candidate(self, strategy: Dispatch, exchange: Exchange = Exchange.gather) -> Candidate:
        """The candidate for one (dispatch, exchange) pair."""
        return next(c for c in self.candidates if (c.strategy, c.exchange) == (strategy, exchange))

    def shaped_config(self, batch: int, seq: int) -> Config:
        """The config this plan was resolved from, for a global (batch, seq) input to the
        block it built: the same strategy and exchange (the parameters rest where this
        placement put them, and a block that switched dispatch with the batch would
        compute differently on the same weights). The local-batch rule is waived: it
        guards how a launch sizes per_device_batch_size against the mesh, while a layer
        takes the batch it is given. At decode a step is one new token, and the context
        length (max_target_length) still sizes it."""
        if self.config is None:
            raise ValueError(
                "This DispatchPlan carries no config (it was not built by selector.analyse "
                "or selector.resolve), so it cannot be re-planned for another input shape. "
                "Build it with selector.resolve(cfg, mesh)."
            )
        decode = self.config.mode is Mode.decode
        return self.config.replace(
            per_device_batch_size=batch / self.mesh.num_devices,
            max_target_length=self.config.max_target_length if decode else seq,
            dispatch=self.strategy,
            expert_exchange=self.placement.exchange,
            expert_group=self.placement.group,
            allow_local_batch_inflation=True,
        )

    def at_shape(self, batch: int, seq: int) -> tuple[DispatchPlan | None, list[Finding]]:
        """(plan or None, findings) of `shaped_config(batch, seq)`: this plan's strategy
        and placement with the per-device numbers and findings at that input shape."""
        return analyse(self.shaped_config(batch, seq), self.live_shape)

    def as_dict(self) -> dict:
        return {
            "strategy": self.strategy.value,
            "reason": self.reason,
            "requested": self.requested.value,
            "cp": self.cp,
            "gmm_backend": self.gmm_backend,
            "exchange_backend": self.exchange_backend,
            "target": self.target,
            "expert_weights": self.expert_weights,
            "placement": self.placement.as_dict(),
            "mesh": self.mesh.as_dict(),
            "per_device": self.per_device.as_dict(),
            "candidates": [
                {
                    **c.estimate.as_dict(),
                    "placement": c.placement.as_dict(),
                    "verdict": c.verdict,
                    "chosen": c.chosen,
                }
                for c in self.candidates
            ],
            "findings": [f.as_dict() for f in self.findings],
        }


# How a route runs a fix: the fix as the route spells it, the config the route then
# analyses, and the route's own findings on it (None: the route cannot run it).
Route = Callable[[Fix], "tuple[Fix, Config, list[Finding]] | None"]


def native_route(cfg: Config) -> Route:
    """The selector's own route: a fix is its overrides applied to `cfg`."""

    def run(fix_: Fix):
        # A size no setting can take is refused as the command line refuses it.
        if any(past_max_int(v) for _, v in fix_.overrides):
            return None
        try:
            return fix_, cfg.apply(fix_.overrides), []
        except (TypeError, ValueError):
            return None

    return run


def analyse(
    cfg: Config,
    live_shape: Mapping[str, int] | None = None,
    *,
    route: Route | None = None,
    given: Sequence[Finding] = (),
    check_fixes: bool = True,
) -> tuple[DispatchPlan | None, list[Finding]]:
    """Every finding, and the plan when the config is complete enough to build one.

    A finding offers only fixes that work: each proposed set of overrides is run on the
    route (by default applied to `cfg`; the MaxText route re-reads its files with the
    fix in MaxText's keys) and the result analysed once; it is kept when this finding is
    gone and no error appears that was not there before. `given`: findings the route
    made reading the config, checked with the analysis' own (they come first).
    check_fixes=False: the plan and the findings as proposed, no fix run."""
    route = route or native_route(cfg)
    plan, found = _analyse(cfg, live_shape)
    findings = [*given, *found]
    if not check_fixes:
        return plan, findings
    search = _FixSearch(route, live_shape, findings, cfg, plan)
    verified = [search.verified(f) for f in findings]
    findings = [f for f, _, _ in verified]
    if not any(clears_all for _, clears_all, _ in verified):
        findings = search.with_joint_fix(findings, [kept for _, _, kept in verified])
    if plan is not None:
        plan = dataclasses.replace(plan, findings=tuple(findings))
    return plan, findings


# How many of each error's fixes (lightest first) a joint fix draws from, and for at
# most how many errors at once (the merges tried grow as choices ** errors).
JOINT_FIX_CHOICES = 3
JOINT_FIX_MAX_ERRORS = 3


class _FixSearch:
    """The fixes of one config's findings, each run on the route and analysed once
    (a config two fixes share is analysed once)."""

    def __init__(self, route: Route, live_shape, before: list[Finding], config: Config, plan=None):
        self.route, self.live_shape, self.config = route, live_shape, config
        # MaxText's global batch (per_device_batch_size x devices), also where the
        # config's mesh is too broken for a plan; unknown beside a live mesh without a
        # plan, whose devices the config does not count.
        self.batch = None
        if plan is not None:
            self.batch = plan.per_device.global_batch
        elif live_shape is None:
            self.batch = _config_batch(config)
        self.old_errors = {f.code for f in errors_in(before)}
        self._runs: dict = {}

    def run(self, fix_: Fix):
        """(the fix as the route spells it, plan, findings after it), or None when the
        route cannot run it or it changes nothing."""
        if _changes_nothing(self.config, fix_):  # param_dtype=bfloat16 where it is already
            return None
        routed = self.route(fix_)
        if routed is None:
            return None
        spelled, config, route_findings = routed
        if config not in self._runs:  # one live shape for the whole search
            self._runs[config] = _analyse(config, self.live_shape)
        plan, found = self._runs[config]
        return spelled, plan, [*route_findings, *found]

    def verified(self, finding: Finding) -> tuple[Finding, bool, list]:
        """The finding with the fixes that work, ranked by what a device then holds (the
        whole step after the fix): the lightest first, each with that number; a fix that
        leaves a device over the chip is dropped when another fix fits. A fix that moves
        devices and leaves only a batch error behind (the new batch shards do not divide
        the global batch) is completed with that error's own batch fix. Also whether one
        of its fixes leaves no error at all, and the fixes kept as proposed (what a
        joint fix merges), lightest first. With none kept, the finding names the fixes
        that were run."""
        good = []  # (the fix as offered, with what a device then holds; as proposed)
        clears_all = False
        spelled_before = set()  # two of the finding's fixes that spell the same overrides
        failed = []  # the fixes run that did not hold, as the route spells them
        completions = []  # fixes completed with a batch, each run once more
        for fix_ in finding.fixes:
            ran = self.run(fix_)
            if ran is not None and not self._clears(finding, ran[2]):
                completed = _with_batch_fix(finding, fix_, ran[2], self.old_errors)
                if completed is not None and (again := self.run(completed)) is not None:
                    fix_, ran = completed, again
                    completions.append(completed)
                else:
                    for then in _then_fixes(finding, fix_, ran[2], self.old_errors):
                        completions.append(then)
                        again = self.run(then)
                        if again is not None and self._clears(finding, again[2]):
                            fix_, ran = then, (self._batch_said(again[0], again[1]), *again[1:])
                            break
            if ran is None:
                continue
            spelled, plan, after = ran
            if (key := spelled.render()) in spelled_before:
                continue
            spelled_before.add(key)
            if self._clears(finding, after):
                est = plan.chosen_estimate if plan is not None else None
                good.append((_with_device_note(spelled, est), fix_))
                clears_all = clears_all or not errors_in(after)
            else:
                failed.append(dataclasses.replace(spelled, note=self._left_by(finding, after)))
        ranked = ranked_fixes([offered for offered, _ in good])
        kept = [proposed for r in ranked for offered, proposed in good if offered is r]
        checked = finding.with_fixes(ranked, failed=tuple(failed))
        run = finding.tried or (*finding.fixes, *completions)
        return dataclasses.replace(checked, tried=run), clears_all, kept

    def _batch_said(self, fix_: Fix, plan) -> Fix:
        """A fix made here (a joint or follow-up fix, whose notes do not say it) with
        the global batch it leads to, where that is not the config's."""
        if plan is None or self.batch is None or plan.per_device.global_batch == self.batch:
            return fix_
        change = (
            f"the global batch goes from {self.batch:g} to "
            f"{plan.per_device.global_batch:g} sequences"
        )
        return dataclasses.replace(fix_, note=f"{fix_.note}; {change}" if fix_.note else change)

    def _left_by(self, finding: Finding, after: list[Finding]) -> str:
        """What a fix that did not hold left: the finding, or the errors it added."""
        if finding.code in {f.code for f in after}:
            return "leaves it standing"
        added = dict.fromkeys(f.code for f in errors_in(after) if f.code not in self.old_errors)
        return "adds " + " and ".join(added)

    def _clears(self, finding: Finding, after: list[Finding]) -> bool:
        """Whether a fix's findings (`after`) are without `finding` and without an error
        that was not there before."""
        new_errors = {f.code for f in errors_in(after)} - self.old_errors
        return finding.code not in {f.code for f in after} and not new_errors

    def with_joint_fix(self, findings: list[Finding], kept: list) -> list[Finding]:
        """Where two or more errors stand and no single fix clears them all, one fix per
        error merged into one set of overrides that leaves no error at all (the lightest
        such set, by what a device then holds), offered first on every error it clears."""
        errors = [
            (f, k) for f, k in zip(findings, kept, strict=True) if f.severity is Severity.error
        ]
        if not 2 <= len(errors) <= JOINT_FIX_MAX_ERRORS or any(not k for _, k in errors):
            return findings
        best = None
        choices = [k[:JOINT_FIX_CHOICES] for _, k in errors]
        for combo in itertools.product(*choices):
            merged: dict = {}
            if any(merged.setdefault(k, v) != v for fix_ in combo for k, v in fix_.overrides):
                continue  # two fixes set one knob differently
            codes = " and ".join(f.code for f, _ in errors)
            ran = self.run(Fix(tuple(merged.items()), f"clears {codes} together", joint=True))
            if ran is None or ran[1] is None or errors_in(ran[2]):
                continue
            spelled, plan, _ = ran
            held = plan.chosen_estimate.device_bytes
            if best is None or held < best[0]:
                said = self._batch_said(spelled, plan)
                best = (held, _with_device_note(said, plan.chosen_estimate))
        if best is None:
            return findings
        joint = best[1]
        return [
            f.with_fixes(ranked_fixes([joint, *f.fixes])) if f.severity is Severity.error else f
            for f in findings
        ]


def _config_batch(cfg: Config) -> float | None:
    """MaxText's global batch as the config's knobs give it, or None where a knob is
    unknown or not a finite number (its own finding says so)."""
    try:
        batch = float(cfg.per_device_batch_size) * int(cfg.num_devices)
    except (TypeError, ValueError, OverflowError):
        return None
    return batch if math.isfinite(batch) else None


def _changes_nothing(cfg: Config, fix_: Fix) -> bool:
    """Whether every override of `fix_` is a setting of `cfg` at the value it has (a key
    only a route reads, such as MaxText's allow_split_physical_axes, changes something)."""
    try:
        return cfg.apply(fix_.overrides) == cfg
    except (TypeError, ValueError, AttributeError, KeyError):
        return False


# The errors a batch that does not fit the mesh raises; each offers a batch fix.
BATCH_ERRORS = (
    "GLOBAL_BATCH_EMPTY",
    "GLOBAL_BATCH_FRACTIONAL",
    "BATCH_NOT_DIVISIBLE",
    "LOCAL_BATCH_INFLATION",
)


def _with_batch_fix(finding: Finding, fix_: Fix, after: list[Finding], old_errors) -> Fix | None:
    """`fix_` with the per_device_batch_size its new mesh needs, when the only thing
    that stops it is a new batch error (moving devices changes the batch shards, and a
    global batch they no longer divide is an error of its own); None otherwise, or when
    `finding` is itself about the batch or the fix already sets it."""
    if finding.code in BATCH_ERRORS or finding.code in {f.code for f in after}:
        return None
    if any(k == "per_device_batch_size" for k, _ in fix_.overrides):
        return None
    new = [f for f in errors_in(after) if f.code not in old_errors]
    if not new or any(f.code not in BATCH_ERRORS for f in new):
        return None
    batch = [x for x in new[0].fixes if [k for k, _ in x.overrides] == ["per_device_batch_size"]]
    if not batch:
        return None
    (pdbs,) = [v for _, v in batch[0].overrides]
    note = batch[0].note or f"per_device_batch_size={pdbs:g} for the new batch shards"
    note = f"{fix_.note}, {note}" if fix_.note else note
    return Fix((*fix_.overrides, ("per_device_batch_size", pdbs)), note)


# How many of the fixes of an error that a fix uncovers are tried after it.
THEN_FIX_CHOICES = 2


def _then_fixes(finding: Finding, fix_: Fix, after: list[Finding], old_errors) -> list[Fix]:
    """`fix_` followed by each of the first fixes of the one new error it leaves, when
    it clears `finding` but uncovers that error (a mesh made whole again may split the
    sequence at decode, which the original mesh's error hid). The second fix was
    proposed on the config after the first, so its overrides win where both set a knob;
    only a second fix that changes where the work runs, not the model, is taken. Empty
    when `finding` stands or the fix leaves no new error or more than one."""
    if finding.code in {f.code for f in after}:
        return []
    new = [f for f in errors_in(after) if f.code not in old_errors]
    if len(new) != 1:
        return []
    then = []
    for second in [x for x in new[0].fixes if _lays_out_only(x)][:THEN_FIX_CHOICES]:
        overrides = {**dict(fix_.overrides), **dict(second.overrides)}
        # The second fix's own note speaks of the config after the first (its batch
        # "from" the first's), so the pair is described as a whole.
        note = f"{fix_.render()} alone leaves {new[0].code}, which the rest clears"
        then.append(Fix(tuple(overrides.items()), note))
    return then


def _lays_out_only(fix_: Fix) -> bool:
    """Whether `fix_` sets only where the work runs (mesh axes, devices, slices, the
    batch): a follow-up fix never changes the model the user asked for."""
    return all(
        k.startswith(("ici_", "dcn_"))
        or k in ("num_devices", "num_slices", "per_device_batch_size")
        for k, _ in fix_.overrides
    )


def _with_device_note(fix_, est: Estimate | None):
    if est is None:
        return fix_
    return dataclasses.replace(
        fix_, held_bytes=est.device_bytes, fits=est.fits, verdict=est.verdict.value
    )


def _experts_split(cfg: Config, mesh: MeshView, live_shape) -> tuple[dict, Estimate] | None:
    """A config whose experts rest split by expert over the devices that now gather
    them, and what the selector would choose there; None when there is none or it has
    errors. With expert_exchange=gather asked for, the same mesh with the exchange
    weighed (auto weighs the fsdp devices as an expert group); otherwise the fsdp
    devices moved to the expert axis (in each tier, ici and dcn: the expert axis grown
    by fsdp's part there, fsdp set to 1), configs only: a live mesh is what it is."""
    overrides: dict = {}
    if cfg.expert_exchange is Exchange.gather:
        overrides["expert_exchange"] = Exchange.auto
    elif live_shape is not None or mesh.size("fsdp") <= 1:
        return None
    else:
        dcn = {a: mesh.dcn_product((a,)) for a in ("fsdp", "expert")}
        ici = {a: mesh.size(a) // dcn[a] for a in dcn}
        for tier, sizes in (("ici", ici), ("dcn", dcn)):
            if sizes["fsdp"] > 1:
                overrides[f"{tier}_fsdp_parallelism"] = 1
                overrides[f"{tier}_expert_parallelism"] = sizes["fsdp"] * sizes["expert"]
    plan, findings = _analyse(cfg.replace(**overrides), live_shape)
    if plan is None or errors_in(findings):
        return None
    return overrides, plan.chosen_estimate


def _analyse(
    cfg: Config, live_shape: Mapping[str, int] | None
) -> tuple[DispatchPlan | None, list[Finding]]:
    """analyse without checking the proposed fixes."""
    findings: list[Finding] = []
    for rule in (*rules.SETTINGS_RULES, *rules.MODEL_RULES):
        findings += rule(cfg)
    mesh, mesh_findings = build_mesh_view(cfg, live_shape)
    findings += mesh_findings
    if live_shape is not None and cfg.num_devices not in (None, mesh.num_devices):
        findings.append(
            warning(
                "NUM_DEVICES_FROM_MESH",
                "num_devices",
                f"num_devices={cfg.num_devices} but the live mesh has {mesh.num_devices} "
                "devices; the live mesh wins. Drop num_devices or make it match.",
            )
        )
    if mesh is None or errors_in(findings):
        return None, findings  # later stages divide by what these checks guard

    # Once per config: the problem (the mesh, a device's batch, the block's letters)
    # and the step outside the MoE blocks.
    base = config_problem(cfg, mesh)
    dev = base.per_device
    for rule in (*rules.LAYOUT_RULES, *rules.MODEL_LAYOUT_RULES):
        findings += rule(cfg, mesh, dev)

    options = candidate_placements(cfg, mesh)
    outside = step_outside(cfg, mesh, dev)
    weighed = {
        k: tuple((place, estimate(k[0], place, base, outside)) for place in places)
        for k, places in options.items()
    }
    placements, estimates = {}, {}
    for k, pairs in weighed.items():
        placements[k], estimates[k] = best_group(pairs)
    (strategy, exchange), reason, verdicts = choose(cfg, estimates)
    chosen = estimates[(strategy, exchange)]
    findings += rules.capacity_settings(cfg, dev, strategy)
    findings += rules.capacity_too_small(cfg, dev, strategy)
    findings += rules.capacity_costly(cfg, strategy, chosen, estimates)
    findings += rules.memory_fits(cfg, mesh, dev, chosen)
    findings += rules.decode_gathers_weights(
        cfg, chosen, lambda: _experts_split(cfg, mesh, live_shape)
    )
    findings += rules.exchange_settings(
        cfg, mesh, strategy, {ex: places for (s, ex), places in options.items() if s is strategy}
    )

    plan = DispatchPlan(
        strategy=strategy,
        reason=reason,
        requested=cfg.dispatch,
        mesh=mesh,
        per_device=dev,
        candidates=tuple(
            Candidate(
                est,
                placements[k],
                verdicts[k],
                k == (strategy, exchange),
                weighed[k] if len(weighed[k]) > 1 else (),
            )
            for k, est in estimates.items()
        ),
        findings=tuple(findings),
        gmm_backend=base.kernel,
        placement=placements[(strategy, exchange)],
        exchange_backend=exchange_backend(cfg),
        target=targets.describe(cfg.hardware.name, mesh.num_devices, cfg.num_slices),
        training=cfg.mode is Mode.train,
        config=cfg,
        live_shape=None if live_shape is None else dict(live_shape),
    )
    return plan, findings
