"""The block compiled for the chips users train on: XLA:TPU (v5p) and XLA:GPU (H100).

Everything here is compiled ahead of time on this CPU machine for abstract devices
(`selector.targets`; nothing runs on a TPU or GPU) and read from the compiled program:
XLA's per-device memory analysis, the Mosaic kernels in the HLO, and the FLOPs of the
expert matmuls.

1. The small block (emb 256, hidden 512, E=16, k=2, bfloat16, (fsdp=2, context=4),
   2 x 4096 tokens, fwd+bwd) for 8 v5p chips and 8 H100s: every dispatch, placement and
   grouped-matmul backend, with the selector's predicted temp beside XLA's.
   Expert-matmul FLOPs per device: the dots of the optimized HLO; for tiled_gmm, whose
   tiles run in loops with data-dependent trip counts, each loop's dot (its tile size
   read from the HLO) times the tiles the kernel's schedule runs for the rows each
   device routes to each expert (tokens routed to k distinct experts uniformly at
   random, seed 0). `vs routed` divides by 2 x 3 x (routed rows) x M x H x 3 (three
   matmuls, forward and two backward products): the dense FLOPs of the routed rows.
2. MaxText 0.2.5's comparison shape on XLA:TPU (emb 2048, hidden 512, E=64, k=8,
   bfloat16, 4 x 8192 tokens; fsdp=2 x context=cp on 2 cp chips): our gathered and
   exchanged megablox blocks with the Pallas kernels, beside MaxText's megablox block
   as measured from outside on the same compiler (outside this repository: jax 0.12.0.1 and
   libtpu 0.0.50.1; MaxText is not run here).

3. With --real: one MoE layer of Qwen3-Next-80B-A3B and of DeepSeek-V3 at their real
   dimensions (presets), gathered and exchanged, compiled for 64 v5p chips
   (fsdp=16 x context=4, sequences of 8192): that the Pallas kernels compile there.

    python -m bench.targets              # writes bench/results/targets.json and .png
    python -m bench.targets --real       # adds the real models (minutes each)
    python -m bench.targets --maxtext    # only MaxText's comparison shape, cp 1, 2, 4
    python -m bench.targets --replot
    python -m bench.targets --check      # both stacks' predictions recounted, compared
    python -m bench.targets --repredict [--into targets_jax012]   # recount into the JSON
"""

from __future__ import annotations

import math
import os
import time

import numpy as np

# Abstract TPU and GPU devices only need JAX's CPU backend (and the CUDA plugin offers its
# compile-only GPU topology only then, on a machine without a GPU driver).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from bench.common import arguments, pyplot, save, table

SMALL = dict(emb=256, hidden=512, experts=16, top_k=2, batch=2, seq=4096)
SMALL_MESH = {"fsdp": 2, "context": 4}
MAXTEXT = dict(emb=2048, hidden=512, experts=64, top_k=8, batch=4, seq=8192)
# MaxText 0.2.5's Pallas megablox block on XLA:TPU, per-device temp MiB by cp (measured
# from outside this repository with MaxText's own RoutedMoE; no script here reruns it).
MAXTEXT_TEMP_MIB = {1: 3209, 2: 1926, 4: 931}
CASES = [  # (dispatch, exchange, backend) compiled for each platform
    ("dense", "gather", "auto"),
    ("subgroup_capacity", "gather", "auto"),
    ("megablox", "gather", "pallas_megablox"),
    ("megablox", "gather", "tiled_gmm"),
    ("megablox", "gather", "ragged_dot"),
    ("megablox", "all_to_all", "pallas_megablox"),
    ("megablox", "all_to_all", "tiled_gmm"),
]
PLATFORM_BACKENDS = {
    "tpu": {"pallas_megablox", "tiled_gmm", "ragged_dot", "auto"},
    "gpu": {"tiled_gmm", "ragged_dot", "auto"},
}
HARDWARE = {"tpu": "v5p", "gpu": "h100"}
COLUMNS = [
    ("platform", "compiler"),
    ("name", "dispatch / weights"),
    ("backend", "grouped matmul"),
    ("temp_mib", "temp MiB"),
    ("predicted_temp_mib", "selector temp MiB"),
    ("kernels", "Mosaic kernels"),
    ("flops_vs_routed", "expert FLOPs / routed"),
]
MAXTEXT_COLUMNS = [
    ("cp", "cp"),
    ("chips", "chips"),
    ("gathered_mib", "ours gathered temp MiB"),
    ("exchanged_mib", "ours exchanged temp MiB"),
    ("fsdp_group_mib", "ours exchanged, fsdp in the group (expert_sequence_and_fsdp)"),
    ("maxtext_mib", "MaxText 0.2.5 temp MiB"),
]


