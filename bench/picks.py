"""Do the selector's picks hold when timed? A judge set of dropless configs, fixed before
the time model it judges changed, every candidate of each timed on 8 simulated CPU
devices, and the selector's pick scored against the measured fastest.

Each config's candidates are every placement the layers can run: megablox with the
weights gathered, megablox exchanged over each expert group the config allows (the
expert axes; plus the sequence axes; plus fsdp), and dense where E / k <= 16 (beyond
that dense does E / k times the routed work and is not timed). Each is compiled once,
then one step of each is timed per round, in rotating order, for ROUNDS rounds, each
timed step after an untimed step of the same candidate (SETTLE), medians kept
(`checks.measured.interleaved`). The untimed step is there because a step's time
depends on the program that ran before it: a gathered block timed right after a dense
one ran 37% slower than after itself (docs/results/picks.md). Timings taken before
2026-12-05 had 9 rounds and no settling step. The timings depend on the layers only, not
on the selector, so they are stored once (`--time`) and the selector is scored on them
whenever its model changes (`--score`, the default): its pick under `auto`, the measured
fastest, the regret (the pick's median over the fastest's), whether the two are within
the rounds' noise (the pick was faster than the fastest in at least a third of the
rounds), and the Spearman rank correlation of estimated against measured time over the
config's candidates.

Every timing run is kept (`runs`; from 2026-12-06): the same configs timed on another
day put a different candidate first in 11 of 28 (docs/results/picks.md), so one run is
not the ground truth. The score of every run pooled (`pooled`: each run's rounds scaled
to its config's fastest, then scored as one run) is reported beside the newest run's,
and `--check` holds it to the bar.

The set was written and timed before the counted time model replaced the fitted one
(see docs/results/picks.md); it is never read for terms or tuned against.

    python -m bench.picks --time     # time every config (judge set about 12 minutes on 2 cores, dev set 25)
    python -m bench.picks            # score today's selector on the stored timings
    python -m bench.picks --check    # score, and fail unless the picks meet the bar
"""

from __future__ import annotations

import math
import sys

from bench.common import use_cpu_devices

TIMING = "--time" in sys.argv
if __name__ == "__main__" and TIMING:
    use_cpu_devices(8)

from bench.common import arguments, load, median, pyplot, save, table  # noqa: E402

ROUNDS = 5
SETTLE = 1  # untimed steps of the same candidate before each timed one
STUDY = "picks_cpu"
DENSE_MAX_RATIO = 16  # dense is timed where E / k is at most this

# (mesh, experts, top_k, sequence, emb, hidden, mode), dropless, one sequence a batch
# shard. Fixed (and timed) before the counted time model; sizes unlike bench.decide's.
JUDGE = [
    ({"context": 8}, 64, 1, 2048, 64, 128, "train"),
    ({"context": 8}, 128, 1, 1024, 96, 192, "train"),
    ({"context": 8}, 16, 1, 4096, 160, 320, "train"),
    ({"context": 8}, 8, 2, 8192, 160, 320, "prefill"),
    ({"context": 8}, 32, 2, 16384, 64, 128, "train"),
    ({"data": 8}, 8, 1, 512, 320, 640, "train"),
    ({"data": 8}, 32, 4, 512, 96, 192, "prefill"),
    ({"data": 8}, 128, 8, 256, 64, 128, "train"),
    ({"fsdp": 8}, 16, 2, 1024, 160, 320, "train"),
    ({"fsdp": 2, "context": 4}, 32, 2, 4096, 96, 192, "train"),
    ({"fsdp": 4, "context": 2}, 64, 4, 2048, 96, 192, "train"),
    ({"fsdp": 2, "context": 4}, 8, 2, 8192, 160, 640, "prefill"),
    ({"fsdp": 4, "context": 2}, 16, 8, 2048, 160, 320, "prefill"),
    ({"expert": 2, "context": 4}, 32, 1, 4096, 160, 320, "train"),
    ({"expert": 4, "context": 2}, 64, 2, 2048, 96, 192, "train"),
    ({"expert": 2, "context": 4}, 16, 4, 4096, 96, 384, "prefill"),
    ({"expert": 8}, 64, 2, 512, 96, 192, "train"),
    ({"tensor": 2, "context": 4}, 32, 2, 4096, 96, 384, "train"),
    ({"tensor": 4, "context": 2}, 16, 4, 2048, 160, 640, "train"),
    ({"tensor": 2, "context": 4}, 64, 1, 2048, 96, 192, "prefill"),
    ({"context_usp_ulysses": 2, "context": 4}, 64, 2, 4096, 96, 192, "train"),
    ({"context_usp_ulysses": 4, "data": 2}, 16, 2, 2048, 160, 320, "train"),
    ({"context_usp_ulysses": 2, "context": 2, "fsdp": 2}, 32, 4, 4096, 96, 192, "prefill"),
    ({"data": 2, "context": 4}, 128, 2, 2048, 64, 128, "train"),
    ({"data": 2, "context": 4}, 8, 1, 8192, 160, 320, "train"),
    ({"data": 4, "context": 2}, 32, 8, 1024, 96, 192, "prefill"),
    ({"fsdp": 2, "expert": 2, "context": 2}, 64, 2, 2048, 96, 192, "train"),
    ({"context_autoregressive": 2, "context": 4}, 16, 2, 4096, 96, 192, "prefill"),
]

