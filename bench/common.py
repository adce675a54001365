"""Shared benchmark plumbing: devices, timing, tables, JSON and PNG output."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def use_cpu_devices(n: int = 8) -> None:
    """Simulated CPU devices; must run before jax is imported."""
    if "jax" in sys.modules:
        raise RuntimeError("use_cpu_devices must run before jax is imported")
    from checks.jax_start import prepare_process, quiet_jax_start  # jax-free

    prepare_process("cpu", n)
    quiet_jax_start()  # no compiler-plugin start-up noise on a machine without accelerators


def block_overrides(
    strategy: str,
    *,
    emb: int,
    hidden: int,
    experts: int,
    top_k: int,
    seq: int,
    per_device_batch_size: float,
    capacity_factor: float = 1.25,
) -> list[str]:
    """selector.compose overrides for one benchmark point: the tiny preset resized,
    float32 on CPU, the capacity factor applied only where it means something."""
    return [
        "model=tiny",
        "mesh=cpu_8",
        "hardware=cpu",
        f"dispatch={strategy}",
        f"capacity_factor={capacity_factor if strategy == 'subgroup_capacity' else -1}",
        f"base_emb_dim={emb}",
        f"base_moe_mlp_dim={hidden}",
        f"num_experts={experts}",
        f"num_experts_per_tok={top_k}",
        f"max_target_length={seq}",
        f"per_device_batch_size={per_device_batch_size}",
        "dtype=float32",
        "context_parallel_load_balance=false",
    ]


def interleaved(fns: dict, runs: int = 5) -> dict[str, list[float]]:
    """`checks.measured.interleaved` (measure mode's timer), imported when called so jax
    starts after `use_cpu_devices`."""
    from checks.measured import interleaved as timed

    return timed(fns, runs)


def median(values) -> float:
    """The median (the mean of the two middle values for an even count)."""
    return statistics.median(values)


def machine() -> dict:
    import jax

    dev = jax.devices()[0]
    return {
        "platform": dev.platform,
        "device_kind": getattr(dev, "device_kind", ""),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
    }


# Table columns (key, header) shared by each study's printout and bench/report.py.
MEMORY_COLUMNS = [
    ("variant", "variant"),
    ("cp", "cp"),
    ("tokens_per_device", "tokens/device"),
    ("arguments_mib", "args MiB"),
    ("temp_mib", "temp MiB"),
    ("total_mib", "args+temp MiB"),
    ("predicted_mib", "selector MiB"),
    ("error", "selector error"),
]

CP_RATIO_COLUMNS = [
    ("variant", "variant"),
    ("cp1", "cp=1 MiB"),
    ("cp4", "cp=4 MiB"),
    ("ratio", "cp=4 / cp=1"),
]

EXCHANGE_TIME_COLUMNS = [
    ("cp", "cp"),
    ("gathered_s", "gathered s"),
    ("exchanged_s", "exchanged s"),
    ("ratio", "exchanged / gathered"),
]

SCALE_COLUMNS = [
    ("model", "model"),
    ("split", "split"),
    ("seq", "seq"),
    ("cp", "cp"),
    ("devices", "devices"),
    ("exchange", "weights"),
    ("arguments_mib", "args MiB"),
    ("arguments_error", "pred."),
    ("outputs_mib", "out MiB"),
    ("outputs_error", "pred."),
    ("temp_mib", "temp MiB"),
    ("temp_error", "pred."),
    ("total_mib", "args+temp MiB"),
    ("total_error", "pred."),
]

TRAIN_COLUMNS = [
    ("setting", "setting"),
    ("cp", "cp"),
    ("global_batch", "global batch"),
    ("tokens_per_device", "tokens/device"),
    ("arguments_mib", "args MiB"),
    ("temp_mib", "temp MiB"),
    ("total_mib", "args+temp MiB"),
    ("vs_cp1", "vs cp=1"),
]

CALIBRATION_COLUMNS = [
    ("key", "strategy"),
    ("points", "points"),
    ("median", "median |error|"),
    ("worst", "worst |error|"),
]

SPEED_COLUMNS = [
    ("strategy", "strategy"),
    ("experts", "E"),
    ("seq", "seq"),
    ("vs_mlp", "time / MLP"),
    ("mem_vs_mlp", "temp / MLP"),
    ("temp_mib", "temp MiB"),
    ("note", "note"),
]
GMM_COLUMNS = [
    ("backend", "backend"),
    ("experts", "E"),
    ("routing", "routing"),
    ("rows_computed", "rows computed"),
    ("vs_dense", "time / dense"),
    ("temp_vs_dense", "temp / dense"),
    ("temp_mib", "temp MiB"),
]


def table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """A GitHub-markdown table of `rows` with (key, header) columns."""

    def cell(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    lines = [
        "| " + " | ".join(h for _, h in columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    lines += ["| " + " | ".join(cell(r.get(k, "")) for k, _ in columns) + " |" for r in rows]
    return "\n".join(lines)


def save(study: str, payload: dict, figure) -> tuple[Path, Path]:
    RESULTS.mkdir(parents=True, exist_ok=True)
    json_path = RESULTS / f"{study}.json"
    png_path = RESULTS / f"{study}.png"
    json_path.write_text(json.dumps(payload, indent=2, sort_keys=True))
    figure.savefig(png_path, dpi=110, bbox_inches="tight")
    return json_path, png_path


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def last_json_line(text: str) -> dict | None:
    """The last line of `text` that is a JSON object (a worker's row), or None."""
    rows = [line for line in text.splitlines() if line.startswith("{")]
    return json.loads(rows[-1]) if rows else None


def worker_row(point: str, cmd: list[str], timeout: float, env: dict | None = None) -> dict:
    """Run one point's worker process (`cmd`, which prints its row as its last JSON
    line) and return that row, or {point, status} saying why there is none: a timeout,
    or a failure with the last line of its stderr."""
    start = time.perf_counter()
    try:
        got = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env or os.environ
        )
    except subprocess.TimeoutExpired:
        return {"point": point, "status": f"timeout after {timeout:.0f} s"}
    row = last_json_line(got.stdout)
    if got.returncode != 0 or row is None:
        return {
            "point": point,
            "status": f"failed: {failure_line(got.stderr or '')[:300]}",
            "seconds": time.perf_counter() - start,
        }
    return row


def dumped_worker_row(
    point: str, cmd: list[str], timeout: float, dump_env: str, env: dict | None = None, flags=""
) -> dict:
    """`worker_row` with XLA dumping the worker's compiles into a temporary folder, whose
    path the worker reads from the environment variable `dump_env`; `flags`: more
    XLA_FLAGS for the worker (the dump flag replaces any XLA_FLAGS of `env`)."""
    with tempfile.TemporaryDirectory() as dump:
        xla_flags = f"--xla_dump_to={dump} {flags}".strip()
        env = {**(env or os.environ), "XLA_FLAGS": xla_flags, dump_env: dump}
        return worker_row(point, cmd, timeout, env)


def failure_line(stderr: str) -> str:
    """What a failed worker's stderr says went wrong: its first fatal line (an abort's
    log ends in a stack trace banner, not the reason), else its last line."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    for line in lines:
        if "Fatal Error" in line or line.startswith("F1") or line.startswith("F0"):
            return line
    return lines[-1] if lines else "no output"


def paired_bars(ax, labels, left: tuple[list, str], right: tuple[list, str], unit: str) -> None:
    """Two bars a label, side by side: `left` and `right` are (values, legend label)."""
    xs = range(len(labels))
    for offset, (values, name) in ((-0.2, left), (0.2, right)):
        ax.bar([x + offset for x in xs], values, 0.4, label=name)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, rotation=30, ha="right")
    ax.set_ylabel(unit)


def log_x_axis(ax, ticks) -> None:
    """A log-scale x axis labelled only at `ticks` (no minor-tick clutter)."""
    ax.set_xscale("log")
    ax.set_xticks(list(ticks))
    ax.set_xticklabels([str(t) for t in ticks])
    ax.minorticks_off()


def log_y_axis(ax) -> None:
    """A log-scale y axis labelled at 1, 2 and 5 of every decade, in plain numbers."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_locator(NullLocator())


def load(study: str) -> dict:
    """The JSON a study last wrote (for --replot)."""
    return json.loads((RESULTS / f"{study}.json").read_text())


ONLY_HELP = (
    "compile again only the points whose label contains TEXT (e.g. all_to_all) and the "
    "points the JSON lacks; the other rows are taken from the JSON"
)


class StoredRows:
    """Under `--only TEXT`, a study's rows from its JSON, handed back by point label (in
    order, for points that share a label) unless the label contains TEXT."""

    def __init__(self, rows: list[dict] | None, only: str | None):
        self.only = only
        self.by_label: dict[str, list[dict]] = {}
        for row in rows or ():
            label = row.get("point", row.get("raw", {}).get("point"))
            self.by_label.setdefault(label, []).append(row)

    def take(self, label: str) -> dict | None:
        """The stored row for this point, or None: compile it."""
        if self.only is None or self.only in label or not self.by_label.get(label):
            return None
        return self.pop(label)

    def pop(self, label: str) -> dict:
        """The next stored row with this label (a KeyError when there is none)."""
        rows = self.by_label.get(label)
        if not rows:
            raise KeyError(f"the JSON has no row for {label!r}: compile it again")
        return rows.pop(0)


def arguments(study: str, doc: str, plot, **options) -> argparse.Namespace | None:
    """A study's command line: `--replot` redraws the PNG from the JSON and returns None.

    `options` maps a flag name to argparse keywords (`runs={"type": int, "default": 3}`).
    """
    parser = argparse.ArgumentParser(description=doc.strip().split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--replot", action="store_true", help="redraw the PNG from the JSON")
    for name, keywords in options.items():
        parser.add_argument(f"--{name}", **keywords)
    args = parser.parse_args()
    if args.replot:
        payload = load(study)
        print("wrote", *save(study, payload, plot(payload)))
        return None
    return args


def same_number(a: float, b: float) -> bool:
    """Whether a recomputed count equals its stored value, to 1e-9 relative (floats
    summed in another order, or by another Python's sum(), differ in the last digits)."""
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1.0)


def check_stored(
    study: str,
    fresh: list[dict],
    key: tuple[str, ...],
    counted=(),
    compiled=(),
    *,
    rows_of=lambda payload: payload["rows"],
    module: str | None = None,
    rerun: str | None = None,
) -> int:
    """A benchmark's `--check`: each freshly computed row against the stored row of
    bench/results/<study>.json with the same `key` values. The `counted` columns (this
    project's own counts) must agree everywhere; the `compiled` ones (a compiler's bytes)
    where the stored JSON was written with the jax installed here. `rows_of` takes the
    stored rows, flat, out of the JSON; `module` names the benchmark (bench.<module>,
    the study's name by default) and `rerun` the command that refreshes the study. 0
    when all agree; otherwise what differs is printed and 1 returned."""
    import jax

    stored = load(study)
    same_stack = stored.get("machine", {}).get("jax") == jax.__version__
    rows = {tuple(r.get(k) for k in key): r for r in rows_of(stored)}
    module = module or study
    diffs = []
    for row in fresh:
        old = rows.get(tuple(row[k] for k in key))
        if old is None:
            diffs.append(f"{[row[k] for k in key]}: no stored row")
            continue
        for column in (*counted, *(compiled if same_stack else ())):
            a, b = row[column], old[column]
            if not same_number(a, b):
                diffs.append(f"{column} of {[row[k] for k in key]}: {a:.6g} now, {b:.6g} stored")
    compared = (["counts"] if counted else []) + (
        ["compiled bytes"] if same_stack and compiled else []
    )
    what = " and ".join(compared) or "nothing comparable on this stack: rows present only"
    if diffs:
        print(f"bench.{module} --check: stale {study}.json ({what}): " + "; ".join(diffs))
        print(f"Re-run {rerun or f'python -m bench.{module}'} to refresh it.")
        return 1
    print(f"bench.{module} --check: {len(fresh)} row(s) agree with {study}.json ({what})")
    return 0


def prediction_errors(
    rows: list[dict], keys=("arguments_error", "outputs_error", "temp_error", "total_error")
) -> list[float]:
    """|error| of every prediction in bench.scale's rows (stored as '+1.2%' strings)."""
    return [abs(float(r[k].rstrip("%")) / 100) for r in rows for k in keys]


def stack() -> str:
    """The compiler stack a study ran on: jax and the TPU and GPU plugins installed."""
    import jax

    libs = []
    for name in ("libtpu", "jax-cuda12-plugin"):
        try:
            libs.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join([f"jax {jax.__version__}", *libs])
