"""How much of a candidate's measured step is its grouped matmul's dots, and how much is
the rest, against what the count says of each. Dev set only: the judge set is never
read for terms.

Each megablox candidate of a dev config (`bench.picks.DEV`) is built twice: as the
layers build it, and with tiled_gmm's tile dots (`layers.grouped_matmul._dot` and
`_xt_dy`) replaced by a rank-one stand-in of the same output shape, which keeps every
slice, loop and in-place write of the tile walks but does almost none of their FLOPs.
Both are timed in interleaved rounds (`checks.measured.interleaved`, each timed step
after an untimed step of itself). The difference of their medians is what the dots cost
in place; the stand-in's median is everything else. The count's parts for the same
candidate: its tile visits' dots priced on the gmm curves, and the rest of its time
(other dots, memory, network, overhead).

    python -m bench.calibration.dot_split 5 10      # dev configs 5 and 10 (about 2 minutes each)
    python -m bench.calibration.dot_split           # every dev config
    python -m bench.calibration.dot_split --score     # the stored timings, counted by today's selector
    python -m bench.calibration.dot_split --replot
"""

from __future__ import annotations

import sys

from bench.common import use_cpu_devices

if __name__ == "__main__" and not {"--replot", "--score"} & set(sys.argv):
    use_cpu_devices(8)

from bench.common import arguments, median, pyplot, save, table  # noqa: E402

STUDY = "dot_split_cpu_dev"
ROUNDS = 5
TILE_KINDS = ("tile", "tile_input_grad", "tile_weight_grad")


def rank_one_dot(a, b, transpose_b: bool):
    """Stands in for `layers.grouped_matmul._dot`: a (rows, N) product of the tile's
    first column and the weight's first row (or column), so the output still depends on
    both operands and nothing is folded away."""
    import jax.numpy as jnp

    row = b[:, :1].T if transpose_b else b[:1, :]
    return (a[:, :1].astype(jnp.float32) * row.astype(jnp.float32)).astype(a.dtype)


def rank_one_xt_dy(x, dy):
    """Stands in for `layers.grouped_matmul._xt_dy`: a (K, N) float32 outer product of
    the tile's first rows."""
    import jax.numpy as jnp

    return x[:1, :].T.astype(jnp.float32) * dy[:1, :].astype(jnp.float32)


def without_dots(config):
    """(the jitted step, its arguments) of `config` with the stand-in dots, compiled
    while they are in place."""
    import jax

    from checks.measured import _step
    from layers import grouped_matmul

    real = grouped_matmul._dot, grouped_matmul._xt_dy
    grouped_matmul._dot, grouped_matmul._xt_dy = rank_one_dot, rank_one_xt_dy
    try:
        fn, args = _step(config, config.dispatch, config.expert_exchange)
        jax.block_until_ready(fn(*args))  # traced and compiled with the stand-ins
    finally:
        grouped_matmul._dot, grouped_matmul._xt_dy = real
    return fn, args


def counted(config) -> tuple[float, float]:
    """(seconds of the tile visits' dots, seconds of the rest) the count gives."""
    import selector
    from selector.timing import matmul_rate

    est = selector.resolve(config).chosen_estimate
    hw = config.hardware
    tiles = sum(
        n * f / matmul_rate(f, hw, kind, m) for kind, f, n, m in est.work.dots if kind in TILE_KINDS
    )
    return tiles, est.time_s - tiles


def counted_row(row: dict, dots: float, other: float) -> dict:
    """`row` (its measured columns) with the counted columns of `dots` and `other`
    seconds."""
    return {
        **row,
        "counted_dots_ms": dots * 1e3,
        "counted_rest_ms": other * 1e3,
        "dots_ratio": dots * 1e3 / max(row["dots_ms"], 1e-6),
        "rest_ratio": other * 1e3 / row["rest_ms"],
    }


def recounted(rows: list[dict]) -> list[dict]:
    """The stored rows with their counted columns from today's selector (the timings
    depend on the layers only)."""
    from bench import picks

    variants = {  # each dev config's candidates, made once however many rows it has
        i: picks.variants(picks.config_of(picks.DEV[i])) for i in {row["dev"] for row in rows}
    }
    return [counted_row(row, *counted(variants[row["dev"]][row["candidate"]])) for row in rows]


def split_point(index: int) -> list[dict]:
    """One dev config's megablox candidates, each timed with and without its dots."""
    from bench import picks
    from checks.measured import _step, interleaved

    point = picks.DEV[index]
    forced = {n: c for n, c in picks.variants(picks.config_of(point)).items() if n != "dense"}
    fns = {}
    for name, config in forced.items():
        fns[name] = _step(config, config.dispatch, config.expert_exchange)
        fns[name + " without dots"] = without_dots(config)
    times = interleaved(fns, ROUNDS, settle=1)
    rows = []
    for name, config in forced.items():
        whole, rest = median(times[name]), median(times[name + " without dots"])
        measured = {
            "dev": index,
            "config": picks.label(point),
            "candidate": name,
            "measured_ms": whole * 1e3,
            "dots_ms": (whole - rest) * 1e3,
            "rest_ms": rest * 1e3,
        }
        rows.append(counted_row(measured, *counted(config)))
        print(rows[-1], flush=True)
    return rows


COLUMNS = [
    ("dev", "dev"),
    ("candidate", "candidate"),
    ("measured_ms", "measured ms"),
    ("dots_ms", "dots ms"),
    ("counted_dots_ms", "counted"),
    ("dots_ratio", "counted / measured"),
    ("rest_ms", "rest ms"),
    ("counted_rest_ms", "counted"),
    ("rest_ratio", "counted / measured"),
]


def plot(payload: dict):
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
    for ax, part in zip(axes, ("dots", "rest"), strict=True):
        for kind, color in (("gather", "C0"), ("all_to_all", "C1")):
            rows = [r for r in payload["rows"] if kind in r["candidate"]]
            ax.loglog(
                [r[f"{part}_ms"] for r in rows],
                [r[f"counted_{part}_ms"] for r in rows],
                "o",
                color=color,
                label="gathered" if kind == "gather" else "exchanged",
            )
        values = [r[k] for r in payload["rows"] for k in (f"{part}_ms", f"counted_{part}_ms")]
        lo, hi = min(values) * 0.8, max(values) * 1.25
        ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8)
        ax.set(
            xlabel=f"measured {part} ms (8 simulated CPU devices)",
            ylabel=f"counted {part} ms",
            title="tiled_gmm's dots" if part == "dots" else "everything else",
        )
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def main() -> int:
    args = arguments(
        STUDY,
        __doc__,
        plot,
        configs={"type": int, "nargs": "*", "metavar": "N", "help": "dev configs (default: all)"},
        score={"action": "store_true", "help": "count the stored timings again, timing nothing"},
    )
    if args is None:
        return 0
    from bench import picks
    from bench.common import load, machine

    if args.score:
        payload = load(STUDY)
        payload["rows"] = recounted(payload["rows"])
    else:
        indices = args.configs or range(len(picks.DEV))
        rows = [row for i in indices for row in split_point(i)]
        payload = {"rounds": ROUNDS, "settle": 1, "machine": machine(), "rows": rows}
    rows = payload["rows"]
    print(table(rows, COLUMNS))
    print("wrote", *save(STUDY, payload, plot(payload)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
