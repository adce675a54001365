"""The mesh as the selector sees it: a size per named axis, and which axes shard what.

Sizes come from the config's ici x dcn knobs (MaxText's `-1` fills the remaining
devices, at most once per tier) or from a live `jax.sharding.Mesh`, whose `.shape`
wins. No jax import: a live mesh is read through its `.shape` mapping.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from .config import MESH_AXES, Config
from .findings import Finding, error, fix, warning

MAX_DEVICES = 1 << 24  # far beyond any machine; keeps the arithmetic meaningful
ROLES = ("batch", "sequence", "experts", "hidden", "embed")


@dataclass(frozen=True)
class MeshView:
    """Axis sizes (every known axis, missing ones as 1) and the role of each axis."""

    sizes: tuple[tuple[str, int], ...]
    batch_axes: tuple[str, ...]
    sequence_axes: tuple[str, ...]
    expert_axes: tuple[str, ...]
    hidden_axes: tuple[str, ...]
    embed_axes: tuple[str, ...]
    source: str  # "config" or "live mesh"
    # The part of each axis that spans slices over DCN (dcn_*_parallelism); empty for a
    # live mesh, whose devices' slices the check does not read.
    dcn_sizes: tuple[tuple[str, int], ...] = ()

    def size(self, axis: str) -> int:
        return dict(self.sizes).get(axis, 1)

    def product(self, axes) -> int:
        return math.prod(self.size(a) for a in axes)

    def dcn_product(self, axes) -> int:
        """Of the devices `axes` span, how many slices they cross (the DCN factor)."""
        dcn = dict(self.dcn_sizes)
        return math.prod(dcn.get(a, 1) for a in axes)

    @property
    def num_devices(self) -> int:
        return math.prod(s for _, s in self.sizes)

    @property
    def batch_shards(self) -> int:
        return self.product(self.batch_axes)

    @property
    def cp(self) -> int:
        """Sequence shards: the product of every axis that shards the sequence."""
        return self.product(self.sequence_axes)

    @property
    def replicating_axes(self) -> tuple[str, ...]:
        """Axes of size > 1 that shard neither batch nor sequence of the tokens."""
        token_axes = set(self.batch_axes) | set(self.sequence_axes)
        return tuple(a for a, s in self.sizes if s > 1 and a not in token_axes)

    def as_dict(self) -> dict:
        return {
            "sizes": dict(self.sizes),
            "source": self.source,
            "roles": {
                "batch": list(self.batch_axes),
                "sequence": list(self.sequence_axes),
                "experts": list(self.expert_axes),
                "hidden": list(self.hidden_axes),
                "embed": list(self.embed_axes),
            },
        }


def fill_tier(cfg: Config, tier: str, devices: int | None, findings: list) -> dict | None:
    """Sizes of one tier (ici or dcn) with its `-1` filled; None if it cannot be."""
    sizes = {a: cfg.parallelism(tier, a) for a in MESH_AXES}
    for axis, size in sizes.items():
        if size == 0 or size < -1:
            findings.append(
                error(
                    "MESH_AXIS_INVALID",
                    f"{tier}_{axis}_parallelism",
                    f"{tier}_{axis}_parallelism={size}: an axis size must be a positive "
                    "integer, or -1 to fill the remaining devices. Set it to 1 to leave "
                    "the axis unused.",
                    [fix(**{f"{tier}_{axis}_parallelism": 1})],
                )
            )
            return None
    fill = [a for a, s in sizes.items() if s == -1]
    if len(fill) > 1:
        names = ", ".join(f"{tier}_{a}_parallelism" for a in fill)
        findings.append(
            error(
                "MESH_FILL_AMBIGUOUS",
                f"{tier}_{fill[0]}_parallelism",
                f"{names} are all -1; at most one {tier} axis may fill the remaining "
                "devices. Give the others explicit sizes.",
                [
                    fix(
                        f"{keep} fills", **{f"{tier}_{a}_parallelism": 1 for a in fill if a != keep}
                    )
                    for keep in fill
                ],
            )
        )
        return None
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if fill:
        if devices is None:
            findings.append(
                error(
                    "NUM_DEVICES_UNKNOWN",
                    "num_devices",
                    f"{tier}_{fill[0]}_parallelism=-1 fills the remaining devices, but "
                    "the device count is unknown. Set num_devices=N (or pass a live mesh).",
                    no_fix="No value is offered: the device count is the machine's, which "
                    "the config does not say.",
                )
            )
            return None
        if devices % fixed:
            findings.append(
                error(
                    "MESH_NOT_DIVISIBLE",
                    f"{tier}_{fill[0]}_parallelism",
                    f"The other {tier} axes multiply to {fixed}, which does not divide the "
                    f"{devices} devices {tier}_{fill[0]}_parallelism=-1 must fill. Make the "
                    f"product of the {tier} axes divide {devices}.",
                    _dividing_sizes(cfg, tier, sizes, devices),
                )
            )
            return None
        sizes[fill[0]] = devices // fixed
    return sizes


def _divisors(n: int, near: int) -> list[int]:
    """The divisors of `n` just below and just above `near` (those that exist)."""
    below = [d for d in range(min(near, n), 0, -1) if n % d == 0][:1]
    above = [d for d in range(near + 1, n + 1) if n % d == 0][:1]
    return below + above


def _dividing_sizes(cfg: Config, tier: str, sizes: dict, devices: int) -> list:
    """Each explicit axis resized, down or up, so the tier's product divides `devices`;
    a sequence axis also with the per-device batch scaled so each batch shard keeps its
    sequences (the fill axis shrinks as it grows)."""
    fixes = []
    for axis, size in sizes.items():
        if size <= 1:
            continue
        others = math.prod(s for a, s in sizes.items() if s != -1 and a != axis)
        if devices % others:
            continue
        for new in _divisors(devices // others, size):
            knob = {f"{tier}_{axis}_parallelism": new}
            fixes.append(fix(**knob))
            if axis in cfg.axis_rules.sequence and new > 1:
                batch = cfg.per_device_batch_size / new
                fixes.append(fix(f"{new} sequence shards", **knob, per_device_batch_size=batch))
    return fixes


def mesh_from_config(cfg: Config) -> tuple[dict | None, list[Finding], dict]:
    """Axis sizes (ici x dcn) from the config's knobs, and any problems found."""
    findings: list[Finding] = []
    if cfg.num_slices < 1:
        findings.append(
            error(
                "MESH_AXIS_INVALID",
                "num_slices",
                f"num_slices={cfg.num_slices} must be >= 1: it counts the "
                "slices joined over DCN. Use 1 for a single slice.",
            )
        )
        return None, findings, {}
    if cfg.num_devices is not None and not 1 <= cfg.num_devices <= MAX_DEVICES:
        findings.append(
            error(
                "NUM_DEVICES_INVALID",
                "num_devices",
                f"num_devices={cfg.num_devices} must be an integer from 1 to {MAX_DEVICES:,} "
                "(or unset to derive it from the mesh).",
                [fix("derived from the mesh", num_devices=None)],
                no_fix="No value is offered: the device count is the machine's, which "
                "the config does not say.",
            )
        )
        return None, findings, {}
    per_slice = None
    if cfg.num_devices is not None:
        if cfg.num_devices % cfg.num_slices:
            findings.append(
                error(
                    "MESH_NOT_DIVISIBLE",
                    "num_slices",
                    f"num_devices={cfg.num_devices} is not divisible by "
                    f"num_slices={cfg.num_slices}. Every slice holds the same devices.",
                    [fix(num_slices=n) for n in _divisors(cfg.num_devices, cfg.num_slices)],
                )
            )
            return None, findings, {}
        per_slice = cfg.num_devices // cfg.num_slices
    ici = fill_tier(cfg, "ici", per_slice, findings)
    dcn = fill_tier(cfg, "dcn", cfg.num_slices, findings)
    if ici is None or dcn is None:
        return None, findings, {}
    sizes = {a: ici[a] * dcn[a] for a in MESH_AXES}
    total = math.prod(sizes.values())
    # A dcn product that is not num_slices also breaks the device count: one set of
    # fixes for both findings.
    dcn_fixes = [fix(num_slices=math.prod(dcn.values()))] + [
        fix(**{f"dcn_{a}_parallelism": 1})
        for a, n in dcn.items()
        if n > 1 and cfg.parallelism("dcn", a) != -1
    ]
    if math.prod(dcn.values()) != cfg.num_slices:
        findings.append(
            error(
                "MESH_DEVICE_MISMATCH",
                "num_slices",
                f"The dcn axes multiply to {math.prod(dcn.values())} but num_slices="
                f"{cfg.num_slices}. Make the dcn_*_parallelism product equal num_slices.",
                dcn_fixes,
            )
        )
    if cfg.num_devices is not None and total != cfg.num_devices:
        shown = " x ".join(f"{a}={s}" for a, s in sizes.items() if s > 1) or "1"
        findings.append(
            error(
                "MESH_DEVICE_MISMATCH",
                "num_devices",
                f"The mesh ({shown}) holds {total} devices but num_devices="
                f"{cfg.num_devices}. Change the ici_/dcn_*_parallelism sizes so they "
                f"multiply to {cfg.num_devices}, or set one of them to -1.",
                [
                    *(
                        fix(
                            f"{a} fills the {cfg.num_devices} devices",
                            **{f"ici_{a}_parallelism": -1},
                        )
                        for a, n in ici.items()
                        if n > 1
                    ),
                    fix(f"the mesh as written, on {total} devices", num_devices=total),
                    *(dcn_fixes if math.prod(dcn.values()) != cfg.num_slices else ()),
                ],
            )
        )
    return sizes, findings, dcn


