"""The selector's counted memory model on small compiled programs, per compiler.

For each point (a dispatch, an exchange, a mesh of up to 8 devices, a shape, a dtype
pair, a mode) the block is compiled for the target's chips (`--target tpu`: XLA:TPU
for v5p chips through libtpu; `gpu`: XLA:GPU for H100s through JAX's CUDA plugin;
`cpu`: XLA:CPU on 8 simulated devices; TPU and GPU ahead of time, nothing runs) and
XLA's per-device temp bytes are set beside the selector's count of what the program
holds (`selector.memory_model`; nothing is fitted). Training compiles fwd+bwd, prefill
and decode the forward. The points are the small shapes the old fitted model was built
on plus the held-out ones fixed beside them; the real layers that judge the model are
in bench.calibration.memory_holdout. Arguments and outputs are checked as they are. Beside the
memory, XLA's cost analysis (FLOPs, bytes accessed) is set against the selector's FLOP
and HBM terms, for comparison.

    python -m bench.calibration.calibrate --target tpu            # compile; the count's errors
    python -m bench.calibration.calibrate --target tpu --rejudge  # the count again, nothing compiled

Writes bench/results/calibrate_<target>.json and .png (counted against compiled temp,
one panel per mode), or the study --into names (e.g. calibrate_tpu_jax012 for the same
points compiled on the jax 0.12 stack); the payload names the stack that compiled it.
--only TEXT compiles again just the points whose label holds TEXT (and any the JSON
lacks).
"""

from __future__ import annotations

import argparse
import sys

from bench.common import use_cpu_devices

use_cpu_devices(8)
if "--target" in sys.argv and sys.argv[sys.argv.index("--target") + 1 :][:1] != ["cpu"]:
    # Abstract TPU and GPU devices need only JAX's CPU backend.
    import os

    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from bench.common import (  # noqa: E402
    CALIBRATION_COLUMNS,
    ONLY_HELP,
    StoredRows,
    load,
    pyplot,
    save,
    stack,
    table,
)
from bench.points import Point, measure, predicted  # noqa: E402

# The chips each target compiles for (one family of coefficients each; cpu has two).
TARGETS = {"cpu": "cpu", "tpu": "v5p", "gpu": "h100"}
MODES = ("train", "prefill", "decode")
PROGRAMS = ("dense", "megablox", "megablox_exchanged", "subgroup_capacity")

MESHES = (
    {"data": 1},
    {"data": 2, "context": 4},
    {"fsdp": 2, "context": 4},
    {"context": 4, "tensor": 2},
    {"expert": 2, "context": 4},
    {"data": 8},
)
# Decode's one token a sequence is not split over the sequence: meshes without it.
DECODE_MESHES = ({"data": 8}, {"fsdp": 2, "expert": 4}, {"data": 4, "tensor": 2})
# Fit shapes vary each dimension on its own (tokens, emb, hidden, experts, top-k), so
# every part's coefficient is pinned by points where it matters.
FIT_SHAPES = (
    dict(seq=4096, emb=128, hidden=256, experts=16, top_k=2),
    dict(seq=2048, emb=256, hidden=512, experts=8, top_k=2),
    dict(seq=2048, emb=128, hidden=128, experts=32, top_k=4),
    dict(seq=8192, emb=64, hidden=128, experts=8, top_k=1),
    dict(seq=1024, emb=512, hidden=256, experts=16, top_k=4),
    dict(seq=2048, emb=64, hidden=512, experts=64, top_k=8),
    dict(seq=4096, emb=256, hidden=128, experts=4, top_k=2),
    # Weight-dominated, as the real models are (few tokens against many expert weights).
    dict(seq=1024, emb=256, hidden=512, experts=64, top_k=2),
    dict(seq=512, emb=512, hidden=256, experts=32, top_k=4),
    # One top-1 shape where the weights outweigh the rows, with 1-2 experts a device
    # when exchanged; one at the real models' top-k (8-10) and a wide embedding; two
    # with as many experts as they have (256-512), where the router's T x E buffers count.
    dict(seq=1024, emb=384, hidden=768, experts=8, top_k=1),
    dict(seq=2048, emb=1024, hidden=256, experts=64, top_k=10),
    dict(seq=2048, emb=128, hidden=128, experts=256, top_k=8),
    dict(seq=1024, emb=128, hidden=64, experts=512, top_k=8),
)
# Decode: `sequences` a batch shard, one token each.
DECODE_SHAPES = (
    dict(seq=4096, sequences=16, emb=256, hidden=512, experts=16, top_k=2),
    dict(seq=4096, sequences=64, emb=128, hidden=256, experts=64, top_k=8),
    dict(seq=4096, sequences=128, emb=512, hidden=256, experts=8, top_k=2),
    dict(seq=4096, sequences=32, emb=1024, hidden=256, experts=64, top_k=10),
    dict(seq=4096, sequences=256, emb=128, hidden=128, experts=256, top_k=8),
    dict(seq=4096, sequences=8, emb=384, hidden=768, experts=8, top_k=1),
    dict(seq=4096, sequences=64, emb=128, hidden=64, experts=512, top_k=8),
    dict(seq=4096, sequences=16, emb=64, hidden=512, experts=32, top_k=4),
)
DTYPES = (("float32", "float32"), ("bfloat16", "bfloat16"), ("bfloat16", "float32"))
# Held out, fixed before any fit: the point reported in issue 11 (emb 192, hidden 384,
# E=12, k=3, capacity factor 1.5 on (data=2, context=4)), and shapes with other E and
# k, on meshes the fit never saw.
HOLDOUT_SHAPES = (
    dict(seq=8192, emb=192, hidden=384, experts=12, top_k=3),
    dict(seq=4096, emb=64, hidden=256, experts=64, top_k=8),
    dict(seq=1024, emb=512, hidden=1024, experts=4, top_k=1),
)
HOLDOUT_MESHES = ({"data": 2, "context": 4}, {"fsdp": 4, "context": 2}, {"expert": 4, "context": 2})
HOLDOUT_DECODE_SHAPES = (
    dict(seq=4096, sequences=48, emb=192, hidden=384, experts=12, top_k=3),
    dict(seq=4096, sequences=24, emb=640, hidden=256, experts=128, top_k=6),
)
HOLDOUT_DECODE_MESHES = ({"expert": 2, "data": 4}, {"fsdp": 4, "tensor": 2})


