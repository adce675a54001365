"""The auto policy: which dispatch to run, how expert weights meet the tokens, and why
each candidate won or lost. A candidate is a (dispatch, exchange) pair.

1. One expert: a plain MLP (nothing to route).
2. A candidate is rejected when it breaks the requested token semantics
   (capacity_factor <= 0 asks for dropless routing, which rules out the capacity path)
   or when what a device would hold does not fit the hardware.
3. capacity_factor > 0 asks for capacity-limited routing: subgroup_capacity honours
   it, so it wins when it fits (CAPACITY_COSTLY says when that is far dearer than the
   dropless choice).
4. Otherwise the dropless candidate with the lowest estimated time wins: compute,
   HBM traffic (activations and the expert weights read) and network traffic (weights
   gathered, or routed rows exchanged).
5. If nothing fits, the candidate holding the least is chosen and MEMORY_EXCEEDED
   says so.
An explicit `dispatch=` or `expert_exchange=` is always honoured (and validated).
"""

from __future__ import annotations

from .config import Config, Dispatch, Exchange
from .cost import Estimate
from .mesh import MeshView
from .placement import WeightPlacement, expert_groups, gathered
from .traits import traits

ROUTED = (Dispatch.subgroup_capacity, Dispatch.megablox, Dispatch.dense)
Key = tuple[Dispatch, Exchange]


def candidates_for(cfg: Config) -> tuple[Dispatch, ...]:
    """The routed dispatches, plus the plain MLP for one expert or when asked for."""
    if cfg.num_experts == 1 or cfg.dispatch is Dispatch.mlp:
        return (Dispatch.mlp,) + ROUTED
    return ROUTED


def exchange_backend(cfg: Config) -> str:
    """Collective that moves routed rows to their experts' owners, by platform."""
    return traits(cfg.hardware.platform).exchange_collective


def exchange_candidates(
    cfg: Config, mesh: MeshView, strategy: Dispatch
) -> dict[Exchange, tuple[WeightPlacement, ...]]:
    """The placements the block can run for `strategy`, by exchange (an explicit
    expert_exchange narrows them): gathered always; exchanged for megablox over each
    expert group that splits num_experts evenly (`placement.expert_groups`: every group
    auto weighs, or the one expert_group names)."""
    options = {Exchange.gather: (gathered(mesh, cfg.num_experts),)}
    if strategy is Dispatch.megablox:
        groups = expert_groups(cfg, mesh)
        if groups:
            options[Exchange.all_to_all] = groups
    if cfg.expert_exchange in options:
        return {cfg.expert_exchange: options[cfg.expert_exchange]}
    if cfg.expert_exchange is not Exchange.auto and cfg.dispatch is Dispatch.auto:
        return {}  # auto looks only at dispatches that can honour the requested exchange
    return options


def candidate_placements(cfg: Config, mesh: MeshView) -> dict[Key, tuple[WeightPlacement, ...]]:
    """Every (dispatch, exchange) candidate and where its weights could rest (every
    expert group auto weighs, for an exchange). When nothing can honour expert_exchange,
    the gathered ones (the layout rules say why)."""
    for asked in (cfg, cfg.replace(expert_exchange=Exchange.gather)):
        options = {
            (s, ex): places
            for s in candidates_for(asked)
            for ex, places in exchange_candidates(asked, mesh, s).items()
        }
        if options:
            break
    return options


def best_group(pairs) -> tuple[WeightPlacement, Estimate]:
    """Of (placement, estimate) pairs for one candidate (its expert groups), the one to
    run: the fastest estimated that fits, else the one holding the least."""
    fitting = [pair for pair in pairs if pair[1].fits]
    if fitting:
        return min(fitting, key=lambda pair: pair[1].time_s)
    return min(pairs, key=lambda pair: pair[1].device_bytes)


def _gib(x: float) -> str:
    return f"{x / 2**30:.3g} GiB"