# A development set the model may be read against: bench.decide's held-out and boundary
# configs (timed again here with every placement). The judge set above is not one.
DEV = [
    ({"data": 8}, 12, 3, 1024, 192, 384, "train"),
    ({"context": 8}, 24, 6, 8192, 192, 384, "train"),
    ({"data": 2, "context": 4}, 8, 8, 4096, 192, 384, "train"),
    ({"fsdp": 2, "context": 4}, 16, 2, 8192, 192, 768, "train"),
    ({"expert": 2, "context": 4}, 32, 8, 4096, 192, 384, "train"),
    ({"tensor": 2, "context": 4}, 16, 4, 8192, 192, 384, "train"),
    ({"context_usp_ulysses": 2, "context": 2, "data": 2}, 24, 3, 4096, 192, 384, "train"),
    ({"context": 8}, 12, 6, 8192, 192, 768, "prefill"),
    ({"fsdp": 2, "context": 4}, 48, 6, 8192, 192, 384, "prefill"),
    ({"data": 8}, 8, 4, 1024, 384, 768, "prefill"),
    ({"context": 8}, 64, 1, 2048, 128, 256, "train"),
    ({"context": 8}, 128, 2, 2048, 128, 256, "train"),
    ({"context": 8}, 64, 2, 1024, 128, 256, "prefill"),
    ({"context": 8}, 32, 1, 4096, 128, 256, "train"),
    ({"data": 2, "context": 4}, 64, 1, 1024, 128, 256, "train"),
    ({"fsdp": 2, "context": 4}, 64, 2, 2048, 192, 384, "train"),
    ({"expert": 2, "context": 4}, 128, 4, 2048, 128, 256, "train"),
    ({"tensor": 2, "context": 4}, 64, 2, 2048, 128, 256, "train"),
    ({"fsdp": 2, "context": 4}, 128, 8, 4096, 128, 256, "prefill"),
    ({"context": 8}, 96, 3, 2048, 192, 384, "train"),
]
SETS = {"judge": (JUDGE, STUDY), "dev": (DEV, "picks_cpu_dev")}

# The placements tried for each config: (dispatch, exchange, expert_group).
VARIANTS = (
    ("megablox", "gather", "auto"),
    ("megablox", "all_to_all", "expert"),
    ("megablox", "all_to_all", "expert_and_sequence"),
    ("megablox", "all_to_all", "expert_sequence_and_fsdp"),
    ("dense", "gather", "auto"),
)


