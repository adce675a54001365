"""Rules on what the chosen dispatch and placement do with these settings."""

from __future__ import annotations

import math

from ..config import MESH_AXES, CapacityRounding, Config, Dispatch, Exchange, ExpertGroup, Mode
from ..cost import Estimate, Verdict
from ..findings import Finding, error, fix, warning
from ..mesh import MeshView
from ..per_device import PerDevice, capacity
from ..placement import exchange_group, fsdp_axes_folded
from ..step_memory import STEP_PARTS
from .layout import fmt, shown_axes
from .moves import move

DROPLESS = (Dispatch.megablox, Dispatch.dense, Dispatch.mlp)
DROP_WARNING_FRACTION = 0.01  # warn when uniform routing alone would drop more than this
CAPACITY_COSTLY_RATIO = 2.0  # warn when the capacity path costs this much more
DROPLESS_FIX = fix("dropless routing", dispatch=Dispatch.megablox, capacity_factor=-1.0)


def poisson_drop_fraction(mean: float, cap: int) -> float:
    """Expected fraction of tokens over capacity when each expert's load is Poisson(mean)."""
    if mean <= 0:
        return 0.0
    if cap > mean + 12 * math.sqrt(mean) + 12:
        return 0.0
    if mean > 1000:  # normal approximation: the exact sum would loop `cap` times
        sigma = math.sqrt(mean)
        z = (cap - mean) / sigma
        pdf = math.exp(-z * z / 2) / math.sqrt(2 * math.pi)
        tail = 0.5 * math.erfc(z / math.sqrt(2))
        return max(0.0, sigma * (pdf - z * tail)) / mean
    # E[max(X - C, 0)] = mean - C + sum_{x <= C} (C - x) p(x)
    log_p = -mean
    below = 0.0
    for x in range(cap + 1):
        below += (cap - x) * math.exp(log_p)
        log_p += math.log(mean) - math.log(x + 1)
    return max(0.0, mean - cap + below) / mean


def capacity_settings(cfg: Config, dev: PerDevice, strategy: Dispatch) -> list[Finding]:
    cf = cfg.capacity_factor
    if strategy is Dispatch.subgroup_capacity and cf <= 0:
        return [
            error(
                "CAPACITY_REQUIRED",
                "capacity_factor",
                f"dispatch=subgroup_capacity drops tokens beyond each expert's capacity, but "
                f"capacity_factor={cf:g} asks for dropless routing.",
                [fix(capacity_factor=1.25), fix(dispatch=Dispatch.megablox)],
            )
        ]
    if strategy in DROPLESS and cf > 0:
        return [
            warning(
                "CAPACITY_IGNORED",
                "capacity_factor",
                f"capacity_factor={cf:g} has no effect: dispatch={strategy.value} is dropless "
                "and routes every token.",
                [
                    fix("say so", capacity_factor=-1.0),
                    fix("cap expert loads", dispatch=Dispatch.subgroup_capacity),
                ],
            )
        ]
    return []


def _factor_for(dev: PerDevice, cfg: Config, target: float) -> float | None:
    """The smallest capacity_factor (in steps of 0.05) whose uniform-routing drops are
    at most `target`, or None above 64."""
    cf = math.floor(cfg.capacity_factor * 20 + 1) / 20
    while cf <= 64:
        cap = capacity(
            dev.sub_seq, cfg.num_experts_per_tok, cfg.num_experts, cf, cfg.capacity_rounding
        )
        if cap and poisson_drop_fraction(dev.expected_tokens_per_expert, cap) <= target:
            return cf
        cf = round(cf + 0.05, 2)
    return None


