"""Do the selector's choices hold when timed? Every candidate of each config compiled and
timed interleaved on 8 simulated CPU devices, a time model fitted on some configs and
its picks checked on others it never saw.

For each config (a mesh of 8 devices, E, k, tokens, emb, hidden, training or prefill;
dropless, so the decision is between megablox gathered, megablox exchanged and dense
where E/k <= 8) every candidate is built and timed one step per round, interleaved
(checks.measured, 5 rounds, medians). The time model prices a candidate as
a x compute + b x HBM + c x network + d seconds from the cost model's terms, with
non-negative a, b, c, d fitted per (mode, program) on the fit configs by relative least
squares; the held-out configs (fixed below before any fit) report how often the fitted
model's pick is the measured fastest and the regret (measured time of the pick over
the fastest's). The unfitted model (a = b = c = 1, d = 0) is reported beside it.

    python -m bench.decide            # time, fit, write bench/results/decide.json and .png
    python -m bench.decide --write    # also store the fit in selector/time_model.json
    python -m bench.decide --refit    # fit again from the JSON's timings (terms recounted)
    python -m bench.decide --boundary # time the BOUNDARY configs, judge the stored fit
    python -m bench.decide --from-counts --write   # TPU/GPU constants from XLA's counts
    python -m bench.decide --live h200 --write     # on a machine with GPUs (or TPUs)

TPU and GPU have no timed programs here. Until they do, their constants come from the
compilers' own counts (`--from-counts`): per (mode, program), the HBM term is scaled by
the median of XLA's bytes accessed over the cost model's HBM bytes, and the compute term
by the median of XLA's FLOPs over the model's where XLA counts all the work (the einsum
paths; the grouped matmul's loops and kernels it does not count in full), over
the points `bench.calibrate --target tpu|gpu` compiled (bench/results/calibrate_*.json).
On a machine with accelerators, `--live HARDWARE` times the same configs on its own
devices (every device on the data axis unless a config's mesh has as many) and fits
that platform's constants from the timings, which replace the counted ones.
"""

from __future__ import annotations

import json
import math
import sys

from bench.common import use_cpu_devices

LIVE = "--live" in sys.argv  # time on this machine's own devices, not simulated CPUs
if __name__ == "__main__" and not LIVE:  # imported (the suite), jax is already up
    use_cpu_devices(8)

import numpy as np  # noqa: E402

from bench.common import arguments, load, pyplot, save, table  # noqa: E402

ROUNDS = 5
TERMS = ("compute", "hbm", "network", "step")

