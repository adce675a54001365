"""The auto policy: which dispatch to run, and why each candidate won or lost.

1. One expert: a plain MLP (nothing to route).
2. A candidate is rejected when it breaks the requested token semantics
   (capacity_factor <= 0 asks for dropless routing, which rules out the capacity path)
   or when its estimated per-device memory does not fit the hardware.
3. capacity_factor > 0 asks for capacity-limited routing: subgroup_capacity honours
   it, so it wins when it fits.
4. Otherwise the dropless candidate with the lowest estimated time wins (megablox for
   long sequences; dense when tokens are so few that per-expert tile padding in the
   grouped matmul costs more than running every expert).
5. If nothing fits, the smallest-memory candidate is chosen and MEMORY_EXCEEDED says so.
An explicit `dispatch=` is always honoured (and validated).
"""

from __future__ import annotations

from .config import Config, Dispatch, Exchange, ExpertGroup
from .cost import Estimate
from .mesh import MeshView
from .placement import WeightPlacement, exchanged, expert_group, gathered

ROUTED = (Dispatch.subgroup_capacity, Dispatch.megablox, Dispatch.dense)


def candidates_for(cfg: Config) -> tuple[Dispatch, ...]:
    """The routed dispatches, plus the plain MLP for one expert or when asked for."""
    if cfg.num_experts == 1 or cfg.dispatch is Dispatch.mlp:
        return (Dispatch.mlp,) + ROUTED
    return ROUTED


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB"


def choose(cfg: Config, estimates: dict[Dispatch, Estimate]) -> tuple[Dispatch, str, dict]:
    """(strategy, why it won, {candidate: verdict})."""
    verdicts: dict[Dispatch, str] = {}
    limit = cfg.hardware.memory_gib * 2**30
    if cfg.dispatch is not Dispatch.auto:
        chosen = cfg.dispatch
        for s in estimates:
            verdicts[s] = "requested" if s is chosen else "not requested"
        return chosen, f"requested explicitly with dispatch={chosen.value}", verdicts

    if cfg.num_experts == 1:
        for s in estimates:
            verdicts[s] = "chosen" if s is Dispatch.mlp else "one expert: nothing to route"
        return Dispatch.mlp, "num_experts=1: a plain SwiGLU MLP, nothing to route", verdicts

    allowed, feasible = [], []
    for s, est in estimates.items():
        if s is Dispatch.subgroup_capacity and cfg.capacity_factor <= 0:
            verdicts[s] = "drops tokens, but capacity_factor <= 0 asks for dropless"
            continue
        allowed.append(s)
        if not est.fits:
            verdicts[s] = f"needs {_gib(est.memory_bytes)} > {_gib(limit)}"
        else:
            feasible.append(s)

    if not feasible:
        chosen = min(allowed, key=lambda s: estimates[s].memory_bytes)
        verdicts[chosen] = "chosen: smallest memory, still too large"
        return chosen, "no candidate fits in memory; the smallest is shown", verdicts

    if cfg.capacity_factor > 0 and Dispatch.subgroup_capacity in feasible:
        chosen = Dispatch.subgroup_capacity
        reason = (
            f"capacity_factor={cfg.capacity_factor:g} asks for capacity-limited routing; "
            "subgroup_capacity applies it per sequence shard and keeps the sequence sharded"
        )
        for s in feasible:
            if s is not chosen:
                verdicts[s] = "dropless: would ignore capacity_factor"
    else:
        dropless = [s for s in feasible if s is not Dispatch.subgroup_capacity]
        chosen = min(dropless, key=lambda s: estimates[s].time_s)
        runner_up = [s for s in dropless if s is not chosen]
        reason = f"fastest dropless dispatch that fits ({estimates[chosen].time_s * 1e3:.3g} ms"
        if runner_up:
            other = min(runner_up, key=lambda s: estimates[s].time_s)
            reason += f" vs {other.value} {estimates[other].time_s * 1e3:.3g} ms"
        reason += " estimated per layer step)"
        for s in feasible:
            if s is not chosen:
                verdicts[s] = "slower (estimated)"
    verdicts[chosen] = "chosen"
    return chosen, reason, verdicts


def gmm_backend(cfg: Config) -> str:
    """Grouped-matmul backend for the megablox dispatch, by platform."""
    return {
        "tpu": "pallas_megablox",  # jax.experimental.pallas.ops.tpu.megablox
        "gpu": "ragged_dot",  # XLA's native grouped matmul on GPU
    }.get(cfg.hardware.platform, "tiled_gmm")  # ours: pure JAX, custom VJP


def exchange_backend(cfg: Config) -> str:
    """Collective that moves routed rows to their experts' owners, by platform."""
    return "all_to_all" if cfg.hardware.platform == "cpu" else "ragged_all_to_all"


def fold_sequence(cfg: Config, mesh: MeshView) -> bool:
    """Whether the sequence axes join the expert group (auto: when E divides evenly)."""
    if cfg.expert_group is ExpertGroup.expert:
        return False
    if cfg.expert_group is ExpertGroup.expert_and_sequence:
        return True
    group, _ = expert_group(mesh, fold_sequence=True)
    return cfg.num_experts % mesh.product(group) == 0


def exchange_candidates(
    cfg: Config, mesh: MeshView, strategy: Dispatch
) -> dict[Exchange, WeightPlacement]:
    """The placements the block can run for `strategy`: always gathered; exchanged for
    megablox when some token axis can form an expert group."""
    options = {Exchange.gather: gathered(mesh, cfg.num_experts)}
    if strategy is Dispatch.megablox:
        ep = exchanged(mesh, cfg.num_experts, fold_sequence(cfg, mesh))
        if ep.group_axes:
            options[Exchange.all_to_all] = ep
    return options
