"""How long XLA:TPU keeps the loss's logits gradient in MaxText's train step, and what
one layer's backward holds beside it.

The whole-step count took the step's largest transient as the larger of the loss's
logits (with their gradient) and one layer's backward, as if the logits' gradient were
gone before the layers' backward starts. This study compiles MaxText 0.2.5's own train
step ahead of time for v5p (`train_compile`, in the 3.12 virtualenv, with
`XLA_FLAGS=--xla_dump_to`) at four decoder layers, points in no judge set, and reads
the live-range report's breakdown at the heap's peak: whether the peak is inside the
layers' backward loop (`transpose(jvp())/while`), which top-level buffer of the
backward the size of the logits' gradient is live there, and the loop's own buffers.

Read from it: the gradient (in the compute dtype, whatever the head's) is live through
the layers' backward at cp 2 and more on 8 and 16 chips, and not at cp 1, with tiled
logits, or on a whole slice of 64 chips; `Traits.logits_gradient_held_from_cp` holds
the law, and a test reads the stored rows. The loop's buffers, by kind, are the data
for counting MaxText's own MoE layer (docs/results/whole-step.md).

    python -m bench.calibration.logits_lifetime --venv /work/venv312
    python -m bench.calibration.logits_lifetime --re-estimate   # recount the stored rows

Each compile takes 1 to 4 minutes on 2 cores; the parsed rows are written to
bench/results/logits_lifetime.json (and the PNG) as each compiles; the dumps are
deleted.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from pathlib import Path

from bench.calibration import maxtext_step
from bench.common import RESULTS, pyplot, save, table

STUDY = "logits_lifetime"
GIB = 2**30
LAYERS = "override_model_config=true:base_num_decoder_layers=4"
# MODEL:CP:TOPOLOGY:KEY=VALUE... (maxtext_step's point syntax), four decoder layers each.
POINTS = (
    # cp 1: tokens a device from 4k to 32k, 8 and 16 chips, the logits' dtype and
    # tiling, a small vocabulary (Mixtral's 32k words)
    f"qwen3-30b-a3b:1:v5p-16:{LAYERS}:max_target_length=4096:per_device_batch_size=1",
    f"qwen3-30b-a3b:1:v5p-16:{LAYERS}:max_target_length=32768:per_device_batch_size=1",
    f"qwen3-30b-a3b:1:v5p-32:{LAYERS}:max_target_length=16384:per_device_batch_size=1",
    f"qwen3-30b-a3b:1:v5p-16:{LAYERS}:max_target_length=16384:per_device_batch_size=1"
    ":logits_dot_in_fp32=true",
    f"qwen3-30b-a3b:1:v5p-16:{LAYERS}:max_target_length=16384:per_device_batch_size=1"
    ":num_vocab_tiling=4",
    f"mixtral-8x7b:1:v5p-32:{LAYERS}:max_target_length=16384:per_device_batch_size=1",
    # cp 2 to 8, the same knobs
    f"qwen3-30b-a3b:4:v5p-32:{LAYERS}:max_target_length=65536:per_device_batch_size=0.25",
    f"qwen3-30b-a3b:2:v5p-16:{LAYERS}:max_target_length=32768:per_device_batch_size=0.5",
    f"qwen3-30b-a3b:8:v5p-32:{LAYERS}:max_target_length=65536:per_device_batch_size=0.125",
    f"qwen3-30b-a3b:4:v5p-32:{LAYERS}:max_target_length=65536:per_device_batch_size=0.25"
    ":context_parallel_load_balance=false",
    f"qwen3-30b-a3b:4:v5p-32:{LAYERS}:max_target_length=65536:per_device_batch_size=0.25"
    ":logits_dot_in_fp32=true",
    f"qwen3-30b-a3b:4:v5p-32:{LAYERS}:max_target_length=65536:per_device_batch_size=0.25"
    ":num_vocab_tiling=4",
    f"mixtral-8x7b:4:v5p-32:{LAYERS}:max_target_length=65536:per_device_batch_size=0.25",
    f"deepseek3-671b:4:v5p-128:{LAYERS}:max_target_length=16384:per_device_batch_size=0.25",
    # the routed rows' shape: k and the hidden width moved at cp 4 on 16 chips
    f"qwen3-30b-a3b:4:v5p-32:{LAYERS}:max_target_length=65536:per_device_batch_size=0.25"
    ":num_experts_per_tok=2",
    f"qwen3-30b-a3b:4:v5p-32:{LAYERS}:max_target_length=65536:per_device_batch_size=0.25"
    ":base_moe_mlp_dim=1536",
    # a whole slice of 64 chips, where XLA:TPU gathers by an all-reduce
    f"qwen3-30b-a3b:4:v5p-128:{LAYERS}:max_target_length=65536:per_device_batch_size=0.25",
)
COLUMNS = [
    ("point", "point"),
    ("tokens", "tokens a device"),
    ("peak_in_layers_backward", "peak in the layers' backward"),
    ("logits_gradient_gib", "logits' gradient counted GiB"),
    ("held_gib", "held at the peak GiB"),
    ("counted_held_gib", "held as counted GiB"),
    ("peak_gib", "compiled peak GiB"),
    ("estimate_gib", "estimate GiB"),
    ("error", "error"),
]
# A line of the live-range report's breakdown of the peak: its indentation, name, the
# bytes under it and the bytes it holds itself.
NODE = re.compile(
    r"^([\s│]*)[├└]── (.*?) \([\d.]+%, total: ([\d ]+) bytes, current: ([\d ]+) bytes"
)
TOP = 6  # the indentation of a top-level entry
BACKWARD = "jit(train_step)/transpose(jvp())"
LOOP = f"{BACKWARD}/while"
# maxtext_step's run-wide defaults, which every point here overrides.
BATCH = {"per_device_batch_size": 1, "max_target_length": 4096}


def breakdown(live_range: str) -> list[tuple[int, str, int, int]]:
    """(indentation, name, bytes under it, bytes it holds) of each line of the
    live-range report's breakdown of the heap's peak."""
    start = live_range.index("Stack trace breakdown for peak usage")
    nodes = (NODE.match(line) for line in live_range[start:].splitlines()[2:])
    return [
        (
            len(m.group(1)),
            m.group(2),
            int(m.group(3).replace(" ", "")),
            int(m.group(4).replace(" ", "")),
        )
        for m in nodes
        if m
    ]


def peak_entries(live_range: str) -> list[tuple[str, int]]:
    """The top-level (name, bytes) entries of the live-range report's breakdown of the
    heap's peak."""
    return [(name, total) for depth, name, total, _ in breakdown(live_range) if depth == TOP]


