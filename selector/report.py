"""Render a plan and its findings as a readable report or as JSON."""

from __future__ import annotations

import json
import textwrap

from .architecture import model_params
from .checked import MeasureCheck
from .config import Config
from .cost import Verdict
from .findings import Finding, errors_in
from .per_device import is_whole
from .plan import DispatchPlan
from .step_memory import STEP_PARTS
from .timing import priced_by

# The candidates' fits column and the whole step's verdict, the margin counted.
FITS = {Verdict.yes: "yes", Verdict.no: "NO", Verdict.margin: "near"}
FIT_WORDS = {
    Verdict.yes: "yes",
    Verdict.no: "no",
    Verdict.margin: "within the margin, compile to be sure (compile=true)",
}


def _n(x: float) -> str:
    return f"{round(x):,}" if is_whole(x) else f"{x:,.8g}"  # 2,047.5 stays 2,047.5


def _wrap(text: str, indent: str) -> str:
    return textwrap.fill(text, width=92, initial_indent=indent, subsequent_indent=indent + "  ")


def render_compiled(check, memory_gib: float | None = None) -> list[str]:
    """The compile check's table: each compiled candidate, estimated beside compiled
    (the whole training step's bytes a device when the step was compiled, against the
    chip's `memory_gib`; else the MoE block's temporaries)."""
    if any(c.step is not None for c in check.compiled):
        return _render_compiled_step(check, memory_gib)
    lines = [
        "",
        f"Compiled for {check.target} (ahead of time on this machine; nothing ran)",
        f"  {'candidate':<21} {'temp MiB est':>12} {'temp MiB XLA':>12} {'error':>7}"
        f" {'device GiB XLA':>14} {'fits':>5} {'XLA / est FLOPs':>15} {'compile s':>9}",
    ]
    chosen = check.plan.chosen_estimate.name
    for c in check.compiled:
        ratio = f"{c.flops / c.estimate.flops:.2f}" if c.flops and c.estimate.flops else "-"
        lines.append(
            f"{'*' if c.name == chosen else ' '} {c.name:<21} "
            f"{c.estimate.memory.temp / 2**20:>12,.1f} {c.compiled.temp / 2**20:>12,.1f} "
            f"{c.temp_error:>+7.0%} {c.device_bytes / 2**30:>14.3g} "
            f"{'yes' if c.fits else 'NO':>5} {ratio:>15} {c.seconds:>9.0f}"
        )
    lines.append(
        f"  choice after compiling: {chosen}"
        + (
            f" (the estimate chose {check.estimated_choice}; compiled numbers decide)"
            if check.changed
            else " (as estimated)"
        )
    )
    return lines


def _render_compiled_step(check, memory_gib: float | None) -> list[str]:
    chip = f", a chip holds {memory_gib:g} GiB" if memory_gib else ""
    lines = [
        "",
        f"Compiled the whole training step for {check.target} (ahead of time on this "
        f"machine; nothing ran{chip})",
        f"  {'candidate':<21} {'args GiB':>9} {'of it params':>12} {'optimizer':>9}"
        f" {'temp GiB':>9} {'peak GiB XLA':>12} {'est GiB':>8} {'error':>7} {'fits':>5}"
        f" {'compile s':>9}",
    ]
    chosen = check.plan.chosen_estimate.name
    for c in check.compiled:
        if c.step is None:
            continue
        s, g = c.step, 2**30
        lines.append(
            f"{'*' if c.name == chosen else ' '} {c.name:<21} {s.arguments / g:>9.3g} "
            f"{s.params / g:>12.3g} {s.optimizer / g:>9.3g} {s.temp / g:>9.3g} "
            f"{s.peak / g:>12.3g} {c.estimate.device_bytes / g:>8.3g} "
            f"{c.device_error:>+7.0%} {'yes' if c.fits else 'NO':>5} {c.seconds:>9.0f}"
        )
    lines.append(
        f"  choice after compiling the whole step: {chosen}"
        + (
            f" (the estimate chose {check.estimated_choice}; compiled numbers decide)"
            if check.changed
            else " (as estimated)"
        )
    )
    return lines