# (mesh, experts, top_k, sequence, emb, hidden, mode): fixed before any fit.
FIT = [
    ({"data": 8}, 8, 2, 1024, 256, 512, "train"),
    ({"data": 8}, 16, 8, 512, 256, 256, "train"),
    ({"context": 8}, 8, 4, 8192, 256, 512, "train"),
    ({"context": 8}, 32, 2, 8192, 128, 256, "train"),
    ({"context": 8}, 64, 8, 4096, 128, 256, "train"),
    ({"data": 2, "context": 4}, 8, 2, 4096, 256, 512, "train"),
    ({"data": 2, "context": 4}, 16, 4, 8192, 128, 512, "train"),
    ({"fsdp": 2, "context": 4}, 8, 8, 4096, 256, 256, "train"),
    ({"fsdp": 2, "context": 4}, 32, 4, 8192, 256, 512, "train"),
    ({"expert": 2, "context": 4}, 16, 2, 4096, 256, 512, "train"),
    ({"expert": 2, "context": 4}, 64, 4, 8192, 128, 256, "train"),
    ({"tensor": 2, "context": 4}, 8, 2, 4096, 256, 1024, "train"),
    ({"tensor": 2, "context": 4}, 32, 8, 4096, 128, 512, "train"),
    ({"context_usp_ulysses": 2, "context": 2, "data": 2}, 8, 4, 4096, 256, 512, "train"),
    ({"context": 8}, 8, 2, 8192, 256, 512, "prefill"),
    ({"context": 8}, 32, 4, 8192, 256, 512, "prefill"),
    ({"data": 2, "context": 4}, 16, 8, 8192, 128, 256, "prefill"),
    ({"fsdp": 2, "context": 4}, 8, 4, 8192, 256, 1024, "prefill"),
    ({"expert": 2, "context": 4}, 64, 8, 8192, 128, 256, "prefill"),
    ({"data": 8}, 4, 1, 1024, 512, 1024, "prefill"),
]
HELD_OUT = [
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
]
# A second held-out set, fixed before it was timed (after the fit): configs on the
# decision boundaries issue 29 names, few tokens a device over many experts (64 to 128
# experts, 128 to 512 tokens a device) where the exchange's rows are few and the gathered
# weights many. `--boundary` times these alone and judges the stored fit on them.
BOUNDARY = [
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
# (name, configs, the payload key of their rows): the sets in the order they are reported.
SETS = (
    ("fit", FIT, "fit_rows"),
    ("held out", HELD_OUT, "held_rows"),
    ("boundary (held out)", BOUNDARY, "boundary_rows"),
)


def overrides(
    mesh: dict, experts, top_k, seq, emb, hidden, mode, hardware: str = "cpu", devices: int = 8
) -> list[str]:
    """One sequence per batch shard (so tokens per device = seq / cp), dropless."""
    shards = 1
    for axis in ("data", "fsdp", "expert"):
        shards *= mesh.get(axis, 1)
    return [
        "model=tiny",
        "mesh=cpu_8",
        f"hardware={hardware}",
        f"num_devices={devices}",
        "ici_fsdp_parallelism=1",
        *(f"ici_{axis}_parallelism={n}" for axis, n in mesh.items()),
        f"num_experts={experts}",
        f"num_experts_per_tok={top_k}",
        f"max_target_length={seq}",
        f"base_emb_dim={emb}",
        f"base_moe_mlp_dim={hidden}",
        f"per_device_batch_size={shards / devices}",
        f"mode={mode}",
        "capacity_factor=-1",
        f"dtype={'float32' if hardware == 'cpu' else 'bfloat16'}",
        "context_parallel_load_balance=false",
        "time_model=false",  # the cost model's own terms, before any fit
    ]


def on_devices(point, devices: int):
    """The point as `devices` devices run it: its own mesh when that has as many, else
    every device on data."""
    mesh, *rest = point
    return (mesh if math.prod(mesh.values()) == devices else {"data": devices}, *rest)


def label(point) -> str:
    mesh, experts, top_k, seq, emb, hidden, mode = point
    axes = ",".join(f"{a}={n}" for a, n in mesh.items())
    return f"{mode} [{axes}] E={experts} k={top_k} seq={seq} M={emb} H={hidden}"


def candidate_terms(c, config) -> dict:
    """One plan candidate's cost-model terms and time-model program."""
    from selector.cost import program_of
    from selector.memory_model import program_key

    compute, hbm, network = c.estimate.time_parts
    return {
        "program": program_of(program_key(c.strategy, c.exchange, config)),
        "terms": {"compute": compute, "hbm": hbm, "network": network, "step": 1.0},
    }


def terms_of(point, hardware: str = "cpu", devices: int = 8) -> dict[str, dict]:
    """Each candidate's terms and program for one config, by candidate name: a pure
    function of the config, so stored timings can be judged under today's model."""
    import selector

    config = selector.to_config(selector.compose(overrides(*point, hardware, devices)))
    return {
        c.estimate.name: candidate_terms(c, config) for c in selector.resolve(config).candidates
    }


def recount(payload: dict) -> dict:
    """The stored rows' terms recounted by today's cost model (the timings stay): a fit
    or a judgement on terms the selector no longer computes would describe another
    model."""
    for _, points, sink in SETS:
        for row, point in zip(payload.get(sink, []), points, strict=False):
            assert row["label"] == label(point), (row["label"], label(point))
            now = terms_of(point)
            for c in row["candidates"]:
                c.update(now[c["name"]])
    return payload


def measure(point, hardware: str = "cpu") -> dict:
    """Every timeable candidate of one config: its cost-model terms and step times."""
    import jax

    import selector
    from checks.measure_mode import timeable
    from checks.measured import time_candidates

    devices = jax.device_count() if LIVE else 8
    point = on_devices(point, devices)
    config = selector.to_config(selector.compose(overrides(*point, hardware, devices)))
    plan = selector.resolve(config)
    keys = [
        (c.strategy, c.exchange)
        for c in plan.candidates
        if timeable(config, (c.strategy, c.exchange))
    ]
    times = time_candidates(config, keys, ROUNDS)
    candidates = []
    for c in plan.candidates:
        key = (c.strategy, c.exchange)
        if key not in times:
            continue
        candidates.append(
            {
                "name": c.estimate.name,
                **candidate_terms(c, config),
                "estimated_s": c.estimate.time_s,
                "times_s": times[key],
                "median_s": float(np.median(times[key])),
            }
        )
    return {
        "label": label(point),
        "estimated_pick": plan.chosen_estimate.name,
        "candidates": candidates,
    }


def fit(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per program, non-negative coefficients on the terms minimising relative error
    (a term whose coefficient fits negative is dropped and the fit repeated)."""
    cands = [c for r in rows for c in r["candidates"]]
    fitted = {}
    for program in sorted({c["program"] for c in cands}):
        pts = [c for c in cands if c["program"] == program]
        measured = np.array([c["median_s"] for c in pts])
        names = [t for t in TERMS if any(c["terms"][t] for c in pts)]
        while True:
            design = np.array([[c["terms"][t] for t in names] for c in pts]) / measured[:, None]
            coef, *_ = np.linalg.lstsq(design, np.ones(len(pts)), rcond=None)
            if (coef >= 0).all() or len(names) == 1:
                break
            names.pop(int(np.argmin(coef)))
        got = dict(zip(names, coef, strict=True))
        fitted[program] = {t: float(got.get(t, 0.0)) for t in TERMS}
    return fitted


UNFITTED = {"compute": 1.0, "hbm": 1.0, "network": 1.0, "step": 0.0}


def predicted(c: dict, model: dict | None) -> float:
    coef = (model or {}).get(c["program"], UNFITTED)
    return sum(coef[t] * c["terms"][t] for t in TERMS)


def decisions(rows: list[dict], model: dict | None) -> list[dict]:
    """Per config: the model's pick among the timed candidates, the measured fastest,
    and the regret."""
    out = []
    for r in rows:
        cands = r["candidates"]
        if len(cands) < 2:
            continue
        pick = min(cands, key=lambda c: predicted(c, model))
        best = min(cands, key=lambda c: c["median_s"])
        out.append(
            {
                "config": r["label"],
                "pick": pick["name"],
                "fastest": best["name"],
                "right": pick["name"] == best["name"],
                "regret": pick["median_s"] / best["median_s"],
                "times_ms": ", ".join(f"{c['name']} {c['median_s'] * 1e3:.3g}" for c in cands),
            }
        )
    return out


def summarise(name: str, ds: list[dict]) -> dict:
    right = sum(d["right"] for d in ds)
    return {
        "set": name,
        "configs": len(ds),
        "picks_fastest": f"{right} of {len(ds)}",
        "share": right / max(len(ds), 1),
        "worst_regret": max((d["regret"] for d in ds), default=1.0),
        "regret_over_1.10": sum(d["regret"] > 1.10 for d in ds),
    }


COLUMNS = [
    ("config", "config"),
    ("pick", "fitted model's pick"),
    ("fastest", "measured fastest"),
    ("regret", "regret"),
    ("times_ms", "measured medians ms"),
]
SUMMARY_COLUMNS = [
    ("set", "configs"),
    ("model", "time model"),
    ("picks_fastest", "pick = measured fastest"),
    ("worst_regret", "worst regret"),
    ("regret_over_1.10", "regret > 1.10"),
]


def write_constants(platform: str, model: dict, source: str) -> None:
    """Store one platform's constants in selector/time_model.json, keeping the others'."""
    from selector.time_model import TIME_MODEL_FILE

    stored = json.loads(TIME_MODEL_FILE.read_text())
    stored = {k: v for k, v in stored.items() if k.split(" ", 1)[0] != platform}
    stored.update({f"{platform} {k}": {**v, "source": source} for k, v in model.items()})
    TIME_MODEL_FILE.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")
    print("wrote", TIME_MODEL_FILE)


def report(payload: dict, write: bool) -> dict:
    model = fit(payload["fit_rows"])
    payload["time_model"] = model
    payload["summary"] = []
    for model_name, m in (("unfitted", None), ("fitted", model)):
        for set_name, _, sink in SETS:
            if payload.get(sink):
                payload["summary"].append(
                    {**summarise(set_name, decisions(payload[sink], m)), "model": model_name}
                )
    if payload.get("boundary_rows"):
        payload["boundary_decisions"] = decisions(payload["boundary_rows"], model)
        print(table(payload["boundary_decisions"], COLUMNS))
        print()
    payload["held_decisions"] = decisions(payload["held_rows"], model)
    print(table(payload["held_decisions"], COLUMNS))
    print()
    print(table(payload["summary"], SUMMARY_COLUMNS))
    if write:
        platform = payload.get("platform", "cpu")
        write_constants(
            platform,
            model,
            f"timed: bench.decide on {payload.get('devices', '8 simulated CPU devices')}",
        )
    return payload


# Programs whose FLOPs XLA's analysis counts in full: the einsum paths. The grouped
# matmul's are not: XLA:GPU's and XLA:CPU's analysis counts its tiled loop body once,
# XLA:TPU's counts the Pallas kernel by the cost estimate it carries, and the exchange
# runs its slots in a loop (counted once on every platform). Those keep the model's FLOPs.
COUNTED_FLOPS = ("dense", "subgroup_capacity")
COUNT_COLUMNS = [
    ("key", "program"),
    ("points", "compiled points"),
    ("compute", "compute x"),
    ("hbm", "HBM x"),
    ("flops_counted", "FLOPs counted by XLA"),
]


def constants_from_counts(platform: str) -> tuple[dict, list[dict]]:
    """(constants per `mode program`, table rows) from bench.calibrate's compiled points
    for `platform`: medians of XLA's counts over the cost model's terms."""
    rows = load(f"calibrate_{platform}")["rows"]
    model, out = {}, []
    for key in sorted({r["key"] for r in rows}):
        sel = [r for r in rows if r["key"] == key and r.get("flops") and r.get("predicted_hbm")]
        if not sel:
            continue
        program = key.split(" ", 1)[1]
        counted = program.split()[-1] in COUNTED_FLOPS
        compute = float(np.median([r["flops"] / r["predicted_flops"] for r in sel]))
        compute = compute if counted else 1.0
        hbm = float(np.median([r["bytes_accessed"] / r["predicted_hbm"] for r in sel]))
        model[program] = {"compute": compute, "hbm": hbm, "network": 1.0, "step": 0.0}
        out.append(
            {
                "key": key,
                "points": len(sel),
                "compute": f"{compute:.2f}",
                "hbm": f"{hbm:.2f}",
                "flops_counted": "yes" if counted else "no: the model's FLOPs (x 1)",
            }
        )
    return model, out


def plot(payload: dict):
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    model = payload["time_model"]
    for ax, (name, m) in zip(axes, (("unfitted (a=b=c=1)", None), ("fitted", model)), strict=True):
        for rows, marker, colour, set_name in (
            (payload["fit_rows"], "o", "C0", "fit configs"),
            (payload["held_rows"], "s", "C1", "held-out configs (hollow)"),
            (payload.get("boundary_rows", []), "^", "C2", "boundary configs (hollow)"),
        ):
            cands = [c for r in rows for c in r["candidates"]]
            ax.scatter(
                [c["median_s"] * 1e3 for c in cands],
                [predicted(c, m) * 1e3 for c in cands],
                marker=marker,
                facecolors=colour if marker == "o" else "none",
                edgecolors=colour,
                label=set_name,
            )
        lo, hi = ax.get_xlim()
        ax.plot([lo, hi], [lo, hi], color="gray", lw=0.8, label="predicted = measured")
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="measured median ms (fwd+bwd or forward, "
            f"{payload.get('devices', '8 simulated CPU devices')})",
            ylabel="time model ms",
            title=f"time model {name}",
        )
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def time_points(name: str, points, hardware: str) -> list[dict]:
    """`measure` each config, saying how far it has got."""
    print(f"{name}: {len(points)} configs", flush=True)
    rows = []
    for i, point in enumerate(points):
        rows.append(measure(point, hardware))
        said = ", ".join(
            f"{c['name']} {c['median_s'] * 1e3:.3g} ms" for c in rows[-1]["candidates"]
        )
        print(f"  [{i + 1}/{len(points)}] {rows[-1]['label']}: {said}", flush=True)
    return rows


def main() -> None:
    args = arguments(
        "decide",
        __doc__,
        plot,
        write={"action": "store_true", "help": "store the fit in selector/time_model.json"},
        refit={"action": "store_true", "help": "fit again from the JSON's timings"},
        **{
            "from-counts": {
                "action": "store_true",
                "help": "TPU and GPU constants from XLA's counts of bench.calibrate's "
                "compiled points",
            }
        },
        live={
            "metavar": "HARDWARE",
            "help": "time on this machine's own devices with this hardware preset (h200, v5p)",
        },
        boundary={
            "action": "store_true",
            "help": "time the BOUNDARY configs only and judge the stored fit on them",
        },
        configs={
            "type": int,
            "metavar": "N",
            "help": "only the first N fit and N held-out configs (a quick try of a machine)",
        },
    )
    if args is None:  # --replot
        return
    if args.from_counts:
        counted = {}
        for platform in ("tpu", "gpu"):
            model, rows = constants_from_counts(platform)
            print(table(rows, COUNT_COLUMNS))
            counted[platform] = rows
            if args.write:
                write_constants(
                    platform, model, f"XLA:{platform.upper()}'s counts (bench.calibrate)"
                )
        payload = load("decide")
        payload["from_counts"] = counted
        print("wrote", *save("decide", payload, plot(payload)))
        return
    if args.boundary:
        payload = recount(load("decide"))
        payload["boundary_rows"] = time_points("boundary", BOUNDARY, "cpu")
        payload = report(payload, write=False)
        print("wrote", *save("decide", payload, plot(payload)))
        return
    if args.refit:
        payload = report(recount(load("decide")), args.write)
        print("wrote", *save("decide", payload, plot(payload)))
        return
    hardware = args.live or "cpu"
    payload = {"rounds": ROUNDS, "fit_rows": [], "held_rows": []}
    if args.live:
        import jax

        from selector import compose, to_config

        platform = to_config(compose([f"hardware={hardware}"])).hardware.platform
        devices = jax.devices()
        if devices[0].platform != platform:
            sys.exit(
                f"--live {hardware} is a {platform} preset, but this machine's jax "
                f"devices are {devices[0].platform}; pick the preset of these devices."
            )
        payload.update(platform=platform, devices=f"{len(devices)} x {devices[0].device_kind}")
    name_of = "decide" if not args.live else f"decide_{payload['platform']}"
    for name, points, sink in SETS[:2]:
        points = points[: args.configs] if args.configs else points
        payload[sink] = time_points(name, points, hardware)
    payload = report(payload, args.write)
    print("wrote", *save(name_of, payload, plot(payload)))


if __name__ == "__main__":
    sys.exit(main())
