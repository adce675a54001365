"""The picks on the first chip lent: every candidate the selector lists for six MoE
layers timed on this machine's accelerator, each pick's regret, the seed's MFU
comparison, and the grouped matmuls side by side. One JSON, in under 8 minutes.

Run it as it is on one H200 (or any GPU) or one TPU host; it reads the devices jax
sees, takes the hardware preset that matches them (h200 on GPU, v5p on TPU, or
`--hardware`) and lays every config out over all of them (context parallelism over
the devices when there are several, one device otherwise):

- six layers: the seed's Qwen3-Next layer at sequence 8,192 (with a dense MLP of the
  same active FLOPs beside it: the bug report's 29.01% against 27.82% MFU on v5p), a
  Qwen3-30B-A3B layer, a Mixtral layer, a DeepSeek-V3-shaped layer (64 of its 256
  experts, to fit one chip), few tokens over many experts (prefill), and k=1;
- each candidate (every dispatch and placement the layers can run, dense where
  E / k <= 16) compiled once and timed ROUNDS rounds interleaved (checks.measured);
  its median, its counted estimate and parts, its MFU (the layer's useful FLOPs, routed
  rows only, over time x the preset's peak), and the regret of the selector's pick
  (its median over the fastest's);
- on GPU, the grouped matmul alone (fwd+bwd): tokamax's ragged_dot where tokamax is
  installed (its default kernel, and its Triton one), tiled_gmm, jax.lax.ragged_dot and
  the dense matmul of the same rows;
- first, the machine constants the counted time prices with, measured on the chip
  beside the preset's published figures: a large bf16 matmul's TFLOP/s, HBM bandwidth
  (one fused elementwise pass, bytes read and written), a program call, a kernel launch
  and a loop trip (bench.calibration.machine's microbenchmarks).

The budget (`--budget`, seconds) stops it starting another config; the JSON is
rewritten after each step, so what ran is kept if the chip is taken back mid-way, and a
layer that fails is recorded with its error and the next one runs. `--dry` runs the same code on this machine's CPU devices at sizes scaled down
(the suite runs it: tests/bench/test_on_device.py), so the script is known to work before a
chip is lent.

    python -m bench.on_device                  # on the chip: bench/results/on_device_<hw>.json
    python -m bench.on_device --dry --out /tmp/dry.json
    python -m bench.on_device --rescore bench/results/on_device_h200.json   # no chip
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import RESULTS, median

ROUNDS = 5
BUDGET_S = 420.0  # leaves room in 8 minutes for start-up and the grouped matmuls
DENSE_MAX_RATIO = 16


@dataclass(frozen=True)
class Layer:
    """One MoE layer to time: (emb, hidden, experts, k, sequence, mode)."""

    name: str
    emb: int
    hidden: int
    experts: int
    top_k: int
    seq: int
    mode: str = "train"
    mlp_beside: bool = False  # time a dense MLP of the same active FLOPs too


LAYERS = (
    Layer("qwen3-next seed (seq 8192)", 2048, 512, 512, 10, 8192, mlp_beside=True),
    Layer("qwen3-30b-a3b", 2048, 768, 128, 8, 4096),
    Layer("mixtral-8x7b", 4096, 14336, 8, 2, 4096),
    Layer("deepseek-v3 shape, 64 experts", 7168, 2048, 64, 8, 2048),
    Layer("few tokens, many experts (prefill)", 2048, 768, 128, 8, 512, mode="prefill"),
    Layer("k=1", 2048, 1024, 16, 1, 8192),
)


def scaled(layer: Layer) -> Layer:
    """The dry run's layer: the same shape of problem, small enough for CPU devices."""
    return Layer(
        layer.name,
        max(16, layer.emb // 32),
        max(16, layer.hidden // 32),
        min(layer.experts, 16),
        min(layer.top_k, 4),
        max(64, layer.seq // 32),
        layer.mode,
        layer.mlp_beside,
    )


def overrides(layer: Layer, hardware: str, devices: int, dry: bool) -> list[str]:
    """One sequence a batch shard, the sequence over every device (or one device)."""
    return [
        "model=tiny",
        f"hardware={hardware}",
        f"num_devices={devices}",
        "num_slices=1",
        "ici_fsdp_parallelism=1",
        f"ici_context_parallelism={devices}",
        f"per_device_batch_size={1 / devices}",
        f"num_experts={layer.experts}",
        f"num_experts_per_tok={layer.top_k}",
        f"base_emb_dim={layer.emb}",
        f"base_moe_mlp_dim={layer.hidden}",
        f"max_target_length={layer.seq}",
        f"mode={layer.mode}",
        "capacity_factor=-1",
        f"dtype={'float32' if dry else 'bfloat16'}",
        "param_dtype=float32",
        "context_parallel_load_balance=false",
        "hardware.memory_gib=1000000",  # time what runs; the chip says if it does not fit
    ]


def useful_flops(layer: Layer, devices: int) -> float:
    """The layer's useful FLOPs a device: its routed rows through the three matmuls,
    forward (and training's backward, twice the forward)."""
    tokens = layer.seq / devices
    passes = 3 if layer.mode == "train" else 1
    return 6 * tokens * layer.top_k * layer.emb * layer.hidden * passes


def candidates(config, layer: Layer, picks=(), tokamax: bool = False) -> dict:
    """{name: forced config}: every placement the selector can run (bench.picks), the
    selector's picks among them even where the benchmark leaves dense out, a dense MLP
    of the same active FLOPs for the seed's comparison, and, where tokamax is installed
    on a GPU, the gather with tokamax's grouped matmul (a kernel `auto` does not pick)."""
    from bench.picks import variants
    from selector import Dispatch
    from selector.config import GmmBackend

    out = dict(variants(config))
    if config.num_experts > DENSE_MAX_RATIO * config.num_experts_per_tok and "dense" not in picks:
        out.pop("dense", None)
    if "dense" in picks and "dense" not in out:
        out["dense"] = config.replace(dispatch=Dispatch.dense)
    if tokamax and "megablox/gather" in out:
        out["megablox/gather[tokamax]"] = out["megablox/gather"].replace(
            gmm_backend=GmmBackend.tokamax
        )
    if layer.mlp_beside:
        out["mlp (same active FLOPs)"] = config.replace(
            num_experts=1,
            num_experts_per_tok=1,
            base_moe_mlp_dim=layer.hidden * layer.top_k,
            dispatch=Dispatch.mlp,
        )
    return out


OFFERED = ("megablox/", "dense", "subgroup_capacity")  # what the selector can pick


def offered(name: str) -> bool:
    return name.startswith(OFFERED) and "[tokamax]" not in name


def time_layer(layer: Layer, hardwares: dict, devices: int, dry: bool, rounds: int) -> dict:
    """Every candidate of one layer timed interleaved; for each pricing in `hardwares`
    ({"published": the preset, "measured": its constants measured here}), each
    candidate's counted estimate and parts, the selector's pick and its regret (its
    median over the fastest offered candidate's)."""
    import importlib.util

    import selector
    from bench.picks import plan_name
    from checks.measured import _step, interleaved

    first = next(iter(hardwares.values()))
    config = selector.to_config(selector.compose(overrides(layer, first.name, devices, dry)))
    picks = {
        key: plan_name(selector.resolve(config.replace(hardware=hw)))
        for key, hw in hardwares.items()
    }
    tokamax = first.platform == "gpu" and importlib.util.find_spec("tokamax") is not None
    forced = candidates(config, layer, tuple(picks.values()), tokamax)
    fns, failed = {}, {}
    for name, c in forced.items():
        try:
            fns[name] = _step(c, c.dispatch, c.expert_exchange)
        except Exception as exc:  # a candidate the chip cannot build is recorded, not fatal
            failed[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
    times = interleaved(fns, rounds) if fns else {}
    peak = first.matmul_tflops * 1e12
    flops = useful_flops(layer, devices)
    rows = {}
    for name, ts in times.items():
        mid = median(ts)
        rows[name] = {"median_s": mid, "times_s": ts, "mfu": flops / (mid * peak)}
        for key, hw in hardwares.items():
            est = selector.resolve(forced[name].replace(hardware=hw)).chosen_estimate
            rows[name][f"estimated_s_{key}"] = est.time_s
            rows[name][f"estimated_parts_s_{key}"] = est.time_parts.as_dict()
    listed = {n: r for n, r in rows.items() if offered(n)}
    fastest = min(listed, key=lambda n: listed[n]["median_s"]) if listed else None
    every = {n: r for n, r in rows.items() if not n.startswith("mlp")}
    return {
        "layer": layer.__dict__,
        "picks": picks,
        "fastest": fastest,
        "fastest_any_kernel": min(every, key=lambda n: every[n]["median_s"]) if every else None,
        "regret": {
            key: listed[pick]["median_s"] / listed[fastest]["median_s"]
            if pick in listed and fastest
            else None
            for key, pick in picks.items()
        },
        "candidates": rows,
        "failed": failed,
    }


def _curve(rows: list[dict]) -> list[list[float]]:
    """bench.calibration.machine's curve rows as the preset's points
    (`machine.curve_point`)."""
    from bench.calibration.machine import curve_point

    return [curve_point(r) for r in rows]


def chip_constants(preset, dry: bool) -> dict:
    """The constants the counted time prices with, measured here by bench.calibration.machine's
    microbenchmarks (no MoE block), in the chip's compute dtype and at the sizes of the
    layers' dots, beside the preset's published figures.

    matmul_tflops: one (n, n) x (n, n) dot; HBM: one fused multiply-add pass over an array
    far larger than any cache (bytes read and written); call, launch and loop trip:
    chains of 4 x 4 dots (per op, a chain's difference); the matmul, tile-visit and
    batched-einsum curves; gathers. One device has no collective to time: those stay
    the preset's.
    """
    import jax
    import jax.numpy as jnp

    from bench.calibration import machine

    dtype = "float32" if dry else "bfloat16"
    n = 256 if dry else 8192
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
    matmul_s = machine._timed(jax.jit(jnp.matmul), a, a.T)
    size = (1 << 20) if dry else (1 << 28)  # 1 GiB of float32 on a chip: 16x an H200's L2
    x = jnp.ones((size,), jnp.float32)
    pass_s = machine._timed(jax.jit(lambda x: x * 1.0001 + 0.5), x)
    launch_s = machine.launch()
    if dry:
        rows, kn, tiles, einsums = (8, 64), ((64, 128),), (32,), ((8, 64, 32, 64),)
    else:
        rows = (8, 64, 512, 2048, 8192)
        kn = ((640, 1280), (2048, 768), (7168, 2048))
        tiles = machine.GMM_TILES
        einsums = ((8, 2048, 2048, 768), (64, 512, 2048, 768), (64, 2048, 7168, 2048))
    measured = {
        "matmul_tflops": 2 * n**3 / matmul_s / 1e12,
        "hbm_bandwidth_gbps": 2 * 4 * size / pass_s / 1e9,
        "gather_gbps": (machine.gather(1024) if dry else machine.gather())[0],
        "call_us": machine.call() * 1e6,
        "launch_us": launch_s * 1e6,
        "loop_trip_us": machine.loop_trip(launch_s) * 1e6,
        "matmul_curve": _curve(machine.matmul_curve(rows, kn, dtype)),
        "gmm_curve": _curve(machine.gmm_curve(tiles, kn, dtype)),
        "einsum_curve": _curve(machine.einsum_curve(einsums, dtype)),
    }
    published = {
        "matmul_tflops": preset.matmul_tflops,
        "hbm_bandwidth_gbps": preset.hbm_bandwidth_gbps,
    }
    return {
        "measured": measured,
        "published": published,
        "measured_over_published": {k: measured[k] / v for k, v in published.items() if v},
        "shapes": {"matmul_n": n, "dtype": dtype, "hbm_floats": size},
    }


def gmm_alone(dry: bool, rounds: int) -> dict:
    """The grouped matmul alone, fwd+bwd: tokamax (when installed), tiled_gmm,
    lax.ragged_dot and a dense matmul of the same rows."""
    import jax
    import jax.numpy as jnp

    from checks.measured import interleaved
    from layers.grouped_matmul import gmm

    rows, emb, hidden, experts = (512, 32, 64, 8) if dry else (16384, 2048, 768, 64)
    dtype = jnp.float32 if dry else jnp.bfloat16
    x = jax.random.normal(jax.random.key(0), (rows, emb), dtype)
    w = jax.random.normal(jax.random.key(1), (experts, emb, hidden), dtype) * 0.02
    sizes = jnp.full((experts,), rows // experts, jnp.int32)

    def fwd_bwd(matmul):
        return jax.jit(
            jax.grad(
                lambda x, w, s: jnp.sum(matmul(x, w, s).astype(jnp.float32) ** 2), argnums=(0, 1)
            )
        )

    kernels = {
        "tiled_gmm": lambda x, w, s: gmm(x, w, s, "tiled_gmm"),
        "ragged_dot": jax.lax.ragged_dot,
        "dense (same rows, one expert)": lambda x, w, s: x @ w[0],
    }
    skipped = {}
    try:
        import tokamax  # noqa: F401

        kernels["tokamax.ragged_dot"] = lambda x, w, s: tokamax.ragged_dot(x, w, s)
        kernels["tokamax.ragged_dot[triton]"] = lambda x, w, s: tokamax.ragged_dot(
            x, w, s, implementation="triton"
        )
    except Exception as exc:  # not installed here (Python < 3.12), or no kernel for the chip
        skipped["tokamax.ragged_dot"] = f"{type(exc).__name__}: {exc}"
    fns = {}
    for name, kernel in kernels.items():
        try:  # a kernel with nothing for this chip (tokamax on CPU) is skipped, and said
            fns[name] = (fwd_bwd(kernel).lower(x, w, sizes).compile(), (x, w, sizes))
        except Exception as exc:
            skipped[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
    times = interleaved(fns, rounds)
    return {
        "shape": {"rows": rows, "emb": emb, "hidden": hidden, "experts": experts},
        "median_s": {n: median(t) for n, t in times.items()},
        "skipped": skipped,
    }


def rescore(run: dict, hardware_overrides=()) -> dict:
    """A chip's stored run priced again by today's count, on this machine (no chip): per
    layer, every timed candidate's estimate, the pick and, where the pick was timed, its
    regret against the chip's medians. Run after every change of the count or of a
    preset, so the picks are judged on the chip without one."""
    import selector
    from bench.picks import plan_name

    rows = []
    for got in run["layers"]:
        layer = Layer(**got["layer"])
        config = selector.to_config(
            selector.compose(
                overrides(layer, run["hardware"], run["devices"], run["dry"])
                + list(hardware_overrides)
            )
        )
        pick = plan_name(selector.resolve(config))
        forced = candidates(config, layer, (pick,), tokamax=False)
        timed = {n: c["median_s"] for n, c in got["candidates"].items() if offered(n)}
        fastest = min(timed, key=timed.get)
        estimates = {
            n: selector.resolve(forced[n]).chosen_estimate.time_s for n in timed if n in forced
        }
        rows.append(
            {
                "layer": layer.name,
                "pick": pick,
                "fastest": fastest,
                "regret": timed[pick] / timed[fastest] if pick in timed else None,
                "measured_s": timed,
                "estimated_s": estimates,
            }
        )
    judged = [r for r in rows if r["regret"] is not None]
    return {
        "hardware": run["hardware"],
        "machine": run["machine"],
        "layers": rows,
        "summary": {
            "layers": len(rows),
            "pick_timed": len(judged),
            "picks_fastest": sum(r["pick"] == r["fastest"] for r in judged),
            "worst_regret": max((r["regret"] for r in judged), default=None),
        },
    }


def plot(rescored: dict, path: Path) -> None:
    """Per layer, each timed candidate's chip median beside today's estimate, the pick
    named in the title."""
    from bench.common import pyplot

    plt = pyplot()
    layers = rescored["layers"]
    fig, axes = plt.subplots(1, len(layers), figsize=(3.2 * len(layers), 3.6), squeeze=False)
    for ax, row in zip(axes[0], layers, strict=True):
        names = list(row["measured_s"])
        xs = range(len(names))
        chip = [row["measured_s"][n] * 1e3 for n in names]
        est = [row["estimated_s"].get(n, float("nan")) * 1e3 for n in names]
        ax.bar([x - 0.2 for x in xs], chip, 0.4, color="tab:blue", label="chip median")
        ax.bar([x + 0.2 for x in xs], est, 0.4, color="tab:orange", label="estimate")
        ax.set_xticks(list(xs), [n.replace("megablox/", "") for n in names])
        ax.set_title(f"{row['layer']}\npick: {row['pick']}", fontsize=8)
    axes[0][0].set_ylabel("ms a layer (fwd+bwd)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(
        f"{rescored['machine'].get('device_kind', '')}: chip medians and today's estimates", y=1.06
    )
    fig.savefig(path, dpi=110, bbox_inches="tight")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("--dry", action="store_true", help="CPU devices, sizes scaled down")
    parser.add_argument("--hardware", help="the preset to price with (default: the devices')")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the layers")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument(
        "--out", help="the JSON to write (default bench/results/on_device_<hw>.json)"
    )
    parser.add_argument(
        "--rescore",
        metavar="RUN_JSON",
        help="price a chip's stored run again with today's count (no chip needed); writes"
        " <run>_rescored.json and .png beside it",
    )
    args = parser.parse_args(argv)
    if args.rescore:
        run_path = Path(args.rescore)
        rescored = rescore(json.loads(run_path.read_text()))
        base = run_path.with_name(run_path.stem + "_rescored")
        base.with_suffix(".json").write_text(json.dumps(rescored, indent=1))
        plot(rescored, base.with_suffix(".png"))
        for row in rescored["layers"]:
            print(
                f"{row['layer']}: pick {row['pick']}, fastest {row['fastest']}, regret {row['regret']}"
            )
        print("wrote", base.with_suffix(".json"), json.dumps(rescored["summary"]))
        return 0
    if args.dry and "jax" not in sys.modules:
        from bench.common import use_cpu_devices

        use_cpu_devices(8)
    import jax

    from bench.common import machine

    devices = jax.devices()
    platform = devices[0].platform
    if platform == "cpu" and not args.dry:
        print("no accelerator here: run with --dry to try the script on CPU devices")
        return 2
    hardware = args.hardware or {"gpu": "h200", "tpu": "v5p", "cpu": "cpu"}[platform]
    count = len(devices)
    count = 2 ** int(math.log2(count))  # a power of two the sequences split over
    out = Path(args.out) if args.out else RESULTS / f"on_device_{hardware}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    results, skipped, errors = [], [], {}
    payload = {
        "machine": machine(),
        "hardware": hardware,
        "devices": count,
        "dry": args.dry,
        "rounds": args.rounds,
        "constants": None,
        "layers": results,
        "failed_layers": errors,
        "skipped_for_time": skipped,
        "gmm": None,
    }

    def write() -> None:  # after every step: a chip taken back keeps what ran
        payload["seconds"] = time.perf_counter() - start
        payload["summary"] = {"layers_timed": len(results)}
        for key in ("published", "measured"):
            regrets = [r["regret"][key] for r in results if r["regret"][key] is not None]
            payload["summary"][key] = {
                "picks_fastest": sum(r["picks"][key] == r["fastest"] for r in results),
                "worst_regret": max(regrets, default=None),
            }
        out.write_text(json.dumps(payload, indent=1, default=str))

    import selector

    preset = selector.to_config(selector.compose([f"hardware={hardware}"])).hardware
    payload["constants"] = chip_constants(preset, args.dry)
    scalars = {k: v for k, v in payload["constants"]["measured"].items() if "curve" not in k}
    print("constants:", json.dumps(scalars), flush=True)
    write()
    measured_hw = dataclasses.replace(
        preset,
        name=preset.name,
        source=f"measured by bench.on_device on {payload['machine']['device_kind']}",
        **payload["constants"]["measured"],
    )
    hardwares = {"published": preset, "measured": measured_hw}
    for layer in LAYERS:
        if time.perf_counter() - start > args.budget:
            skipped.append(layer.name)
            continue
        shape = scaled(layer) if args.dry else layer
        try:
            got = time_layer(shape, hardwares, count, args.dry, args.rounds)
        except Exception as exc:  # recorded; the next layer still runs
            errors[layer.name] = f"{type(exc).__name__}: {str(exc)[:500]}"
            print(f"{layer.name}: FAILED {errors[layer.name]}", flush=True)
            write()
            continue
        results.append(got)
        print(
            f"{layer.name}: picks {got['picks']}, fastest {got['fastest']}"
            f" (any kernel: {got['fastest_any_kernel']}), regret {got['regret']}"
            f" ({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
        write()
    if platform in ("gpu", "cpu"):
        payload["gmm"] = gmm_alone(args.dry, args.rounds)
    write()
    print("wrote", out, json.dumps(payload["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
