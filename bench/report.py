"""Print the README's Results section from the studies' JSON (bench/results/*.json).

python -m bench.report > /tmp/results.md   # then paste under "## Results"
"""

from __future__ import annotations

from bench.common import (
    CP_RATIO_COLUMNS,
    GMM_COLUMNS,
    MEMORY_COLUMNS,
    SPEED_COLUMNS,
    load,
    table,
)


def memory_section(mem: dict) -> list[str]:
    shape, hold = mem["shape"], mem["holdout_shape"]
    rows = [{**r, "error": f"{r['error']:+.1%}" if "error" in r else ""} for r in mem["rows"]]
    worst = max(abs(r["error"]) for r in mem["rows"] if "error" in r)
    hworst = max(abs(r["error"]) for r in mem["holdout"] if "error" in r)
    return [
        "### Memory against cp (`python -m bench.memory`)\n",
        "Per-device temp memory of the block's compiled fwd+bwd "
        "(`memory_analysis().temp_size_in_bytes`) on a (data=1, context=cp) mesh: one sequence "
        f"of {shape['seq']} tokens (a fixed global batch and sequence), emb {shape['emb']}, "
        f"hidden {shape['hidden']}, E={shape['experts']}, k={shape['top_k']}, capacity factor "
        "1.25 for the capacity path. `flatten` is today's frameworks' block: the same megablox "
        "computation with the same grouped matmul, but on (batch x sequence) flattened and "
        "sorted globally under plain jit, so the difference is the sharding alone. `selector` is "
        "the selector's predicted per-device memory for the same point.\n",
        table(rows, MEMORY_COLUMNS),
        "",
        table(mem["summary"], CP_RATIO_COLUMNS),
        "",
        "The selector's memory coefficients (`selector/cost.py`, `MEMORY_CALIBRATION`) are "
        f"fitted on this study; its worst error here is {worst:.1%}. On a held-out shape "
        f"(seq {hold['seq']}, emb {hold['emb']}, hidden {hold['hidden']}, E={hold['experts']}; "
        f"cp 1 and 4) the worst error is {hworst:.1%}.\n",
        "![memory](bench/results/memory.png)\n",
    ]


def speed_section(spd: dict) -> list[str]:
    return [
        "### Speed (`python -m bench.speed`)\n",
        "fwd+bwd of the whole block (router, sort, grouped matmul, unsort and combine "
        f"included) on one CPU device, {spd['tokens']} tokens per step, emb {spd['emb']}, "
        f"hidden {spd['hidden']}, k={spd['top_k']}, as a ratio to a dense SwiGLU MLP over the "
        f"same {spd['tokens'] * spd['top_k']} rows measured in the same process (its median over "
        f"both sets of runs: {spd['mlp_median_s']:.2f} s; temp {spd['mlp_temp_mib']:.0f} MiB). "
        "Points where a strategy would run for minutes are skipped and marked.\n",
        table(spd["rows"], SPEED_COLUMNS),
        "",
    ]


def gmm_section(gmm: dict) -> list[str]:
    return [
        "### Grouped matmul (`python -m bench.gmm`)\n",
        f"fwd+bwd of one grouped matmul over {gmm['rows_routed']} routed rows, {gmm['emb']} x "
        f"{gmm['hidden']}, against the dense matmul of the same work (median "
        f"{gmm['dense_median_s']:.3f} s, temp {gmm['dense_temp_mib']:.0f} MiB).\n",
        table(gmm["rows"], GMM_COLUMNS),
        "\n![gmm](bench/results/gmm.png)",
    ]


def main() -> None:
    parts = memory_section(load("memory")) + speed_section(load("speed")) + gmm_section(load("gmm"))
    print("\n".join(parts))


if __name__ == "__main__":
    main()
