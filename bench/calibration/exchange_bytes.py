"""XLA:TPU's bytes accessed for the real layers, gathered against exchanged.

One MoE layer of Qwen3-Next-80B-A3B and of DeepSeek-V3 at their real dimensions (their
presets), bfloat16, fwd+bwd, one sequence of 8192 tokens per fsdp shard, compiled ahead
of time on this CPU machine for 64 v5p chips (fsdp=16 x context=4; nothing runs on a
TPU), as `bench.targets --real` compiles them. Read from the compiled program: XLA's
cost analysis (`bytes accessed`, `flops`) and memory analysis (per-device temp and
argument bytes). XLA's cost analysis may count a while loop's body once, whatever its
trip count (the exchange's rounds, slots and per-expert loops are while loops), so
`while_loops` says how many the program has.

Rows are kept per JAX version and `--label` (e.g. before / after a change), so the
JSON holds both stacks' numbers side by side:

    python -m bench.calibration.exchange_bytes --label after            # jax of this python
    PYTHONPATH=. .nox/tests-3-12/bin/python -m bench.calibration.exchange_bytes --label after
    python -m bench.calibration.exchange_bytes --label fsdp_folded --exchange all_to_all \
        --expert_group expert_sequence_and_fsdp     # fsdp in the expert group as well
    python -m bench.calibration.exchange_bytes --replot
"""

from __future__ import annotations

import json
import os
import time

# Abstract TPU devices only need JAX's CPU backend.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from bench.common import arguments, load, pyplot, save, table
from bench.targets import REAL_MESH, real_layer_overrides

STUDY = "exchange_bytes"
MODELS = ("qwen3_next_80b_a3b", "deepseek_v3")
EXCHANGES = ("gather", "all_to_all")

COLUMNS = [
    ("label", "label"),
    ("jax", "jax"),
    ("model", "model"),
    ("exchange", "weights"),
    ("bytes_gib", "bytes accessed GiB"),
    ("tflops", "TFLOPs"),
    ("temp_mib", "temp MiB"),
    ("arguments_mib", "args MiB"),
    ("while_loops", "while loops"),
    ("compile_s", "compile s"),
]


def build_block(cfg, mesh):
    """The abstract block (no weights allocated) the selector plans for `cfg` on `mesh`."""
    from flax import nnx

    import layers
    import selector

    plan = selector.resolve(cfg, mesh)
    return nnx.eval_shape(lambda: layers.MoEBlock(plan, mesh=mesh, rngs=nnx.Rngs(0)))


def compile_row(model: str, exchange: str, mesh, label: str, group: str = "auto") -> dict:
    import jax

    import selector
    from checks.compiled import cost_analysis
    from layers.programs import compile_fwd_bwd

    overrides = [*real_layer_overrides(model, exchange), f"expert_group={group}"]
    block = build_block(selector.compose(overrides), mesh)
    start = time.perf_counter()
    program = compile_fwd_bwd(block, 16, 8192)
    seconds = time.perf_counter() - start
    cost = cost_analysis(program)
    m = program.memory_analysis()
    text = program.as_text()
    return {
        "label": label,
        "jax": jax.__version__,
        "model": model,
        "exchange": exchange,
        "expert_group": group,
        "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        "bytes_gib": float(cost.get("bytes accessed", 0.0)) / 2**30,
        "flops": float(cost.get("flops", 0.0)),
        "tflops": float(cost.get("flops", 0.0)) / 1e12,
        "temp_mib": m.temp_size_in_bytes / 2**20,
        "arguments_mib": m.argument_size_in_bytes / 2**20,
        "while_loops": text.count(" while("),
        "kernels": text.count('custom_call_target="tpu_custom_call"'),
        "compile_s": round(seconds, 1),
    }


def plot(payload: dict):
    plt = pyplot()
    rows = payload["rows"]
    fig, axes = plt.subplots(1, len(MODELS), figsize=(12, 4.5))
    for ax, model in zip(axes, MODELS, strict=True):
        mine = [r for r in rows if r["model"] == model]
        names = sorted({(r["jax"], r["label"]) for r in mine})
        for offset, exchange in enumerate(EXCHANGES):
            got = {(r["jax"], r["label"]): r for r in mine if r["exchange"] == exchange}
            xs = [i + 0.4 * offset for i, n in enumerate(names) if n in got]
            ys = [got[n]["bytes_gib"] for n in names if n in got]
            ax.bar(xs, ys, width=0.4, label=exchange)
        ax.set_xticks([i + 0.2 for i in range(len(names))])
        ax.set_xticklabels([f"jax {j}\n{lab}" for j, lab in names], fontsize=8)
        ax.set_ylabel("XLA:TPU bytes accessed, GiB per device (fwd+bwd)")
        ax.set_title(f"{model}, 64 v5p (fsdp=16 x context=4)")
        ax.legend()
    fig.tight_layout()
    return fig


def _save(payload: dict) -> tuple:
    """The JSON and PNG (the JSON alone where matplotlib is not installed)."""
    try:
        figure = plot(payload)
    except ImportError:
        path = save.__globals__["RESULTS"] / f"{STUDY}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2, sort_keys=True))
        return (path,)
    return save(STUDY, payload, figure)


def main() -> None:
    args = arguments(
        STUDY,
        __doc__,
        plot,
        label={"default": "now", "help": "the rows' label (e.g. before, after)"},
        only={"default": None, "help": "compile only this model"},
        exchange={"default": None, "help": "compile only this exchange (gather, all_to_all)"},
        expert_group={"default": "auto", "help": "the exchange's expert_group (label it too)"},
    )
    if args is None:
        return
    import jax

    import layers
    from checks.targets import devices
    from selector import targets

    mesh = layers.make_mesh(REAL_MESH, devices(targets.Target("v5p", 64)))
    try:
        payload = load(STUDY)
    except FileNotFoundError:
        payload = {"rows": []}
    for model in MODELS if args.only is None else (args.only,):
        for exchange in EXCHANGES if args.exchange is None else (args.exchange,):
            row = compile_row(model, exchange, mesh, args.label, args.expert_group)
            # A row replaces only its own: same label, stack, layer, exchange and group
            # (rows stored before the group was recorded are the auto group's).
            key = (row["label"], row["jax"], model, exchange, args.expert_group)
            payload["rows"] = [
                r
                for r in payload["rows"]
                if (r["label"], r["jax"], r["model"], r["exchange"], r.get("expert_group", "auto"))
                != key
            ] + [row]
            print(table([row], COLUMNS).splitlines()[-1], flush=True)
            print("wrote", *_save(payload), flush=True)
    payload["rows"].sort(key=lambda r: (r["model"], r["jax"], r["label"], r["exchange"]))
    print(table(payload["rows"], COLUMNS))
    print("jax", jax.__version__, "wrote", *_save(payload))


if __name__ == "__main__":
    main()