def tail(name: str) -> str:
    """The last three parts of an operation's name, as the tables show it."""
    return "/".join(name.split("/")[-3:])


def loop_leaves(live_range: str, least: int = 2**26) -> list[tuple[str, int]]:
    """The buffers of at least `least` bytes live at the heap's peak inside the layers'
    backward loop, (`tail` of the name, bytes), in the report's order."""
    out, inside = [], False
    for depth, name, _, held in breakdown(live_range):
        if depth == TOP:  # a top-level entry: the loop, or something beside it
            inside = name.endswith(LOOP)
        elif inside and held >= least:
            out.append((tail(name), held))
    return out


def held_like(entries: list[tuple[str, int]], size: float) -> int:
    """Bytes of the largest top-level buffer of the backward (`transpose(jvp())`), outside
    the layers' loop, within 1% of `size`, half of it or twice it (the logits' gradient
    in the compute dtype or in float32); 0 when none."""
    sizes = [
        b
        for name, b in entries
        if BACKWARD in name
        and LOOP not in name
        and any(abs(b - s) <= 0.01 * s for s in (size, size / 2, size * 2))
    ]
    return max(sizes, default=0)


def tokens_of(point: dict) -> float:
    """Tokens a device holds: MaxText's per_device_batch_size sequences of
    max_target_length (its global batch is that times the chips)."""
    named = dict(p.partition("=")[::2] for p in point["extra"])
    return float(named["per_device_batch_size"]) * int(named["max_target_length"])


