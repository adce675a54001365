"""Speed of each dispatch (fwd+bwd, one device) as a ratio to a dense SwiGLU MLP doing
the same active work (tokens x k rows): each point is timed in alternation with the
MLP (bench.common.interleaved) and the ratio is of the two medians of 5 runs.

8,192 tokens per step (batch x sequence), emb 512, hidden 1024, k = 8, float32, over
E in {8, 64, 128} and sequence lengths {1024, 8192}. The capacity path's masks grow
with sub_seq^2 and dense does E/k times the work, so points where one would run for
minutes are skipped and marked so.

    python -m bench.speed            # add --quick for one E and fewer runs
    python -m bench.speed --check    # E=8, seq 1024 compiled again, against speed.json

`--check` compiles each strategy's block at E=8, sequence 1024 again and compares what
does not depend on the machine's load: the grouped matmul the plan picks, everywhere;
the compiled temp where the JSON was written with the jax installed here. It does not
time them: a time stored on one machine is not reproduced on another.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import layers
import selector
from bench.common import (
    SPEED_COLUMNS,
    arguments,
    block_overrides,
    check_stored,
    interleaved,
    log_x_axis,
    machine,
    median,
    pyplot,
    save,
    table,
)
from layers.programs import block_forward, fwd_bwd_loss

TOKENS, EMB, HIDDEN, TOP_K, CAPACITY_FACTOR = 8192, 512, 1024, 8, 1.25
MASK_LIMIT = 2.2e8  # elements of the (T, E, C) dispatch mask beyond which we skip
DENSE_LIMIT = 2  # skip dense when it does more than this many times the routed work
STRATEGIES = ("megablox", "subgroup_capacity", "dense")


def mlp_step():
    """fwd+bwd of a dense SwiGLU MLP over TOKENS x TOP_K rows: the reference time."""
    mlp = layers.MlpBlock(EMB, HIDDEN, rngs=nnx.Rngs(0))
    ws = (mlp.wi_0[...], mlp.wi_1[...], mlp.wo[...])
    x = jax.random.normal(jax.random.key(0), (TOKENS * TOP_K, EMB))

    def loss(ws, x):
        a, b, c = ws
        return jnp.sum(((jax.nn.silu(x @ a) * (x @ b)) @ c) ** 2)

    fn = jax.jit(jax.grad(loss, argnums=(0, 1)))
    temp = fn.lower(ws, x).compile().memory_analysis().temp_size_in_bytes
    return fn, (ws, x), temp


def block_step(strategy: str, experts: int, seq: int):
    cfg = selector.compose(
        block_overrides(
            strategy,
            emb=EMB,
            hidden=HIDDEN,
            experts=experts,
            top_k=TOP_K,
            seq=seq,
            per_device_batch_size=TOKENS // seq,
            capacity_factor=CAPACITY_FACTOR,
        )
    )
    mesh = layers.make_mesh({"data": 1})
    model = layers.MoEBlock(selector.resolve(cfg, mesh), mesh=mesh, rngs=nnx.Rngs(0))
    fn = jax.jit(jax.grad(fwd_bwd_loss(block_forward(model)), argnums=(0, 1)))
    x = jax.random.normal(jax.random.key(1), (TOKENS // seq, seq, EMB))
    args = (model.weights(), x)
    temp = fn.lower(*args).compile().memory_analysis().temp_size_in_bytes
    return fn, args, temp, model.plan.gmm_backend


def skip_reason(strategy: str, experts: int, seq: int) -> str | None:
    if strategy == "subgroup_capacity":
        cap = -(-seq * TOP_K * CAPACITY_FACTOR // experts)
        if TOKENS * experts * cap > MASK_LIMIT:
            return f"skipped: (T, E, C) mask of {TOKENS * experts * cap:.2g} elements"
    if strategy == "dense" and experts / TOP_K > DENSE_LIMIT:
        return f"skipped: {experts // TOP_K}x the routed work"
    return None


def compiled_row(strategy: str, experts: int, seq: int, mlp_temp: int):
    """(a row's columns that do not depend on the machine's load, the block to time)."""
    fn, fargs, temp, backend = block_step(strategy, experts, seq)
    row = {
        "strategy": strategy,
        "experts": experts,
        "seq": seq,
        "temp_mib": temp / 2**20,
        "mem_vs_mlp": temp / mlp_temp,
        "note": f"gmm: {backend}" if strategy == "megablox" else "",
    }
    return row, (fn, fargs)


def check() -> int:
    """`--check`: every strategy at E=8, sequence 1024, compiled again against speed.json.
    The note (the grouped matmul the plan picks) is part of the key, so a changed pick
    finds no stored row."""
    *_, mlp_temp = mlp_step()
    fresh = [compiled_row(s, 8, 1024, mlp_temp)[0] for s in STRATEGIES]
    key = ("strategy", "experts", "seq", "note")
    return check_stored("speed", fresh, key, (), ("temp_mib", "mem_vs_mlp"))


def plot(payload: dict):
    rows = payload["rows"]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(12, 4.2))
    top = max(r["vs_mlp"] for r in rows if "vs_mlp" in r) * 1.15
    markers = {"megablox": "o", "subgroup_capacity": "s", "dense": "^"}
    for strategy, marker in markers.items():
        for seq, style in ((1024, "-"), (8192, "--")):
            run = [
                r for r in rows if (r["strategy"], r["seq"]) == (strategy, seq) and "vs_mlp" in r
            ]
            if run:
                ax.plot(
                    [r["experts"] for r in run],
                    [r["vs_mlp"] for r in run],
                    marker + style,
                    label=f"{strategy}, seq {seq}",
                )
        skipped = [r for r in rows if r["strategy"] == strategy and "vs_mlp" not in r]
        if skipped:  # drawn hollow at the top, with the table's reason in the legend
            reasons = list(dict.fromkeys(r["note"].removeprefix("skipped: ") for r in skipped))
            seqs = sorted({r["seq"] for r in skipped})
            ax.scatter(
                [r["experts"] for r in skipped],
                [top] * len(skipped),
                marker=marker,
                facecolors="none",
                edgecolors="gray",
                label=f"{strategy} not run (seq {', '.join(map(str, seqs))}): "
                + "; ".join(reasons),
            )
    ax.axhline(1.0, color="gray", lw=0.8, label="dense MLP of the same rows (baseline)")
    ax.set(
        xlabel="experts E",
        ylabel="fwd+bwd time / dense MLP (same rows)",
        title=f"{TOKENS} tokens, emb {EMB}, hidden {HIDDEN}, k={TOP_K}, one CPU device "
        "(medians, interleaved)",
        ylim=(0, top * 1.08),
    )
    log_x_axis(ax, sorted({r["experts"] for r in rows}))
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    return fig


def main() -> None:
    quick = {"action": "store_true", "help": "E=64, seq 8192, 3 runs"}
    check_flag = {"action": "store_true", "help": "E=8 compiled again, compared to speed.json"}
    args = arguments("speed", __doc__, plot, quick=quick, check=check_flag)
    if args is None:
        return
    if args.check:
        raise SystemExit(check())
    runs = 3 if args.quick else 5
    grid = [(64, 8192)] if args.quick else [(e, s) for e in (8, 64, 128) for s in (1024, 8192)]

    mlp_fn, mlp_args, mlp_temp = mlp_step()
    rows, all_mlp = [], []
    for experts, seq in grid:
        for strategy in STRATEGIES:
            reason = skip_reason(strategy, experts, seq)
            if reason:
                row = {"strategy": strategy, "experts": experts, "seq": seq, "note": reason}
            else:
                row, block = compiled_row(strategy, experts, seq, mlp_temp)
                times = interleaved({"block": block, "mlp": (mlp_fn, mlp_args)}, runs)
                t, base = median(times["block"]), median(times["mlp"])
                all_mlp += times["mlp"]
                row.update(median_s=t, times_s=times["block"], mlp_median_s=base, vs_mlp=t / base)
            rows.append(row)
            print(
                f"  E={experts:<4} seq={seq:<5} {strategy:<18} "
                f"{row.get('vs_mlp', float('nan')):6.2f}x the MLP  {row.get('note', '')}",
                flush=True,
            )
    mlp_median = median(all_mlp)
    print(
        f"dense MLP median over every interleaved run: {mlp_median:.3f} s; "
        f"temp {mlp_temp / 2**20:.0f} MiB"
    )
    print(table(rows, SPEED_COLUMNS))

    payload = {
        "machine": machine(),
        "tokens": TOKENS,
        "emb": EMB,
        "hidden": HIDDEN,
        "top_k": TOP_K,
        "runs": runs,
        "mlp_median_s": mlp_median,
        "mlp_times_s": all_mlp,
        "mlp_temp_mib": mlp_temp / 2**20,
        "rows": rows,
    }
    print("wrote", *save("speed" + ("_quick" if args.quick else ""), payload, plot(payload)))


if __name__ == "__main__":
    main()