def mesh_from_live(shape: Mapping[str, int]) -> tuple[dict, list[Finding]]:
    """Axis sizes from a live mesh's `.shape`; unknown axes are kept and reported."""
    findings = []
    sizes = {a: 1 for a in MESH_AXES}
    for axis, size in shape.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            findings.append(
                error(
                    "MESH_AXIS_INVALID",
                    "mesh",
                    f"The mesh axis '{axis}' has size {size!r}; every axis of a mesh holds "
                    "a positive whole number of devices. Build the mesh with sizes >= 1 "
                    "(layers.make_mesh), dropping an axis rather than giving it 0.",
                    no_fix="No setting can change it: a live mesh's sizes are read as they are.",
                )
            )
            continue
        if axis not in MESH_AXES and size > 1:
            findings.append(
                warning(
                    "MESH_UNKNOWN_AXIS",
                    "mesh",
                    f"The mesh axis '{axis}' (size {size}) is none of {', '.join(MESH_AXES)}; "
                    "the MoE block treats it as replicating the tokens. Rename it, or add "
                    "it to axis_rules.batch or axis_rules.sequence.",
                )
            )
        sizes[axis] = int(size)
    return sizes, findings


def axis_rule_findings(cfg: Config, sizes: Mapping[str, int]) -> list[Finding]:
    """Problems in the axis-roles table itself: unknown axes, an axis twice in one
    role or in one weight, and roles the block cannot honour together (only axes of
    size > 1 can conflict: a size-1 axis splits nothing)."""
    findings = []
    known_axes = tuple(sizes)
    rules = cfg.axis_rules
    for role in ROLES:
        listed = getattr(rules, role)
        for axis in listed:
            if axis not in known_axes:
                findings.append(
                    error(
                        "AXIS_RULE_UNKNOWN_AXIS",
                        f"axis_rules.{role}",
                        f"axis_rules.{role} names '{axis}', which is not a mesh axis "
                        f"({', '.join(known_axes)}). Remove it or fix its spelling.",
                        [_without(role, listed, {axis})],
                    )
                )
        twice = sorted({a for a in listed if listed.count(a) > 1})
        if twice:
            findings.append(
                error(
                    "AXIS_RULE_DUPLICATE",
                    f"axis_rules.{role}",
                    f"axis_rules.{role} lists {', '.join(twice)} more than once; a mesh axis "
                    "can split a dimension only once. List each axis once.",
                    [fix(**{f"axis_rules__{role}": list(dict.fromkeys(listed))})],
                )
            )
    both = sorted(set(rules.batch) & set(rules.sequence))
    if both:
        findings.append(
            error(
                "AXIS_RULE_CONFLICT",
                "axis_rules",
                f"{', '.join(both)} shard both the batch and the sequence; an axis can "
                "shard one token dimension. Remove it from axis_rules.batch or "
                "axis_rules.sequence.",
                [_without(r, getattr(rules, r), set(both)) for r in ("sequence", "batch")],
            )
        )
    tokens = set(rules.batch) | set(rules.sequence)
    split_twice = sorted(a for a in set(rules.hidden) & tokens if sizes.get(a, 1) > 1)
    if split_twice:
        findings.append(
            error(
                "AXIS_RULE_CONFLICT",
                "axis_rules.hidden",
                f"{', '.join(split_twice)} splits the tokens and also the expert hidden dim; "
                "the block sums the hidden slices over an axis whose devices hold the same "
                "tokens, so it cannot also split them. Remove it from axis_rules.hidden "
                "(the tokens stay split) or from the token roles.",
                [_without("hidden", rules.hidden, set(split_twice))],
            )
        )
    for weight, roles in (("expert weights", ("experts", "embed", "hidden")),):
        seen: dict[str, str] = {}
        for role in roles:
            for axis in getattr(rules, role):
                if sizes.get(axis, 1) > 1 and axis in seen and seen[axis] != role:
                    findings.append(
                        error(
                            "AXIS_RULE_DUPLICATE",
                            f"axis_rules.{role}",
                            f"'{axis}' shards two dimensions of the {weight} (axis_rules."
                            f"{seen[axis]} and axis_rules.{role}); a mesh axis can split one "
                            f"dimension of an array. Remove it from one of them.",
                            [_without(r, getattr(rules, r), {axis}) for r in (seen[axis], role)],
                        )
                    )
                seen.setdefault(axis, role)
    idle = sorted((set(rules.experts) | set(rules.embed)) - tokens)
    idle = [a for a in idle if sizes.get(a, 1) > 1]
    if idle:
        findings.append(
            error(
                "AXIS_RULE_WEIGHTS_OFF_TOKENS",
                "axis_rules",
                f"{', '.join(idle)} shards the expert weights at rest but not the tokens, so "
                "the block would gather the weights over devices that hold the same tokens "
                "and compute the same thing on each. Add it to axis_rules.batch or "
                "axis_rules.sequence, or remove it from axis_rules.experts / axis_rules.embed.",
                [
                    fix(axis_rules__batch=[*rules.batch, *idle]),
                    fix(
                        axis_rules__experts=[a for a in rules.experts if a not in idle],
                        axis_rules__embed=[a for a in rules.embed if a not in idle],
                    ),
                ],
            )
        )
    return findings


def _without(role: str, listed, axes: set):
    """The fix that drops `axes` from axis_rules.`role`."""
    return fix(**{f"axis_rules__{role}": [a for a in listed if a not in axes]})


def build_mesh_view(cfg: Config, live_shape: Mapping[str, int] | None):
    """(MeshView or None, findings). None when the sizes cannot be determined."""
    dcn: dict = {}
    if live_shape is not None:
        sizes, findings = mesh_from_live(live_shape)
        source = "live mesh"
    else:
        sizes, findings, dcn = mesh_from_config(cfg)
        source = "config"
    if sizes is None:
        return None, findings
    findings += axis_rule_findings(cfg, sizes)
    rules = cfg.axis_rules
    view = MeshView(
        sizes=tuple(sizes.items()),
        batch_axes=tuple(rules.batch),
        sequence_axes=tuple(rules.sequence),
        expert_axes=tuple(rules.experts),
        hidden_axes=tuple(rules.hidden),
        embed_axes=tuple(rules.embed),
        source=source,
        dcn_sizes=tuple((a, n) for a, n in dcn.items() if n > 1),
    )
    return view, findings
