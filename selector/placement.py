"""Where the expert weights rest and how they meet the tokens (part of the plan).

Two ways, decided by the policy and stated in the plan:

- `gather`: the expert dim rests on the `experts` axes and the embedding dim on the
  `embed` axes; the block all-gathers both once per step (FSDP-style) and every device
  computes with every expert; gradients come back reduce-scattered.
- `all_to_all` (expert parallelism): the expert dim rests on the expert *group* (the
  `experts` axes, plus the sequence axes when they are folded in); a device computes
  only with its own E / group experts and the routed rows travel to them and back.

In both, the hidden dim rests on the `hidden` axes and stays split inside the block
(each shard computes its slice of every expert it serves; the output is summed once).
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import Config, Exchange, ExpertGroup, Mode
from .mesh import MeshView


@dataclass(frozen=True)
class WeightPlacement:
    """Where the expert weights rest and how they meet the tokens: the axes that split
    each dim of the weights at rest, the expert group that exchanges routed rows (empty
    when the weights are gathered), and the experts a device computes with.

    Attributes:
      exchange: gather or all_to_all (never auto in a plan).
      experts_axes, embed_axes, hidden_axes: the axes that split each dim at rest.
      group_axes, folded_axes: the expert group that exchanges rows (() when
        gathered) and the sequence axes folded into it.
      experts_per_device, shared_embed_axes, group: as the comment beside each says.

    Examples:
      >>> import selector
      >>> plan = selector.resolve(selector.compose(["model=tiny", "mesh=cpu_8",
      ...     "ici_context_parallelism=4", "per_device_batch_size=0.25"]))
      >>> place = plan.placement
      >>> place.exchange.value, place.embed_axes, place.experts_per_device
      ('gather', ('fsdp', 'context'), 8)
    """

    exchange: Exchange  # gather or all_to_all (never auto in a plan)
    experts_axes: tuple[str, ...]  # shard the expert dim at rest
    embed_axes: tuple[str, ...]  # shard the embedding dim at rest
    hidden_axes: tuple[str, ...]  # shard the hidden dim, at rest and in the matmuls
    group_axes: tuple[str, ...]  # the expert group that exchanges rows; () when gathered
    experts_per_device: int  # experts a device computes with
    folded_axes: tuple[str, ...]  # sequence axes folded into the expert group
    # The embedding dim of the router and the shared experts at rest: the embed axes,
    # and the fsdp axes folded into the group (which split every expert by expert, but
    # these weights, held by every device, still by their embedding dim).
    shared_embed_axes: tuple[str, ...] = ()
    # The expert_group that gives this placement (auto when gathered): what re-planning
    # at another input shape asks for, so the weights stay where they rest.
    group: ExpertGroup = ExpertGroup.auto

    def as_dict(self) -> dict:
        return {
            "exchange": self.exchange.value,
            "experts_axes": list(self.experts_axes),
            "embed_axes": list(self.embed_axes),
            "hidden_axes": list(self.hidden_axes),
            "group_axes": list(self.group_axes),
            "folded_axes": list(self.folded_axes),
            "shared_embed_axes": list(self.shared_embed_axes),
            "experts_per_device": self.experts_per_device,
            "expert_group": self.group.value,
        }


def gathered(mesh: MeshView, num_experts: int) -> WeightPlacement:
    """Weights rest sharded by the axis roles and are gathered into the block."""
    experts = _present(mesh, mesh.expert_axes)
    embed = _present(mesh, tuple(a for a in mesh.embed_axes if a not in experts))
    return WeightPlacement(
        exchange=Exchange.gather,
        experts_axes=experts,
        embed_axes=embed,
        hidden_axes=_present(mesh, mesh.hidden_axes),
        group_axes=(),
        experts_per_device=num_experts,
        folded_axes=(),
        shared_embed_axes=embed,
    )


@dataclass(frozen=True)
class GroupAxes:
    """The expert group an exchange would use: the one answer to which axes it folds."""

    axes: tuple[str, ...]  # the group: expert axes that split the tokens, then any folded
    folded: tuple[str, ...]  # sequence axes folded in
    left_out: str = ""  # why sequence axes of size > 1 stay out of the group ("" if none do)
    fsdp: tuple[str, ...] = ()  # fsdp-like axes in the group (expert_sequence_and_fsdp)


def exchange_group(cfg: Config, mesh: MeshView) -> GroupAxes:
    """The expert group for `cfg` on `mesh`, decode included. Every group axis must split
    the tokens, or the same rows would travel twice. The sequence axes join when
    expert_group asks for them, or (auto) when the larger group still splits
    num_experts evenly; never at decode, where the one new token per sequence is not
    split by them. expert_group=expert_sequence_and_fsdp puts the fsdp-like axes first
    (batch axes that split the weights' embedding dim too): the experts rest split over
    them instead, and no device gathers them. Policy, rules and report all read this, so
    they cannot disagree."""
    experts = _token_expert_axes(mesh)
    fsdp = ()
    if cfg.expert_group is ExpertGroup.expert_sequence_and_fsdp:
        fsdp = fsdp_axes_folded(mesh)
        experts = fsdp + experts
    sequence = tuple(a for a in _present(mesh, mesh.sequence_axes) if a not in experts)
    if not sequence:
        return GroupAxes(experts, (), fsdp=fsdp)
    named = " x ".join(f"{a}={mesh.size(a)}" for a in sequence)
    if cfg.mode is Mode.decode:
        return GroupAxes(
            experts,
            (),
            f"at mode=decode each sequence feeds one new token, which the sequence axes "
            f"({named}) do not split, so they cannot join the expert group",
            fsdp=fsdp,
        )
    if cfg.expert_group is ExpertGroup.expert:
        return GroupAxes(experts, (), f"expert_group=expert leaves the sequence axes ({named}) out")
    folded = experts + sequence
    if cfg.expert_group is ExpertGroup.auto and cfg.num_experts % mesh.product(folded):
        return GroupAxes(
            experts,
            (),
            f"expert_group=auto leaves the sequence axes ({named}) out, since with them the "
            f"group of {mesh.product(folded)} devices would not split num_experts="
            f"{cfg.num_experts}",
        )
    return GroupAxes(folded, sequence, fsdp=fsdp)


def _token_expert_axes(mesh: MeshView) -> tuple[str, ...]:
    """The expert axes of size > 1 that split the tokens (only those can exchange them)."""
    token_axes = set(mesh.batch_axes) | set(mesh.sequence_axes)
    return tuple(a for a in _present(mesh, mesh.expert_axes) if a in token_axes)


def fsdp_axes_folded(mesh: MeshView) -> tuple[str, ...]:
    """The axes expert_group=expert_sequence_and_fsdp adds to the group: batch axes of
    size > 1 that split the weights' embedding dim too and are not expert axes already
    (none: the group is expert_and_sequence's)."""
    experts = _token_expert_axes(mesh)
    return tuple(
        a for a in _present(mesh, mesh.batch_axes) if a in mesh.embed_axes and a not in experts
    )


def exchanged(cfg: Config, mesh: MeshView) -> WeightPlacement:
    """Weights rest on the expert group (E / group experts each) and rows are exchanged."""
    group = exchange_group(cfg, mesh)
    size, num_experts = mesh.product(group.axes), cfg.num_experts
    if group.fsdp:
        named = ExpertGroup.expert_sequence_and_fsdp
    else:
        named = ExpertGroup.expert_and_sequence if group.folded else ExpertGroup.expert
    return WeightPlacement(
        exchange=Exchange.all_to_all,
        experts_axes=group.axes,
        embed_axes=_present(mesh, tuple(a for a in mesh.embed_axes if a not in group.axes)),
        hidden_axes=_present(mesh, mesh.hidden_axes),
        group_axes=group.axes,
        experts_per_device=num_experts // size if size and num_experts % size == 0 else 0,
        folded_axes=group.folded,
        shared_embed_axes=_present(
            mesh, tuple(a for a in mesh.embed_axes if a not in group.axes or a in group.fsdp)
        ),
        group=named,
    )


# The expert groups auto weighs, each as the layers build it.
GROUPS = (ExpertGroup.expert, ExpertGroup.expert_and_sequence, ExpertGroup.expert_sequence_and_fsdp)


def expert_groups(cfg: Config, mesh: MeshView) -> tuple[WeightPlacement, ...]:
    """The exchanged placements to weigh: the configured expert_group's, and with
    expert_group=auto every other distinct group the layers can run (the expert axes;
    with the sequence axes; with fsdp too). A group of no device, or whose devices do
    not split num_experts evenly, is left out; () when none is left."""
    asked = [exchanged(cfg, mesh)]
    if cfg.expert_group is ExpertGroup.auto:
        asked += [exchanged(cfg.replace(expert_group=group), mesh) for group in GROUPS]
    options: list[WeightPlacement] = []
    for place in asked:
        seen = {p.group_axes for p in options}
        if place.group_axes and place.experts_per_device and place.group_axes not in seen:
            options.append(place)
    return tuple(options)


def _present(mesh: MeshView, axes) -> tuple[str, ...]:
    """The axes of size > 1 (a size-1 axis shards nothing), in the order given."""
    return tuple(a for a in axes if mesh.size(a) > 1)


def describe(p: WeightPlacement, mesh: MeshView, training: bool = True) -> str:
    """One sentence for the report: where the weights rest and how the block uses them."""

    def over(axes):
        return "x".join(f"{a}={mesh.size(a)}" for a in axes)

    rest = [
        f"{role} over {over(axes)}"
        for role, axes in (
            ("experts", p.experts_axes),
            ("embed", p.embed_axes),
            ("hidden", p.hidden_axes),
        )
        if axes
    ]
    where = f"rest sharded ({', '.join(rest)})" if rest else "rest replicated"
    hidden = (
        f"; the hidden dim stays split over {over(p.hidden_axes)} inside the block (each "
        "shard computes its slice of every expert, the output is summed once)"
        if p.hidden_axes
        else ""
    )
    if p.exchange is Exchange.all_to_all:
        return (
            f"{where}; expert parallel over {over(p.group_axes)}: each device computes with "
            f"its {p.experts_per_device} experts and routed rows travel to them by "
            f"all-to-all and back{hidden}"
        )
    gathered_axes = p.experts_axes + p.embed_axes
    if not gathered_axes:
        return f"{where}; every device computes with all experts{hidden}"
    grads = ", and gradients come back reduce-scattered" if training else ""
    return (
        f"{where}; the block all-gathers {over(gathered_axes)} once per step (FSDP-style), "
        f"every device computes with all experts{grads}{hidden}"
    )
