"""How long `search=true` takes, on one core: every layout of the real models' slices.

    python -m bench.search            # 5 rounds a case, writes bench/results/search.json/png
    python -m bench.search --check    # the smallest case once, compared to the stored JSON

Each case is searched `--rounds` times in this process (pinned to one core where the
OS allows), the median reported with the counts the search made (meshes, checks,
layouts that pass) and its first layout. The `--check` mode re-runs the tiny case and
fails when its counts or first layout differ from the stored result (time is not
compared: these machines are noisy).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from bench.common import RESULTS, median, pyplot, same_number, save

CASES = {
    "tiny, 8 CPU devices": ["model=tiny", "mesh=cpu_8", "search_global_batch=8"],
    "Qwen3-Next, 64 v5p, 32k": [
        "model=qwen3_next_80b_a3b",
        "max_target_length=32768",
        "search_global_batch=64",
    ],
    "Qwen3-30B-A3B, 16 v5p, 128k": [
        "model=qwen3_30b_a3b",
        "num_devices=16",
        "max_target_length=131072",
        "search_global_batch=2",
    ],
    "DeepSeek-V3, 256 v5p, 32k, batch 256": [
        "model=deepseek_v3",
        "num_devices=256",
        "max_target_length=32768",
        "search_global_batch=256",
    ],
    "DeepSeek-V3, 256 v5p, 32k, batch 64": [
        "model=deepseek_v3",
        "num_devices=256",
        "max_target_length=32768",
        "search_global_batch=64",
    ],
}
CHECKED = "tiny, 8 CPU devices"
# The README's real cases on the MaxText route: searched, then the first layout compiled
# by MaxText's own train_compile (--maxtext BASE_YML; Python 3.12 with maxtext).
MAXTEXT_CASES = {
    "qwen3-next-80b-a3b, v5p-128, 32k, batch 16": [
        "model_name=qwen3-next-80b-a3b",
        "compile_topology=v5p-128",
        "max_target_length=32768",
        "context_parallel_load_balance=false",
        "search_global_batch=16",
    ],
    "qwen3-30b-a3b, v5p-32, 128k, batch 2": [
        "model_name=qwen3-30b-a3b",
        "compile_topology=v5p-32",
        "max_target_length=131072",
        "search_global_batch=2",
    ],
    "deepseek3-671b, v5p-512, 32k, batch 64": [
        "model_name=deepseek3-671b",
        "compile_topology=v5p-512",
        "max_target_length=32768",
        "search_global_batch=64",
    ],
}


def one_core() -> bool:
    """Pin this process to one core (the issue's bar is one core)."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        return True
    return False


def run_case(overrides: list[str], rounds: int) -> dict:
    import selector

    cfg = selector.compose(overrides)
    seconds, found = [], None
    for _ in range(rounds):
        start = time.perf_counter()
        found = selector.search(cfg)
        seconds.append(time.perf_counter() - start)
    first = found.layouts[0] if found.layouts else None
    return {
        "overrides": overrides,
        "seconds": seconds,
        "median_s": median(seconds),
        "meshes": found.meshes,
        "checked": found.checked,
        "layouts": len(found.layouts),
        "refused": dict(found.refused),
        "first": None
        if first is None
        else {
            "overrides": first.overrides,
            "device_gib": first.device_bytes / 2**30,
            "fits": first.verdict.value,
            "step_time_s": first.step.total,
        },
    }


def plot(results: dict):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.2))
    names = list(results)
    ax.barh(names, [results[n]["median_s"] for n in names], color="tab:blue")
    ax.axvline(10, color="tab:red", linestyle="--", label="the 10 s bar")
    for i, n in enumerate(names):
        r = results[n]
        ax.text(r["median_s"], i, f" {r['median_s']:.2f} s, {r['checked']:,} checks", va="center")
    ax.set_xlabel("seconds, median (one core)")
    ax.set_title("search=true: every layout of the slice")
    ax.invert_yaxis()
    ax.legend(loc="lower right")
    return fig


def maxtext_case(base: str, args: list[str], timeout: int) -> dict:
    """One MaxText case: the search's first layout and MaxText's compile of it (the
    CLI's two JSON lines: the search, then the route's report with the compile)."""
    import json
    import subprocess

    cmd = [sys.executable, "-m", "selector", base, *args]
    cmd += ["search=true", "compile=true", "output=json"]
    start = time.perf_counter()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"args": args, "status": f"timed out after {timeout} s"}
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    row = {"args": args, "exit": out.returncode, "seconds": time.perf_counter() - start}
    if not lines or not lines[0].get("layouts"):
        return {**row, "status": "no layout", "stderr": out.stderr[-2000:]}
    first = lines[0]["layouts"][0]
    row.update(layout=first["overrides"], estimate_gib=first["device_gib"], fits=first["fits"])
    row.update(step_time_s=first["step_time_s"], checked=lines[0]["checked"])
    compiled = lines[1].get("compiled", {}) if len(lines) > 1 else {}
    step = compiled.get("maxtext_train_compile", {})
    row["compile"] = step
    if step.get("status") == "ok":
        row["compiled_gib"] = step["device_bytes"] / 2**30
        row["error"] = row["estimate_gib"] / row["compiled_gib"] - 1
    return row


def _same(a, b) -> bool:
    """Equal, floats as `check_stored` compares counts: Python 3.12's sum() of floats
    rounds otherwise than 3.11's (compensated), so a stored step time differs in its
    last digit."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, float):
        return same_number(a, b)
    return a == b


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--check", action="store_true", help="re-run the tiny case, compare counts")
    p.add_argument("--maxtext", metavar="BASE_YML", help="compile the real cases' first layouts")
    p.add_argument("--only", help="with --maxtext: the cases whose name contains this")
    p.add_argument("--timeout", type=int, default=1800)
    args = p.parse_args(argv)
    if args.maxtext:
        import json

        path = RESULTS / "search_maxtext.json"
        stored = json.loads(path.read_text()) if path.exists() else {"cases": {}}
        for name, case in MAXTEXT_CASES.items():
            if args.only and args.only not in name:
                continue
            print(f"{name}: searching and compiling ...", flush=True)
            stored["cases"][name] = row = maxtext_case(args.maxtext, case, args.timeout)
            print(json.dumps(row)[:400], flush=True)
            path.write_text(json.dumps(stored, indent=2, sort_keys=True))
        print(f"wrote {path}")
        return 0
    pinned = one_core()
    if args.check:
        import json

        stored = json.loads((RESULTS / "search.json").read_text())["cases"][CHECKED]
        now = run_case(CASES[CHECKED], 1)
        keys = ("meshes", "checked", "layouts", "refused", "first")
        diff = [k for k in keys if not _same(now[k], stored[k])]
        if diff:
            print(
                f"bench.search --check: {', '.join(diff)} differ from search.json; re-run "
                "python -m bench.search",
                file=sys.stderr,
            )
            return 1
        print(f"bench.search --check: {CHECKED} as stored ({now['checked']} checks)")
        return 0
    pinned = one_core()
    results = {}
    for name, overrides in CASES.items():
        results[name] = run_case(overrides, args.rounds)
        r = results[name]
        print(
            f"{name}: {r['median_s']:.2f} s median of {args.rounds}; {r['meshes']} meshes, "
            f"{r['checked']:,} checks, {r['layouts']} layouts pass",
            flush=True,
        )
    import platform

    payload = {
        "study": "search",
        "one_core": pinned,
        "rounds": args.rounds,
        "python": platform.python_version(),
        "cases": results,
    }
    paths = save("search", payload, plot(results))
    print(f"wrote {paths[0]} and {paths[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