def render_measured(check) -> list[str]:
    """The measure check's table: each timed candidate, estimated beside measured."""
    lines = [
        "",
        f"Timed on {check.devices} {check.hardware} devices (interleaved rounds, medians)",
        f"  {'candidate':<21} {'est ms':>9} {'median ms':>10} {'measured / est':>14}",
    ]
    chosen = check.plan.chosen_estimate.name
    for c in check.measured:
        lines.append(
            f"{'*' if c.name == chosen else ' '} {c.name:<21} {c.estimate.time_s * 1e3:>9.3g} "
            f"{c.median * 1e3:>10.3g} {c.ratio:>14.3g}"
        )
    lines.append(
        f"  choice after timing: {chosen}"
        + (
            f" (the estimate chose {check.estimated_choice}; the measurement decides)"
            if check.changed
            else " (as estimated)"
        )
    )
    return lines


def render_text(
    cfg: Config, plan: DispatchPlan | None, findings: list[Finding], compiled=None
) -> str:
    hw = cfg.hardware
    lines = [
        f"MoE dispatch plan: {cfg.model_name} (E={cfg.num_experts}, k={cfg.num_experts_per_tok},"
        f" emb={cfg.base_emb_dim}, hidden={cfg.base_moe_mlp_dim}, {cfg.dtype}), "
        f"mode={cfg.mode.value}, hardware={hw.name}",
    ]
    if plan is not None:
        mesh, dev = plan.mesh, plan.per_device
        sizes = "  ".join(f"{a}={s}" for a, s in mesh.sizes)
        lines += [
            "",
            f"Mesh ({mesh.source}, {mesh.num_devices} devices): {sizes}",
            f"  batch axes     {', '.join(mesh.batch_axes) or '-':<54} -> {dev.batch_shards} shards",
            f"  sequence axes  {', '.join(mesh.sequence_axes) or '-':<54} -> cp = {dev.cp}",
            f"  expert axes    {', '.join(mesh.expert_axes) or '-':<54} -> "
            f"{mesh.product(mesh.expert_axes)}",
            f"  hidden axes    {', '.join(mesh.hidden_axes) or '-':<54} -> "
            f"{mesh.product(mesh.hidden_axes)}",
            "",
            "Per device",
            f"  global batch           {_n(dev.global_batch)} sequence(s) "
            f"(per_device_batch_size {cfg.per_device_batch_size:g} x {dev.num_devices} devices)",
            f"  local batch            {_n(dev.local_batch)} sequence(s) per batch shard",
            f"  sequence, sub-sequence {_n(dev.seq_len)}, {_n(dev.sub_seq)} tokens (cp = {dev.cp})",
            f"  tokens per device      {_n(dev.tokens_per_device)}"
            + (f" (same tokens on {dev.replication} devices)" if dev.replication > 1 else ""),
            f"  gmm rows per device    {_n(dev.gmm_rows)} (tokens x k)",
            "  capacity per subgroup  "
            + (
                f"{dev.capacity_per_subgroup} tokens per expert (capacity_factor "
                f"{cfg.capacity_factor:g}, {dev.expected_tokens_per_expert:.3g} expected)"
                if dev.capacity_per_subgroup is not None
                else "dropless (capacity_factor <= 0)"
            ),
            "",
            "Candidates (per device, one step; block = one MoE layer's program, device = the",
            "whole training step's peak with this block: see 'Whole step' below)",
            f"  {'candidate':<21} {'TFLOP':>7} {'rows':>10} {'block GiB':>9} {'device GiB':>10}"
            f" {'network GB':>10} {'weights GB':>10} {'rows GB':>8} {'est ms':>8} {'fits':>5}"
            "  verdict",
        ]
        for c in plan.candidates:
            e = c.estimate
            mark = "*" if c.chosen else " "
            lines.append(
                f"{mark} {c.name:<21} {e.flops / 1e12:>7.3g} {_n(e.rows):>10} "
                f"{e.memory.peak / 2**30:>9.3g} "
                f"{e.device_bytes / 2**30:>10.3g} {e.traffic.network / 1e9:>10.3g} "
                f"{e.traffic.weights_bytes / 1e9:>10.3g} {e.traffic.rows_bytes / 1e9:>8.3g} "
                f"{e.time_s * 1e3:>8.3g} {FITS[e.verdict]:>5}  {c.verdict}"
            )
        lines += [
            "",
            f"Choice: {plan.chosen_estimate.name}"
            + (
                f" (grouped matmul: {plan.gmm_backend}"
                + (
                    f"; rows exchanged by {plan.exchange_backend})"
                    if plan.placement.group_axes
                    else ")"
                )
                if plan.strategy.value == "megablox"
                else ""
            ),
            _wrap(f"why: {plan.reason}", "  "),
            *_tile_lines(plan),
            *render_time(cfg, plan),
            *(
                [f"  compiles for: {plan.target} (selector.targets; python -m bench.targets)"]
                if plan.target
                else []
            ),
            _wrap(f"expert weights: {plan.expert_weights}", "  "),
            *render_step(cfg, plan),
        ]
    if compiled is not None:  # a compile check, or a measure check
        measured = isinstance(compiled, MeasureCheck)
        lines += (
            render_measured(compiled)
            if measured
            else render_compiled(compiled, cfg.hardware.memory_gib)
        )
    lines += ["", f"Findings ({len(findings)})" if findings else "Findings: none"]
    for f in findings:
        lines.append(_wrap(f"{f.severity.value.upper()} {f.code} [{f.setting}]: {f.message}", "  "))
    n_err = len(errors_in(findings))
    n_warn = len(findings) - n_err
    if n_err:
        last = f"FAILED: {n_err} error(s), {n_warn} warning(s)"
    elif any(f.code == "MEMORY_WITHIN_MARGIN" for f in findings):
        last = (
            f"WITHIN THE MARGIN: no errors, {n_warn} warning(s); compile to be sure "
            "(compile=true). Exit status 3."
        )
    else:
        last = f"OK: no errors, {n_warn} warning(s)"
    lines += ["", last]
    return "\n".join(lines)