def _why_faster(est: Estimate) -> str:
    t = est.time_parts
    return (
        f"{est.time_s * 1e3:.3g} ms: compute {t.compute * 1e3:.3g}, memory {t.memory * 1e3:.3g}, "
        f"network {t.network * 1e3:.3g}, overhead {t.overhead * 1e3:.3g}"
    )


def choose(cfg: Config, estimates: dict[Key, Estimate]) -> tuple[Key, str, dict[Key, str]]:
    """(chosen candidate, why it won, {candidate: verdict})."""
    verdicts: dict[Key, str] = {}
    limit = cfg.hardware.memory_gib * 2**30
    keys = list(estimates)
    if cfg.dispatch is not Dispatch.auto:
        keys = [k for k in keys if k[0] is cfg.dispatch]
        for k in estimates:
            if k[0] is not cfg.dispatch:
                verdicts[k] = "not requested"
    if cfg.num_experts == 1 and cfg.dispatch is Dispatch.auto:
        for k in estimates:
            verdicts[k] = "one expert: nothing to route"
        keys = [k for k in keys if k[0] is Dispatch.mlp]
        chosen = keys[0]
        verdicts[chosen] = "chosen"
        return chosen, "num_experts=1: a plain SwiGLU MLP, nothing to route", verdicts

    # Asked for by name, the capacity path is still priced (CAPACITY_REQUIRED says why
    # it should not run); auto leaves it out when dropless routing is asked. Auto always
    # has a dropless candidate (megablox), so `allowed` is never empty.
    drop_capacity = cfg.capacity_factor <= 0 and cfg.dispatch is Dispatch.auto
    allowed, feasible = [], []
    for k in keys:
        est = estimates[k]
        if k[0] is Dispatch.subgroup_capacity and drop_capacity:
            verdicts[k] = "drops tokens, but capacity_factor <= 0 asks for dropless"
            continue
        allowed.append(k)
        if not est.fits:
            verdicts[k] = f"needs {_gib(est.device_bytes)} > {_gib(limit)}"
        else:
            feasible.append(k)
    if not feasible:
        chosen = min(allowed, key=lambda k: estimates[k].device_bytes)
        verdicts[chosen] = "chosen: holds the least, still too much"
        return chosen, "no candidate fits in memory; the one holding the least is shown", verdicts

    capacity = [k for k in feasible if k[0] is Dispatch.subgroup_capacity]
    if cfg.dispatch is not Dispatch.auto:
        chosen = min(feasible, key=lambda k: estimates[k].time_s)
        reason = f"requested explicitly with dispatch={cfg.dispatch.value}"
        others = [k for k in feasible if k != chosen]
        if others:  # one dispatch's exchanges: gather and all_to_all, so one other
            (other,) = others
            reason += (
                f"; weights {chosen[1].value} ({_why_faster(estimates[chosen])}) beat "
                f"{other[1].value} ({_why_faster(estimates[other])})"
            )
        for k in others:
            verdicts[k] = "slower (estimated)"
    elif capacity:  # feasible holds the capacity path only when capacity_factor > 0
        chosen = capacity[0]
        reason = (
            f"capacity_factor={cfg.capacity_factor:g} asks for capacity-limited routing; "
            "subgroup_capacity applies it per sequence shard and keeps the sequence sharded"
        )
        for k in feasible:
            if k != chosen:
                verdicts[k] = "dropless: would ignore capacity_factor"
    else:
        # Every feasible candidate is dropless here: the capacity path was left out above
        # (capacity_factor <= 0) or is not feasible (it wins the branch before).
        chosen = min(feasible, key=lambda k: estimates[k].time_s)
        reason = f"fastest dropless candidate that fits ({_why_faster(estimates[chosen])})"
        runner_up = [k for k in feasible if k != chosen]
        if runner_up:
            other = min(runner_up, key=lambda k: estimates[k].time_s)
            reason += f"; next: {estimates[other].name} ({_why_faster(estimates[other])})"
        for k in feasible:
            if k != chosen:
                verdicts[k] = "slower (estimated)"
    verdicts[chosen] = "chosen"
    return chosen, reason, verdicts
