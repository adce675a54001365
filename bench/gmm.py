"""Grouped matmul alone, fwd+bwd: ours (tiled_gmm) vs jax.lax.ragged_dot vs the dense
matmul of the same work, on 16,384 routed rows, emb 512, hidden 1024, float32.

    python -m bench.gmm
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import GMM_COLUMNS, load, log_x_axis, machine, median_time, pyplot, save, table
from layers.grouped_matmul import gmm

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
    return jax.jit(jax.grad(lambda x, w: jnp.sum(matmul(x, w) ** 2), argnums=(0, 1)))


def timed(fn, args, runs):
    temp = fn.lower(*args).compile().memory_analysis().temp_size_in_bytes
    t, times = median_time(fn, *args, runs=runs)
    return t, times, temp


def plot(payload: dict):
    rows = payload["rows"]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for backend, kind, style in (
        ("tiled_gmm", "uniform", "o-"),
        ("tiled_gmm", "zipf", "s--"),
        ("tiled_gmm", "all_to_one", "^:"),
        ("ragged_dot", "uniform", "x-"),
    ):
        pts = [r for r in rows if r["backend"] == backend and r["routing"] == kind]
        ax.plot(
            [r["experts"] for r in pts],
            [r["vs_dense"] for r in pts],
            style,
            label=f"{backend}, {kind}",
        )
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set(
        yscale="log",
        xlabel="experts E",
        ylabel="fwd+bwd time / dense matmul",
        title=f"grouped matmul, {ROWS} rows, {EMB}x{HIDDEN}, one CPU device",
    )
    log_x_axis(ax, (8, 32, 64))
    ax.legend(fontsize=7)
    return fig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--replot", action="store_true", help="redraw the PNG from the JSON")
    args = parser.parse_args()
    if args.replot:
        print("wrote", *save("gmm", load("gmm"), plot(load("gmm"))))
        return
    x = jax.random.normal(jax.random.key(0), (ROWS, EMB))
    w_dense = jax.random.normal(jax.random.key(1), (EMB, HIDDEN)) * 0.02
    dense_t, dense_times, dense_temp = timed(fwd_bwd(lambda x, w: x @ w), (x, w_dense), args.runs)
    print(f"dense matmul of the same work: {dense_t:.3f} s", flush=True)
    rows = []
    for experts in (8, 32, 64):
        w = jax.random.normal(jax.random.key(2), (experts, EMB, HIDDEN)) * 0.02
        for kind in ("uniform", "zipf", "all_to_one"):
            gs = jnp.asarray(group_sizes(kind, experts))
            backends = ("tiled_gmm", "ragged_dot") if kind == "uniform" else ("tiled_gmm",)
            for backend in backends:
                fn = fwd_bwd(lambda x, w, gs=gs, b=backend: gmm(x, w, gs, b))
                t, times, temp = timed(fn, (x, w), args.runs)
                rows.append(
                    {
                        "backend": backend,
                        "experts": experts,
                        "routing": kind,
                        "median_s": t,
                        "times_s": times,
                        "vs_dense": t / dense_t,
                        "temp_mib": temp / 2**20,
                        "temp_vs_dense": temp / dense_temp,
                    }
                )
                print(
                    f"  E={experts:<3} {kind:<10} {backend:<10} {t:7.3f} s "
                    f"({t / dense_t:.2f}x dense)",
                    flush=True,
                )
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
