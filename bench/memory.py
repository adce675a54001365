"""Per-device memory of the MoE block's fwd+bwd against context parallelism, weights
included, gathered against exchanged (expert parallel, the context devices folded into
the expert group), next to the flatten baseline and the selector's prediction.

For cp in {1, 2, 4, 8} on a (data=1, context=cp) mesh, one sequence (a fixed global
batch and sequence): XLA's compiled per-device argument and temp bytes
(`memory_analysis()`), so the weights a device holds count. Also the wall time of the
exchanged block's fwd+bwd against the gathered one's on this CPU (interleaved runs, a
ratio of medians).

    python -m bench.memory
    python -m bench.memory --check   # megablox at cp 8 again, compared to memory.json
"""

from __future__ import annotations

from bench.common import use_cpu_devices

use_cpu_devices(8)

import jax  # noqa: E402
from flax import nnx  # noqa: E402

import layers  # noqa: E402
import selector  # noqa: E402
from bench.common import (  # noqa: E402
    CP_RATIO_COLUMNS,
    EXCHANGE_TIME_COLUMNS,
    MEMORY_COLUMNS,
    arguments,
    check_stored,
    interleaved,
    load,
    log_x_axis,
    machine,
    median,
    pyplot,
    save,
    table,
)
from bench.flatten_baseline import flatten_block_forward  # noqa: E402
from bench.points import Point, measure, predicted  # noqa: E402
from layers.programs import block_forward, compile_fwd_bwd, fwd_bwd_loss  # noqa: E402

SHAPE = dict(seq=8192, emb=256, hidden=512, experts=16, top_k=2)
CPS = (1, 2, 4, 8)
VARIANTS = (
    ("dense", "gather"),
    ("subgroup_capacity", "gather"),
    ("megablox", "gather"),
    ("megablox", "all_to_all"),
)


def point(strategy: str, exchange: str, cp: int) -> Point:
    return Point(
        strategy, {"data": 1, "context": cp}, exchange=exchange, capacity_factor=1.25, **SHAPE
    )


def name(strategy: str, exchange: str) -> str:
    return f"megablox/{exchange}" if strategy == "megablox" else strategy


def flatten_row(cp: int) -> dict:
    """The bug report's block: the same megablox computation on (batch x sequence)
    flattened and sorted globally under plain jit."""
    p = point("megablox", "gather", cp)
    cfg = selector.compose(p.overrides())
    mesh = layers.make_mesh(p.mesh)
    plan = selector.resolve(cfg, mesh)
    block = nnx.eval_shape(lambda: layers.MoEBlock(plan, mesh=mesh, rngs=nnx.Rngs(0)))
    m = compile_fwd_bwd(block, 1, p.seq, forward=flatten_block_forward(block)).memory_analysis()
    return {
        "variant": "flatten (baseline)",
        "cp": cp,
        "tokens_per_device": p.seq // cp,
        "arguments_mib": m.argument_size_in_bytes / 2**20,
        "temp_mib": m.temp_size_in_bytes / 2**20,
        "total_mib": (m.argument_size_in_bytes + m.temp_size_in_bytes) / 2**20,
    }


def rows_for(cp: int, variants=VARIANTS) -> list[dict]:
    out = []
    for strategy, exchange in variants:
        if exchange == "all_to_all" and cp == 1:
            continue  # no expert group on one device: the same program as gathered
        m = measure(point(strategy, exchange, cp))
        predicted = m["predicted_arguments"] + m["predicted_temp"]
        total = m["arguments"] + m["temp"]
        out.append(
            {
                "variant": name(strategy, exchange),
                "cp": cp,
                "tokens_per_device": m["tokens_per_device"],
                "arguments_mib": m["arguments"] / 2**20,
                "temp_mib": m["temp"] / 2**20,
                "total_mib": total / 2**20,
                "predicted_mib": predicted / 2**20,
                "error": f"{predicted / total - 1:+.1%}",
            }
        )
    if variants == VARIANTS:
        out.append(flatten_row(cp))
    return out


