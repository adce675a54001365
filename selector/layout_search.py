"""search: the launch settings, found for the user.

Given the model, the chips and a global batch held fixed, enumerate the layouts the
framework runs: every factorization of a slice's devices over the data, fsdp, context,
expert and tensor axes (slices, when there are several, split the data axis over DCN),
the per-device batch that the global batch gives, each remat policy MaxText 0.2.5 keeps
on the device (`REMAT_BY_MEMORY`; the offloading ones move tensors to the host, a cost
nothing here counts) and the vocabulary tiling. Each layout is checked by the same
analysis as a launch (`plan._analyse`: every rule, the dispatch and expert group it
weighs, the whole step's memory and its margin); a layout with an error is refused
(and counted by the error's code), and the rest are ranked: those that fit surely
(the estimate plus the chip's margin) before those within the margin, then by the whole
step's counted time (`selector.step_time`; within `TIE` a tie), then by what a device
holds.

The vocabulary tiling only trades memory for nothing the time counts, so a layout
takes the smallest tiling that fits (1, 2, 4, ... up to `MAX_VOCAB_TILING`). A mesh on
which `remat_policy=full` (which saves the least) does not fit at the largest tiling
is refused for every policy without checking them.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from .config import Config, Mode
from .cost import Verdict
from .findings import errors_in, render_value
from .plan import DispatchPlan, _analyse
from .step_memory import REMAT_BY_MEMORY
from .step_time import NOT_COUNTED, StepTime, step_time
from .timing import priced_by

SEARCH_AXES = ("data", "fsdp", "context", "expert", "tensor")
MAX_VOCAB_TILING = 64
_MEMORY_CODES = {"MEMORY_EXCEEDED"}


@dataclass(frozen=True)
class Layout:
    """One launch layout that passes the check: its settings (MaxText's keys and the
    selector's dispatch keys), the plan the check made for it and its whole step's
    counted time.

    Attributes:
      settings: the keys that select it, in the route's spelling.
      plan: the plan the launch check made for it.
      step: the whole step's counted time, by part (`step_time.StepTime`).

    Examples:
      >>> import selector
      >>> found = selector.search(selector.compose(["model=tiny", "mesh=cpu_8",
      ...     "search_global_batch=8"]))
      >>> first = found.layouts[0]
      >>> first.overrides[3], first.verdict.value
      ('ici_expert_parallelism=8', 'yes')
    """

    settings: dict
    plan: DispatchPlan
    step: StepTime

    @property
    def device_bytes(self) -> float:
        return self.plan.chosen_estimate.device_bytes

    @property
    def verdict(self) -> Verdict:
        return self.plan.chosen_estimate.verdict

    @property
    def overrides(self) -> list[str]:
        """The command-line overrides that select this layout."""
        return [f"{k}={render_value(v)}" for k, v in self.settings.items()]

    def as_dict(self) -> dict:
        est = self.plan.chosen_estimate
        return {
            "settings": {k: render_value(v) for k, v in self.settings.items()},
            "dispatch": est.name,
            "expert_group": self.plan.placement.group.value,
            "device_gib": self.device_bytes / 2**30,
            "fits": self.verdict.value,
            "step_time_s": self.step.total,
            "step_time_parts": self.step.as_dict(),
            "overrides": self.overrides,
        }


@dataclass(frozen=True)
class SearchResult:
    """Every layout that passes the check, best first (sure fits, then those within
    the margin, each by counted step time), and what was refused.

    Attributes:
      layouts: every layout that passes, best first.
      global_batch, num_devices: what was held fixed (sequences, chips).
      meshes, checked, refused: factorizations tried, analyses run, and the layouts
        refused by their first error's code, most first.
      seconds, uncounted: the search's time; the per-op constants it could not price.

    Examples:
      >>> import selector
      >>> found = selector.search(selector.compose(["model=tiny", "mesh=cpu_8",
      ...     "search_global_batch=8"]))
      >>> found.num_devices, found.meshes, len(found.layouts) > 0, found.refused[0][0]
      (8, 35, True, 'LOCAL_BATCH_INFLATION')
    """

    layouts: tuple[Layout, ...]
    global_batch: float  # sequences, held fixed
    num_devices: int
    meshes: int  # factorizations of the devices tried
    checked: int  # analyses run
    refused: tuple[tuple[str, int], ...]  # (first error's code, layouts) most first
    seconds: float
    uncounted: tuple[str, ...]  # per-op constants the chip has no figure for

    def as_dict(self) -> dict:
        return {
            "global_batch": self.global_batch,
            "num_devices": self.num_devices,
            "meshes": self.meshes,
            "checked": self.checked,
            "refused": dict(self.refused),
            "seconds": self.seconds,
            "uncounted": list(self.uncounted),
            "layouts": [layout.as_dict() for layout in self.layouts],
        }


def factorizations(n: int, axes: int) -> list[tuple[int, ...]]:
    """Every way to write n as an ordered product of `axes` positive factors.

    >>> factorizations(4, 2)
    [(1, 4), (2, 2), (4, 1)]
    """
    if axes == 1:
        return [(n,)]
    return [
        (d, *rest)
        for d in range(1, n + 1)
        if n % d == 0
        for rest in factorizations(n // d, axes - 1)
    ]


def global_batch(cfg: Config, num_devices: int) -> float:
    """The global batch in sequences the search holds fixed: search_global_batch, or
    search_global_tokens over the sequence length, or the config's own
    per_device_batch_size times the devices."""
    if cfg.search_global_batch > 0:
        return float(cfg.search_global_batch)
    if cfg.search_global_tokens > 0:
        return cfg.search_global_tokens / cfg.max_target_length
    return cfg.per_device_batch_size * num_devices


def search(
    cfg: Config,
    progress: Callable[[int, int], None] | None = None,
    route: Callable[[Config], tuple[Config, list]] | None = None,
    spell: Callable[[dict], dict] | None = None,
) -> SearchResult:
    """Every layout of `cfg`'s chips that its check passes, fastest first.

    Args:
      cfg: the typed config: the model, `hardware`, the devices (`num_devices`, or the
        mesh preset's) and `num_slices`, `max_target_length`, and the global batch
        (`global_batch`).
      progress: called with (meshes done, meshes) as the search goes.
      route: what a route adds for each mesh, `(config) -> (config, findings)`: the
        MaxText route's exchange by its expert axis and its torus check
        (`MaxTextImport.for_mesh`); an error there refuses the mesh.
      spell: the route's spelling of a layout's settings (the MaxText route's keys,
        `MaxTextImport.launch_settings`); None: the selector's keys.

    Returns:
      The SearchResult: `.layouts` (each `.settings`, `.plan`, `.step`), what was
      refused and by which error, and how long the search took.
    """
    start = time.perf_counter()
    devices = _devices(cfg)
    slices = max(cfg.num_slices, 1)
    per_slice = devices // slices
    batch = global_batch(cfg, devices)
    base = cfg.replace(
        num_devices=devices,
        per_device_batch_size=batch / devices,
        dcn_data_parallelism=slices,
        **{f"dcn_{a}_parallelism": 1 for a in SEARCH_AXES if a != "data"},
        ici_context_usp_ulysses_parallelism=1,
        ici_context_autoregressive_parallelism=1,
        search=False,
    )
    remats = REMAT_BY_MEMORY if cfg.mode is Mode.train else ("full",)
    meshes = factorizations(per_slice, len(SEARCH_AXES))
    found: list[Layout] = []
    refused: Counter = Counter()
    checked = 0
    for done, factors in enumerate(meshes, 1):
        if progress is not None:
            progress(done, len(meshes))
        sizes = dict(zip(SEARCH_AXES, factors, strict=True))
        mesh_cfg = base.replace(**{f"ici_{a}_parallelism": s for a, s in sizes.items()})
        if route is not None:
            mesh_cfg, route_findings = route(mesh_cfg)
            if errors_in(route_findings):
                refused[_first_error(route_findings)] += len(remats)
                continue
        # The least memory this mesh can hold: nothing saved, the vocabulary tiled most.
        tiling_cap = _tiling_cap(mesh_cfg)
        plan, findings = _analyse(
            mesh_cfg.replace(remat_policy=remats[0], num_vocab_tiling=tiling_cap), None
        )
        checked += 1
        if plan is None or errors_in(findings):
            refused[_first_error(findings)] += len(remats)
            continue
        for remat in remats:
            layout, code, tries = _fitting(mesh_cfg.replace(remat_policy=remat), tiling_cap)
            checked += tries
            if layout is None:
                refused[code] += 1
            else:
                found.append(layout)
    found.sort(key=_rank)
    if spell is not None:
        found = [dataclasses.replace(lay, settings=spell(lay.settings)) for lay in found]
    return SearchResult(
        layouts=tuple(found),
        global_batch=batch,
        num_devices=devices,
        meshes=len(meshes),
        checked=checked,
        refused=tuple(refused.most_common()),
        seconds=time.perf_counter() - start,
        uncounted=cfg.hardware.uncounted,
    )


# Step times this close (relative) are a tie, and the lighter layout ranks first: the
# count is not finer than that.
TIE = 0.005


def _rank(layout: Layout) -> tuple:
    """Sure fits before those within the memory margin; then by step time in steps of
    TIE; then by what a device holds."""
    step = math.floor(math.log(max(layout.step.total, 1e-12)) / math.log1p(TIE))
    return (layout.verdict is not Verdict.yes, step, layout.device_bytes)


def _devices(cfg: Config) -> int:
    if cfg.num_devices:
        return cfg.num_devices
    sizes = [cfg.parallelism(t, a) for t in ("ici", "dcn") for a in SEARCH_AXES]
    if any(s < 0 for s in sizes):
        raise ValueError(
            "search=true needs the number of chips: set num_devices (or pick a mesh preset "
            "that sets it, mesh=v5p_128)."
        )
    return math.prod(sizes)


def _tiling_cap(cfg: Config) -> int:
    """The largest vocabulary tiling worth trying: a power of two at most
    MAX_VOCAB_TILING that divides the tokens a device holds."""
    tokens = cfg.per_device_batch_size * cfg.max_target_length
    cap = 1
    while cap * 2 <= MAX_VOCAB_TILING and tokens % (cap * 2) == 0:
        cap *= 2
    return cap


def _fitting(cfg: Config, cap: int) -> tuple[Layout | None, str, int]:
    """The layout at the smallest vocabulary tiling that passes the check, or None with
    the error that refused it; and how many analyses that took."""
    tries, tiling, code = 0, 1, ""
    while tiling <= cap:
        plan, findings = _analyse(cfg.replace(num_vocab_tiling=tiling), None)
        tries += 1
        errors = errors_in(findings)
        if plan is not None and not errors:
            return _layout(cfg.replace(num_vocab_tiling=tiling), plan), "", tries
        code = _first_error(findings)
        if not {f.code for f in errors} <= _MEMORY_CODES:
            break  # tiling the vocabulary only ever saves memory
        tiling *= 2
    return None, code, tries


def _first_error(findings) -> str:
    errors = errors_in(findings)
    return errors[0].code if errors else "NO_PLAN"


def _layout(cfg: Config, plan: DispatchPlan) -> Layout:
    settings: dict = {f"ici_{a}_parallelism": cfg.parallelism("ici", a) for a in SEARCH_AXES}
    if cfg.num_slices > 1:
        settings["dcn_data_parallelism"] = cfg.dcn_data_parallelism
    settings["per_device_batch_size"] = cfg.per_device_batch_size
    settings["remat_policy"] = cfg.remat_policy
    settings["num_vocab_tiling"] = cfg.num_vocab_tiling
    settings["dispatch"] = plan.strategy
    settings["expert_exchange"] = plan.placement.exchange
    settings["expert_group"] = plan.placement.group
    dev = plan.per_device
    return Layout(settings, plan, step_time(cfg, plan.mesh, dev, plan.chosen_estimate))


def fastest_per_mesh(result: SearchResult) -> list[Layout]:
    """The fastest layout of each mesh, fastest first: the list a reader compares."""
    seen, best = set(), []
    for layout in result.layouts:
        key = tuple(v for k, v in layout.settings.items() if k.endswith("_parallelism"))
        if key not in seen:
            seen.add(key)
            best.append(layout)
    return best


def exit_code(result: SearchResult) -> int:
    """0 when a layout fits surely, 3 when every one that passes is within the memory
    margin (compile to be sure), 1 when none passes."""
    if not result.layouts:
        return 1
    return 0 if any(lay.verdict is Verdict.yes for lay in result.layouts) else 3


def render_search(cfg: Config, result: SearchResult, top: int) -> str:
    """The search's text report: what was searched, the `top` fastest meshes, each with
    its time parts and the overrides that select it, and what the times leave out."""
    hw = cfg.hardware
    lines = [
        f"search: {cfg.model_name} on {result.num_devices} {hw.name} chips"
        f"{f' in {cfg.num_slices} slices' if cfg.num_slices > 1 else ''}, "
        f"{cfg.max_target_length:,} tokens a sequence, a global batch of "
        f"{result.global_batch:g} sequences (held fixed)",
        f"  {result.meshes} meshes, {result.checked} checks in {result.seconds:.2f} s; "
        f"{len(result.layouts)} layouts pass the check",
    ]
    if result.refused:
        refused = ", ".join(f"{code} {n:,}" for code, n in result.refused)
        lines.append(f"  refused: {refused}")
    if not result.layouts:
        lines.append(
            "error: no layout of these chips passes the check at this global batch. Give "
            "more chips (num_devices=), a smaller global batch (search_global_batch=) or "
            "shorter sequences (max_target_length=); the refusals above name what stops "
            "each layout (python -m selector with its overrides explains one)."
        )
        return "\n".join(lines)
    shown = fastest_per_mesh(result)[: max(top, 1)]
    lines.append(
        f"  the {len(shown)} fastest meshes (each at its fastest remat policy; output=json "
        "lists every layout):"
    )
    for rank, layout in enumerate(shown, 1):
        low, high = layout.plan.chosen_estimate.device_range(hw)
        fits = "fits" if layout.verdict is Verdict.yes else "within the margin"
        held = f"{layout.device_bytes / 2**30:.1f} GiB"
        if high > low:
            held += f" ({low / 2**30:.1f} to {high / 2**30:.1f})"
        lines.append(
            f"  {rank}. step {layout.step.total:.3g} s, {held} of {hw.memory_gib:g}: {fits}; "
            f"{layout.plan.chosen_estimate.name}, expert group "
            f"{layout.plan.placement.group.value}"
        )
        parts = ", ".join(f"{k} {v:.3g}" for k, v in layout.step.parts if v > 0)
        lines.append(f"     time (s): {parts}")
        lines.append(f"     {' '.join(layout.overrides)}")
    lines.append(f"  times priced by: {priced_by(hw)}")
    lines.append(f"  not counted: {'; '.join(NOT_COUNTED)}")
    lines.append(
        "  the ranking rests on the count and the constants above: no layout here has been "
        "timed (measure=true times one config's dispatch candidates on this machine)"
    )
    return "\n".join(lines)


__all__ = [
    "Layout",
    "SearchResult",
    "exit_code",
    "factorizations",
    "fastest_per_mesh",
    "global_batch",
    "render_search",
    "search",
]