def capacity_too_small(cfg: Config, dev: PerDevice, strategy: Dispatch) -> list[Finding]:
    if strategy is not Dispatch.subgroup_capacity or dev.capacity_per_subgroup is None:
        return []
    if dev.sub_seq <= 1:
        return []  # one token per subgroup: its k distinct experts never exceed capacity 1
    k, experts = cfg.num_experts_per_tok, cfg.num_experts
    raw = dev.expected_tokens_per_expert * cfg.capacity_factor
    cap = dev.capacity_per_subgroup
    if cap == 0:
        return [
            warning(
                "CAPACITY_ZERO",
                "capacity_factor",
                f"capacity_rounding={cfg.capacity_rounding.value} truncates the per-subgroup "
                f"capacity to 0 (capacity_factor={cfg.capacity_factor:g}, {fmt(dev.sub_seq)} "
                f"tokens x {k} / {experts} experts): every assignment is dropped, as MaxText "
                "0.2.5's formula (measured) would drop it.",
                [fix(capacity_factor=1.0), fix(capacity_rounding=CapacityRounding.ours)],
            )
        ]
    if raw < 1:
        needed = math.ceil(experts / (dev.sub_seq * k) * 100) / 100
        return [
            warning(
                "CAPACITY_BELOW_ONE",
                "capacity_factor",
                f"Per-subgroup capacity is sub_seq x k / E x capacity_factor = "
                f"{fmt(dev.sub_seq)} x {k} / {experts} x {cfg.capacity_factor:g} = {raw:.3g}, "
                "under one token per expert (rounded up to 1).",
                [fix(capacity_factor=needed), DROPLESS_FIX],
            )
        ]
    dropped = poisson_drop_fraction(dev.expected_tokens_per_expert, cap)
    if dropped <= DROP_WARNING_FRACTION:
        return []
    enough = _factor_for(dev, cfg, DROP_WARNING_FRACTION)
    fixes = [fix(capacity_factor=enough)] if enough else []
    return [
        warning(
            "DROPS_LIKELY",
            "capacity_factor",
            f"Each subgroup of {fmt(dev.sub_seq)} tokens expects "
            f"{dev.expected_tokens_per_expert:.3g} tokens per expert against a capacity of "
            f"{cap}; even perfectly uniform routing would drop about {dropped:.1%} of "
            "assignments (real routing drops more).",
            [*fixes, DROPLESS_FIX],
        )
    ]


def memory_fits(cfg: Config, mesh: MeshView, dev: PerDevice, est: Estimate) -> list[Finding]:
    """What one device holds for the whole step (`StepMemory`): every parameter's
    weights, gradients and optimizer state at rest, the activations saved across
    layers, and the largest transient (the logits, or one layer's attention and MoE
    block), against the chip, its margin counted (`Estimate.device_range`): an error
    only when even the range's bottom is over the chip; a warning, compile to be sure,
    when the chip's size falls inside the range."""
    if est.verdict is Verdict.yes:
        return []
    gib = 2**30
    parts = est.device_breakdown or {}
    at_rest = est.state_bytes if est.step is None else est.step.at_rest
    state_bigger = at_rest >= est.device_bytes - at_rest
    # The bytes a device may hold for the verdict to move: under the chip at the range's
    # bottom (out of MEMORY_EXCEEDED) or at its top (out of the margin).
    low, high = est.device_range(cfg.hardware)
    scale = est.device_bytes / (high if est.verdict is Verdict.margin else low)
    target = cfg.hardware.memory_gib * gib * scale
    slices = _slices_needed(at_rest, est.device_bytes - at_rest, target)
    fixes = _memory_fixes(cfg, mesh, parts, state_bigger, slices)
    if est.verdict is Verdict.margin:
        return [within_margin(cfg, est, fixes)]
    shown = ", ".join(
        f"{name.replace('_', ' ')} {parts[name] / gib:.3g}"
        for name in STEP_PARTS
        if parts.get(name, 0) > 0
    )
    return [
        error(
            "MEMORY_EXCEEDED",
            # The knob behind the larger share: the weights' storage, or the batch.
            "param_dtype" if state_bigger else "per_device_batch_size",
            f"dispatch={est.name}: the whole step needs about {est.device_bytes / gib:.3g} "
            f"GiB per device, more than the {cfg.hardware.memory_gib:g} GiB of a "
            f"{cfg.hardware.name} ({shown} GiB; the peak holds what rests, what is saved "
            "and the largest of the logits and one layer's attention plus MoE block (with the "
            "logits' gradient where the compiler keeps it through the layers), and "
            "the copy an all-reduce leaves where it gathers a tensor over the whole slice); "
            + (
                "the parameters' state dominates: shard it over more devices or store it smaller."
                if state_bigger
                else "the activations dominate: save less (remat_policy), tile the "
                "logits (num_vocab_tiling), raise cp or the batch shards, or lower "
                "per_device_batch_size."
            ),
            fixes,
            no_fix=f"None of the overrides tried (weights stored in fewer bits, experts "
            f"exchanged, more slices, a lighter step, fewer tokens a device) brings a device "
            f"under {cfg.hardware.memory_gib:g} GiB: it needs a chip with more memory "
            f"(hardware=), more than {MAX_SLICE_FACTOR}x the chips, or a smaller model.",
        )
    ]