def overrides(platform, dims, mesh, dispatch, exchange, backend) -> list[str]:
    devices = math.prod(mesh.values())
    return [
        "model=tiny",
        f"hardware={HARDWARE[platform]}",
        f"num_devices={devices}",
        "ici_fsdp_parallelism=1",
        *(f"ici_{a}_parallelism={n}" for a, n in mesh.items()),
        f"dispatch={dispatch}",
        f"expert_exchange={exchange}",
        f"gmm_backend={backend}",
        f"capacity_factor={1.25 if dispatch == 'subgroup_capacity' else -1}",
        f"base_emb_dim={dims['emb']}",
        f"base_moe_mlp_dim={dims['hidden']}",
        f"num_experts={dims['experts']}",
        f"num_experts_per_tok={dims['top_k']}",
        f"max_target_length={dims['seq']}",
        f"per_device_batch_size={dims['batch'] / devices}",
        "dtype=bfloat16",
        "param_dtype=bfloat16",
        "context_parallel_load_balance=false",
        "hardware.memory_gib=1000000",
        # MaxText's comparison holds 4 sequences on fsdp=2: two a batch shard, on purpose.
        "allow_local_batch_inflation=true",
    ]


def compile_block(platform, dims, mesh, dispatch, exchange, backend, group="auto"):
    import selector
    from checks.compiled import compile_plan
    from selector import targets

    target = targets.Target(HARDWARE[platform], math.prod(mesh.values()))
    cfg = selector.to_config(
        selector.compose(
            [*overrides(platform, dims, mesh, dispatch, exchange, backend), f"expert_group={group}"]
        )
    )
    block, program, _, seconds = compile_plan(cfg, selector.resolve(cfg, mesh), target)
    return block, program, seconds


def routed_group_sizes(tokens: int, experts: int, top_k: int, seed: int = 0) -> np.ndarray:
    """Rows per expert on one device when each token picks k distinct experts at random."""
    rng = np.random.default_rng(seed)
    picks = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
    return np.bincount(picks.reshape(-1), minlength=experts)


def tiled_rows_run(group_sizes: np.ndarray, tiles: tuple[int, ...]) -> int:
    """Rows tiled_gmm computes for these groups: its own schedule (full tiles, largest
    class first, then one masked tail tile per group that has one)."""
    from layers.grouped_matmul import tile_plan

    full, (tail, tail_E, _), _ = tile_plan(np.asarray(group_sizes, np.int32), tiles)
    return int(
        sum(tile * int(count_E.sum()) for tile, count_E, _ in full) + tail * int(tail_E.sum())
    )


def expert_flops(platform, block, program, dims) -> tuple[float, float]:
    """(expert-matmul FLOPs per device, dense FLOPs of the routed rows), fwd+bwd."""
    from layers.grouped_matmul import tile_classes

    text = program.as_text()
    tokens = dims["batch"] * dims["seq"] // 8
    rows = tokens * dims["top_k"]
    m, h = dims["emb"], dims["hidden"]
    routed = 2 * 3 * rows * m * h * 3
    if platform != "gpu" or block.spec.exchange is not None:
        return float("nan"), routed  # TPU: convolutions; exchanged: per-slot schedules
    import sys

    sys.path.insert(0, "tests")
    from hlo import dot_flops

    static = dot_flops(text, "expert_compute")
    if block.plan.strategy.value == "megablox" and block.plan.gmm_backend == "tiled_gmm":
        tiles = tile_classes(rows)
        sizes = routed_group_sizes(tokens, dims["experts"], dims["top_k"])
        # Loop bodies appear once in the HLO: count their work from the schedule instead.
        static -= dot_flops(text, "expert_compute/while")
        static += 2 * tiled_rows_run(sizes, tiles) * m * h * 3 * 3
    return static, routed


# The small block's exchange is compiled over the context devices (fsdp stays a weight
# split), the group these studies have always compiled; pinned, as `auto` weighs others.
SMALL_GROUP = "expert_and_sequence"


def small_cases():
    """(platform, dispatch, exchange, backend) of every small row, in the study's order."""
    for platform in ("tpu", "gpu"):
        for dispatch, exchange, backend in CASES:
            if backend in PLATFORM_BACKENDS[platform]:
                yield platform, dispatch, exchange, backend


def small_estimate(platform, dispatch, exchange, backend, jax_version: str = "auto"):
    """The selector's estimate of one small row, counted for `jax_version`'s compilers."""
    import selector

    cfg = selector.compose(
        [
            *overrides(platform, SMALL, SMALL_MESH, dispatch, exchange, backend),
            f"expert_group={SMALL_GROUP}",
            f"hardware.jax_version={jax_version}",
        ]
    )
    return selector.resolve(cfg, SMALL_MESH).chosen_estimate


