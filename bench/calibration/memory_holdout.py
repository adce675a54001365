"""The memory model held out on the real presets, compiled for the chips (issue 29).

The judge set is fixed here, before the model it judges: one MoE layer of each real
preset (Qwen3-30B-A3B, Qwen3-Next-80B-A3B, DeepSeek-V3, Mixtral-8x7B: routing and
shared experts as their presets have them), bfloat16, megablox gathered and exchanged
(over the context devices, and with fsdp folded into the expert group),
training (fwd+bwd) and prefill (fwd), at cp 1, 2 and 4, one sequence of 8,192 tokens per
fsdp shard, compiled ahead of time on this CPU machine for

- 64 v5p chips (XLA:TPU through libtpu), fsdp = 64 / cp x context = cp, and
- 8 H200s, one node (XLA:GPU through JAX's CUDA plugin), fsdp = 8 / cp x context = cp.

Nothing runs on a chip. Each program's per-device temp (XLA's memory analysis) is set
beside the selector's estimate of that program's temp; the small shapes the model was
built on are not in the set. Run it once per stack (jax 0.10.2 with libtpu 0.0.42, jax
0.12.0.1 with libtpu 0.0.50): the compiled numbers go to
`bench/results/memory_holdout.json` under the stack's name, so the model can be judged
again later without compiling (`--judge`).

    python -m bench.calibration.memory_holdout            # compile this stack's programs (resumes)
    python -m bench.calibration.memory_holdout --judge    # the estimate against every stack's programs
    python -m bench.calibration.memory_holdout --replot
"""

from __future__ import annotations

import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from bench.common import RESULTS, arguments, pyplot, save, stack, table
from bench.common import load as stored

STUDY = "memory_holdout"
MODELS = ("qwen3_30b_a3b", "qwen3_next_80b_a3b", "deepseek_v3", "mixtral_8x7b")
CPS = (1, 2, 4)
# gathered; exchanged over the context devices (the group `auto` chose before it weighed
# fsdp too); exchanged with fsdp folded into the group (every device owns E / (fsdp x cp)
# experts whole), added to the set before any count of it changed.
EXCHANGES = ("gather", "all_to_all", "all_to_all_fsdp")
GROUPS = {"all_to_all": "expert_and_sequence", "all_to_all_fsdp": "expert_sequence_and_fsdp"}
MODES = ("train", "prefill")
TARGETS = {"v5p": 64, "h200": 8}  # chip -> devices
SEQ = 8192
WITHIN = 0.20  # issue 29 line 1: within 20% ...
SHARE = 0.90  # ... for at least 90% of the programs, on each stack
COLUMNS = [
    ("stack", "stack"),
    ("chip", "chips"),
    ("model", "model"),
    ("cp", "cp"),
    ("exchange", "weights"),
    ("mode", "mode"),
    ("temp_mib", "compiled temp MiB"),
    ("estimate_mib", "estimate MiB"),
    ("error", "error"),
]  # one row a program (the JSON's rows)


def programs():
    """Every (chip, model, cp, exchange, mode) of the judge set."""
    for chip in TARGETS:
        for model in MODELS:
            for cp in CPS:
                for exchange in EXCHANGES:
                    for mode in MODES:
                        yield chip, model, cp, exchange, mode


def overrides(chip: str, model: str, cp: int, exchange: str, mode: str) -> list[str]:
    return layer_overrides(chip, TARGETS[chip], model, cp, SEQ, exchange, mode)


def layer_overrides(
    chip: str, devices: int, model: str, cp: int, seq: int, exchange: str, mode: str
) -> list[str]:
    """One MoE layer of `model`, megablox with `exchange` (a key of EXCHANGES), on
    `devices` chips as fsdp = devices / cp x context = cp, one `seq`-token sequence a
    fsdp shard, bfloat16, memory unbounded (the compiler's temp is the answer)."""
    return [
        f"model={model}",
        f"hardware={chip}",
        f"num_devices={devices}",
        "num_slices=1",
        f"ici_fsdp_parallelism={devices // cp}",
        f"ici_context_parallelism={cp}",
        f"per_device_batch_size={1 / cp}",
        f"max_target_length={seq}",
        f"mode={mode}",
        "dispatch=megablox",
        f"expert_exchange={'gather' if exchange == 'gather' else 'all_to_all'}",
        *([f"expert_group={GROUPS[exchange]}"] if exchange in GROUPS else []),
        "dtype=bfloat16",
        "param_dtype=bfloat16",
        "hardware.memory_gib=1000000",
    ]


