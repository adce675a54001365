"""The whole-step estimate's margin, per compiler and route: how far today's count has
been from the compiled peak on each judge set.

    python -m bench.calibration.margins            # score the count on every judge set (JSON + PNG)
    python -m bench.calibration.margins --write    # and write each chip's step_margin into conf/

A judge set is a committed study of compiled whole steps (the compiled bytes are the
truth; the estimate is recounted here with today's code):

- XLA:TPU, native route: `step_compile` and `step_compile_jax012` (this project's
  decoder for v5p, 64 chips, jax 0.10.2 and 0.12.0.1, the MoE layers `auto` picked
  when the expert group was the context devices alone), and `step_compile_default`
  (the 10 of those 12 points whose pick changed once `auto` weighed fsdp in the group,
  compiled with today's picks on jax 0.10.2, 2026-12-05, before any count changed);
- XLA:GPU, native route: `step_compile_gpu` and `step_compile_gpu_jax012` (H200);
- XLA:TPU, MaxText route: `judge_step` (MaxText 0.2.5's train_compile for v5p, 20
  points from 1k to 32k tokens a device, written by `bench.calibration.maxtext_step --into
  judge_step` before the count it scores changed).

The native sets also served while the count was developed, so their margins are what
the count does on programs it has seen; the MaxText set never did. The error of a
point is estimate / compiled - 1; a chip's margin is [under, over]: the largest
shortfall and the largest excess, each rounded up to the percent. With it, every
point's compiled peak lies in [estimate / (1 + over), estimate / (1 - under)], which is
what the verdict (`selector.cost.verdict`) reads.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

from bench.common import RESULTS, pyplot, save, table

STUDY = "margins"
GIB = 2**30
CONF = Path(__file__).resolve().parents[2] / "conf" / "hardware"
# (compiler, route) -> the judge sets that speak for it, and the chips whose presets
# take its margin (the same compiler; chips differ in HBM, the error is relative).
JUDGES = {
    ("tpu", "native"): (
        ("step_compile", "step_compile_jax012", "step_compile_default"),
        ("v5p", "v5e", "v6e"),
    ),
    ("gpu", "native"): (("step_compile_gpu", "step_compile_gpu_jax012"), ("h100", "h200")),
    ("tpu", "maxtext"): (("judge_step",), ("v5p", "v5e", "v6e")),
}
FIELDS = {"native": "step_margin", "maxtext": "maxtext_step_margin"}
MAXTEXT_STUDIES = ("judge_step", "maxtext_step")
# Scored beside the judge sets but not in any margin: MaxText's compiles the count was
# developed against (4,096 tokens a device).
DEV_SETS = ("maxtext_step",)
MARGIN_COMMENT = {
    "native": "# How far the whole-step estimate has been from this compiler's peak, [under,\n"
    "# over], on the native route's judge sets (written by python -m bench.calibration.margins --write).",
    "maxtext": "# The same on MaxText's own compiled steps (the MaxText route's margin).",
}


# The expert group `auto` gave an exchange before it weighed fsdp too: the group of the
# judge rows that do not record theirs.
CONTEXT_GROUP = "expert_and_sequence"


def native_pins(candidate: str, group: str = CONTEXT_GROUP) -> list[str]:
    """The overrides that make today's selector estimate the program that was compiled:
    its dispatch (the time count may pick another), its exchange, and for an exchange
    its expert group."""
    dispatch = f"dispatch={candidate.split('/')[0]}"
    if candidate.startswith("megablox/all_to_all"):
        return [dispatch, "expert_exchange=all_to_all", f"expert_group={group}"]
    return [dispatch, "expert_exchange=gather"]


def native_estimate(row: dict, target: str, jax_version: str) -> float:
    import selector
    from bench.calibration.step_compile import overrides, parse

    model, cp, layers = parse(row["point"])
    lines = [
        *overrides(model, cp, target, layers),
        *native_pins(row["candidate"], row.get("expert_group", CONTEXT_GROUP)),
        f"hardware.jax_version={jax_version}",
    ]
    plan, _ = selector.api.analyse_any(selector.to_config(selector.compose(lines)))
    return plan.chosen_estimate.device_bytes


def maxtext_estimate(row: dict, base: str) -> float:
    import selector
    from bench.calibration.maxtext_step import overrides, parse_point

    point = parse_point(row["point"])
    args = argparse.Namespace(per_device_batch_size=1, max_target_length=4096)
    imported = selector.from_maxtext(base, overrides(point, args))
    plan, _ = selector.api.analyse_any(imported.config)
    return plan.chosen_estimate.device_bytes


def judged_rows(study: str, base: str | None) -> list[dict]:
    """Each compiled point of a judge set with today's estimate beside it. A MaxText
    compile that ran out of memory counts with the bytes XLA's message names."""
    path = RESULTS / f"{study}.json"
    if not path.is_file():
        print(f"no {path.name}: that judge set is not compiled here")
        return []
    payload = json.loads(path.read_text())
    out = []
    for row in payload["rows"]:
        compiled = row.get("peak_gib")
        if compiled is None or row.get("status") not in ("ok", "oom"):
            continue
        if study in MAXTEXT_STUDIES:
            if base is None:
                continue
            est = maxtext_estimate(row, base) / GIB
        else:
            jax_version = (payload.get("stack") or "").split(",")[0].removeprefix("jax ")
            target = "gpu" if "gpu" in study else "tpu"
            est = native_estimate(row, target, jax_version or "auto") / GIB
        out.append(
            {
                "study": study,
                "point": row["point"],
                "status": row["status"],
                "compiled_gib": compiled,
                "estimate_gib": est,
                "error": est / compiled - 1,
            }
        )
    return out


