"""Grouped matmul alone, fwd+bwd: ours (tiled_gmm) vs jax.lax.ragged_dot vs the dense
matmul of the same work, on 16,384 routed rows, emb 512, hidden 1024, float32.

Each point is timed in alternation with the dense matmul (bench.common.interleaved), so
its ratio compares runs under the same load; the group sizes are a runtime argument,
as in the block (closed-over sizes would be compile-time constants XLA can exploit).
Ratios are of medians of `--runs` runs each. Each row also says how many rows the
grouped matmul computes, tile padding included, as the selector counts them
(`selector.tiles`: `tiled_gmm_rows`; ragged_dot on XLA:CPU computes every group on
every row).

    python -m bench.gmm
    python -m bench.gmm --check   # E=8, uniform, both backends compiled again, against gmm.json

`--check` compiles its points again and compares what does not depend on the machine's
load: the counted rows everywhere, the compiled temp where the JSON was written with the
jax installed here. It does not time them: a time stored on one machine is not
reproduced on another.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import (
    GMM_COLUMNS,
    arguments,
    check_stored,
    interleaved,
    log_x_axis,
    machine,
    median,
    pyplot,
    save,
    table,
)
from layers.grouped_matmul import gmm
from selector.tiles import tiled_gmm_rows

ROWS, EMB, HIDDEN = 16384, 512, 1024


def group_sizes(kind: str, experts: int) -> np.ndarray:
    if kind == "uniform":
        sizes = np.full(experts, ROWS // experts)
    elif kind == "zipf":
        z = 1.0 / np.arange(1, experts + 1)
        sizes = np.floor(z / z.sum() * ROWS).astype(int)
    else:  # every row to one expert, the rest empty
        sizes = np.zeros(experts, int)
    sizes[0] += ROWS - sizes.sum()
    return sizes.astype(np.int32)


def fwd_bwd(matmul):
    """jit(d/d(x, w) of sum(matmul(x, w, group_sizes)^2)), group sizes a runtime input."""
    return jax.jit(jax.grad(lambda x, w, gs: jnp.sum(matmul(x, w, gs) ** 2), argnums=(0, 1)))


def temp_bytes(fn, args) -> int:
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes


def counted_rows(backend: str, sizes: np.ndarray) -> int:
    """Rows the grouped matmul computes as the selector counts them: tiled_gmm's tiles,
    padding included; XLA:CPU's ragged_dot runs every group over every row."""
    if backend == "ragged_dot":
        return ROWS * len(sizes)
    return tiled_gmm_rows(tuple(int(s) for s in sizes), ROWS)


def inputs():
    """(x, the dense matmul's fwd+bwd and its arguments, its temp bytes)."""
    x = jax.random.normal(jax.random.key(0), (ROWS, EMB))
    w_dense = jax.random.normal(jax.random.key(1), (EMB, HIDDEN)) * 0.02
    one_group = jnp.asarray([ROWS], jnp.int32)
    dense = (fwd_bwd(lambda x, w, gs: x @ w), (x, w_dense, one_group))
    return x, dense, temp_bytes(*dense)


def point(x, backend: str, experts: int, kind: str):
    """(the grouped matmul's fwd+bwd and its arguments, its group sizes)."""
    w = jax.random.normal(jax.random.key(2), (experts, EMB, HIDDEN)) * 0.02
    sizes = group_sizes(kind, experts)
    fn = fwd_bwd(lambda x, w, gs, b=backend: gmm(x, w, gs, b))
    return (fn, (x, w, jnp.asarray(sizes))), sizes


def compiled_row(x, dense_temp: int, backend: str, experts: int, kind: str):
    """(a row's columns that do not depend on the machine's load, the point to time)."""
    compiled, sizes = point(x, backend, experts, kind)
    temp = temp_bytes(*compiled)
    return {
        "backend": backend,
        "experts": experts,
        "routing": kind,
        "rows_computed": counted_rows(backend, sizes),
        "temp_mib": temp / 2**20,
        "temp_vs_dense": temp / dense_temp,
    }, compiled


def check() -> int:
    """`--check`: E=8 uniform, both backends, compiled again against gmm.json."""
    x, _, dense_temp = inputs()
    fresh = [compiled_row(x, dense_temp, b, 8, "uniform")[0] for b in ("tiled_gmm", "ragged_dot")]
    key = ("backend", "experts", "routing")
    return check_stored("gmm", fresh, key, ("rows_computed",), ("temp_mib", "temp_vs_dense"))


def plot(payload: dict):
    rows = payload["rows"]
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for kind, style in (("uniform", "o-"), ("zipf", "s--"), ("all_to_one", "^:")):
        pts = [r for r in rows if r["backend"] == "tiled_gmm" and r["routing"] == kind]
        left.plot([r["experts"] for r in pts], [r["vs_dense"] for r in pts], style, label=kind)
    left.axhline(1.0, color="gray", lw=0.8, label="dense matmul (baseline)")
    left.set(
        xlabel="experts E",
        ylabel="fwd+bwd time / dense matmul",
        title="tiled_gmm (ours)",
        ylim=(0, max(1.6, max(r["vs_dense"] for r in rows if r["backend"] == "tiled_gmm") * 1.1)),
    )
    log_x_axis(left, (8, 32, 64))
    left.legend(fontsize=7)
    pts = [r for r in rows if r["backend"] == "ragged_dot"]
    right.plot([r["experts"] for r in pts], [r["vs_dense"] for r in pts], "x-", label="uniform")
    right.axhline(1.0, color="gray", lw=0.8, label="dense matmul (baseline)")
    right.set(yscale="log", xlabel="experts E", title="jax.lax.ragged_dot on XLA:CPU")
    log_x_axis(right, (8, 32, 64))
    right.legend(fontsize=7)
    fig.suptitle(f"grouped matmul, {ROWS} rows, {EMB}x{HIDDEN}, one CPU device", fontsize=10)
    return fig


def main() -> None:
    check_flag = {"action": "store_true", "help": "E=8 compiled again, compared to gmm.json"}
    args = arguments("gmm", __doc__, plot, runs={"type": int, "default": 5}, check=check_flag)
    if args is None:
        return
    if args.check:
        raise SystemExit(check())
    x, dense, dense_temp = inputs()
    rows, dense_times = [], []
    for experts in (8, 32, 64):
        for kind in ("uniform", "zipf", "all_to_one"):
            backends = ("tiled_gmm", "ragged_dot") if kind == "uniform" else ("tiled_gmm",)
            for backend in backends:
                row, timed = compiled_row(x, dense_temp, backend, experts, kind)
                times = interleaved({"point": timed, "dense": dense}, args.runs)
                t, base = median(times["point"]), median(times["dense"])
                dense_times += times["dense"]
                row.update(
                    median_s=t, times_s=times["point"], dense_median_s=base, vs_dense=t / base
                )
                rows.append(row)
                print(
                    f"  E={experts:<3} {kind:<10} {backend:<10} {t:7.3f} s "
                    f"({t / base:.2f}x the dense matmul timed beside it)",
                    flush=True,
                )
    dense_t = median(dense_times)
    print(table(rows, GMM_COLUMNS))
    payload = {
        "machine": machine(),
        "rows_routed": ROWS,
        "emb": EMB,
        "hidden": HIDDEN,
        "runs": args.runs,
        "dense_median_s": dense_t,
        "dense_times_s": dense_times,
        "dense_temp_mib": dense_temp / 2**20,
        "rows": rows,
    }
    print("wrote", *save("gmm", payload, plot(payload)))


if __name__ == "__main__":
    main()
