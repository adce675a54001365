"""How XLA's temp for an exchanged block grows beyond what lives at its peak.

libtpu reports more temp (or less) than its buffer assignment holds live at the heap's
peak, by bytes no buffer of the dump names. This study compiles small exchanged MoE
blocks ahead of time for v5p, one shape knob moved at a time from a base (16 chips,
E 128, M 2,048, H 768, k 8, 2,048 tokens a device, bfloat16), each in its own process
with `XLA_FLAGS=--xla_dump_to`, and sets the compiler's temp beside the selector's
count, the live bytes at the peak and the buffer assignment's temp allocations.

Two expert groups: `folded` (fsdp and context folded into the group: every device owns
its experts whole) and `context` (the sequence axes alone: the weights are gathered
over fsdp). Training (forward and backward) and the serving forward (prefill).

`--chip h200` compiles the folded training block for one node of 8 H200 (XLA:GPU)
from a base of 8 devices and E 64, the same knobs moved.

The laws read from it are `Traits.exchange_heap` and `exchange_serving_heap`
(selector/traits.py); tests read the stored rows. None of these programs is in a judge
set (the real presets' layers of `memory_holdout` and `step_compile`): the base's layer
dims are Qwen3-30B-A3B's (E 128, M 2,048, H 768, k 8), on other chip counts.

    python -m bench.calibration.exchange_heap
    python -m bench.calibration.exchange_heap --into exchange_heap_jax012   # jax 0.12
    python -m bench.calibration.exchange_heap --chip h200 [--into exchange_heap_h200_jax012]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from bench.common import RESULTS, dumped_worker_row, save, stack, table

MIB = 2**20
GROUPS = {"folded": "expert_sequence_and_fsdp", "context": "expert_and_sequence"}
BASE = {"devices": 16, "cp": 1, "E": 128, "M": 2048, "H": 768, "k": 8, "tokens": 2048}


def _moved(**knobs) -> dict:
    return {**BASE, **knobs}


# (name, shape) per point: one knob moved at a time from BASE.
_SHAPES = (
    ("base", _moved()),
    *((f"tokens{t}", _moved(tokens=t)) for t in (1024, 1280, 1536, 1792, 4096, 8192)),
    *((f"H{h}", _moved(H=h)) for h in (384, 1024, 1280, 1536, 3072)),
    *((f"E{e}", _moved(E=e)) for e in (64, 256, 512)),
    *((f"M{m}", _moved(M=m)) for m in (1024, 4096)),
    *((f"k{k}", _moved(k=k)) for k in (2, 4)),
    *((f"devices{d}", _moved(devices=d)) for d in (8, 32)),
    ("devices64_E256", _moved(devices=64, E=256)),
    ("devices64_E256_tokens8192", _moved(devices=64, E=256, tokens=8192)),
    ("cp2", _moved(cp=2)),
    ("cp2_tokens1024", _moved(cp=2, tokens=1024)),
)
_CONTEXT_SHAPES = tuple(
    (f"cp{cp}_{name}", {**shape, "cp": cp})
    for cp in (2, 4)
    for name, shape in (
        ("base", _moved()),
        ("tokens1024", _moved(tokens=1024)),
        ("tokens4096", _moved(tokens=4096)),
        ("H384", _moved(H=384)),
        ("E64", _moved(E=64)),
        ("k2", _moved(k=2)),
    )
)
_PREFILL_NAMES = (
    "base", "tokens1024", "tokens4096", "tokens8192", "H384", "H3072", "E64", "E512",
    "M1024", "M4096", "k2", "devices64_E256", "cp2",
)  # fmt: skip
# The serving forward's window on libtpu 0.0.50 (2026-12-05): finer steps around the
# base in tokens, k and M, and pairs that hold T x M or T x k at the base's value.
_PREFILL_SWEEP = (
    *((f"tokens{t}", _moved(tokens=t)) for t in (1536, 1792, 2304, 2560, 3072, 3584)),
    *((f"k{k}", _moved(k=k)) for k in (4, 6, 10, 12)),
    *((f"M{m}", _moved(M=m)) for m in (1536, 2560, 3072)),
    ("tokens4096_M1024", _moved(tokens=4096, M=1024)),
    ("tokens1024_M4096", _moved(tokens=1024, M=4096)),
    ("tokens1024_k16", _moved(tokens=1024, k=16)),
    ("tokens4096_k4", _moved(tokens=4096, k=4)),
    # a shared expert beside the routed ones (H wide), bare and behind a sigmoid gate
    ("shared", _moved(shared=1)),
    ("shared_gate", _moved(shared=2)),
    ("k10_shared_gate", _moved(k=10, shared=2)),
    ("tokens4096_shared", _moved(tokens=4096, shared=1)),
)
_PREFILL_SHAPES = (
    *((name, shape) for name, shape in _SHAPES if name in _PREFILL_NAMES),
    *((name, shape) for name, shape in _PREFILL_SWEEP if name not in _PREFILL_NAMES),
)
POINTS = (
    *(("folded", "train", name, shape) for name, shape in _SHAPES),
    *(("context", "train", name, shape) for name, shape in _CONTEXT_SHAPES),
    *(("folded", "prefill", name, shape) for name, shape in _PREFILL_SHAPES),
)
# One node of 8 H200 (XLA:GPU), training with fsdp folded in. E 64 (E_c 8): with E 128
# the base would be, device for device, the judge set's Qwen3-30B-A3B layer at cp 4.
# E 8 and 16 give one and two local experts (Mixtral's E_c at cp 4).
H200_BASE = {**BASE, "chip": "h200", "devices": 8, "E": 64}


def _h200(**knobs) -> dict:
    return {**H200_BASE, **knobs}


H200_POINTS = tuple(
    ("folded", "train", f"h200 {name}", shape)
    for name, shape in (
        ("base", _h200()),
        *((f"tokens{t}", _h200(tokens=t)) for t in (1024, 1536, 3072, 4096, 8192)),
        *((f"H{h}", _h200(H=h)) for h in (384, 1536, 3072)),
        *((f"E{e}", _h200(E=e)) for e in (8, 16, 32, 96, 256, 512)),
        ("E8_H3072", _h200(E=8, H=3072)),
        ("E8_M4096", _h200(E=8, M=4096)),
        *((f"M{m}", _h200(M=m)) for m in (1024, 4096)),
        *((f"k{k}", _h200(k=k)) for k in (2, 4)),
        ("devices4", _h200(devices=4)),
        ("cp2", _h200(cp=2)),
        ("cp4", _h200(cp=4)),
        ("cp2_tokens4096", _h200(cp=2, tokens=4096)),
        # one local expert, wide: H toward Mixtral's (its layer is in the judge set)
        *((f"E8_H{h}", _h200(E=8, H=h)) for h in (6144, 12288)),
        ("E8_k2_M4096_H12288", _h200(E=8, k=2, M=4096, H=12288)),
        ("E8_k2_M4096_H6144_tokens4096", _h200(E=8, k=2, M=4096, H=6144, tokens=4096)),
    )
)
CHIPS = {"v5p": POINTS, "h200": H200_POINTS}
COLUMNS = [
    ("point", "point"),
    ("round_mib", "round buffer R MiB"),
    ("weights_mib", "local experts W MiB"),
    ("live_mib", "live at the peak MiB"),
    ("alloc_mib", "temp allocated MiB"),
    ("temp_mib", "XLA temp MiB"),
    ("count_mib", "count MiB"),
    ("error", "count error"),
]


def label(point) -> str:
    group, mode, name, _ = point
    return f"{group} {mode} {name}"


def overrides(point) -> list[str]:
    group, mode, _, s = point
    fsdp = s["devices"] // s["cp"]
    return [
        "model=qwen3_30b_a3b",  # its routing and norms; every size below is overridden
        f"hardware={s.get('chip', 'v5p')}",
        f"num_devices={s['devices']}",
        "num_slices=1",
        f"ici_fsdp_parallelism={fsdp}",
        f"ici_context_parallelism={s['cp']}",
        f"per_device_batch_size={1 / s['cp']}",
        f"max_target_length={s['tokens'] * s['cp']}",
        f"mode={mode}",
        "dispatch=megablox",
        "expert_exchange=all_to_all",
        f"expert_group={GROUPS[group]}",
        "dtype=bfloat16",
        "param_dtype=bfloat16",
        "hardware.memory_gib=1000000",
        f"num_experts={s['E']}",
        f"base_emb_dim={s['M']}",
        f"base_moe_mlp_dim={s['H']}",
        f"num_experts_per_tok={s['k']}",
        *(["shared_experts=1"] if s.get("shared") else []),
        *(["shared_expert_gate=true"] if s.get("shared") == 2 else []),
    ]


def worker(chip: str, index: int) -> None:
    import selector
    from bench.calibration.dump_peak import block_peak
    from checks.compiled import compile_plan
    from selector import targets
    from selector.memory_model import routed_weight_elements
    from selector.problem import problem_shape, round_buffer_bytes

    point = CHIPS[chip][index]
    cfg = selector.compose(overrides(point))
    plan = selector.resolve(cfg)
    p = problem_shape(cfg, plan.mesh, plan.placement)
    _, program, _, _ = compile_plan(cfg, plan, targets.Target(chip, plan.mesh.num_devices))
    temp = program.memory_analysis().temp_size_in_bytes
    dump = Path(os.environ["EXCHANGE_HEAP_DUMP"])
    fields, _ = block_peak(dump, temp, plan.chosen_estimate.memory.temp)
    shape = {
        "point": label(point),
        "group": point[0],
        "mode": point[1],
        "round_mib": round_buffer_bytes(p) / MIB,
        "weights_mib": routed_weight_elements(plan.strategy, p) * p.pb / MIB,
    }
    print(json.dumps({**shape, **fields}))


def plot(payload: dict):
    from bench.common import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for group, mode in (("folded", "train"), ("context", "train"), ("folded", "prefill")):
        rows = [
            r
            for r in payload["rows"]
            if r.get("status") == "ok" and (r["group"], r["mode"]) == (group, mode)
        ]
        ax.scatter(
            [r["round_mib"] / r["weights_mib"] for r in rows],
            [r["temp_mib"] / r["count_mib"] for r in rows],
            label=f"{group} {mode}",
        )
    ax.axvline(1 / 3, color="gray", lw=0.8, ls=":")
    ax.set(
        xscale="log",
        xlabel="round buffer R / local experts' weights W",
        ylabel="XLA temp / count",
    )
    chip = payload.get("chip", "v5p")
    ax.set_title(f"exchanged blocks on {chip} ({payload['stack']})", fontsize=9)
    ax.legend(fontsize=8)
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chip", choices=sorted(CHIPS), default="v5p")
    parser.add_argument("--into", help="the result file's name (exchange_heap[_CHIP])")
    parser.add_argument("--resume", action="store_true", help="keep the stored rows that ran")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.chip, args.worker)
        return
    into = args.into or ("exchange_heap" if args.chip == "v5p" else f"exchange_heap_{args.chip}")
    stored = RESULTS / f"{into}.json"
    kept = {}
    if args.resume and stored.exists():
        kept = {
            r["point"]: r for r in json.loads(stored.read_text())["rows"] if r.get("status") == "ok"
        }
    rows = []
    for index, point in enumerate(CHIPS[args.chip]):
        if label(point) in kept:
            rows.append(kept[label(point)])
            continue
        cmd = [sys.executable, "-m", "bench.calibration.exchange_heap", "--chip", args.chip]
        cmd += ["--worker", str(index)]
        env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
        row = dumped_worker_row(label(point), cmd, 900, "EXCHANGE_HEAP_DUMP", env=env)
        rows.append(row)
        print(row.get("point"), row.get("error", row.get("status")), flush=True)
    print(table([r for r in rows if r.get("status") == "ok"], COLUMNS))
    payload = {"chip": args.chip, "stack": stack(), "rows": rows}
    print("wrote", *save(into, payload, plot(payload)))


if __name__ == "__main__":
    main()