def overrides(mesh: dict, experts, top_k, seq, emb, hidden, mode) -> list[str]:
    """One sequence per batch shard (tokens per device = seq / cp), dropless, float32;
    whole attention heads on every tensor shard (the block timed has no attention)."""
    shards = math.prod(mesh.get(a, 1) for a in ("data", "fsdp", "expert"))
    tensor = mesh.get("tensor", 1)
    return [
        "model=tiny",
        "mesh=cpu_8",
        "hardware=cpu",
        "num_devices=8",
        "ici_fsdp_parallelism=1",
        *(f"ici_{axis}_parallelism={n}" for axis, n in mesh.items()),
        f"num_experts={experts}",
        f"num_experts_per_tok={top_k}",
        f"max_target_length={seq}",
        f"base_emb_dim={emb}",
        f"base_moe_mlp_dim={hidden}",
        f"per_device_batch_size={shards / 8}",
        f"mode={mode}",
        "capacity_factor=-1",
        "dtype=float32",
        "context_parallel_load_balance=false",
        *([f"base_num_query_heads={tensor}", f"base_num_kv_heads={tensor}"] if tensor > 2 else []),
    ]


def label(point) -> str:
    mesh, experts, top_k, seq, emb, hidden, mode = point
    axes = ",".join(f"{a}={n}" for a, n in mesh.items())
    return f"{mode} [{axes}] E={experts} k={top_k} seq={seq} M={emb} H={hidden}"


def config_of(point):
    import selector

    return selector.to_config(selector.compose(overrides(*point)))


def candidate_name(strategy: str, exchange: str, group_axes) -> str:
    """How a placement is named here: megablox/gather, megablox/all_to_all[context],
    dense."""
    if strategy != "megablox":
        return strategy
    if exchange != "all_to_all":
        return f"megablox/{exchange}"
    return f"megablox/all_to_all[{'+'.join(group_axes)}]"


def plan_name(plan) -> str:
    return candidate_name(
        plan.strategy.value, plan.placement.exchange.value, plan.placement.group_axes
    )


def variants(config) -> dict[str, object]:
    """{name: forced config} for every distinct placement the config allows."""
    from selector import Dispatch, Exchange, ExpertGroup
    from selector.findings import errors_in
    from selector.plan import analyse

    out = {}
    for strategy, exchange, group in VARIANTS:
        if (
            strategy == "dense"
            and config.num_experts > DENSE_MAX_RATIO * config.num_experts_per_tok
        ):
            continue
        forced = config.replace(
            dispatch=Dispatch(strategy),
            expert_exchange=Exchange(exchange),
            expert_group=ExpertGroup(group),
        )
        plan, findings = analyse(forced)
        if plan is None or errors_in(findings) or plan.placement.exchange.value != exchange:
            continue
        out.setdefault(plan_name(plan), forced)
    return out


def time_point(point) -> dict:
    """Every variant of one config timed interleaved."""
    from checks.measured import _step, interleaved

    config = config_of(point)
    forced = variants(config)
    fns = {name: _step(c, c.dispatch, c.expert_exchange) for name, c in forced.items()}
    times = interleaved(fns, ROUNDS, settle=SETTLE)
    # In the order the stored JSON holds them (sorted keys), so the decisions scored
    # right after timing are the ones a reload scores.
    return {"label": label(point), "times_s": dict(sorted(times.items()))}


def estimated(point) -> dict[str, float]:
    """Today's selector's estimated time of each variant of `point`."""
    import selector

    return {
        name: selector.resolve(c).chosen_estimate.time_s
        for name, c in variants(config_of(point)).items()
    }


def spearman(xs, ys) -> float:
    """Spearman's rank correlation (average ranks on ties); 1 for fewer than 2 values
    or a constant side."""

    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for m in range(i, j + 1):
                r[order[m]] = (i + j) / 2
            i = j + 1
        return r

    if len(xs) < 2:
        return 1.0
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx = math.sqrt(sum((a - mx) ** 2 for a in rx))
    vy = math.sqrt(sum((b - my) ** 2 for b in ry))
    return 1.0 if vx == 0 or vy == 0 else cov / (vx * vy)