# The most slices a memory fix multiplies a job by.
MAX_SLICE_FACTOR = 64


def _slices_needed(at_rest: float, rest: float, target: float) -> int | None:
    """The least power-of-two factor of the chips that would bring a device under
    `target` bytes if what rests (`at_rest`: weights, gradients, optimizer state) split
    over the new chips and nothing else shrank; None when the rest alone is over it or
    more than MAX_SLICE_FACTOR would be needed. A guess for the fix search to check."""
    factor = 1
    while at_rest / factor + rest > target:
        factor *= 2
        if factor > MAX_SLICE_FACTOR or rest >= target:
            return None
    return factor


def _memory_fixes(
    cfg: Config, mesh: MeshView, parts: dict, state_bigger: bool, slices: int | None = None
) -> list:
    """Overrides that make a device hold less: weights stored in fewer bits, experts
    exchanged, more slices (2x, 4x, and `slices`x when more are needed), a lighter step,
    and (when the activations dominate) fewer tokens a device."""
    return [
        fix("weights stored in 16 bits", param_dtype="bfloat16"),
        fix("weights stored in 8 bits", param_dtype="float8_e4m3fn"),
        *_exchange_fixes(mesh),
        *_more_slices(cfg, mesh, slices),
        *_lighter_step(cfg, parts),
        *(_fewer_tokens(cfg, mesh) if not state_bigger else ()),
    ]


def _exchange_fixes(mesh: MeshView) -> list:
    """The experts exchanged over the expert and sequence axes, and over fsdp too where
    that adds devices (without fsdp-like axes the two groups are the same)."""
    groups = [ExpertGroup.expert_and_sequence]
    if fsdp_axes_folded(mesh):
        groups.append(ExpertGroup.expert_sequence_and_fsdp)
    return [fix(expert_exchange=Exchange.all_to_all, expert_group=g) for g in groups]


def within_margin(cfg: Config, est: Estimate, fixes: list) -> Finding:
    """The chip's size falls between what a device may hold at least and at most, given
    how far the estimate has been from the compiler on its judge set."""
    gib = 2**30
    low, high = est.device_range(cfg.hardware)
    under, over = cfg.hardware.step_margin
    return warning(
        "MEMORY_WITHIN_MARGIN",
        "compile",
        f"dispatch={est.name}: the whole step is estimated at {est.device_bytes / gib:.3g} "
        f"GiB per device against the {cfg.hardware.memory_gib:g} GiB of a "
        f"{cfg.hardware.name}; on its judge set ({cfg.hardware.step_margin_source}) the "
        f"estimate has been up to {under:.0%} under and {over:.0%} over the compiled "
        f"peak, so a device holds {low / gib:.3g} to {high / gib:.3g} GiB: within the "
        "margin. Compile to be sure: add compile=true (the compiled step's peak then "
        "decides), or take a fix that leaves room.",
        fixes,
    )


def _lighter_step(cfg: Config, parts: dict) -> list:
    """Save less across layers (MaxText's `full` remat policy keeps only each layer's
    input), and tile the logits when they are the step's largest transient."""
    fixes = []
    if cfg.mode is Mode.train and cfg.remat_policy != "full":
        fixes.append(fix("recompute every layer in the backward", remat_policy="full"))
    layer = parts.get("attention_peak", 0) + parts.get("moe_block", 0)
    if parts.get("logits", 0) > layer:
        for tiles in (4, 16):
            if tiles > cfg.num_vocab_tiling:
                fixes.append(fix(f"the logits {tiles} tiles at a time", num_vocab_tiling=tiles))
    return fixes


def _fewer_tokens(cfg: Config, mesh: MeshView) -> list:
    """Fewer tokens a device: 2x or 4x the context devices (taken from data, else
    fsdp), or a 2x or 4x smaller per_device_batch_size."""
    fixes = []
    for part in (2, 4):
        for source in ("data", "fsdp"):
            moved = move(cfg, mesh, {"context": mesh.size("context") * part}, to=source)
            if moved:
                # The batch shards shrink with the source axis, so the per-device batch
                # shrinks too, or the local batch would grow (LOCAL_BATCH_INFLATION).
                fixes.append(
                    fix(
                        f"cp {part}x, the devices taken from {source}, the global batch 1/{part}",
                        **dict(moved),
                        per_device_batch_size=cfg.per_device_batch_size / part,
                    )
                )
                break
    for part in (2, 4):
        fixes.append(
            fix(
                f"1/{part} of the tokens a device holds; the global batch shrinks with it",
                per_device_batch_size=cfg.per_device_batch_size / part,
            )
        )
    return fixes