def variants(shape: dict, meshes, dtypes, cfs, hardware: str, mode: str) -> list[Point]:
    points = []
    for mesh in meshes:
        for dtype, param_dtype in dtypes:
            common = dict(
                mesh=mesh,
                dtype=dtype,
                param_dtype=param_dtype,
                hardware=hardware,
                mode=mode,
                **shape,
            )
            points.append(Point("megablox", **common))
            points.append(Point("dense", **common))
            for cf in cfs:
                points.append(Point("subgroup_capacity", capacity_factor=cf, **common))
            if any(mesh.get(a, 1) > 1 for a in ("expert", "context")):
                points.append(Point("megablox", exchange="all_to_all", **common))
    return points


def dtypes_for(target: str, i: int) -> tuple:
    """Shape i's dtypes: on CPU float32 and one half-precision pair (two families);
    elsewhere one pair, in turn (one family, each dtype at its own bytes)."""
    if target == "cpu":
        return (DTYPES[0], DTYPES[1 + i % 2])
    return (DTYPES[i % 3],)


def fit_points(target: str) -> list[Point]:
    hw, pts = TARGETS[target], []
    for i, shape in enumerate(FIT_SHAPES):  # training: two meshes a shape, in turn
        meshes = [MESHES[(i + 3 * j) % len(MESHES)] for j in range(2)]
        cfs = (1.25, 2.0) if i % 3 else (1.0,)
        pts += variants(shape, meshes, dtypes_for(target, i), cfs, hw, "train")
    for i, shape in enumerate(FIT_SHAPES[::2]):  # prefill: one mesh a shape
        mesh = MESHES[(i + 1) % len(MESHES)]
        pts += variants(shape, [mesh], dtypes_for(target, i + 1), (1.25,), hw, "prefill")
    for i, shape in enumerate(DECODE_SHAPES):
        mesh = DECODE_MESHES[i % len(DECODE_MESHES)]
        pts += variants(shape, [mesh], dtypes_for(target, i), (1.25,), hw, "decode")
    return pts


def holdout_points(target: str) -> list[Point]:
    hw, pts = TARGETS[target], []
    for i, shape in enumerate(HOLDOUT_SHAPES):
        dtypes = dtypes_for(target, i + 1)
        pts += variants(shape, HOLDOUT_MESHES, dtypes, (1.5,), hw, "train")
        pts += variants(shape, HOLDOUT_MESHES[i : i + 1], dtypes, (1.5,), hw, "prefill")
    for i, shape in enumerate(HOLDOUT_DECODE_SHAPES):
        mesh = HOLDOUT_DECODE_MESHES[i]
        pts += variants(shape, [mesh], dtypes_for(target, i), (1.5,), hw, "decode")
    return pts


