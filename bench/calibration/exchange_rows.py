"""How many of the exchange's round buffers a compiler holds at its peak.

The exchanged block (`layers/expert_parallel.py`) moves rows to their experts' owners in
rounds of (G, B, M) buffers: G the expert group, B the rows a device sends each owner a
round. Each point here compiles one real preset's MoE layer, megablox exchanged with
fsdp folded into the expert group (training fwd+bwd, or the serving forward), ahead of
time for the chip, in its own process with `XLA_FLAGS=--xla_dump_to`, and reads from
the live-range file the buffers live at the heap's peak: how many are one round buffer
big (`round_buffers`), and how many bytes live there in all (`live_mib`, parameters
left out). Beside them: XLA's temp, the buffer assignment's temp allocations and the
selector's count (`Traits.exchange_row_buffers` in selector/traits.py reads this).

None of these programs is in a judge set (memory_holdout's are 64 v5p and 8 H200 at
8,192 tokens a sequence and per_device_batch_size 1 / cp; these have other chip
counts or sequence lengths).

    python -m bench.calibration.exchange_rows --chip v5p
    python -m bench.calibration.exchange_rows --chip h200 --into exchange_rows_h200
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from bench.common import dumped_worker_row, save, stack, table

MIB = 2**20
# chip -> (devices, model, cp, sequence, mode) per point
POINTS = {
    "v5p": (
        (16, "qwen3_30b_a3b", 1, 4096, "train"),
        (16, "qwen3_30b_a3b", 2, 4096, "train"),
        (32, "qwen3_30b_a3b", 2, 8192, "train"),
        (64, "qwen3_30b_a3b", 2, 16384, "train"),
        (32, "qwen3_next_80b_a3b", 2, 4096, "train"),
        (128, "deepseek_v3", 2, 4096, "train"),
        (32, "qwen3_30b_a3b", 2, 8192, "prefill"),
        (64, "qwen3_30b_a3b", 4, 4096, "prefill"),
    ),
    "h200": (
        (8, "qwen3_30b_a3b", 1, 4096, "train"),
        (8, "qwen3_30b_a3b", 2, 16384, "train"),
        (8, "qwen3_30b_a3b", 2, 4096, "prefill"),
        (8, "qwen3_30b_a3b", 4, 16384, "prefill"),
        (4, "qwen3_30b_a3b", 1, 8192, "prefill"),
    ),
}
COLUMNS = [
    ("point", "point"),
    ("round_mib", "one round buffer MiB"),
    ("round_buffers", "round buffers at the peak"),
    ("live_mib", "live at the peak MiB"),
    ("alloc_mib", "temp allocated MiB"),
    ("temp_mib", "XLA temp MiB"),
    ("count_mib", "count MiB"),
    ("error", "count error"),
]


def label(chip: str, point) -> str:
    devices, model, cp, seq, mode = point
    return f"{chip}:{devices} {model} cp{cp} seq{seq} {mode}"


def overrides(chip: str, point) -> list[str]:
    from bench.calibration.memory_holdout import layer_overrides

    devices, model, cp, seq, mode = point
    return layer_overrides(chip, devices, model, cp, seq, "all_to_all_fsdp", mode)


def peak_buffers(live_range: str) -> list[int]:
    """Bytes each buffer holds at the heap's peak (the live-range file's breakdown)."""
    _, _, breakdown = live_range.partition("Stack trace breakdown for peak usage")
    return [int(n.replace(" ", "")) for n in re.findall(r"current: ([\d ]+) bytes", breakdown)]


def round_buffers(sizes: list[int], round_bytes: int) -> int:
    """How many of `sizes` are one round buffer (a buffer may carry a few small values
    beside the rows: within 1%)."""
    return sum(round_bytes <= s <= 1.01 * round_bytes for s in sizes)


def worker(chip: str, index: int) -> None:
    import selector
    from bench.calibration.dump_peak import block_peak
    from checks.compiled import compile_plan
    from selector import targets
    from selector.problem import problem_shape, round_buffer_bytes

    point = POINTS[chip][index]
    cfg = selector.compose(overrides(chip, point))
    plan = selector.resolve(cfg)
    p = problem_shape(cfg, plan.mesh, plan.placement)
    round_bytes = int(round_buffer_bytes(p))
    _, program, _, _ = compile_plan(cfg, plan, targets.Target(chip, point[0]))
    temp = program.memory_analysis().temp_size_in_bytes
    dump = Path(os.environ["EXCHANGE_DUMP"])
    fields, live_range = block_peak(dump, temp, plan.chosen_estimate.memory.temp)
    shape = {
        "point": label(chip, point),
        "mode": point[4],
        "round_mib": round_bytes / MIB,
        "round_buffers": round_buffers(peak_buffers(live_range), round_bytes),
    }
    print(json.dumps({**shape, **fields}))


def plot(payload: dict):
    from bench.common import pyplot

    plt = pyplot()
    rows = [r for r in payload["rows"] if r.get("status") == "ok"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, key in (("live at the peak", "live_mib"), ("XLA temp", "temp_mib")):
        ax.scatter([r["count_mib"] for r in rows], [r[key] for r in rows], label=name)
    top = max([r["temp_mib"] for r in rows] + [1])
    ax.plot([1, top], [1, top], color="gray", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="count (MiB)", ylabel="compiled (MiB)")
    ax.set_title(f"exchanged layers on {payload['chip']} ({payload['stack']})", fontsize=9)
    ax.legend()
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chip", choices=sorted(POINTS), default="v5p")
    parser.add_argument("--into", default="", help="the result file (exchange_rows_CHIP)")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.chip, args.worker)
        return
    rows = []
    for index, point in enumerate(POINTS[args.chip]):
        cmd = [sys.executable, "-m", "bench.calibration.exchange_rows"]
        cmd += ["--chip", args.chip, "--worker", str(index)]
        env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
        row = dumped_worker_row(label(args.chip, point), cmd, 900, "EXCHANGE_DUMP", env=env)
        rows.append(row)
        print(row.get("point"), row.get("round_buffers", row.get("status")), flush=True)
    print(table([r for r in rows if r.get("status") == "ok"], COLUMNS))
    payload = {"chip": args.chip, "stack": stack(), "rows": rows}
    print("wrote", *save(args.into or f"exchange_rows_{args.chip}", payload, plot(payload)))


if __name__ == "__main__":
    main()