def _more_slices(cfg: Config, mesh: MeshView, needed: int | None = None) -> list:
    """More chips: 2x and 4x the slices (hosts), and `needed`x when that is more, the
    new ones splitting the weights over dcn fsdp, every other dcn size kept; the
    per-device batch stays, so the global batch grows with the chips. Configs only: a
    live mesh is what it is."""
    if mesh.source != "config" or cfg.num_slices < 1:
        return []
    dcn = {a: mesh.dcn_product((a,)) for a in MESH_AXES}
    # A dcn -1 fill is written out, so it is not recomputed on the bigger machine.
    filled = {f"dcn_{a}_parallelism": n for a, n in dcn.items() if cfg.parallelism("dcn", a) == -1}
    fixes = []
    for factor in (2, 4, *([needed] if needed and needed > 4 else [])):
        slices = cfg.num_slices * factor
        changed = {
            "num_devices": mesh.num_devices * factor,
            "num_slices": slices,
            **filled,
            "dcn_fsdp_parallelism": dcn["fsdp"] * factor,
        }
        fixes.append(
            fix(
                f"{factor}x the chips: {slices} slices of {mesh.num_devices // cfg.num_slices} "
                f"{cfg.hardware.name}, weights split over the new ones",
                **changed,
            )
        )
    return fixes


def capacity_costly(cfg: Config, strategy: Dispatch, chosen: Estimate, estimates) -> list[Finding]:
    """The capacity path chosen for capacity_factor > 0 although a dropless candidate
    is far cheaper: honoured, never silently."""
    if strategy is not Dispatch.subgroup_capacity or cfg.dispatch is not Dispatch.auto:
        return []
    dropless = [e for (s, _), e in estimates.items() if s in DROPLESS and s is not Dispatch.mlp]
    dropless = [e for e in dropless if e.fits]
    if not dropless:
        return []
    best = min(dropless, key=lambda e: e.time_s)
    slower = chosen.time_s / best.time_s
    bigger = chosen.device_bytes / best.device_bytes
    if max(slower, bigger) < CAPACITY_COSTLY_RATIO:
        return []
    return [
        warning(
            "CAPACITY_COSTLY",
            "capacity_factor",
            f"capacity_factor={cfg.capacity_factor:g} asks for capacity-limited routing, so "
            f"subgroup_capacity runs: about {chosen.time_s * 1e3:.3g} ms and "
            f"{chosen.device_bytes / 2**30:.3g} GiB per device, where the dropless {best.name} "
            f"would take {best.time_s * 1e3:.3g} ms and {best.device_bytes / 2**30:.3g} GiB "
            f"({slower:.1f}x the time, {bigger:.1f}x the memory).",
            [fix("dropless routing, unless you need the capacity semantics", capacity_factor=-1.0)],
        )
    ]


