"""MaxText 0.2.5's own whole-train-step memory, compiled ahead of time for TPU on this
machine (no TPU needed), beside this project's estimate for the same MaxText config.

Each point is MaxText's `train_compile` run in a separate Python (>= 3.12) virtualenv with
jax[tpu] and maxtext installed (as noxfile.py builds for the 3.12 stack); its
`Memory analysis: CompiledMemoryStats(...)` line gives the compiled step's arguments,
outputs, aliased and temp bytes (peak = arguments + outputs - aliased + temp). The estimate
is `python -m selector <base.yml> ... output=json` in this (jax-free) Python: the chosen
candidate's `device_bytes` and `device_breakdown`.

    python -m bench.calibration.maxtext_step --venv /work/venv312 \
        --points qwen3-30b-a3b:1,qwen3-30b-a3b:4,qwen3-next-80b-a3b:4:v5p-128

A point is MODEL:CP[:TOPOLOGY][:KEY=VALUE...] (topology default v5p-16; v5p names count TensorCores, so
v5p-16 is 8 chips); ici_fsdp_parallelism = chips / CP. Compiles take minutes each on 2
cores, so each parsed compile is cached in bench/results/maxtext_step_cache.json keyed by
its command line (the venv's python left out); --recompile ignores the cache. A compile
that times out or fails is recorded with its status and skipped in the plot.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from bench.common import RESULTS, pyplot, save, table
from checks import maxtext_step

STUDY = "maxtext_step"
CACHE = RESULTS / f"{STUDY}_cache.json"
REPO = Path(__file__).resolve().parents[2]
GIB = 1024**3
DEFAULT_POINTS = (
    "qwen3-30b-a3b:1,qwen3-30b-a3b:2,qwen3-30b-a3b:4,mixtral-8x7b:1,mixtral-8x7b:2,mixtral-8x7b:4"
)
COLUMNS = [
    ("point", "point"),
    ("chips", "chips"),
    ("status", "compile"),
    ("arguments_gib", "args GiB"),
    ("outputs_gib", "out GiB"),
    ("aliased_gib", "aliased GiB"),
    ("temp_gib", "temp GiB"),
    ("peak_gib", "peak GiB"),
    ("estimate_gib", "estimate GiB"),
    ("error", "rel. error"),
    ("compile_s", "compile s"),
]


def venv_python(venv: str) -> str:
    p = Path(venv)
    return str(p / "bin" / "python") if p.is_dir() else str(p)


def base_yml(python: str) -> str:
    """MaxText's configs/base.yml in the venv's site-packages (found without importing
    maxtext, which would start jax)."""
    code = (
        "import importlib.util, os; s = importlib.util.find_spec('maxtext'); "
        "print(os.path.join(list(s.submodule_search_locations)[0], 'configs', 'base.yml'))"
    )
    return subprocess.run(
        [python, "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()


def chips_of(topology: str) -> int:
    """Chips in one slice of a v5p/v4 topology name (which counts TensorCores, 2 a chip)."""
    m = re.fullmatch(r"(v5p|v4)-(\d+)", topology)
    if not m:
        raise SystemExit(f"only v5p-N / v4-N topologies are understood here, not {topology!r}")
    return int(m.group(2)) // 2


def parse_point(text: str) -> dict:
    """MODEL:CP[:TOPOLOGY][:KEY=VALUE...]; the KEY=VALUE parts are extra MaxText overrides
    for this point (e.g. context_parallel_load_balance=false, which MaxText requires for
    GatedDeltaNet layers at cp > 1)."""
    parts = text.split(":")
    extra = [p for p in parts[2:] if "=" in p]
    parts = [p for p in parts if "=" not in p]
    if len(parts) not in (2, 3):
        raise SystemExit(f"a point is MODEL:CP[:TOPOLOGY][:KEY=VALUE...], not {text!r}")
    model, cp = parts[0], int(parts[1])
    topology = parts[2] if len(parts) == 3 else "v5p-16"
    chips = chips_of(topology)
    # Other ici_*_parallelism axes named in the point take their share before fsdp.
    others = 1
    for p in extra:
        key, _, value = p.partition("=")
        if key.startswith("ici_") and key.endswith("_parallelism"):
            others *= int(value)
    if chips % (cp * others):
        raise SystemExit(f"{text}: cp={cp} x the other axes ({others}) do not divide {chips} chips")
    return {
        "label": text,
        "model": model,
        "cp": cp,
        "topology": topology,
        "chips": chips,
        "fsdp": chips // (cp * others),
        "extra": extra,
    }


def overrides(point: dict, args) -> list[str]:
    """The point's MaxText overrides; a per_device_batch_size or max_target_length the
    point names replaces the run's."""
    named = {p.partition("=")[0] for p in point["extra"]}
    batch = [
        f"{key}={value}"
        for key, value in (
            ("per_device_batch_size", f"{args.per_device_batch_size:g}"),
            ("max_target_length", args.max_target_length),
        )
        if key not in named
    ]
    return [
        f"model_name={point['model']}",
        f"compile_topology={point['topology']}",
        "compile_topology_num_slices=1",
        f"ici_context_parallelism={point['cp']}",
        f"ici_fsdp_parallelism={point['fsdp']}",
        *batch,
        *point["extra"],
    ]