def render_time(cfg: Config, plan: DispatchPlan) -> list[str]:
    """Each candidate's counted time by part, what it counted, and the constants that
    priced it; the expert groups an exchange weighed."""
    lines = [
        "",
        "Time, counted (ms: compute + memory + network + overhead; selector.timing)",
    ]
    for c in plan.candidates:
        e, w = c.estimate, c.estimate.work
        t = e.time_parts
        copied = w.activation_relayout_bytes + w.activation_transpose_bytes
        streamed = w.streamed_bytes(cfg.hardware.cache_mib * 2**20)
        lines.append(
            f"{'*' if c.chosen else ' '} {c.name:<21} {e.time_s * 1e3:>8.3g} = "
            f"{t.compute * 1e3:.3g} + {t.memory * 1e3:.3g} + {t.network * 1e3:.3g} + "
            f"{t.overhead * 1e3:.3g}"
        )
        lines.append(
            _wrap(
                f"{w.flops / 1e9:,.4g} GFLOP in {w.dot_count:,.0f} dots; "
                f"{w.memory_bytes / 1e9:.3g} GB through memory, {w.gather_bytes / 1e9:.3g} GB "
                f"gathered, {(w.relayout_bytes + w.transpose_bytes) / 1e9:.3g} GB relaid"
                + (
                    f", {copied / 1e9:.3g} GB of activations copied into another layout"
                    if copied
                    else ""
                )
                + (
                    f", {streamed / 1e9:.3g} GB of tile visits streamed past the cache"
                    if streamed and cfg.hardware.gmm_streamed_gbps
                    else ""
                )
                + "; "
                f"{w.collectives:,.0f} collectives, {w.ici_bytes / 1e9:.3g} GB over "
                f"ICI, {w.dcn_bytes / 1e9:.3g} GB over DCN; {w.ops:,.0f} other ops, "
                f"{w.loop_trips:,.0f} loop trips",
                "      ",
            )
        )
        if c.groups:
            weighed = ", ".join(
                f"{'+'.join(p.group_axes)} {est.time_s * 1e3:.3g} ms"
                + ("" if est.fits else " (does not fit)")
                for p, est in c.groups
            )
            lines.append(_wrap(f"expert groups weighed: {weighed}", "      "))
    lines.append(_wrap(f"priced by {cfg.hardware.name}: {priced_by(cfg.hardware)}", "  "))
    return lines