def score(rows: list[dict]) -> list[dict]:
    """Per config: the selector's pick, the measured fastest, the regret, whether the
    two are within the rounds' noise, and the rank correlation."""
    import selector

    by_label = {label(p): p for p in JUDGE + DEV}
    out = []
    for row in rows:
        point = by_label[row["label"]]
        times = row["times_s"]
        medians = {n: median(t) for n, t in times.items()}
        est = estimated(point)
        pick = plan_name(selector.resolve(config_of(point)))
        fastest = min(medians, key=medians.get)
        timed = pick in medians
        regret = medians[pick] / medians[fastest] if timed else float("inf")
        wins = sum(a < b for a, b in zip(times.get(pick, []), times[fastest], strict=False))
        names = [n for n in medians if n in est]
        out.append(
            {
                "config": row["label"],
                "pick": pick,
                "fastest": fastest,
                "right": pick == fastest,
                "within_noise": pick == fastest or (timed and wins >= len(times[fastest]) / 3),
                "regret": regret,
                "spearman": spearman([est[n] for n in names], [medians[n] for n in names]),
                "candidates": len(medians),
                "times_ms": ", ".join(f"{n} {medians[n] * 1e3:.3g}" for n in medians),
                "estimated_ms": ", ".join(f"{n} {est[n] * 1e3:.3g}" for n in names),
            }
        )
    return out


def pooled(runs: list[list[dict]]) -> list[dict]:
    """One row per config holding every run's rounds, each run's scaled so its
    config's fastest median is 1 (a run on a slower day weighs the same as one on a
    faster day; the order of the candidates within each run is what is pooled). Only
    the configs and candidates every run timed; `score` reads the rows as it reads one
    run's (its `times_ms` are then multiples of each run's fastest, not ms)."""
    by_label = [{r["label"]: r["times_s"] for r in rows} for rows in runs]
    out = []
    for row in runs[-1]:
        timed = [run.get(row["label"]) for run in by_label]
        if any(t is None for t in timed):
            continue
        names = [n for n in row["times_s"] if all(n in t for t in timed)]
        pooled_times: dict[str, list[float]] = {n: [] for n in names}
        for times in timed:
            fastest = min(median(times[n]) for n in names)
            for n in names:
                pooled_times[n] += [t / fastest for t in times[n]]
        out.append({"label": row["label"], "times_s": pooled_times})
    return out


def _kind(name: str) -> str:
    return "dense" if name == "dense" else "gathered" if "gather" in name else "exchanged"


def _milliseconds(d: dict) -> tuple[dict, dict]:
    """({candidate: measured median ms}, {candidate: estimated ms}) of one decision."""

    def parsed(text: str) -> dict:
        return {n: float(v) for n, v in (part.rsplit(" ", 1) for part in text.split(", "))}

    return parsed(d["times_ms"]), parsed(d["estimated_ms"])


def count_error(decisions: list[dict]) -> dict:
    """{program kind: [median, least, most, programs]} of the estimate over the measured
    median, each candidate of each config one program."""
    ratios: dict[str, list[float]] = {}
    for d in decisions:
        ms, es = _milliseconds(d)
        for name in es:
            ratios.setdefault(_kind(name), []).append(es[name] / ms[name])
    return {k: [median(v), min(v), max(v), len(v)] for k, v in sorted(ratios.items())}


def summary(decisions: list[dict]) -> dict:
    n = len(decisions)
    right = sum(d["right"] for d in decisions)
    multi = [d for d in decisions if d["candidates"] > 2]
    return {
        "configs": n,
        "picks_fastest": f"{right} of {n}",
        "share": right / max(n, 1),
        "within_noise": sum(d["within_noise"] for d in decisions),
        "worst_regret": max((d["regret"] for d in decisions), default=1.0),
        "median_regret": median([d["regret"] for d in decisions]) if decisions else 1.0,
        "regret_over_1.10": sum(d["regret"] > 1.10 for d in decisions),
        "median_spearman": median([d["spearman"] for d in multi]) if multi else 1.0,
    }


def reproduced(earlier: list[dict], rows: list[dict]) -> dict:
    """How two timing runs of the same configs agree: in how many the measured fastest
    is the same candidate, and each other candidate's time relative to its config's
    fastest in the new run over the same in the earlier one (median, least, most), so a
    machine slower overall does not count as a change."""
    before = {r["label"]: {n: median(t) for n, t in r["times_s"].items()} for r in earlier}
    same, compared, ratios = 0, 0, []
    for row in rows:
        now = {n: median(t) for n, t in row["times_s"].items()}
        then = before.get(row["label"])
        if then is None:
            continue
        compared += 1
        first = min(now, key=now.get), min(then, key=then.get)
        same += first[0] == first[1]
        lo_now, lo_then = now[first[0]], then[first[1]]
        ratios += [
            (now[n] / lo_now) / (then[n] / lo_then)
            for n in now
            if n in then and not n == first[0] == first[1]
        ]
    ratios = ratios or [1.0]
    return {
        "same_fastest": f"{same} of {compared}",
        "relative_time_ratio": [median(ratios), min(ratios), max(ratios)],
    }