def parse_log(text: str) -> dict:
    """The compiled step's bytes from train_compile's output (the route's own reader,
    `checks.maxtext_step.parse_log`), with its peak; or the failure it reports."""
    out = maxtext_step.parse_log(text)
    if out["status"] == "ok":
        out["peak"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temp"]
    return out


def run_train_compile(
    python: str, cmd_tail: list[str], timeout: float, cwd: str, env: dict | None = None
) -> tuple[str, int] | None:
    """`python cmd_tail` (MaxText's train_compile) on the CPU backend, `env` added to this
    process's environment: (its stdout and stderr, its exit status), or None when it ran
    past `timeout`."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", **(env or {}))
    try:
        proc = subprocess.run(
            [python, *cmd_tail], env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd
        )
    except subprocess.TimeoutExpired:
        return None
    return proc.stdout + "\n" + proc.stderr, proc.returncode


def compile_point(python: str, base: str, point: dict, args, cache: dict) -> dict:
    cmd_tail = ["-m", "maxtext.trainers.pre_train.train_compile", base, *overrides(point, args)]
    key = "JAX_PLATFORMS=cpu python " + " ".join(cmd_tail)
    if key in cache and not args.recompile:
        return cache[key]
    timeout = args.timeout_large if point["chips"] > 8 else args.timeout
    print(f"[{point['label']}] compiling (timeout {timeout} s): {key}", flush=True)
    start = time.monotonic()
    ran = run_train_compile(python, cmd_tail, timeout, args.workdir)
    if ran is None:
        text, result = "", {"status": "timeout", "message": f"no result within {timeout} s"}
    else:
        text, code = ran
        result = {**parse_log(text), "returncode": code}
    result["compile_s"] = round(time.monotonic() - start, 1)
    result["command"] = key
    if args.logs:
        Path(args.logs).mkdir(parents=True, exist_ok=True)
        if result["status"] != "timeout":
            (Path(args.logs) / f"{point['label'].replace(':', '_')}.log").write_text(text)
    if result["status"] != "timeout" or args.cache_timeouts:
        cache[key] = result
        CACHE.write_text(json.dumps(cache, indent=2, sort_keys=True))
    return result


def seed_cache(python: str, base: str, seeds: list[str], args, cache: dict) -> None:
    """--seed POINT=LOGFILE[@SECONDS]: a compile already run by hand (same command line)
    parsed into the cache."""
    for seed in seeds:
        label, _, rest = seed.rpartition("=")  # a label may hold KEY=VALUE parts
        path, _, seconds = rest.partition("@")
        point = parse_point(label)
        key = "JAX_PLATFORMS=cpu python " + " ".join(
            ["-m", "maxtext.trainers.pre_train.train_compile", base, *overrides(point, args)]
        )
        result = parse_log(Path(path).read_text(errors="replace"))
        result["compile_s"] = float(seconds) if seconds else None
        result["command"] = key
        result["seeded_from"] = path
        cache[key] = result
    CACHE.write_text(json.dumps(cache, indent=2, sort_keys=True))


def estimate(base: str, point: dict, args) -> dict:
    cmd = [sys.executable, "-m", "selector", base, *overrides(point, args), "output=json"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        return {"status": "failed", "message": (proc.stderr or proc.stdout).strip()[-600:]}
    chosen = [c for c in report.get("plan", {}).get("candidates", []) if c.get("chosen")]
    if not chosen:
        return {"status": "no candidate", "message": json.dumps(report.get("findings", ""))[:600]}
    c = chosen[0]
    return {
        "status": "ok",
        "candidate": c["name"],
        "device_bytes": c["device_bytes"],
        "device_breakdown": c["device_breakdown"],
        "fits": c.get("fits"),
        "ok": report.get("ok"),
        "errors": [
            f.get("code") for f in report.get("findings", []) if f.get("severity") == "error"
        ],
        "notes": report.get("maxtext", {}).get("notes", []),
    }


def versions(python: str) -> dict:
    code = (
        "import importlib.metadata as m, json, platform; "
        "print(json.dumps({'python': platform.python_version(), **{p: m.version(p) for p in "
        "['jax', 'jaxlib', 'libtpu', 'flax', 'maxtext', 'tokamax']}}))"
    )
    try:
        out = subprocess.run(
            [python, "-c", code], check=True, capture_output=True, text=True
        ).stdout
        return json.loads(out)
    except (subprocess.CalledProcessError, json.JSONDecodeError):
        return {}


def row_of(point: dict, compiled: dict, est: dict) -> dict:
    row = {
        "point": point["label"],
        "model": point["model"],
        "cp": point["cp"],
        "fsdp": point["fsdp"],
        "topology": point["topology"],
        "chips": point["chips"],
        "extra": point["extra"],
        "status": compiled["status"],
        "compile_s": compiled.get("compile_s"),
        "compiled": compiled,
        "estimate": est,
    }
    if compiled["status"] == "ok":
        for k in ("arguments", "outputs", "aliased", "temp", "peak"):
            row[f"{k}_gib"] = compiled[k] / GIB
    elif compiled.get("used_bytes"):
        row["peak_gib"] = compiled["used_bytes"] / GIB  # what the failed compile reports
    if est.get("status") == "ok":
        row["estimate_gib"] = est["device_bytes"] / GIB
        if "peak_gib" in row:
            row["error"] = (row["estimate_gib"] - row["peak_gib"]) / row["peak_gib"]
    return row


def plot(rows: list[dict]):
    plt = pyplot()
    shown = [r for r in rows if "peak_gib" in r and "estimate_gib" in r]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(shown) + 2), 4.5))
    xs = range(len(shown))
    w = 0.38
    bars = ax.bar(
        [x - w / 2 for x in xs],
        [r["peak_gib"] for r in shown],
        w,
        label="MaxText compiled peak (args+out-aliased+temp)",
    )
    for bar, r in zip(bars, shown, strict=True):
        if r["status"] == "oom":  # no CompiledMemoryStats: the bytes XLA's OOM message names
            bar.set_hatch("//")
    ax.bar(
        [x + w / 2 for x in xs],
        [r["estimate_gib"] for r in shown],
        w,
        label="moe-cp estimate (device_bytes)",
    )
    for x, r in zip(xs, shown, strict=True):
        top = max(r["peak_gib"], r["estimate_gib"])
        tag = f"{r['error']:+.1%}" + ("\nOOM: XLA's\nrequired" if r["status"] == "oom" else "")
        ax.annotate(
            tag, (x, top), textcoords="offset points", xytext=(0, 4), ha="center", fontsize=9
        )
    ax.set_xticks(list(xs))
    ax.set_xticklabels(
        [
            f"{r['model']}\ncp={r['cp']} fsdp={r['fsdp']}\n{r['chips']} chips"
            + ("\nno load balance" if r["extra"] else "")
            for r in shown
        ],
        fontsize=8,
    )
    ax.set_ylabel("GiB per chip")
    ax.axhline(95.73, color="grey", ls=":", lw=1, label="v5p HBM as XLA reports it (95.73G)")
    ax.set_title("Whole train step per chip: MaxText 0.2.5 AOT compile (XLA:TPU) vs estimate")
    ax.set_ylim(0, 1.3 * max([95.73] + [max(r["peak_gib"], r["estimate_gib"]) for r in shown]))
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2)
    return fig


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--venv",
        default="/work/venv312/bin/python",
        help="the venv (or its python) with maxtext + jax[tpu]",
    )
    ap.add_argument(
        "--points",
        default=DEFAULT_POINTS,
        help="comma-separated MODEL:CP[:TOPOLOGY][:KEY=VALUE...]",
    )
    ap.add_argument("--per-device-batch-size", type=float, default=1)
    ap.add_argument("--max-target-length", type=int, default=4096)
    ap.add_argument(
        "--timeout", type=int, default=900, help="seconds a compile on <= 8 chips may take"
    )
    ap.add_argument(
        "--timeout-large", type=int, default=1200, help="seconds a compile on > 8 chips may take"
    )
    ap.add_argument("--recompile", action="store_true", help="ignore the cache")
    ap.add_argument(
        "--cache-timeouts", action="store_true", help="cache timeouts too (skip them next time)"
    )
    ap.add_argument(
        "--seed",
        action="append",
        default=[],
        help="POINT=LOGFILE[@SECONDS]: parse a finished run's log into the cache",
    )
    ap.add_argument("--logs", default="", help="folder to keep each compile's full output in")
    ap.add_argument("--workdir", default="/tmp", help="the folder train_compile runs in")
    ap.add_argument(
        "--into", default=STUDY, help="write the rows to bench/results/INTO.json and .png"
    )
    args = ap.parse_args(argv)

    python = venv_python(args.venv)
    base = base_yml(python)
    RESULTS.mkdir(parents=True, exist_ok=True)
    cache = json.loads(CACHE.read_text()) if CACHE.exists() else {}
    if args.seed:
        seed_cache(python, base, args.seed, args, cache)

    rows = []
    for label in args.points.split(","):
        point = parse_point(label.strip())
        compiled = compile_point(python, base, point, args, cache)
        est = estimate(base, point, args)
        rows.append(row_of(point, compiled, est))
        print(
            f"[{label}] compile {compiled['status']} ({compiled.get('compile_s')} s); estimate {est.get('status')}",
            flush=True,
        )

    print(table(rows, COLUMNS))
    payload = {
        "study": args.into,
        "base_yml": base,
        "maxtext_stack": versions(python),
        "per_device_batch_size": args.per_device_batch_size,
        "max_target_length": args.max_target_length,
        "peak": "arguments + outputs - aliased + temp (CompiledMemoryStats)",
        "error": "(estimate - compiled peak) / compiled peak",
        "rows": rows,
    }
    json_path, png_path = save(args.into, payload, plot(rows))
    print(f"wrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()