def _tile_lines(plan: DispatchPlan) -> list[str]:
    """The chosen grouped matmul's row tile, the rows it computes, and each tile priced."""
    tiling, est = plan.gmm_tiling, plan.chosen_estimate
    if tiling is None:
        return []
    text = (
        f"row tile: {tiling.tm} ({tiling.source}): {_n(est.rows)} rows computed for "
        f"{_n(plan.per_device.gmm_rows)} routed"
    )
    if est.tile_options:
        priced = ", ".join(f"{o.tm}: {o.time_s * 1e3:.3g}" for o in est.tile_options)
        text += f"; kernel ms by tile {priced}"
    return [_wrap(text, "  ")]


def render_json(
    cfg: Config,
    plan: DispatchPlan | None,
    findings: list[Finding],
    overrides: list[str] | None = None,
    compiled=None,
) -> str:
    """One line of JSON (one per job in a multirun)."""
    payload = {
        "overrides": overrides,
        "ok": not errors_in(findings),
        "model_name": cfg.model_name,
        "model": model_params(cfg).as_dict(),
        "hardware": cfg.hardware.name,
        "mode": cfg.mode.value,
        "plan": plan.as_dict() if plan is not None else None,
        "findings": [f.as_dict() for f in findings],
        "compiled": None,
        "measured": None,
    }
    if compiled is not None:
        payload["measured" if isinstance(compiled, MeasureCheck) else "compiled"] = (
            compiled.as_dict()
        )
    return json.dumps(payload, sort_keys=True)


def _count(n: float) -> str:
    """A parameter count as people say it: 79.67B, 452K."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.4g}{unit}"
    return f"{n:g}"


def render_step(cfg: Config, plan: DispatchPlan) -> list[str]:
    """The whole model's size and what a device holds for the chosen candidate's step."""
    params = model_params(cfg)
    lines = [
        "",
        _wrap(
            f"Model: {_count(params.total)} parameters, {_count(params.active)} active "
            f"a token ({params.moe_layers} MoE and {params.dense_layers} dense layers, "
            f"vocabulary {cfg.vocab_size:,}; remat_policy {cfg.remat_policy}, "
            f"num_vocab_tiling {cfg.num_vocab_tiling})",
            "",
        ),
    ]
    parts = plan.chosen_estimate.device_breakdown
    if parts is None:
        return lines
    shown = [(name, parts[name]) for name in STEP_PARTS if parts.get(name, 0) > 0]
    lines.append(f"Whole step on a device ({plan.chosen_estimate.name}), GiB:")
    lines += [f"  {name.replace('_', ' '):<22} {value / 2**30:>9.3g}" for name, value in shown]
    lines += [
        f"  {'peak':<22} {parts['total'] / 2**30:>9.3g}  (what rests + what is saved + the",
        f"  {'':<22} {'':>9}  largest of the logits and one layer's attention + MoE block"
        + (" + the logits' gradient" if parts.get("logits_gradient_held") else "")
        + (" + the all-reduce copy)" if parts.get("all_reduce_copy") else ")"),
    ]
    est, hw = plan.chosen_estimate, cfg.hardware
    low, high = est.device_range(hw)
    if hw.step_margin and est.compiled_step_bytes is None:
        under, over = hw.step_margin
        lines.append(
            _wrap(
                f"margin: the estimate has been {under:.0%} under to {over:.0%} over the "
                f"compiled peak ({hw.step_margin_source}): a device holds {low / 2**30:.3g} "
                f"to {high / 2**30:.3g} GiB of {hw.memory_gib:g}; fits: "
                f"{FIT_WORDS[est.verdict]}",
                "  ",
            )
        )
    elif est.compiled_step_bytes is None:
        lines.append(
            _wrap(
                f"margin: none known (no judge set for {hw.name} on this route): the "
                "verdict is the estimate's alone",
                "  ",
            )
        )
    return lines