def margin_of(rows: list[dict]) -> list[float]:
    """[under, over], each rounded up to the percent (0 when the estimate never erred
    that way)."""
    under = max([0.0, *(-r["error"] for r in rows)])
    over = max([0.0, *(r["error"] for r in rows)])
    return [math.ceil(under * 100 - 1e-9) / 100, math.ceil(over * 100 - 1e-9) / 100]


def margins(base: str | None) -> dict:
    """Every (compiler, route) judged: its rows, margin, and the share within 10%."""
    out = {}
    for (compiler, route), (studies, chips) in JUDGES.items():
        rows = [r for s in studies for r in judged_rows(s, base)]
        if not rows:
            continue
        within = sum(abs(r["error"]) <= 0.10 for r in rows) / len(rows)
        out[f"{compiler}/{route}"] = {
            "compiler": compiler,
            "route": route,
            "studies": list(studies),
            "chips": list(chips),
            "margin": margin_of(rows),
            "within_10pct": within,
            "rows": rows,
        }
    return out


def source_of(judged: dict) -> str:
    return f"{', '.join(judged['studies'])}: {len(judged['rows'])} compiled steps"


def write_conf(judged: dict) -> list[Path]:
    """Each chip preset's margin lines, replaced in place (or appended)."""
    written = []
    for entry in judged.values():
        field = FIELDS[entry["route"]]
        for chip in entry["chips"]:
            path = CONF / f"{chip}.yaml"
            text = path.read_text()
            lines = {
                field: f"{field}: [{entry['margin'][0]:g}, {entry['margin'][1]:g}]",
                f"{field}_source": f'{field}_source: "{source_of(entry)}"',
            }
            if not re.search(rf"^{field}:", text, re.M):
                text += f"{MARGIN_COMMENT[entry['route']]}\n"
            for key, line in lines.items():
                pattern = re.compile(rf"^{key}:.*$", re.M)
                text = pattern.sub(line, text) if pattern.search(text) else f"{text}{line}\n"
            path.write_text(text)
            written.append(path)
    return written


def plot(judged: dict):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, entry in enumerate(judged.values()):
        errors = [r["error"] * 100 for r in entry["rows"]]
        ax.scatter([i] * len(errors), errors, alpha=0.6)
        under, over = entry["margin"]
        ax.plot([i - 0.2, i + 0.2], [-under * 100] * 2, color="k")
        ax.plot([i - 0.2, i + 0.2], [over * 100] * 2, color="k")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(range(len(judged)))
    ax.set_xticklabels(
        [
            f"{k}\n{len(v['rows'])} steps, {v['within_10pct']:.0%} within 10%"
            for k, v in judged.items()
        ],
        fontsize=8,
    )
    ax.set_ylabel("estimate / compiled peak - 1 (%)")
    ax.set_title("Whole-step estimate against the compiled peak, per judge set (bars: margin)")
    return fig


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--base", default="", help="MaxText 0.2.5's configs/base.yml")
    ap.add_argument("--write", action="store_true", help="write the margins into conf/")
    args = ap.parse_args(argv)
    base = args.base or default_base()
    judged = margins(base)
    for name, entry in judged.items():
        print(f"== {name}: margin {entry['margin']}, {entry['within_10pct']:.0%} within 10%")
        print(
            table(
                entry["rows"],
                [
                    ("study", "study"),
                    ("point", "point"),
                    ("compiled_gib", "compiled GiB"),
                    ("estimate_gib", "estimate GiB"),
                    ("error", "est / compiled - 1"),
                ],
            )
        )
    dev = {study: judged_rows(study, base) for study in DEV_SETS}
    for study, rows in dev.items():
        print(f"== {study} (development set, no margin): {len(rows)} points")
        print(
            table(
                rows,
                [
                    ("point", "point"),
                    ("compiled_gib", "compiled GiB"),
                    ("estimate_gib", "estimate GiB"),
                    ("error", "est / compiled - 1"),
                ],
            )
        )
    payload = {"study": STUDY, "judged": judged, "development": dev}
    json_path, png_path = save(STUDY, payload, plot(judged))
    print(f"wrote {json_path} and {png_path}")
    if args.write:
        for path in write_conf(judged):
            print(f"wrote {path}")


def default_base() -> str | None:
    """MaxText's base.yml from the wheel the tests fetch (`~/.cache/moe-cp`), if there."""
    path = Path.home() / ".cache" / "moe-cp" / "maxtext-0.2.5" / "maxtext" / "configs" / "base.yml"
    return str(path) if path.is_file() else None


if __name__ == "__main__":
    main()