SELECTED_MODES = MODES


def selected(points: list[Point]) -> list[Point]:
    return [p for p in points if p.mode in SELECTED_MODES]


def errors(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        pred = r["predicted_temp"]
        out.append(
            {
                "point": r["point"],
                "key": r["key"],
                "mode": r["key"].split()[1],
                "temp_mib": r["temp"] / 2**20,
                "predicted_mib": pred / 2**20,
                "error": pred / r["temp"] - 1,
                "arguments_error": r["predicted_arguments"] / r["arguments"] - 1,
                "outputs_error": r["predicted_outputs"] / r["outputs"] - 1,
            }
        )
    return out


def summary(errs: list[dict]) -> list[dict]:
    rows = []
    for key in sorted({e["key"] for e in errs}):
        sel = [abs(e["error"]) for e in errs if e["key"] == key]
        rows.append(
            {
                "key": key,
                "points": len(sel),
                "median": f"{np.median(sel):.1%}",
                "worst": f"{max(sel):.1%}",
            }
        )
    return rows


COST_COLUMNS = [
    ("key", "program"),
    ("points", "points"),
    ("flops_ratio", "XLA FLOPs / selector FLOPs (median)"),
    ("flops_range", "range"),
    ("bytes_ratio", "XLA bytes accessed / selector HBM bytes (median)"),
    ("bytes_range", "range"),
]


def cost_summary(rows: list[dict]) -> list[dict]:
    """XLA's cost analysis against the selector's FLOP and HBM terms, per program."""
    out = []
    for key in sorted({r["key"] for r in rows}):
        sel = [r for r in rows if r["key"] == key and r.get("flops")]
        if not sel:
            continue
        f = [r["flops"] / r["predicted_flops"] for r in sel]
        b = [r["bytes_accessed"] / r["predicted_hbm"] for r in sel]
        out.append(
            {
                "key": key,
                "points": len(sel),
                "flops_ratio": f"{np.median(f):.2f}",
                "flops_range": f"{min(f):.2f}-{max(f):.2f}",
                "bytes_ratio": f"{np.median(b):.2f}",
                "bytes_range": f"{min(b):.2f}-{max(b):.2f}",
            }
        )
    return out


def plot(payload: dict):
    """Counted against compiled temp: one panel per mode, one colour per program,
    filled circles the small points, crosses the held-out small points."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(MODES), figsize=(13, 4.4))
    colours = dict(zip(PROGRAMS, ("tab:blue", "tab:orange", "tab:green", "tab:red"), strict=True))
    everything = payload["fit_errors"] + payload["holdout_errors"]
    for ax, mode in zip(axes, MODES, strict=True):
        pts = [e for e in everything if e["mode"] == mode]
        if not pts:
            ax.set_visible(False)
            continue
        for _, errs, marker in (
            ("small", payload["fit_errors"], "o"),
            ("held out", payload["holdout_errors"], "x"),
        ):
            for program, colour in colours.items():
                sel = [e for e in errs if e["mode"] == mode and e["key"].split()[2] == program]
                ax.scatter(
                    [e["temp_mib"] for e in sel],
                    [e["predicted_mib"] for e in sel],
                    marker=marker,
                    s=16 if marker == "o" else 30,
                    color=colour,
                    alpha=0.6 if marker == "o" else 1.0,
                )
        lo = min(e["temp_mib"] for e in pts)
        hi = max(e["temp_mib"] for e in pts)
        for f, style in ((1.0, "-"), (1.2, ":"), (0.8, ":")):
            ax.plot([lo, hi], [lo * f, hi * f], style, color="gray", lw=0.8)
        ax.set(xscale="log", yscale="log", xlabel="compiled temp MiB per device", title=mode)
    axes[0].set_ylabel("selector's counted temp MiB")
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=c, marker="o", ls="", label=p) for p, c in colours.items()]
    handles += [
        Line2D([], [], color="gray", marker="o", ls="", label="small points"),
        Line2D([], [], color="gray", marker="x", ls="", label="held out"),
        Line2D([], [], color="gray", ls=":", label="+-20%"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8)
    fig.suptitle(f"counted memory model against {payload['compiler']}")
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    return fig


COMPILERS = {
    "cpu": "XLA:CPU, 8 simulated devices",
    "tpu": "XLA:TPU (libtpu), v5p chips, ahead of time",
    "gpu": "XLA:GPU (JAX's CUDA plugin), H100s, ahead of time",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument(
        "--target", choices=sorted(TARGETS), default="cpu", help="the compiler to compile for"
    )
    parser.add_argument("--replot", action="store_true", help="redraw the PNG from the JSON")
    parser.add_argument(
        "--rejudge",
        action="store_true",
        help="the selector's side again from the measured rows in the JSON (no compile)",
    )
    parser.add_argument("--only", metavar="TEXT", help=ONLY_HELP)
    parser.add_argument(
        "--into", metavar="NAME", help="the study to write (default calibrate_TARGET[_MODES])"
    )
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help="comma-separated modes to compile (default: all)",
    )
    args = parser.parse_args()
    global SELECTED_MODES  # noqa: PLW0603 - one run, one selection, read by the point lists
    SELECTED_MODES = tuple(m for m in MODES if m in args.modes.split(","))
    study = args.into or study_name(args.target)
    if args.replot:
        payload = load(study)
        save(study, payload, plot(payload))
        return
    if args.rejudge:
        stored = load(study)
        report(
            args.target,
            repredicted(selected(fit_points(args.target)), stored["rows"]),
            repredicted(selected(holdout_points(args.target)), stored["holdout_rows"]),
            study,
            stored.get("stack"),  # the compiles' stack, not this process's
        )
        return
    stored = load(study) if args.only else {}
    rows, held = [], []
    for name, points, sink, kept in (
        (
            "small",
            selected(fit_points(args.target)),
            rows,
            StoredRows(stored.get("rows"), args.only),
        ),
        (
            "held out",
            selected(holdout_points(args.target)),
            held,
            StoredRows(stored.get("holdout_rows"), args.only),
        ),
    ):
        print(f"{name}: {len(points)} points ({COMPILERS[args.target]})", flush=True)
        for i, point in enumerate(points):
            sink.append(kept.take(point.label()) or measure(point))
            print(
                f"  [{i + 1}/{len(points)}] {point.label()}: {sink[-1]['temp'] / 2**20:.1f} MiB",
                flush=True,
            )
    report(args.target, rows, held, study, stack())


def repredicted(points: list[Point], rows: list[dict]) -> list[dict]:
    """The stored rows of `points` with the selector's side (its count, arguments,
    outputs) computed again from each point's config: XLA's numbers are kept, so a new
    part or hand count needs no recompile."""
    stored = StoredRows(rows, only=None)
    return [{**stored.pop(p.label()), **predicted(p)} for p in points]


def report(
    target: str, rows: list[dict], held: list[dict], study: str, compiled_on: str | None
) -> None:
    """Print the count's errors, write the study's JSON and PNG."""
    fit_errs, hold_errs = errors(rows), errors(held)
    print(f"\ncounted memory model on {COMPILERS[target]}")
    print("\nsmall points\n" + table(summary(fit_errs), CALIBRATION_COLUMNS))
    print("\nheld-out small points\n" + table(summary(hold_errs), CALIBRATION_COLUMNS))
    worst_io = max(
        abs(e[k]) for e in fit_errs + hold_errs for k in ("arguments_error", "outputs_error")
    )
    print(f"\narguments and outputs: worst |error| {worst_io:.2%} over every point")
    costs = cost_summary(rows + held)
    print("\nXLA's cost analysis against the selector's terms\n" + table(costs, COST_COLUMNS))
    payload = {
        "target": target,
        "compiler": COMPILERS[target],
        "fit_errors": fit_errs,
        "holdout_errors": hold_errs,
        "fit_summary": summary(fit_errs),
        "holdout_summary": summary(hold_errs),
        "cost_summary": costs,
        "arguments_outputs_worst_error": worst_io,
        "rows": rows,
        "holdout_rows": held,
    }
    if compiled_on:
        payload["stack"] = compiled_on
    print("\nwrote", *save(study, payload, plot(payload)))


def study_name(target: str) -> str:
    modes = "" if SELECTED_MODES == MODES else "_" + "_".join(SELECTED_MODES)
    return f"calibrate_{target}{modes}"


if __name__ == "__main__":
    main()