def recount(study: str) -> dict:
    """The stored study with the small rows' predictions counted again for the jax it
    was compiled with (XLA's numbers kept)."""
    from bench.common import load

    payload = load(study)
    for row, case in zip(payload["small"], small_cases(), strict=True):
        est = small_estimate(*case, jax_version=payload["jax"])
        row["predicted_temp_mib"] = est.memory.temp / 2**20
    return payload


def check() -> int:
    """0 when both stacks' stored predictions are today's count."""
    from bench.common import check_stored

    failed = 0
    for study in ("targets", "targets_jax012"):
        failed |= check_stored(
            study,
            recount(study)["small"],
            ("platform", "name", "backend"),
            ("predicted_temp_mib",),
            rows_of=lambda payload: payload["small"],
            module="targets",
            rerun="python -m bench.targets --repredict [--into targets_jax012]",
        )
    return failed


def small_rows() -> list[dict]:
    rows = []
    for platform, dispatch, exchange, backend in small_cases():
        block, program, seconds = compile_block(
            platform, SMALL, SMALL_MESH, dispatch, exchange, backend, SMALL_GROUP
        )
        m = program.memory_analysis()
        flops, routed = expert_flops(platform, block, program, SMALL)
        est = small_estimate(platform, dispatch, exchange, backend)
        rows.append(
            {
                "platform": {"tpu": "XLA:TPU v5p x 8", "gpu": "XLA:GPU H100 x 8"}[platform],
                "name": f"{dispatch} / {exchange}",
                "backend": block.plan.gmm_backend if dispatch == "megablox" else "",
                "temp_mib": m.temp_size_in_bytes / 2**20,
                "arguments_mib": m.argument_size_in_bytes / 2**20,
                "predicted_temp_mib": est.memory.temp / 2**20,
                "kernels": program.as_text().count('custom_call_target="tpu_custom_call"'),
                "flops_vs_routed": "" if math.isnan(flops) else round(flops / routed, 3),
                "compile_s": round(seconds, 1),
            }
        )
        print(table(rows[-1:], COLUMNS).splitlines()[-1], flush=True)
    return rows


def maxtext_rows() -> list[dict]:
    rows = []
    for cp, temp in MAXTEXT_TEMP_MIB.items():
        mesh = {"fsdp": 2, "context": cp}
        row = {"cp": cp, "chips": 2 * cp, "maxtext_mib": temp}
        for key, exchange, group in (
            ("gathered_mib", "gather", "auto"),
            ("exchanged_mib", "all_to_all", "auto"),
            ("fsdp_group_mib", "all_to_all", "expert_sequence_and_fsdp"),
        ):
            if key == "exchanged_mib" and cp == 1:
                row[key] = ""  # no expert group at cp = 1 unless fsdp joins it
                continue
            _, program, _ = compile_block("tpu", MAXTEXT, mesh, "megablox", exchange, "auto", group)
            row[key] = program.memory_analysis().temp_size_in_bytes / 2**20
        rows.append(row)
        print(table(rows[-1:], MAXTEXT_COLUMNS).splitlines()[-1], flush=True)
    return rows


REAL_MESH = {"fsdp": 16, "context": 4}  # 64 v5p chips: a 4x4x4 slice
REAL_COLUMNS = [
    ("model", "model"),
    ("exchange", "weights"),
    ("kernels", "Mosaic kernels"),
    ("arguments_mib", "args MiB"),
    ("temp_mib", "temp MiB"),
    ("compile_s", "compile s"),
]


def real_layer_overrides(model: str, exchange: str) -> list[str]:
    """One MoE layer of `model` at its real size on 64 v5p chips (fsdp=16 x context=4),
    bfloat16, one sequence of 8192 tokens per fsdp shard, megablox with `exchange`."""
    return [
        f"model={model}",
        "mesh=v5p_128",
        "num_devices=64",
        "ici_fsdp_parallelism=16",
        "ici_context_parallelism=4",
        "per_device_batch_size=0.25",
        "max_target_length=8192",
        "dispatch=megablox",
        f"expert_exchange={exchange}",
        "dtype=bfloat16",
        "param_dtype=bfloat16",
        "hardware.memory_gib=1000000",
    ]


