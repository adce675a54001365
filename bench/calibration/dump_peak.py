"""Where a compiled program's temp goes, read from an XLA dump (`XLA_FLAGS=--xla_dump_to=DIR`)
of that compile beside the `CompiledMemoryStats` line its log printed.

XLA:TPU's memory analysis reports `temp_size_in_bytes`; the dump's buffer assignment
names the temp allocations it made (the heap, packing included) and its live-range
file the buffers live at the heap's peak. What the memory analysis counts beyond the
buffer assignment's allocations is added by the backend after buffer assignment and is
named by no buffer in the dump.

    python -m bench.calibration.dump_peak DUMP_DIR LOG_FILE

LOG_FILE is MaxText's train_compile output, or what `python -m bench.calibration.step_compile
--worker POINT` printed (this project's step, whose module is `jit_step`). Used for the
readings in docs/results/whole-step.md (MaxText's Qwen3-Next at 4 and 8 layers, dumps of
about 30 MB each; this project's Mixtral and Qwen3-30B-A3B steps on v5p and H200).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from bench.common import last_json_line
from checks import maxtext_step

GIB = 1024**3
MIB = 2**20


def allocations(buffer_assignment: str) -> dict[str, int]:
    """Bytes the buffer assignment allocates in HBM (memory space 0): parameters and temp."""
    out = {"parameters": 0, "temp": 0}
    for line in buffer_assignment.splitlines():
        if not line.startswith("allocation") or "thread-local" in line or " color " in line:
            continue
        size = int(re.search(r"size (\d+)", line).group(1))
        out["parameters" if "parameter" in line else "temp"] += size
    return out


def live_peak(live_range: str) -> int:
    """Bytes live at the heap simulator's peak, parameters included."""
    m = re.search(r"Stack trace breakdown for peak usage: ([\d ]+) bytes", live_range)
    return int(m.group(1).replace(" ", "")) if m else 0


def block_peak(dump: Path, temp: int, count: float) -> tuple[dict, str]:
    """One compiled block's row fields from its dump folder (one module's buffer
    assignment and live ranges): the live bytes at the peak (parameters left out), the
    temp allocations, XLA's `temp` and the selector's `count`, in MiB; and the
    live-range text."""
    (assignment,) = dump.glob("*after_optimizations-buffer-assignment.txt")
    (ranges,) = dump.glob("*after_optimizations-live-range.txt")
    alloc = allocations(assignment.read_text())
    live_range = ranges.read_text()
    fields = {
        "live_mib": (live_peak(live_range) - alloc["parameters"]) / MIB,
        "alloc_mib": alloc["temp"] / MIB,
        "temp_mib": temp / MIB,
        "count_mib": count / MIB,
        "error": f"{count / temp - 1:+.1%}",
        "status": "ok",
    }
    return fields, live_range


def _one(dump: Path, suffix: str) -> Path:
    found = [
        p
        for module in ("train_step", "jit_train_step", "jit_step")
        for p in sorted(dump.glob(f"*.{module}.*after_optimizations-{suffix}.txt"))
    ]
    if len(found) != 1:
        raise SystemExit(
            f"{dump}: expected one train_step or jit_step *-{suffix}.txt, found {len(found)}; "
            "give the folder XLA_FLAGS=--xla_dump_to named for one compile of a step."
        )
    return found[0]


def _stats(log: Path) -> dict:
    """The step's memory analysis: bench.calibration.step_compile's worker line, or MaxText's log."""
    text = log.read_text(errors="replace")
    row = last_json_line(text)
    if row is not None and "compiled" in row:
        return {"status": "ok", **row["compiled"]}
    return maxtext_step.parse_log(text)


def read(dump: Path, log: Path) -> dict[str, float]:
    alloc = allocations(_one(dump, "buffer-assignment").read_text())
    ranges = _one(dump, "live-range")
    stats = _stats(log)
    if stats["status"] != "ok":
        raise SystemExit(f"{log}: no memory analysis in it ({stats['status']}: {stats['message']})")
    named_temp = alloc["temp"]
    return {
        "arguments": stats["arguments"] / GIB,
        "temp (memory analysis)": stats["temp"] / GIB,
        "temp the buffer assignment allocates": named_temp / GIB,
        "of which live at its peak": (live_peak(ranges.read_text()) - alloc["parameters"]) / GIB,
        "temp no buffer names": (stats["temp"] - named_temp) / GIB,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dump", type=Path)
    ap.add_argument("log", type=Path)
    args = ap.parse_args(argv)
    for name, gib in read(args.dump, args.log).items():
        print(f"{name:40s} {gib:8.2f} GiB")


if __name__ == "__main__":
    main()
