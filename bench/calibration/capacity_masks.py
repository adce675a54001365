"""How many copies of the capacity path's one-hot dispatch mask a compiler holds.

The capacity block (`layers/subgroup_capacity.py`) builds (tokens, E, C) dispatch and
combine masks and multiplies them into einsums. XLA:TPU fuses them; XLA:GPU and XLA:CPU
hold mask-sized buffers at the peak. Each point here compiles the block alone (fwd+bwd
for `train`, forward for `prefill`) ahead of time for the chip, in its own process with
`XLA_FLAGS=--xla_dump_to`, and reads from the buffer assignment's temp heap the slots
the size of one mask (in float32 or in the compute dtype, bfloat16); beside them, XLA's
temp and the selector's count (`Traits.capacity_masks_*` in selector/traits.py).

`read` points are those the traits were read from; `held` points are shapes they were
not read from, the check of the law.

    python -m bench.calibration.capacity_masks --chip h200
    python -m bench.calibration.capacity_masks --chip h200 --into capacity_masks_jax012
    python -m bench.calibration.capacity_masks --chip cpu --set read
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

from bench.common import dumped_worker_row, save, stack, table

MIB = 2**20
# (set, data, context, sequence, experts, top_k, mode, emb, hidden)
POINTS = (
    ("read", 2, 1, 8192, 16, 2, "train", 256, 512),
    ("read", 1, 2, 8192, 32, 4, "train", 256, 512),
    ("read", 1, 4, 8192, 16, 2, "train", 256, 512),
    ("read", 2, 1, 2048, 64, 8, "train", 256, 512),
    ("read", 2, 1, 8192, 16, 2, "prefill", 256, 512),
    ("read", 1, 2, 8192, 32, 4, "prefill", 256, 512),
    ("read", 1, 4, 8192, 16, 2, "prefill", 256, 512),
    ("held", 2, 1, 16384, 32, 2, "train", 512, 1024),
    ("held", 1, 8, 16384, 16, 4, "train", 256, 512),
    ("held", 4, 1, 4096, 8, 1, "train", 1024, 256),
    ("held", 2, 2, 8192, 64, 6, "prefill", 512, 512),
    ("held", 1, 4, 32768, 16, 2, "train", 256, 256),
    ("held", 1, 4, 32768, 16, 2, "prefill", 256, 256),
)
COLUMNS = [
    ("set", "set"),
    ("point", "point"),
    ("mask_mib", "one mask, bf16 MiB"),
    ("f32_slots", "f32 mask slots"),
    ("bf16_slots", "bf16 mask slots"),
    ("temp_mib", "XLA temp MiB"),
    ("count_mib", "count MiB"),
    ("error", "count error"),
]


def label(point) -> str:
    _, data, cp, seq, experts, k, mode, emb, hidden = point
    return f"{mode} data={data} context={cp} seq={seq} E={experts} k={k} M={emb} H={hidden}"


def slots(dump: str, elements: int) -> tuple[int, int]:
    """(float32, bfloat16) mask-sized slots (distinct offsets) in the largest heap of
    the buffer assignment in `dump`."""
    files = glob.glob(os.path.join(dump, "*jit_*buffer-assignment.txt"))
    text = open(max(files, key=os.path.getsize)).read()
    allocations = re.findall(r"^allocation (\d+): size (\d+)", text, re.M)
    index, size = max(allocations, key=lambda a: int(a[1]))
    heap = text.split(f"allocation {index}: size {size}")[1].split("\nallocation ")[0]
    found = {4: set(), 2: set()}
    pattern = r"\(size=(\d+),offset=(\d+)\)"
    for value_size, offset in re.findall(pattern, heap):
        for width in found:
            if int(value_size) == elements * width:
                found[width].add(int(offset))
    return len(found[4]), len(found[2])


def worker(chip: str, index: int) -> None:
    from bench.points import Point, measure, planned
    from selector.problem import problem_shape

    point = POINTS[index]
    _, data, cp, seq, experts, k, mode, emb, hidden = point
    block = Point(
        "subgroup_capacity",
        {"data": data, "context": cp},
        seq=seq,
        emb=emb,
        hidden=hidden,
        experts=experts,
        top_k=k,
        hardware=chip,
        dtype="bfloat16",
        mode=mode,
    )
    m = measure(block)
    cfg, plan = planned(block)
    p = problem_shape(cfg, plan.mesh, plan.placement)
    elements = int(p.T * p.E * p.C)  # one device's (tokens, E, C) mask, C as planned
    f32, bf16 = slots(os.environ["CAPACITY_DUMP"], elements)
    row = {
        "set": point[0],
        "point": label(point),
        "mask_mib": elements * 2 / MIB,
        "f32_slots": f32,
        "bf16_slots": bf16,
        "temp_mib": m["temp"] / MIB,
        "count_mib": m["predicted_temp"] / MIB,
        "error": f"{m['predicted_temp'] / m['temp'] - 1:+.1%}",
        "status": "ok",
    }
    print(json.dumps(row))


def plot(payload: dict):
    from bench.common import pyplot

    plt = pyplot()
    rows = [r for r in payload["rows"] if r.get("status") == "ok"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, marker in (("read", "o"), ("held", "s")):
        got = [r for r in rows if r["set"] == name]
        ax.scatter(
            [r["temp_mib"] for r in got], [r["count_mib"] for r in got], marker=marker, label=name
        )
    top = max([r["temp_mib"] for r in rows] + [1])
    ax.plot([1, top], [1, top], color="gray", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="XLA temp (MiB)", ylabel="count (MiB)")
    ax.set_title(f"capacity block on {payload['chip']}: count against XLA ({payload['stack']})")
    ax.legend()
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chip", default="h200", help="hardware preset: h200, v5p, cpu, ...")
    parser.add_argument("--set", choices=("read", "held", "all"), default="all")
    parser.add_argument("--into", default="capacity_masks", help="the result file's name")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.chip, args.worker)
        return
    rows = []
    for index, point in enumerate(POINTS):
        if args.set not in ("all", point[0]):
            continue
        env = {**os.environ, **({"JAX_PLATFORMS": "cpu"} if args.chip == "cpu" else {})}
        cmd = [sys.executable, "-m", "bench.calibration.capacity_masks"]
        cmd += ["--chip", args.chip, "--worker", str(index)]
        flags = "--xla_force_host_platform_device_count=8"
        row = dumped_worker_row(label(point), cmd, 900, "CAPACITY_DUMP", env, flags)
        rows.append(row)
        print(row.get("point"), row.get("error", row.get("status")), flush=True)
    print(table([r for r in rows if r.get("status") == "ok"], COLUMNS))
    payload = {"chip": args.chip, "stack": stack(), "rows": rows}
    print("wrote", *save(args.into, payload, plot(payload)))


if __name__ == "__main__":
    main()