def real_rows() -> list[dict]:
    """One MoE layer of each real model (its preset: routing and shared experts too),
    bfloat16, fwd+bwd, one sequence of 8192 tokens per fsdp shard, on 64 v5p chips."""
    from flax import nnx

    import layers
    import selector
    from checks.targets import devices
    from layers.programs import compile_fwd_bwd
    from selector import targets

    target = targets.Target("v5p", 64)
    mesh = layers.make_mesh(REAL_MESH, devices(target))
    rows = []
    for model in ("qwen3_next_80b_a3b", "deepseek_v3"):
        for exchange in ("gather", "all_to_all"):
            cfg = selector.compose(real_layer_overrides(model, exchange))
            block = nnx.eval_shape(
                lambda cfg=cfg: layers.MoEBlock(
                    selector.resolve(cfg, mesh), mesh=mesh, rngs=nnx.Rngs(0)
                )
            )
            start = time.perf_counter()
            program = compile_fwd_bwd(block, 16, 8192)
            m = program.memory_analysis()
            rows.append(
                {
                    "model": model,
                    "exchange": exchange,
                    "kernels": program.as_text().count('custom_call_target="tpu_custom_call"'),
                    "arguments_mib": m.argument_size_in_bytes / 2**20,
                    "temp_mib": m.temp_size_in_bytes / 2**20,
                    "compile_s": round(time.perf_counter() - start),
                }
            )
            print(table(rows[-1:], REAL_COLUMNS).splitlines()[-1], flush=True)
    return rows


def plot(payload: dict):
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    small = payload["small"]
    labels = [f"{r['name']}\n{r['backend']}".strip() for r in small if "TPU" in r["platform"]]
    for offset, (platform, color) in enumerate((("TPU", "tab:blue"), ("GPU", "tab:orange"))):
        mine = {
            f"{r['name']}\n{r['backend']}".strip(): r for r in small if platform in r["platform"]
        }
        xs = [i + 0.4 * offset for i, lab in enumerate(labels) if lab in mine]
        ys = [mine[lab]["temp_mib"] for lab in labels if lab in mine]
        axes[0].bar(xs, ys, width=0.4, color=color, label=f"XLA:{platform}")
    axes[0].set_xticks([i + 0.2 for i in range(len(labels))])
    axes[0].set_xticklabels(labels, rotation=45, ha="right", fontsize=7)
    axes[0].set_ylabel("per-device temp MiB (fwd+bwd)")
    axes[0].set_title("Small block, (fsdp=2, context=4), compiled ahead of time")
    axes[0].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    mt = payload["maxtext"]
    cps = [r["cp"] for r in mt]
    axes[1].plot(cps, [r["maxtext_mib"] for r in mt], "k--o", label="MaxText 0.2.5 megablox")
    axes[1].plot(cps, [r["gathered_mib"] for r in mt], "-o", label="ours, gathered")
    ex = [(r["cp"], r["exchanged_mib"]) for r in mt if r["exchanged_mib"] != ""]
    axes[1].plot([c for c, _ in ex], [v for _, v in ex], "-s", label="ours, exchanged")
    folded = [(r["cp"], r["fsdp_group_mib"]) for r in mt if r.get("fsdp_group_mib")]
    if folded:
        xs, ys = [c for c, _ in folded], [v for _, v in folded]
        axes[1].plot(xs, ys, "-^", label="ours, exchanged, fsdp in the group")
    axes[1].set_xscale("log", base=2)
    axes[1].set_xticks(cps)
    axes[1].set_xticklabels([str(c) for c in cps])
    axes[1].set_xlabel("cp (fsdp=2 x context=cp chips, fixed global batch)")
    axes[1].set_ylabel("per-device temp MiB (fwd+bwd)")
    axes[1].set_title("MaxText's shape on XLA:TPU v5p")
    axes[1].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


def main() -> None:
    args = arguments(
        "targets",
        __doc__,
        plot,
        real={
            "action": "store_true",
            "help": "only compile the real models' layers for "
            "64 v5p chips (minutes each) and add them to the JSON",
        },
        into={
            "default": "targets",
            "help": "the study's name (targets_jax012 for the second stack's run)",
        },
        maxtext={
            "action": "store_true",
            "help": "only compile MaxText's comparison shape (cp 1, 2, 4) into the JSON",
        },
        check={"action": "store_true", "help": "recount both studies' predictions"},
        repredict={"action": "store_true", "help": "recount the study's predictions into it"},
    )
    if args is None:
        return
    if args.check:
        raise SystemExit(check())
    if args.repredict:
        payload = recount(args.into)
        print(table(payload["small"], COLUMNS))
        print("wrote", *save(args.into, payload, plot(payload)))
        return
    # --real and --maxtext compile one part again and keep the rest of the study.
    for part, wanted, rows, columns in (
        ("real", args.real, real_rows, REAL_COLUMNS),
        ("maxtext", args.maxtext, maxtext_rows, MAXTEXT_COLUMNS),
    ):
        if wanted:
            from bench.common import load

            payload = load(args.into)
            payload[part] = rows()
            print(table(payload[part], columns))
            print("wrote", *save(args.into, payload, plot(payload)))
            return
    import jax

    payload = {"jax": jax.__version__, "small": small_rows(), "maxtext": maxtext_rows()}
    print(table(payload["small"], COLUMNS))
    print()
    print(table(payload["maxtext"], MAXTEXT_COLUMNS))
    print("wrote", *save(args.into, payload, plot(payload)))


if __name__ == "__main__":
    main()