def key(chip, model, cp, exchange, mode) -> str:
    return f"{chip} {model} cp{cp} {exchange} {mode}"


def estimate_temp(over: list[str], stack_name: str = "") -> float | None:
    """The selector's temp for the program (bytes) as the compiler of `stack_name`'s jax
    holds it (the jax installed here without one), or None when it plans no such one."""
    import selector

    version = stack_name.split(",")[0].removeprefix("jax ").strip() or "auto"
    try:
        plan = selector.resolve(selector.compose([*over, f"hardware.jax_version={version}"]))
    except selector.ConfigError:
        return None
    return plan.chosen_estimate.memory.temp


def compile_one(over: list[str], chip: str) -> dict:
    import selector
    from checks.compiled import compile_plan
    from selector import targets

    cfg = selector.compose(over)
    try:
        plan = selector.resolve(cfg)
    except selector.ConfigError as exc:
        return {"refused": str(exc)[:300]}
    target = targets.Target(chip, TARGETS[chip])
    _, program, _, seconds = compile_plan(cfg, plan, target)
    m = program.memory_analysis()
    return {
        "temp_bytes": m.temp_size_in_bytes,
        "argument_bytes": m.argument_size_in_bytes,
        "output_bytes": m.output_size_in_bytes,
        "alias_bytes": m.alias_size_in_bytes,
        "compile_s": round(seconds, 1),
    }


def load() -> dict:
    """The stored compiles (bench.common.load), or none yet."""
    return stored(STUDY) if (RESULTS / f"{STUDY}.json").exists() else {"stacks": {}}