COLUMNS = [
    ("config", "config"),
    ("pick", "selector's pick"),
    ("fastest", "measured fastest"),
    ("regret", "regret"),
    ("spearman", "Spearman"),
    ("times_ms", "measured medians ms"),
]
SUMMARY_COLUMNS = [
    ("picks_fastest", "pick = measured fastest"),
    ("within_noise", "within noise"),
    ("worst_regret", "worst regret"),
    ("median_regret", "median regret"),
    ("regret_over_1.10", "regret > 1.10"),
    ("median_spearman", "median Spearman (3+ candidates)"),
]
BAR = {"share": 0.9, "worst_regret": 1.10}


def plot(payload: dict):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 5))
    for d in payload["decisions"]:
        ms, es = _milliseconds(d)
        names = [n for n in ms if n in es]
        ax.plot(
            [ms[n] for n in names],
            [es[n] for n in names],
            "o-" if d["right"] else "x--",
            color="C0" if d["right"] else "C3",
            alpha=0.6,
            lw=0.7,
        )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="measured median ms (8 simulated CPU devices)",
        ylabel="estimated ms",
        title="each config's candidates (red: pick not the fastest)",
    )
    fig.tight_layout()
    return fig


def main() -> int:
    args = arguments(
        STUDY,
        __doc__,
        plot,
        time={"action": "store_true", "help": "time every config's candidates"},
        check={"action": "store_true", "help": "fail unless the picks meet the bar"},
        only={"type": int, "metavar": "N", "help": "with --time: only the first N configs"},
        set={"choices": sorted(SETS), "default": "judge", "help": "the judge set or the dev set"},
    )
    if args is None:
        return 0
    points, study = SETS[args.set]
    if args.time:
        from bench.common import machine

        rows = []
        for i, point in enumerate(points[: args.only] if args.only else points):
            rows.append(time_point(point))
            said = ", ".join(f"{n} {median(t) * 1e3:.3g}" for n, t in rows[-1]["times_s"].items())
            print(f"[{i + 1}/{len(points)}] {rows[-1]['label']}: {said} ms", flush=True)
        stored = load(study)
        payload = {"rounds": ROUNDS, "settle": SETTLE, "machine": machine(), "rows": rows}
        # What earlier runs and models scored stays; the earlier timings are scored by
        # today's model and compared with the new ones, and kept for the pooled score.
        payload.update({k: stored[k] for k in ("baseline", "earlier") if k in stored})
        payload["runs"] = [
            *stored.get("runs", []),
            {"machine": stored.get("machine"), "rows": stored["rows"]},
        ]
        payload["earlier_timings"] = {
            "machine": stored.get("machine"),
            "summary": summary(score(stored["rows"])),
            "reproduced": reproduced(stored["rows"], rows),
        }
    else:
        payload = load(study)
    payload["decisions"] = score(payload["rows"])
    payload["summary"] = summary(payload["decisions"])
    payload["estimate_over_measured"] = count_error(payload["decisions"])
    if payload.get("runs"):  # every run kept, pooled (`pooled`)
        every = [run["rows"] for run in payload["runs"]] + [payload["rows"]]
        payload["pooled"] = {"runs": len(every), "summary": summary(score(pooled(every)))}
    print(table(payload["decisions"], COLUMNS))
    print()
    print(table([payload["summary"]], SUMMARY_COLUMNS))
    if "pooled" in payload:
        print(f"\nevery run pooled ({payload['pooled']['runs']} runs):")
        print(table([payload["pooled"]["summary"]], SUMMARY_COLUMNS))
    print("wrote", *save(study, payload, plot(payload)))
    s = payload["pooled"]["summary"] if "pooled" in payload else payload["summary"]
    if args.check and (s["share"] < BAR["share"] or s["worst_regret"] > BAR["worst_regret"]):
        print(f"below the bar: {BAR}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
