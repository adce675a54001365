"""The real models' sizes, compiled abstractly on up to 64 simulated CPU devices.

One MoE layer of `qwen3_next_80b_a3b` and of `deepseek_v3` at their real dimensions,
bfloat16 parameters and compute, fwd+bwd, sequences of 8192 and 32768 tokens. Each
split is an 8-device base (over data, fsdp, tensor, expert) that holds a fixed global
batch (one sequence per batch shard); context parallelism cp in {1, 2, 4, 8} adds cp x
the base's devices for the same batch, as one does to fit a longer sequence. Every
point is compiled from abstract inputs (nothing is allocated, so the 45 GB DeepSeek-V3
layer needs no memory) for the weights gathered into the block and, where an expert
group exists, exchanged by all-to-all with the context devices folded into the group.

For each point: XLA's per-device argument, output and temp bytes, and the selector's
prediction of each. The programs are XLA:CPU's, which computes bfloat16 as float32;
the selector prices that (see selector/cost.py).

    python -m bench.scale            # writes bench/results/scale.json and .png
    python -m bench.scale --quick    # 8192 tokens only
    python -m bench.scale --only all_to_all   # compile the exchanged points again
    python -m bench.scale --check    # every study's predictions again, against its JSON

With --target tpu or gpu the same layers are compiled ahead of time by the compilers
users train with (nothing runs): XLA:TPU for v5p slices (fsdp=8 x context=cp, 8 to 64
chips) and XLA:GPU for H200 nodes (fsdp=2 x context=cp, 2 to 16 GPUs: one host up to 8,
two hosts at 16), sequences of 8192; writes scale_tpu / scale_gpu.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys

from bench.common import use_cpu_devices

use_cpu_devices(64)
if "--target" in sys.argv:  # abstract TPU and GPU devices need only JAX's CPU backend
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

from bench.common import (  # noqa: E402
    ONLY_HELP,
    SCALE_COLUMNS,
    StoredRows,
    check_stored,
    load,
    log_x_axis,
    log_y_axis,
    prediction_errors,
    pyplot,
    save,
    stack,
    table,
)
from bench.points import Point, device_count, measure, predicted  # noqa: E402

MODELS = {  # dims from the presets in conf/model (the model cards)
    "qwen3_next_80b_a3b": dict(emb=2048, hidden=512, experts=512, top_k=10),
    "deepseek_v3": dict(emb=7168, hidden=2048, experts=256, top_k=8),
}
SPLITS = {
    "fsdp8": {"fsdp": 8},
    "fsdp4_tensor2": {"fsdp": 4, "tensor": 2},
    "data2_fsdp2_expert2": {"data": 2, "fsdp": 2, "expert": 2},
}
CPS = (1, 2, 4, 8)
# The expert group these studies compiled the exchange over: the expert axes and the
# context devices (fsdp stays a weight split). Pinned, since `auto` may weigh another.
EXCHANGE_GROUP = ("expert_group=expert_and_sequence",)
# The compilers users train with: (hardware preset, the split cp multiplies).
TARGET_SPLITS = {
    "tpu": ("v5p", "fsdp8", {"fsdp": 8}),
    "gpu": ("h200", "fsdp2", {"fsdp": 2}),
}
COMPILERS = {
    "cpu": "XLA:CPU, 64 simulated devices",
    "tpu": "XLA:TPU (libtpu), v5p slices of 8-64 chips, ahead of time",
    "gpu": "XLA:GPU (JAX's CUDA plugin), H200 nodes of 2-16 GPUs (two hosts at 16), ahead of time",
}


def target_points(target: str) -> list[tuple[str, str, Point]]:
    hardware, split, base = TARGET_SPLITS[target]
    out = []
    for model in MODELS:
        for cp in CPS:
            for exchange in ("gather", "all_to_all"):
                if exchange == "all_to_all" and cp == 1:
                    continue  # no expert group to exchange over
                point = Point(
                    "megablox",
                    {**base, "context": cp},
                    8192,
                    exchange=exchange,
                    dtype="bfloat16",
                    param_dtype="bfloat16",
                    model=model,
                    hardware=hardware,
                    extra=EXCHANGE_GROUP if exchange == "all_to_all" else (),
                    **MODELS[model],
                )
                out.append((model, split, point))
    return out


def points(seqs) -> list[tuple[str, str, Point]]:
    out = []
    for model in MODELS:
        for split, base in SPLITS.items():
            for seq in seqs:
                for cp in CPS:
                    for exchange in ("gather", "all_to_all"):
                        if exchange == "all_to_all" and cp == 1 and "expert" not in base:
                            continue  # no expert group to exchange over
                        out.append((model, split, scale_point(model, split, seq, cp, exchange)))
    return out


def scale_point(model: str, split: str, seq: int, cp: int, exchange: str) -> Point:
    """One layer of `model` on `split` x context=cp, bfloat16 weights and compute."""
    return Point(
        "megablox",
        {**SPLITS[split], "context": cp},
        seq,
        exchange=exchange,
        dtype="bfloat16",
        param_dtype="bfloat16",
        model=model,
        extra=EXCHANGE_GROUP if exchange == "all_to_all" else (),
        **MODELS[model],
    )


def row(model: str, split: str, point: Point, m: dict) -> dict:
    """One table row: what XLA compiled, and the selector's prediction of it (after a
    new calibration, `--repredict` asks the selector again without recompiling)."""
    predicted = {
        "arguments": m["predicted_arguments"],
        "outputs": m["predicted_outputs"],
        "temp": m["predicted_temp"],
    }
    measured = {k: m[k] for k in ("arguments", "outputs", "temp")}

    def err(key):
        return f"{predicted[key] / measured[key] - 1:+.1%}"

    total = measured["arguments"] + measured["temp"]
    predicted_total = predicted["arguments"] + predicted["temp"]
    return {
        "model": model,
        "split": split,
        "seq": point.seq,
        "cp": point.mesh["context"],
        "devices": point.devices,
        "exchange": point.exchange,
        "arguments_mib": measured["arguments"] / 2**20,
        "outputs_mib": measured["outputs"] / 2**20,
        "temp_mib": measured["temp"] / 2**20,
        "total_mib": total / 2**20,
        "arguments_error": err("arguments"),
        "outputs_error": err("outputs"),
        "temp_error": err("temp"),
        "total_error": f"{predicted_total / total - 1:+.1%}",
        "predicted": predicted,
        "measured": measured,
        "tokens_per_device": m["tokens_per_device"],
        "raw": m,
    }


def plot(payload: dict):
    """One panel per (sequence length, model): every length the JSON holds, so the plot
    shows what each of the README's tables shows."""
    rows = payload["rows"]
    plt = pyplot()
    models = sorted({r["model"] for r in rows})
    seqs = sorted({r["seq"] for r in rows})
    fig, axes = plt.subplots(
        len(seqs), len(models), figsize=(6.5 * len(models), 4.4 * len(seqs)), squeeze=False
    )
    compiler = payload.get("compiler", COMPILERS["cpu"])
    for row_axes, seq in zip(axes, seqs, strict=True):
        for ax, model in zip(row_axes, models, strict=True):
            for split in sorted({r["split"] for r in rows}):
                for exchange, style in (("gather", "o-"), ("all_to_all", "s--")):
                    pts = [
                        r
                        for r in rows
                        if (r["model"], r["split"], r["seq"], r["exchange"])
                        == (model, split, seq, exchange)
                    ]
                    if not pts:
                        continue
                    line = ax.plot(
                        [r["cp"] for r in pts],
                        [r["total_mib"] / 1024 for r in pts],
                        style,
                        label=f"{split}, {exchange}",
                    )
                    ax.plot(
                        [r["cp"] for r in pts],
                        [
                            (r["predicted"]["arguments"] + r["predicted"]["temp"]) / 2**30
                            for r in pts
                        ],
                        "x:",
                        color=line[0].get_color(),
                    )
            ax.plot([], [], "kx:", label="selector's prediction (same colour)")
            ax.set(
                xlabel="context parallelism cp (devices = the split's x cp)",
                ylabel="arguments + temp GiB per device",
                title=f"{model}, sequence {seq}, bf16, fwd+bwd\n{compiler}",
            )
            log_y_axis(ax)
            log_x_axis(ax, CPS)
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    return fig