def exchange_settings(cfg: Config, mesh: MeshView, strategy: Dispatch, options) -> list[Finding]:
    """An explicit expert_exchange=all_to_all the block cannot honour, and expert groups
    that do not split num_experts evenly."""
    if cfg.expert_exchange is not Exchange.all_to_all:
        return []
    placed = options.get(Exchange.all_to_all)
    gather = fix(expert_exchange=Exchange.gather)
    if strategy is not Dispatch.megablox and cfg.dispatch is not Dispatch.auto:
        return [
            error(
                "EXCHANGE_NEEDS_MEGABLOX",
                "expert_exchange",
                f"expert_exchange=all_to_all sends routed rows to their experts' owners, which "
                f"only the megablox dispatch does; dispatch={strategy.value} computes every "
                "expert on every device.",
                [fix(dispatch=Dispatch.megablox, capacity_factor=-1.0), gather],
            )
        ]
    group = exchange_group(cfg, mesh)
    if placed is not None:
        return _group_unfolded(cfg, group)
    size = mesh.product(group.axes)
    why = f" ({group.left_out})" if group.left_out else ""
    if size <= 1:
        return [
            error(
                "EXPERT_GROUP_EMPTY",
                "expert_exchange",
                "expert_exchange=all_to_all needs an expert group: an expert axis or a "
                "sequence axis of size > 1 that splits the tokens; this mesh gives none"
                f"{why}.",
                [*_experts_from(cfg, mesh), gather],
            )
        ]
    # The narrower groups a config can ask for: the fsdp axes left out, then the sequence
    # axes too (the fix search keeps those whose group splits num_experts).
    narrower = [ExpertGroup.expert_and_sequence] if group.fsdp and group.folded else []
    narrower += [ExpertGroup.expert] if group.fsdp or group.folded else []
    fixes = [fix(expert_group=g) for g in narrower]
    return [
        error(
            "EXPERTS_NOT_DIVISIBLE_BY_GROUP",
            "expert_group",
            f"num_experts={cfg.num_experts} does not split over the expert group "
            f"({shown_axes(mesh, group.axes)} = {size} devices){why}.",
            [*fixes, *_experts_from(cfg, mesh), gather],
        )
    ]


def _group_unfolded(cfg: Config, group) -> list[Finding]:
    """expert_group=expert_and_sequence (or expert_sequence_and_fsdp) asked for, but the
    sequence axes stay out."""
    asked = (ExpertGroup.expert_and_sequence, ExpertGroup.expert_sequence_and_fsdp)
    if cfg.expert_group not in asked or not group.left_out:
        return []
    return [
        warning(
            "EXPERT_GROUP_UNFOLDED",
            "expert_group",
            f"expert_group={cfg.expert_group.value} asks for the sequence axes in the expert "
            f"group, but {group.left_out}; the rows are exchanged without them.",
            [fix(expert_group=ExpertGroup.auto)],
        )
    ]


def _experts_from(cfg: Config, mesh: MeshView) -> list:
    """Split the experts over an expert axis made of devices taken from another axis
    (the sequence axes first: at decode they only repeat the token), as many as
    num_experts and that axis have in common."""
    if "expert" not in mesh.expert_axes or "expert" not in mesh.batch_axes:
        return []
    fixes = []
    sources = [a for a in mesh.sequence_axes if mesh.size(a) > 1]
    sources += [a for a in ("fsdp", "data") if mesh.size(a) > 1]
    for source in sources:
        take = math.gcd(cfg.num_experts, mesh.size(source))
        if take <= 1:
            continue
        new = {source: mesh.size(source) // take, "expert": mesh.size("expert") * take}
        moved = move(cfg, mesh, new, to="expert")
        if moved:
            fixes.append(fix(f"experts split over {take} of the {source} devices", **dict(moved)))
    return fixes


DECODE_GATHER_RATIO = 100  # weights gathered per step against the tokens' own bytes


def decode_gathers_weights(cfg: Config, chosen: Estimate, alternative) -> list:
    """Decode that gathers the expert weights for a handful of tokens: each step moves
    every expert's weights to every device. `alternative()` gives (overrides, Estimate)
    of the same config with the fsdp devices holding experts instead, or None; it is a
    second analysis, so it runs only once the chosen plan is found gathering."""
    if cfg.mode is not Mode.decode or chosen.exchange is not Exchange.gather:
        return []
    gathered = chosen.traffic.weight_gather
    if gathered < DECODE_GATHER_RATIO * max(chosen.input_bytes, 1.0):
        return []
    split = alternative()
    if split is None:
        return []
    overrides, other = split
    if other.time_s >= chosen.time_s / 2:
        return []
    knobs = " ".join(f"{k}={v}" for k, v in overrides.items())
    return [
        warning(
            "DECODE_GATHERS_WEIGHTS",
            "ici_expert_parallelism",
            f"mode=decode with the expert weights gathered: every step moves "
            f"{gathered / 1e9:.3g} GB of weights a device a layer for "
            f"{chosen.input_bytes / 1e6:.3g} MB of tokens ({chosen.time_s * 1e3:.3g} ms "
            f"estimated). With the experts split over those devices ({knobs}) the routed "
            f"rows travel instead: {other.name}, {other.traffic.network / 1e9:.3g} GB, "
            f"{other.time_s * 1e3:.3g} ms estimated.",
            [fix("experts split, rows exchanged", **overrides)],
        )
    ]
