"""Why the grouped matmul walks its tiles two ways: each walk tried on the other's job,
on XLA:CPU (one device, float32).

The forward and the input gradient visit each tile class in one flat loop over every
expert's tiles (the row tiles of the output are written in place). The weight gradient
visits expert by expert and sums each expert's tiles in one float32 (K, N) carry,
written once. One walk for all would be either (a) the weight gradient on the flat
walk, adding each tile's x^T dy into dw[e] (a (K, N) read and write per tile), or (b)
the forward on the per-expert walk (a loop per expert with rows, a cond per smaller
class, the tail in a 0-or-1-trip loop: the fastest of the variants tried).
This times both against the library's walks on the same rows (uniform routing, seed
0; the last two shapes are few rows against many experts' weights, as at decode),
interleaved, medians of `--runs`; each pair's results agree exactly (checked).

    python -m bench.walkers       # writes bench/results/walkers.json and .png
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bench.common import arguments, interleaved, machine, median, pyplot, save, table

# The alternative walks are built from the library's own pieces (its flat schedule, tail
# window and tile products, private there), so only the walk differs from what it runs.
from layers.grouped_matmul import (
    _dot,
    _flat_schedule,
    _tail_window,
    _xt_dy,
    tile_classes,
    tile_plan,
    tiled_forward,
    tiled_weight_grad,
)

# (routed rows, K, N, experts)
SHAPES = [
    (8192, 256, 512, 16),
    (8192, 1024, 1024, 16),
    (16384, 512, 512, 64),
    # Few rows against many experts' big weights: a decode step, a small batch.
    (64, 1024, 512, 256),
    (512, 2048, 1024, 256),
]


def flat_weight_grad(x_RK, dy_RN, group_sizes_E):
    """The weight gradient on the forward's walk: per tile class a flat loop over every
    expert's tiles, each tile's x^T dy added into dw[e] (the masked tail as well)."""
    rows, k = x_RK.shape
    num_experts = group_sizes_E.shape[0]
    full, (tail, tail_E, tail_first_E), ends_E = tile_plan(group_sizes_E, tile_classes(rows))

    def add_tile(dw, e, start, size, keep=None):
        x = lax.dynamic_slice_in_dim(x_RK, start, size)
        x = x if keep is None else jnp.where(keep, x, 0)
        g = _xt_dy(x, lax.dynamic_slice_in_dim(dy_RN, start, size))
        return lax.dynamic_update_index_in_dim(
            dw, lax.dynamic_index_in_dim(dw, e, 0, keepdims=False) + g, e, 0
        )

    dw = jnp.zeros((num_experts, k, dy_RN.shape[1]), jnp.float32)
    for tile, count_E, first_E in full:
        expert, within, total = _flat_schedule(count_E, rows // tile + 1)

        def body(i, dw, tile=tile, first_E=first_E, expert=expert, within=within):
            e = expert[i]
            return add_tile(dw, e, first_E[e] + within[i] * tile, tile)

        dw = lax.fori_loop(0, total, body, dw)
    expert, _, total = _flat_schedule(tail_E, num_experts)

    def tail_body(i, dw):
        e = expert[i]
        start, keep = _tail_window(tail_first_E[e], ends_E[e], rows, tail)
        return add_tile(dw, e, start, tail, keep)

    return lax.fori_loop(0, total, tail_body, dw).astype(x_RK.dtype)


def per_expert_forward(x_RK, w_EKN, group_sizes_E):
    """The forward on the weight gradient's walk: expert by expert (experts without rows
    skipped), its full tiles of the largest class in a loop, each smaller class once
    under a cond, the masked tail last in a loop of 0 or 1 trips (under a cond it was
    5x slower at decode), each tile's rows written in place."""
    rows = x_RK.shape[0]
    num_experts = group_sizes_E.shape[0]
    full, (tail, tail_E, tail_first_E), ends_E = tile_plan(group_sizes_E, tile_classes(rows))
    has_rows_E = group_sizes_E > 0
    busy = jnp.nonzero(has_rows_E, size=num_experts, fill_value=0)[0]

    def write(y, e, start, size, keep=None):
        out = _dot(lax.dynamic_slice_in_dim(x_RK, start, size), w_EKN[e], False)
        if keep is not None:
            out = jnp.where(keep, out, lax.dynamic_slice_in_dim(y, start, size))
        return lax.dynamic_update_slice_in_dim(y, out, start, 0)

    def expert_body(i, y):
        e = busy[i]
        (big, big_E, big_first_E), *once = full
        y = lax.fori_loop(0, big_E[e], lambda j, y: write(y, e, big_first_E[e] + j * big, big), y)
        for tile, count_E, first_E in once:
            y = lax.cond(
                count_E[e] > 0,
                lambda y, tile=tile, first_E=first_E: write(y, e, first_E[e], tile),
                lambda y: y,
                y,
            )

        def tail_tile(_, y):
            start, keep = _tail_window(tail_first_E[e], ends_E[e], rows, tail)
            return write(y, e, start, tail, keep)

        return lax.fori_loop(0, tail_E[e], tail_tile, y)

    y = jnp.zeros((rows, w_EKN.shape[2]), x_RK.dtype)
    return lax.fori_loop(0, jnp.sum(has_rows_E), expert_body, y)