# Each study and the compiler its points were compiled for.
STUDIES = {
    "scale": "cpu",
    "scale_tpu": "tpu",
    "scale_gpu": "gpu",
    "scale_tpu_jax012": "tpu",
    "scale_gpu_jax012": "gpu",
}


def compiled_with(payload: dict) -> str:
    """The jax release a study's programs were compiled with: its recorded stack's, or
    0.10.2 for the studies written before the stack was recorded (the Python 3.11
    stack). The selector's count of them follows that release's compiler."""
    found = re.search(r"jax (\S+?),", payload.get("stack") or "")
    return found.group(1) if found else "0.10.2"


def repredicted(study: str) -> list[dict]:
    """The study's rows with the selector's side counted again, XLA's side kept; each
    point counted for the jax release it was compiled with, whatever is installed."""
    payload = load(study)
    release = f"hardware.jax_version={compiled_with(payload)}"
    target = STUDIES[study]
    todo = target_points(target) if target != "cpu" else points(tuple(payload["seqs"]))
    stored = StoredRows(payload["rows"], None)
    rows = []
    for model, split, p in todo:
        old = stored.by_label.get(p.label())
        if not old:  # a point the study did not compile (--quick)
            continue
        pinned = dataclasses.replace(p, extra=(*p.extra, release))
        rows.append(row(model, split, p, {**stored.pop(p.label())["raw"], **predicted(pinned)}))
    return rows


