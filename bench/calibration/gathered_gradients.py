"""What XLA:TPU holds for a gathered training block's weight gradients.

The block gathers its expert weights over the batch axes, multiplies, and in the
backward reduce-scatters their gradients. The memory model counted the three gathered
gradients whole beside the three gathered weights on XLA:TPU, a cover that held on the
judge set's 64-chip programs. This study compiles small gathered training blocks ahead
of time for v5p (megablox, bfloat16, fsdp over the chips, optionally a data axis), each
in its own process with `XLA_FLAGS=--xla_dump_to`, from a base (E 128, M 2,048, H 768,
k 8, 2,048 tokens a device, Qwen3-30B-A3B's layer dims) with one knob moved at a time,
and sets XLA's temp beside the gathered weights W (the three matrices), the live bytes at
the peak, the buffer assignment's temp allocations and the selector's count.

Read from it (both libtpu releases the same): where the gather is an all-gather (fewer
than 64 chips, or a data axis beside fsdp) the block's temp is the gathered weights and
its activations, no gradient beside them; where the gather spans a whole slice of 64
chips or more (an all-reduce, `Traits.all_reduce_gather_devices`) it holds about 1.1 to
1.2 W more, which the three gradients count. The traits `all_gather_gradients_held`
(0 on XLA:TPU) and `gathered_gradients_held` (1) hold the law; a test reads the stored
rows. Every point is on one slice: across slices the count keeps the three. None of these
programs is in a judge set (the real presets' layers of `memory_holdout`, the steps of
`step_compile` and MaxText's steps).

    python -m bench.calibration.gathered_gradients
    python -m bench.calibration.gathered_gradients --into gathered_gradients_jax012   # jax 0.12
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from bench.common import dumped_worker_row, save, stack, table

STUDY = "gathered_gradients"
MIB = 2**20
BASE = {"chips": 16, "data": 1, "E": 128, "M": 2048, "H": 768, "k": 8, "tokens": 2048}


def _moved(**knobs) -> dict:
    return {**BASE, **knobs}


# (name, shape): the chips through the all-reduce's threshold, a data axis beside fsdp
# (the gather then spans part of the slice), and the shape knobs at 16 and 64 chips.
POINTS = (
    *((f"chips{c}", _moved(chips=c)) for c in (8, 16, 32, 64, 128)),
    ("chips64_data4", _moved(chips=64, data=4)),
    ("chips64_data2", _moved(chips=64, data=2)),
    ("chips128_data2", _moved(chips=128, data=2)),
    *(
        (f"chips{c}_{name}", _moved(chips=c, **knob))
        for c in (16, 64)
        for name, knob in (
            ("H1536", {"H": 1536}),
            ("E64", {"E": 64}),
            ("tokens8192", {"tokens": 8192}),
        )
    ),
)
COLUMNS = [
    ("point", "point"),
    ("all_reduce", "gathered by all-reduce"),
    ("weights_mib", "gathered weights W MiB"),
    ("live_mib", "live at the peak MiB"),
    ("alloc_mib", "temp allocated MiB"),
    ("temp_mib", "XLA temp MiB"),
    ("temp_over_weights", "temp / W"),
    ("count_mib", "count MiB"),
    ("error", "count error"),
]


def overrides(shape: dict) -> list[str]:
    return [
        "model=qwen3_30b_a3b",  # its routing and norms; every size below is overridden
        "hardware=v5p",
        f"num_devices={shape['chips']}",
        "num_slices=1",
        f"ici_fsdp_parallelism={shape['chips'] // shape['data']}",
        f"ici_data_parallelism={shape['data']}",
        "ici_context_parallelism=1",
        "per_device_batch_size=1",
        f"max_target_length={shape['tokens']}",
        "mode=train",
        "dispatch=megablox",
        "expert_exchange=gather",
        "dtype=bfloat16",
        "param_dtype=bfloat16",
        "hardware.memory_gib=1000000",
        f"num_experts={shape['E']}",
        f"base_emb_dim={shape['M']}",
        f"base_moe_mlp_dim={shape['H']}",
        f"num_experts_per_tok={shape['k']}",
    ]


def worker(index: int) -> None:
    import selector
    from bench.calibration.dump_peak import block_peak
    from checks.compiled import compile_plan
    from selector import targets
    from selector.memory_model import gathers_by_all_reduce, routed_weight_elements
    from selector.problem import problem_shape
    from selector.traits import traits

    name, shape = POINTS[index]
    cfg = selector.to_config(selector.compose(overrides(shape)))
    plan = selector.resolve(cfg)
    p = problem_shape(cfg, plan.mesh, plan.placement)
    _, program, _, _ = compile_plan(cfg, plan, targets.Target("v5p", plan.mesh.num_devices))
    temp = program.memory_analysis().temp_size_in_bytes
    fields, _ = block_peak(
        Path(os.environ["GATHERED_GRADIENTS_DUMP"]), temp, plan.chosen_estimate.memory.temp
    )
    weights = routed_weight_elements(plan.strategy, p) * p.xb
    row = {
        "point": name,
        **shape,
        "all_reduce": gathers_by_all_reduce(traits("tpu", p.release), plan.mesh, p.gathered),
        "weights_mib": weights / MIB,
        "temp_over_weights": temp / weights,
    }
    print(json.dumps({**row, **fields}))


def plot(payload: dict):
    from bench.common import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    rows = [r for r in payload["rows"] if r.get("status") == "ok"]
    for all_reduce, marker in ((False, "o"), (True, "s")):
        picked = [r for r in rows if r["all_reduce"] is all_reduce]
        ax.scatter(
            [r["weights_mib"] for r in picked],
            [r["temp_mib"] / r["weights_mib"] for r in picked],
            marker=marker,
            label="gathered by all-reduce" if all_reduce else "gathered by all-gather",
        )
    ax.set(xscale="log", xlabel="gathered weights W (MiB)", ylabel="XLA temp / W")
    ax.set_title(f"gathered training blocks on v5p ({payload['stack']})", fontsize=9)
    ax.legend(fontsize=8)
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--into", default=STUDY, help="the result file's name")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.worker)
        return
    rows = []
    for index, (name, _) in enumerate(POINTS):
        cmd = [sys.executable, "-m", "bench.calibration.gathered_gradients", "--worker", str(index)]
        env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
        row = dumped_worker_row(name, cmd, 900, "GATHERED_GRADIENTS_DUMP", env=env)
        rows.append(row)
        print(row.get("point"), row.get("error", row.get("status")), flush=True)
    print(table([r for r in rows if r.get("status") == "ok"], COLUMNS))
    payload = {"study": STUDY, "stack": stack(), "rows": rows}
    save(args.into, payload, plot(payload))


if __name__ == "__main__":
    main()