def compile_point(python: str, base: str, point: dict, timeout: int) -> dict:
    args = argparse.Namespace(**BATCH)
    cmd = ["-m", "maxtext.trainers.pre_train.train_compile", base]
    cmd += maxtext_step.overrides(point, args)
    with tempfile.TemporaryDirectory() as dump:
        start = time.monotonic()
        flags = {"XLA_FLAGS": f"--xla_dump_to={dump}"}
        ran = maxtext_step.run_train_compile(python, cmd, timeout, tempfile.gettempdir(), flags)
        if ran is None:
            return {"status": "timeout"}
        stats = maxtext_step.parse_log(ran[0])
        stats["compile_s"] = round(time.monotonic() - start, 1)
        ranges = sorted(Path(dump).glob("*jit_train_step*after_optimizations-live-range.txt"))
        if stats["status"] != "ok" or len(ranges) != 1:
            return {**stats, "status": stats["status"] if stats["status"] != "ok" else "no dump"}
        text = ranges[0].read_text()
        stats["entries"] = [e for e in peak_entries(text) if e[1] >= 2**26]
        stats["loop_entries"] = loop_leaves(text)
    return stats


def row_of(label: str, python: str, base: str, timeout: int) -> dict:
    point = maxtext_step.parse_point(label)
    est = maxtext_step.estimate(base, point, argparse.Namespace(**BATCH))
    row = {"point": label, "status": est["status"]}
    if est["status"] != "ok":
        return {**row, "message": est.get("message", "")}
    compiled = compile_point(python, base, point, timeout)
    row["status"] = compiled["status"]
    if compiled["status"] != "ok":
        return row
    peak = compiled["arguments"] + compiled["outputs"] - compiled["aliased"] + compiled["temp"]
    row.update(
        tokens=tokens_of(point),
        entries=compiled["entries"],
        loop_entries=compiled["loop_entries"],
        compile_s=compiled["compile_s"],
        peak_in_layers_backward=any(LOOP in name for name, _ in compiled["entries"]),
        peak_gib=peak / GIB,
    )
    return with_estimate(row, est)


def with_estimate(row: dict, est: dict) -> dict:
    """`row` (a compiled point) with the count's columns from `est` (maxtext_step's
    estimate of the same point)."""
    gradient = est["device_breakdown"]["logits"] / 2  # half of the logits and gradient
    return {
        **row,
        "candidate": est["candidate"],
        "breakdown": est["device_breakdown"],
        "logits_gradient_gib": gradient / GIB,
        "held_gib": held_like(row["entries"], gradient) / GIB,
        "counted_held_gib": est["device_breakdown"]["logits_gradient_held"] / GIB,
        "estimate_gib": est["device_bytes"] / GIB,
        "error": f"{est['device_bytes'] / GIB / row['peak_gib'] - 1:+.1%}",
    }


def short(point: str) -> str:
    """A point's label without the four-layer override, as the docs' table names it."""
    return point.replace(LAYERS + ":", "")