ROW_KEY = ("model", "split", "seq", "cp", "exchange")
PREDICTED = ("predicted_arguments", "predicted_outputs", "predicted_temp")


def _flat(r: dict) -> dict:
    """A row's key and its predictions, as `check_stored` compares them."""
    return {
        **{k: r[k] for k in ROW_KEY},
        **{f"predicted_{k}": v for k, v in r["predicted"].items()},
    }


def check() -> int:
    """0 when every study's stored predictions are today's count; else what moved."""
    failed = 0
    for study in STUDIES:
        fresh = [_flat(r) for r in repredicted(study)]
        if len(fresh) != len(load(study)["rows"]):  # a stored point no longer planned
            print(f"bench.scale --check: {study}.json has rows no point of today predicts")
            failed = 1
        failed |= check_stored(
            study,
            fresh,
            ROW_KEY,
            PREDICTED,
            rows_of=lambda payload: [_flat(r) for r in payload["rows"]],
            module="scale",
            rerun="python -m bench.scale --repredict [--target T --into STUDY]",
        )
    return failed


def summarise(rows: list[dict]) -> None:
    print(table(rows, SCALE_COLUMNS))
    errors = prediction_errors(rows)
    within = sum(e <= 0.15 for e in errors)
    print(f"\n{within} of {len(errors)} predictions within 15%; worst {max(errors):.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--quick", action="store_true", help="8192 tokens only")
    parser.add_argument("--replot", action="store_true", help="redraw the PNG from the JSON")
    parser.add_argument(
        "--repredict",
        action="store_true",
        help="recompute the selector's predictions from the JSON (after a new calibration)",
    )
    parser.add_argument("--only", metavar="TEXT", help=ONLY_HELP)
    parser.add_argument(
        "--target", choices=("tpu", "gpu"), help="compile for v5p slices or H200 nodes instead"
    )
    parser.add_argument(
        "--into", metavar="NAME", help="with --target: the study to write (default scale_TARGET)"
    )
    parser.add_argument(
        "--check", action="store_true", help="every study's predictions again, against its JSON"
    )
    args = parser.parse_args()
    if args.check:
        sys.exit(check())
    if args.target:
        return run_target(args.target, args.only, args.repredict, args.into)
    if args.replot or args.repredict:
        payload = load("scale")
        if args.repredict:  # the selector's side again, from each point's config
            payload["rows"] = repredicted("scale")
            summarise(payload["rows"])
        save("scale", payload, plot(payload))
        return
    assert device_count() == 64, "bench.scale needs 64 simulated devices"
    seqs = (8192,) if args.quick else (8192, 32768)
    rows = compile_all(points(seqs), "scale", args.only)
    summarise(rows)
    payload = {"rows": rows, "models": MODELS, "splits": SPLITS, "seqs": list(seqs)}
    print("wrote", *save("scale" if not args.quick else "scale_quick", payload, plot(payload)))


def compile_all(todo, study: str, only: str | None) -> list[dict]:
    """Each point's row: compiled now, or (under --only) taken from the study's JSON."""
    stored = StoredRows(load(study)["rows"] if only else None, only)
    rows = []
    for i, (model, split, point) in enumerate(todo):
        rows.append(stored.take(point.label()) or row(model, split, point, measure(point)))
        r = rows[-1]
        print(
            f"[{i + 1}/{len(todo)}] {point.label()}: args {r['arguments_mib']:.0f} MiB "
            f"({r['arguments_error']}), temp {r['temp_mib']:.0f} MiB ({r['temp_error']})",
            flush=True,
        )
    return rows


def run_target(
    target: str, only: str | None, repredict: bool = False, into: str | None = None
) -> None:
    """Compile the target's points into `into` (default scale_TARGET), e.g. scale_tpu_jax012
    for the same points on the jax 0.12 stack; the payload names the stack."""
    study = into or f"scale_{target}"
    todo = target_points(target)
    if repredict:  # the selector's side again (after a new calibration), XLA's kept
        rows = repredicted(study)
        compiled_on = load(study).get("stack")  # the compiles' stack, not this process's
    else:
        rows = compile_all(todo, study, only)
        compiled_on = stack()
    print(f"compiled by {COMPILERS[target]}")
    summarise(rows)
    payload = {"rows": rows, "models": MODELS, "compiler": COMPILERS[target], "target": target}
    if compiled_on:
        payload["stack"] = compiled_on
    print("wrote", *save(study, payload, plot(payload)))


if __name__ == "__main__":
    main()
