"""The whole training step of the presets' decoders (`checks.step`: embeddings, attention,
the chosen MoE block, the layers scanned and rematerialised, AdamW) compiled ahead of
time for 64 chips at the real shape, beside the estimate's whole-step bytes
(`Estimate.device_bytes` and its breakdown).

    python -m bench.calibration.step_compile --target tpu --points qwen3_30b_a3b:1,mixtral_8x7b:4

`--into NAME` writes the rows to bench/results/NAME.json and .png instead of the target's
own study (`step_compile`, `step_compile_gpu`), e.g. `--into step_compile_jax012` for the
same points compiled on the jax 0.12 stack.

A point is MODEL:CP or MODEL:CP:LAYERS (`base_num_decoder_layers=LAYERS`, for a model
whose whole depth is more than the chips hold, e.g. `deepseek_v3:1:8`: its 3 dense
layers and 5 MoE layers, as bench.calibration.maxtext_step compiles MaxText's step for it). 64
chips (v5p:4x4x4 for tpu, 64 H200s as 8 nodes of 8 for gpu), ici_fsdp_parallelism =
64 / CP, ici_context_parallelism = CP, max_target_length 8192 and per_device_batch_size
1 / CP, so each device holds one 8,192-token sequence's shard. Each
point compiles in its own process with a timeout (minutes each on 2 cores); one that
fails or times out is recorded with its status and left out of the plot. On TPU the
MoE layers use the tiled grouped matmul: the Pallas megablox kernel does not trace
inside the rematerialised layer scan with jax 0.10.2 (see the README).
"""

from __future__ import annotations

import json
import sys

from bench.common import RESULTS, arguments, paired_bars, pyplot, save, stack, table, worker_row

STUDY = "step_compile"
GIB = 2**30
CHIPS = 64
SEQ = 8192
DEFAULT_POINTS = (
    "qwen3_30b_a3b:1,qwen3_30b_a3b:2,qwen3_30b_a3b:4,mixtral_8x7b:1,mixtral_8x7b:2,mixtral_8x7b:4"
)
HARDWARE = {"tpu": "v5p", "gpu": "h200"}


def study(target: str) -> str:
    """Each target's rows in their own JSON and PNG."""
    return STUDY if target == "tpu" else f"{STUDY}_{target}"


COLUMNS = [
    ("point", "point"),
    ("status", "compile"),
    ("candidate", "MoE layers"),
    ("arguments_gib", "args GiB"),
    ("temp_gib", "temp GiB"),
    ("peak_gib", "peak GiB"),
    ("estimate_gib", "estimate GiB"),
    ("error", "est / XLA - 1"),
    ("seconds", "compile s"),
]


def overrides(model: str, cp: int, target: str, layers: int | None = None) -> list[str]:
    out = [
        f"model={model}",
        "mesh=v5p_128",
        f"hardware={HARDWARE[target]}",
        f"num_devices={CHIPS}",
        f"ici_fsdp_parallelism={CHIPS // cp}",
        f"ici_context_parallelism={cp}",
        f"max_target_length={SEQ}",
        f"per_device_batch_size={1 / cp}",
        "mode=train",
    ]
    if layers:
        out += [f"base_num_decoder_layers={layers}"]
    if target == "gpu":
        out += ["dcn_fsdp_parallelism=1"]
    return out + (["gmm_backend=tiled_gmm"] if target == "tpu" else [])


def worker(point: str, target: str) -> dict:
    """Compile one point in this process; the row as a dict."""
    from checks.jax_start import prepare_process

    prepare_process("tpu" if target == "tpu" else "gpu", CHIPS)
    import selector
    from checks.step import compile_step

    model, cp, layers = parse(point)
    cfg = selector.compose(overrides(model, cp, target, layers))
    plan, findings = selector.api.analyse_any(selector.to_config(cfg))
    if plan is None:
        return {"point": point, "status": "refused", "findings": [f.code for f in findings]}
    est = plan.chosen_estimate
    _, n = compile_step(cfg, plan, progress=lambda s: print(s, file=sys.stderr, flush=True))
    return {
        "point": point,
        "status": "ok",
        "candidate": est.name,
        "expert_group": plan.placement.as_dict()["expert_group"],
        "target": n.target,
        "compiled": n.as_dict(),
        "arguments_gib": n.arguments / GIB,
        "temp_gib": n.temp / GIB,
        "peak_gib": n.peak / GIB,
        "estimate_gib": est.device_bytes / GIB,
        "estimate_breakdown": est.device_breakdown,
        "error": est.device_bytes / n.peak - 1,
        "seconds": n.seconds,
    }