def markdown(rows: list[dict]) -> str:
    """The docs' table of the compiled rows (docs/results/whole-step.md quotes it)."""
    lines = [
        "| point (4 layers) | peak in the layers' backward | the gradient held there GiB "
        "| counted GiB | compiled peak GiB | estimate GiB | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] != "ok":
            continue
        lines.append(
            f"| {short(r['point'])} | {'yes' if r['peak_in_layers_backward'] else 'no'} "
            f"| {r['held_gib']:.2f} | {r['counted_held_gib']:.2f} | {r['peak_gib']:.1f} "
            f"| {r['estimate_gib']:.1f} | {r['error']} |"
        )
    return "\n".join(lines)


# What a buffer inside the layers' loop is, by the operation that names it.
KINDS = (
    ("weights cast", "convert_element_type"),
    ("routed rows (sort)", "sort_activations"),
    ("grouped matmuls", "gmm"),
    ("all-reduce", "psum"),
    ("activation", "ffn_act"),
    ("attention", "splash"),
    ("loop carry", "wide.param"),
)


def loop_buffers(row: dict) -> list[tuple[str, int]]:
    """The buffers of the layers' backward loop live at a row's peak: those nested under
    the loop's entry (`loop_entries`) and those the report lists at its top level with
    the loop's name (DeepSeek-V3's psum and grouped matmul, for one)."""
    top = [
        (tail(name), held)
        for name, held in row["entries"]
        if LOOP in name and not name.endswith(LOOP)
    ]
    return [*row["loop_entries"], *top]


def loop_kinds(loop_entries: list[tuple[str, int]]) -> dict[str, float]:
    """GiB of the layer loop's buffers at the peak by kind (`KINDS`; the rest "other")."""
    out = {name: 0.0 for name, _ in KINDS} | {"other": 0.0}
    for name, held in loop_entries:
        kind = next((k for k, part in KINDS if part in name), "other")
        out[kind] += held / GIB
    return out


def layer_markdown(rows: list[dict]) -> str:
    """The docs' table of what one layer's backward holds in MaxText's loop at the peak,
    against the count of the layer (attention and the larger of the MoE block and a
    dense feed-forward)."""
    kinds = [name for name, _ in KINDS] + ["other"]
    lines = [
        "| point (4 layers) | loop GiB | counted layer GiB | " + " | ".join(kinds) + " |",
        "|---|---|---|" + "---|" * len(kinds),
    ]
    for r in rows:
        if r["status"] != "ok" or "loop_entries" not in r:
            continue
        b = r["breakdown"]
        layer = b["attention_peak"] + max(b["moe_block"], b["dense_ffn_peak"])
        held = loop_kinds(loop_buffers(r))
        lines.append(
            f"| {short(r['point'])} | {sum(held.values()):.2f} | {layer / GIB:.2f} | "
            + " | ".join(f"{held[k]:.2f}" for k in kinds)
            + " |"
        )
    return "\n".join(lines)


def plot(rows: list[dict]):
    plt = pyplot()
    shown = [r for r in rows if r["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    xs = range(len(shown))
    ax.bar(
        [x - 0.2 for x in xs],
        [r["logits_gradient_gib"] for r in shown],
        0.4,
        label="the logits' gradient (count)",
    )
    ax.bar(
        [x + 0.2 for x in xs],
        [r["held_gib"] for r in shown],
        0.4,
        label="a buffer that size live at the compiled peak",
    )
    ax.set_xticks(list(xs))
    ax.set_xticklabels(
        [short(r["point"]) for r in shown],
        fontsize=6,
        rotation=20,
        ha="right",
    )
    ax.set_ylabel("GiB a chip")
    ax.set_title("MaxText 0.2.5 (XLA:TPU, v5p): the logits' gradient at the step's peak")
    ax.legend(fontsize=8)
    return fig


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", default="/work/venv312", help="the 3.12 venv with maxtext")
    ap.add_argument(
        "--points",
        default=",".join(POINTS),
        help="comma-separated points to compile; the JSON's other rows are kept",
    )
    ap.add_argument("--timeout", type=int, default=1200)
    ap.add_argument(
        "--re-estimate",
        action="store_true",
        help="compile nothing: the stored rows' count columns from today's count",
    )
    args = ap.parse_args(argv)
    python = maxtext_step.venv_python(args.venv)
    base = maxtext_step.base_yml(python)
    path = RESULTS / f"{STUDY}.json"
    stored = {r["point"]: r for r in json.loads(path.read_text())["rows"]} if path.exists() else {}
    if args.re_estimate:
        for label, row in stored.items():
            if row["status"] == "ok":
                point = maxtext_step.parse_point(label)
                est = maxtext_step.estimate(base, point, argparse.Namespace(**BATCH))
                stored[label] = with_estimate(row, est)
    else:  # a point asked for is compiled again; the others are kept
        for label in args.points.split(","):
            stored[label] = row_of(label, python, base, args.timeout)
            summary = {k: stored[label].get(k) for k in ("point", "status", "error")}
            print(json.dumps(summary), flush=True)
            write(stored, python)  # each point as it compiles
    rows = write(stored, python)
    print(table(rows, COLUMNS))
    print(markdown(rows))
    print(layer_markdown(rows))


def write(stored: dict[str, dict], python: str) -> list[dict]:
    """The study's JSON and PNG from the rows by point (POINTS' order first); the rows."""
    rows = [stored[p] for p in POINTS if p in stored]
    rows += [r for p, r in stored.items() if p not in POINTS]
    payload = {"study": STUDY, "maxtext_stack": maxtext_step.versions(python), "rows": rows}
    print("wrote", *save(STUDY, payload, plot(rows)), flush=True)
    return rows


if __name__ == "__main__":
    RESULTS.mkdir(parents=True, exist_ok=True)
    main()