def write(payload: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{STUDY}.json").write_text(json.dumps(payload, indent=2, sort_keys=True))


def compile_stack(only_chip: str | None) -> None:
    payload = load()
    name = stack()
    compiled = payload["stacks"].setdefault(name, {})
    for program in programs():
        chip = program[0]
        if only_chip and chip != only_chip:
            continue
        k = key(*program)
        if k in compiled:
            continue
        start = time.perf_counter()
        try:
            compiled[k] = compile_one(overrides(*program), chip)
        except Exception as exc:  # a compile that fails is a result of its own
            compiled[k] = {"failed": f"{type(exc).__name__}: {str(exc)[:300]}"}
        print(k, compiled[k], f"{time.perf_counter() - start:.0f} s", flush=True)
        write(payload)


def judge(payload: dict) -> list[dict]:
    rows = []
    for name, compiled in sorted(payload["stacks"].items()):
        for program in programs():
            got = compiled.get(key(*program))
            if not got or "temp_bytes" not in got:
                continue
            estimate = estimate_temp(overrides(*program), name)
            if estimate is None:
                continue
            chip, model, cp, exchange, mode = program
            rows.append(
                {
                    "stack": name,
                    "chip": chip,
                    "model": model,
                    "cp": cp,
                    "exchange": exchange,
                    "mode": mode,
                    "temp_mib": got["temp_bytes"] / 2**20,
                    "estimate_mib": estimate / 2**20,
                    "error": f"{estimate / got['temp_bytes'] - 1:+.1%}",
                    "ratio": estimate / got["temp_bytes"],
                }
            )
    return rows


COMPACT_COLUMNS = [
    ("chip", "chips"),
    ("model", "model"),
    ("cp", "cp"),
    ("exchange", "weights"),
    ("train_mib", "train: compiled MiB"),
    ("train_estimate_mib", "counted MiB"),
    ("train_error", "error"),
    ("prefill_mib", "prefill: compiled MiB"),
    ("prefill_estimate_mib", "counted MiB"),
    ("prefill_error", "error"),
]


def compact(rows: list[dict], stack_name: str) -> list[dict]:
    """One stack's rows with training and prefill side by side."""
    out: dict[tuple, dict] = {}
    for r in rows:
        if r["stack"] != stack_name:
            continue
        k = (r["chip"], r["model"], r["cp"], r["exchange"])
        row = out.setdefault(k, dict(zip(("chip", "model", "cp", "exchange"), k, strict=True)))
        row[f"{r['mode']}_mib"] = r["temp_mib"]
        row[f"{r['mode']}_estimate_mib"] = r["estimate_mib"]
        row[f"{r['mode']}_error"] = r["error"]
    return list(out.values())


def judged_set(exchange: str) -> str:
    """Which set a program is judged in: the first set (gathered, and exchanged over the
    context devices), or the fsdp-folded group's, added later and scored apart."""
    return "fsdp folded" if exchange == "all_to_all_fsdp" else "first"


def summary(rows: list[dict]) -> list[dict]:
    out = []
    for name in sorted({r["stack"] for r in rows}):
        for judged in ("first", "fsdp folded"):
            mine = [r for r in rows if r["stack"] == name and judged_set(r["exchange"]) == judged]
            if not mine:
                continue
            within = sum(abs(r["ratio"] - 1) <= WITHIN for r in mine)
            out.append(
                {
                    "stack": name,
                    "set": judged,
                    "programs": len(mine),
                    "within": within,
                    "share": within / len(mine),
                    "met": within / len(mine) >= SHARE,
                }
            )
    return out


def plot(payload: dict):
    plt = pyplot()
    rows = payload["rows"]
    stacks = sorted({r["stack"] for r in rows})
    fig, axes = plt.subplots(1, len(stacks), figsize=(6.5 * len(stacks), 5.5), squeeze=False)
    for ax, name in zip(axes[0], stacks, strict=True):
        mine = [r for r in rows if r["stack"] == name]
        for chip, marker in (("v5p", "o"), ("h200", "s")):
            pts = [r for r in mine if r["chip"] == chip]
            ax.scatter(
                [r["temp_mib"] for r in pts],
                [r["estimate_mib"] for r in pts],
                marker=marker,
                label=f"{chip} ({len(pts)} programs)",
                alpha=0.7,
            )
        lo = min(min(r["temp_mib"], r["estimate_mib"]) for r in mine)
        hi = max(max(r["temp_mib"], r["estimate_mib"]) for r in mine)
        xs = [lo, hi]
        ax.plot(xs, xs, "k-", lw=0.8)
        ax.plot(xs, [x * (1 + WITHIN) for x in xs], "k:", lw=0.8)
        ax.plot(xs, [x * (1 - WITHIN) for x in xs], "k:", lw=0.8, label="+-20%")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("compiled temp, MiB per device")
        ax.set_ylabel("estimated temp, MiB per device")
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def main() -> None:
    args = arguments(
        STUDY,
        __doc__,
        plot,
        judge={"action": "store_true", "help": "judge the estimate; compile nothing"},
        chip={"default": None, "help": "compile only this chip (v5p, h200)"},
    )
    if args is None:
        return
    if not args.judge:
        compile_stack(args.chip)
        return
    payload = load()
    payload["rows"] = judge(payload)
    payload["summary"] = summary(payload["rows"])
    for name in sorted({r["stack"] for r in payload["rows"]}):
        print(f"\n{name}\n")
        print(table(compact(payload["rows"], name), COMPACT_COLUMNS))
    print(
        table(
            payload["summary"],
            [
                ("stack", "stack"),
                ("set", "set"),
                ("programs", "programs"),
                ("within", "within 20%"),
                ("share", "share"),
                ("met", "met"),
            ],
        )
    )
    print("wrote", *save(STUDY, payload, plot(payload)))


if __name__ == "__main__":
    main()