def plot(payload: dict):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.2))
    rows = payload["rows"]
    at = np.arange(len(rows))
    for offset, key, colour, label in (
        (-0.2, "wgrad_ratio", "tab:orange", "(a) weight gradient on the flat walk"),
        (0.2, "fwd_ratio", "tab:blue", "(b) forward on the per-expert walk"),
    ):
        ax.bar(at + offset, [r[key] for r in rows], width=0.4, color=colour, label=label)
    ax.axhline(1.0, color="gray", lw=0.8, label="the library's walk for that job")
    ax.set_xticks(at, [r["shape"] for r in rows], fontsize=8)
    top = max(max(r["wgrad_ratio"], r["fwd_ratio"]) for r in rows)
    ax.set_ylim(0, top * 1.45)  # room for the legend above the bars
    ax.set(ylabel="time / the library's walk's time", title="one walk for both jobs, either way")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    return fig


COLUMNS = [
    ("shape", "rows x K x N, E"),
    ("wgrad_ms", "weight grad: per-expert walk ms"),
    ("wgrad_flat_ms", "on the flat walk ms"),
    ("wgrad_ratio", "(a) ratio"),
    ("fwd_ms", "forward: flat walk ms"),
    ("fwd_per_expert_ms", "on the per-expert walk ms"),
    ("fwd_ratio", "(b) ratio"),
]


def main() -> None:
    args = arguments("walkers", __doc__, plot, runs={"type": int, "default": 7})
    if args is None:
        return
    rows = []
    for n, k, h, experts in SHAPES:
        x = jax.random.normal(jax.random.key(0), (n, k), jnp.float32)
        dy = jax.random.normal(jax.random.key(1), (n, h), jnp.float32)
        ids = jax.random.randint(jax.random.key(2), (n,), 0, experts)
        gs = jnp.bincount(ids, length=experts).astype(jnp.int32)
        w = jax.random.normal(jax.random.key(3), (experts, k, h), jnp.float32) * 0.05
        jobs = {
            "wgrad": (jax.jit(lambda x, dy, gs: tiled_weight_grad(x, dy, gs)), (x, dy, gs)),
            "wgrad_flat": (jax.jit(flat_weight_grad), (x, dy, gs)),
            "fwd": (jax.jit(lambda x, w, gs: tiled_forward(x, (w,), gs)[0]), (x, w, gs)),
            "fwd_per_expert": (jax.jit(per_expert_forward), (x, w, gs)),
        }
        for a, b in (("wgrad", "wgrad_flat"), ("fwd", "fwd_per_expert")):
            np.testing.assert_array_equal(
                np.asarray(jobs[a][0](*jobs[a][1])), np.asarray(jobs[b][0](*jobs[b][1]))
            )
        times = {name: median(t) for name, t in interleaved(jobs, args.runs).items()}
        rows.append(
            {
                "shape": f"{n} x {k} x {h}, E={experts}",
                **{f"{name}_ms": round(t * 1e3, 1) for name, t in times.items()},
                "wgrad_ratio": round(times["wgrad_flat"] / times["wgrad"], 2),
                "fwd_ratio": round(times["fwd_per_expert"] / times["fwd"], 2),
            }
        )
        print(table(rows[-1:], COLUMNS), flush=True)
    print(table(rows, COLUMNS))
    payload = {"machine": machine(), "runs": args.runs, "rows": rows}
    print("wrote", *save("walkers", payload, plot(payload)))


if __name__ == "__main__":
    main()