def timing(cp: int, runs: int) -> dict:
    """Median fwd+bwd wall time, exchanged against gathered, timed in alternation."""
    fns = {}
    for exchange in ("gather", "all_to_all"):
        p = point("megablox", exchange, cp)
        mesh = layers.make_mesh(p.mesh)
        plan = selector.resolve(selector.compose(p.overrides()), mesh)
        block = layers.MoEBlock(plan, mesh=mesh, rngs=nnx.Rngs(0))
        x = jax.random.normal(jax.random.key(1), (1, p.seq, p.emb))
        x = jax.device_put(x, block.layout.named(block.layout.x_BSM))
        fn = jax.jit(jax.grad(fwd_bwd_loss(block_forward(block)), argnums=(0, 1)))
        fns[exchange] = (fn, (block.weights(), x))
    times = interleaved(fns, runs)
    gathered, exchanged = median(times["gather"]), median(times["all_to_all"])
    return {
        "cp": cp,
        "gathered_s": gathered,
        "exchanged_s": exchanged,
        "ratio": exchanged / gathered,
        "times": times,
    }


def summary(rows: list[dict]) -> list[dict]:
    by = {(r["variant"], r["cp"]): r for r in rows}
    out = []
    for variant in [name(s, e) for s, e in VARIANTS] + ["flatten (baseline)"]:
        one = by.get((variant, 1)) or by.get(("megablox/gather", 1))  # EP at cp=1 = gathered
        four = by[(variant, 4)]
        out.append(
            {
                "variant": variant,
                "cp1": one["total_mib"],
                "cp4": four["total_mib"],
                "ratio": four["total_mib"] / one["total_mib"],
            }
        )
    return out


def plot(payload: dict):
    rows = payload["rows"]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for variant in [name(s, e) for s, e in VARIANTS]:
        pts = [r for r in rows if r["variant"] == variant]
        line = ax.plot([r["cp"] for r in pts], [r["total_mib"] for r in pts], "o-", label=variant)
        ax.plot(
            [r["cp"] for r in pts],
            [r["predicted_mib"] for r in pts],
            "x:",
            color=line[0].get_color(),
        )
    base = [r for r in rows if r["variant"] == "flatten (baseline)"]
    ax.plot(
        [r["cp"] for r in base],
        [r["total_mib"] for r in base],
        "--",
        color="gray",
        lw=2,
        label="flatten baseline (the bug report's block)",
    )
    ax.set(
        yscale="log",
        xlabel=f"context parallelism cp (one sequence of {payload['shape']['seq']} tokens)",
        ylabel="args + temp MiB per device (fwd+bwd)",
        title="MoE block memory vs cp, weights included (x: selector)",
    )
    log_x_axis(ax, CPS)
    ax.legend(fontsize=7)
    return fig


def repredicted(payload: dict) -> dict:
    """The selector's column again (after a new calibration); XLA's numbers kept."""
    for r in payload["rows"]:
        if r["variant"].startswith("flatten"):
            continue
        strategy, _, exchange = r["variant"].partition("/")
        m = predicted(point(strategy, exchange or "gather", r["cp"]))
        total = r["arguments_mib"] + r["temp_mib"]
        r["predicted_mib"] = (m["predicted_arguments"] + m["predicted_temp"]) / 2**20
        r["error"] = f"{r['predicted_mib'] / total - 1:+.1%}"
    return payload


def main() -> None:
    repredict = {"action": "store_true", "help": "the selector's column again from the JSON"}
    check = {"action": "store_true", "help": "one point again, compared to memory.json"}
    args = arguments(
        "memory", __doc__, plot, runs={"type": int, "default": 3}, repredict=repredict, check=check
    )
    if args is None:
        return
    if args.check:
        fresh = rows_for(8, (("megablox", "gather"), ("megablox", "all_to_all")))
        compiled = ("arguments_mib", "temp_mib")
        raise SystemExit(
            check_stored("memory", fresh, ("variant", "cp"), ("predicted_mib",), compiled)
        )
    if args.repredict:
        payload = repredicted(load("memory"))
        print(table(payload["rows"], MEMORY_COLUMNS))
        print("wrote", *save("memory", payload, plot(payload)))
        return
    rows = []
    for cp in CPS:
        rows += rows_for(cp)
        print(
            f"cp={cp}: "
            + ", ".join(f"{r['variant']} {r['total_mib']:.0f} MiB" for r in rows if r["cp"] == cp),
            flush=True,
        )
    times = [timing(cp, args.runs) for cp in CPS[1:]]
    print(table(rows, MEMORY_COLUMNS))
    print("\ncp=4 / cp=1 (args + temp)\n" + table(summary(rows), CP_RATIO_COLUMNS))
    print("\nwall time of fwd+bwd on this CPU\n" + table(times, EXCHANGE_TIME_COLUMNS))
    payload = {
        "machine": machine(),
        "shape": SHAPE,
        "rows": rows,
        "summary": summary(rows),
        "timing": times,
    }
    print("wrote", *save("memory", payload, plot(payload)))


if __name__ == "__main__":
    main()
