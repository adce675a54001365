"""Per-device temp memory of the MoE block (fwd+bwd) against context parallelism.

For cp in {1, 2, 4, 8} on a (data=1, context=cp) mesh, one long sequence (a fixed
global batch and sequence): XLA's compiled `memory_analysis().temp_size_in_bytes` per
device for each strategy, next to the flatten baseline (what today's frameworks do)
and the selector's predicted per-device memory. It also fits the selector's memory
calibration (printed; copy it into selector/cost.py) and checks it on a held-out shape.

    python -m bench.memory
"""

from __future__ import annotations

from bench.common import (
    CP_RATIO_COLUMNS,
    MEMORY_COLUMNS,
    block_overrides,
    log_x_axis,
    machine,
    pyplot,
    save,
    table,
    use_cpu_devices,
)

use_cpu_devices(8)

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import layers  # noqa: E402
import selector  # noqa: E402
from layers.programs import compile_fwd_bwd  # noqa: E402
from selector.cost import activation_parts, problem_shape, weight_bytes  # noqa: E402

STRATEGIES = ("dense", "subgroup_capacity", "megablox")
MAIN = dict(seq=8192, emb=256, hidden=512, experts=16, top_k=2)
HOLDOUT = dict(seq=4096, emb=128, hidden=384, experts=8, top_k=2)
CAPACITY_FACTOR = 1.25


def build(strategy: str, cp: int, shape: dict):
    """(typed config, block) for one point of the study."""
    cfg = selector.compose(
        block_overrides(
            strategy,
            emb=shape["emb"],
            hidden=shape["hidden"],
            experts=shape["experts"],
            top_k=shape["top_k"],
            seq=shape["seq"],
            per_device_batch_size=1 / cp,
            capacity_factor=CAPACITY_FACTOR,
        )
    )
    mesh = layers.make_mesh({"data": 1, "context": cp})
    return selector.to_config(cfg), layers.MoEBlock(cfg, mesh=mesh, rngs=nnx.Rngs(0))


def measure(shape: dict, cps=(1, 2, 4, 8)) -> list[dict]:
    rows = []
    for cp in cps:
        for strategy in (*STRATEGIES, "flatten"):
            cfg, model = build("megablox" if strategy == "flatten" else strategy, cp, shape)
            program = compile_fwd_bwd(
                model, 1, shape["seq"], flatten_baseline=strategy == "flatten"
            )
            temp = program.memory_analysis().temp_size_in_bytes
            row = {
                "strategy": strategy,
                "cp": cp,
                "tokens_per_device": shape["seq"] // cp,
                "temp_mib": temp / 2**20,
            }
            if strategy != "flatten":
                plan = model.plan
                est = next(c.estimate for c in plan.candidates if c.strategy.value == strategy)
                p = problem_shape(cfg, plan.mesh, plan.per_device)
                row["hand_parts"] = activation_parts(plan.strategy, p)
                row["weight_bytes"] = weight_bytes(plan.strategy, p)
                row["temp_bytes"] = temp
                row["predicted_mib"] = est.memory_bytes / 2**20
                row["error"] = est.memory_bytes / temp - 1
            rows.append(row)
            print(f"  {strategy:<18} cp={cp}: {temp / 2**20:9.1f} MiB", flush=True)
    return rows


def fit_calibration(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per strategy, non-negative coefficients on (rows, masks, weights) minimising the
    relative error of the predicted temp bytes (a column that fits negative is dropped)."""
    fitted = {}
    for s in STRATEGIES:
        pts = [r for r in rows if r["strategy"] == s]
        meas = np.array([r["temp_bytes"] for r in pts], float)
        cols = {
            "rows": [r["hand_parts"]["rows"] for r in pts],
            "masks": [r["hand_parts"]["masks"] for r in pts],
            "weights": [r["weight_bytes"] for r in pts],
        }
        names = [k for k, v in cols.items() if any(v)]
        while True:
            design = np.array([cols[k] for k in names], float).T / meas[:, None]
            coef, *_ = np.linalg.lstsq(design, np.ones(len(pts)), rcond=None)
            if (coef >= 0).all() or len(names) == 1:
                break
            names.pop(int(np.argmin(coef)))
        fitted[s] = {
            k: round(float(dict(zip(names, coef, strict=True)).get(k, 0.0)), 3) for k in cols
        }
    return fitted


def main() -> None:
    print("memory study: fwd+bwd temp MiB per device, (data=1, context=cp), one sequence")
    rows = measure(MAIN)
    holdout = measure(HOLDOUT, cps=(1, 4))
    by = {(r["strategy"], r["cp"]): r for r in rows}
    summary = []
    for s in (*STRATEGIES, "flatten"):
        r1, r4 = by[(s, 1)], by[(s, 4)]
        summary.append(
            {
                "strategy": s,
                "cp1": r1["temp_mib"],
                "cp4": r4["temp_mib"],
                "ratio": r4["temp_mib"] / r1["temp_mib"],
            }
        )
    print(table(rows, MEMORY_COLUMNS))
    print("\nheld-out shape", HOLDOUT)
    print(table(holdout, MEMORY_COLUMNS))
    fitted = fit_calibration(rows)
    print("\nfitted MEMORY_CALIBRATION (selector/cost.py):", fitted)
    print("\ncp=4 / cp=1")
    print(table(summary, CP_RATIO_COLUMNS))

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for s in (*STRATEGIES, "flatten"):
        pts = [r for r in rows if r["strategy"] == s]
        ax.plot([r["cp"] for r in pts], [r["temp_mib"] for r in pts], "o-", label=s)
        if s != "flatten":
            ax.plot(
                [r["cp"] for r in pts],
                [r["predicted_mib"] for r in pts],
                "x:",
                color=ax.lines[-1].get_color(),
                label=f"{s} (selector)",
            )
    ax.set(
        yscale="log",
        xlabel="context parallelism cp",
        ylabel="temp MiB per device (fwd+bwd)",
        title=f"MoE block memory vs cp (seq {MAIN['seq']}, E={MAIN['experts']})",
    )
    log_x_axis(ax, (1, 2, 4, 8))
    ax.legend(fontsize=7)
    paths = save(
        "memory",
        {
            "machine": machine(),
            "shape": MAIN,
            "holdout_shape": HOLDOUT,
            "rows": rows,
            "holdout": holdout,
            "summary": summary,
            "fitted_calibration": fitted,
        },
        fig,
    )
    print("\nwrote", *paths)


if __name__ == "__main__":
    main()
