"""Print the README's Results section from the studies' JSON (bench/results/*.json).

python -m bench.report > /tmp/results.md   # then paste under "## Results"
"""

from __future__ import annotations

from bench.common import (
    CP_RATIO_COLUMNS,
    EXCHANGE_TIME_COLUMNS,
    GMM_COLUMNS,
    MEMORY_COLUMNS,
    SCALE_COLUMNS,
    SPEED_COLUMNS,
    TRAIN_COLUMNS,
    load,
    prediction_errors,
    table,
)


def memory_section(mem: dict) -> list[str]:
    s = mem["shape"]
    return [
        "### Memory against cp (`python -m bench.memory`)\n",
        "Per-device bytes of the block's compiled fwd+bwd (`memory_analysis()`: arguments, "
        "so the weights a device holds count, plus temporaries) on a (data=1, context=cp) "
        f"mesh, one sequence of {s['seq']} tokens (a fixed global batch), emb {s['emb']}, "
        f"hidden {s['hidden']}, E={s['experts']}, k={s['top_k']}, float32, capacity factor "
        "1.25 for the capacity path. `megablox/all_to_all` folds the context devices into "
        "the expert group (cp=1 has no group: it is the gathered program). The flatten "
        "baseline is the block the bug report describes: our megablox computation on the "
        "flattened (batch x sequence) sorted globally under plain jit. `selector` is the cost model's "
        "prediction of the same bytes.\n",
        table(mem["rows"], MEMORY_COLUMNS),
        "",
        table(mem["summary"], CP_RATIO_COLUMNS),
        "",
        "Wall time of fwd+bwd on this 2-core CPU, exchanged against gathered megablox, "
        "timed in alternation (median of each):\n",
        table(mem["timing"], EXCHANGE_TIME_COLUMNS),
        "",
        "![memory](bench/results/memory.png)\n",
    ]


def _percent(text: str) -> float:
    return float(text.rstrip("%")) / 100


def calibrate_table(cal: dict) -> tuple[str, int, int]:
    """(the per-program table: held out beside fit; programs within 15% at their worst
    held-out point; programs)."""
    fit = {r["key"]: r for r in cal["fit_summary"]}
    rows, within = [], 0
    for h in cal["holdout_summary"]:
        f = fit.get(h["key"], {})
        within += _percent(h["worst"]) <= 0.15
        rows.append(
            {
                "program": h["key"],
                "held": h["points"],
                "held_median": h["median"],
                "held_worst": h["worst"],
                "fit": f.get("points", 0),
                "fit_worst": f.get("worst", ""),
            }
        )
    columns = [
        ("program", "program"),
        ("held", "held-out points"),
        ("held_median", "held-out median"),
        ("held_worst", "held-out worst"),
        ("fit", "fit points"),
        ("fit_worst", "fit worst"),
    ]
    return table(rows, columns), within, len(rows)


def calibrate_section(cal: dict) -> list[str]:
    """One compiler's memory-model table (bench.calibration.calibrate --target ...)."""
    text, within, programs = calibrate_table(cal)
    return [
        f"{cal['compiler']}, {len(cal['rows'])} fitted and {len(cal['holdout_rows'])} "
        f"held-out programs; {within} of {programs} programs within 15% at their worst "
        "held-out point:\n",
        text,
        "",
    ]


def scale_section(sc: dict) -> list[str]:
    rows = sc["rows"]
    errors = prediction_errors(rows)
    temp = prediction_errors(rows, ("temp_error",))
    shown = [r for r in rows if r["seq"] == min(sc["seqs"])]
    return [
        "### The real models' sizes (`python -m bench.scale`)\n",
        "One MoE layer of `qwen3_next_80b_a3b` and `deepseek_v3` at their real dimensions "
        "(routing and shared experts included), bfloat16 parameters and compute, fwd+bwd, "
        "compiled from abstract inputs (nothing allocated) on up to 64 simulated CPU "
        "devices: an 8-device base split holding a fixed global batch, times cp context "
        "devices. `pred.` is the selector's error on each number. "
        f"{sum(e <= 0.15 for e in errors)} of {len(errors)} predictions are within 15% "
        f"(temp: {sum(e <= 0.15 for e in temp)} of {len(temp)}; worst {max(temp):.1%}). "
        "These are XLA:CPU programs, which keep bfloat16 weights but compute part of the "
        f"block in float32. Sequence {min(sc['seqs'])} below; both lengths are in "
        "bench/results/scale.json.\n",
        table(shown, SCALE_COLUMNS),
        "",
        "![scale](bench/results/scale.png)\n",
    ]


def train_section(tr: dict) -> list[str]:
    return [
        "### A whole training step (`python -m bench.train_memory`)\n",
        f"The example model's compiled train step (2 layers, attention and MoE, AdamW), "
        f"sequence {tr['seq']}, per device, on (data=2, context=cp): a fixed global batch of "
        "2 sequences against per_device_batch_size held at 1 (the inflation trap of the bug "
        "reports: the global batch grows with cp and every device keeps the whole "
        "sequence).\n",
        table(tr["rows"], TRAIN_COLUMNS),
        "",
        "![train memory](bench/results/train_memory.png)\n",
    ]


def speed_section(sp: dict) -> list[str]:
    return [
        "### Speed (`python -m bench.speed`)\n",
        f"fwd+bwd of the whole block on one CPU device, {sp['tokens']} tokens, emb "
        f"{sp['emb']}, hidden {sp['hidden']}, k={sp['top_k']}, as a ratio to a dense SwiGLU "
        "MLP over the same routed rows timed in alternation with each point (median of "
        f"{sp['runs']} runs each; the MLP's median over all of them: "
        f"{sp['mlp_median_s']:.2f} s).\n",
        table(sp["rows"], SPEED_COLUMNS),
        "",
        "![speed](bench/results/speed.png)\n",
    ]


def gmm_section(g: dict) -> list[str]:
    return [
        "### Grouped matmul (`python -m bench.gmm`)\n",
        f"fwd+bwd of one grouped matmul over {g['rows_routed']} rows, {g['emb']} x "
        f"{g['hidden']}, group sizes passed at run time, against the dense matmul of the "
        f"same work timed in alternation with each point (median of {g['runs']} runs each).\n",
        table(g["rows"], GMM_COLUMNS),
        "",
        "![gmm](bench/results/gmm.png)\n",
    ]


def main() -> None:
    import argparse

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    out = []
    for study, section in (
        ("memory", memory_section),
        ("calibrate_tpu", calibrate_section),
        ("calibrate_gpu", calibrate_section),
        ("calibrate_cpu_train", calibrate_section),
        ("calibrate_cpu_prefill_decode", calibrate_section),
        ("scale", scale_section),
        ("train_memory", train_section),
        ("speed", speed_section),
        ("gmm", gmm_section),
    ):
        try:
            out += section(load(study))
        except FileNotFoundError:
            out.append(f"_{study}: not run yet (`python -m bench.{study}`)_\n")
    print("\n".join(out))


if __name__ == "__main__":
    main()