def run_point(point: str, target: str, timeout: float) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "bench.calibration.step_compile",
        "--target",
        target,
        "--worker",
        point,
    ]
    return worker_row(point, cmd, timeout)


def plot(payload: dict):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    rows = [r for r in payload["rows"] if r.get("status") == "ok"]
    paired_bars(
        ax,
        [r["point"] for r in rows],
        ([r["peak_gib"] for r in rows], "compiled peak"),
        ([r["estimate_gib"] for r in rows], "estimate"),
        "GiB a device",
    )
    ax.axhline(payload["chip_gib"], color="grey", linestyle="--", label="chip memory")
    ax.set_title(
        f"Whole training step, {CHIPS} {payload['target']} chips, {SEQ} tokens a sequence\n"
        f"{payload.get('stack', 'jax 0.10.2')}"
    )
    ax.legend()
    return fig


def main() -> None:
    args = arguments(
        STUDY,
        __doc__,
        plot,
        target={"choices": ("tpu", "gpu"), "default": "tpu"},
        points={"default": DEFAULT_POINTS},
        timeout={"type": float, "default": 1200.0, "help": "seconds per point"},
        worker={"default": None, "help": argparse_hidden()},
        re_estimate={
            "action": "store_true",
            "help": "keep the compiled numbers in the JSON and redo only the estimates",
        },
        into={"default": None, "help": "the study's name to write (default: the target's)"},
    )
    if args is None:
        return
    name = args.into or study(args.target)
    if args.re_estimate:
        re_estimate(args.target, name)
        return
    if args.worker:
        print(json.dumps(worker(args.worker, args.target)))
        return
    import selector

    chip = selector.to_config(selector.compose([f"hardware={HARDWARE[args.target]}"])).hardware
    # The target's stored rows are kept; each point compiled replaces its own row.
    stored = RESULTS / f"{name}.json"
    rows = json.loads(stored.read_text())["rows"] if stored.exists() else []
    compiled_on = stack()
    for point in args.points.split(","):
        print(f"compiling {point} for {args.target} ...", flush=True)
        row = run_point(point, args.target, args.timeout)
        rows = sorted([r for r in rows if r["point"] != point] + [row], key=_order)
        print(table([row], COLUMNS), flush=True)
        payload = {
            "target": args.target,
            "chip_gib": chip.memory_gib,
            "stack": compiled_on,
            "rows": rows,
        }
        # Saved after every point: compiles are long.
        paths = save(name, payload, plot(payload))
    print(table(rows, COLUMNS))
    print("wrote", *paths)


def parse(point: str) -> tuple[str, int, int | None]:
    """(model, cp, layers or None) of MODEL:CP[:LAYERS]."""
    model, cp, *layers = point.split(":")
    return model, int(cp), int(layers[0]) if layers else None


def _order(row: dict) -> tuple[str, int, int]:
    model, cp, layers = parse(row["point"])
    return model, layers or 0, cp


def re_estimate(target: str, name: str) -> None:
    """The stored compiled rows with the current selector's estimate beside them (the
    compiles take minutes each; the estimate is a function of the same config)."""
    import selector

    payload = json.loads((RESULTS / f"{name}.json").read_text())
    for row in payload["rows"]:
        if row.get("status") != "ok":
            continue
        model, cp, layers = parse(row["point"])
        cfg = selector.to_config(selector.compose(overrides(model, cp, target, layers)))
        plan, _ = selector.api.analyse_any(cfg)
        est = plan.candidate(*_key(row["candidate"])).estimate
        row["estimate_gib"] = est.device_bytes / GIB
        row["estimate_breakdown"] = est.device_breakdown
        row["error"] = est.device_bytes / (row["peak_gib"] * GIB) - 1
    print(table(payload["rows"], COLUMNS))
    print("wrote", *save(name, payload, plot(payload)))


def _key(name: str):
    """(Dispatch, Exchange) of a candidate's name (`megablox/gather`, `dense`)."""
    import selector

    strategy, _, exchange = name.partition("/")
    return selector.Dispatch(strategy), selector.Exchange(exchange or "gather")


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
