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
  installed, tiled_gmm, jax.lax.ragged_dot and the dense matmul of the same rows.

The budget (`--budget`, seconds) stops it starting another config; what ran is
written. `--dry` runs the same code on this machine's CPU devices at sizes scaled down
(the suite runs it: tests/test_on_device.py), so the script is known to work before a
chip is lent.

    python -m bench.on_device                  # on the chip: bench/results/on_device_<hw>.json
    python -m bench.on_device --dry --out /tmp/dry.json
"""

from __future__ import annotations

import argparse
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


def candidates(config, layer: Layer) -> dict:
    """{name: forced config}: every placement the selector can run (bench.picks), and a
    dense MLP of the same active FLOPs for the seed's comparison."""
    from bench.picks import variants
    from selector import Dispatch

    out = dict(variants(config))
    if config.num_experts > DENSE_MAX_RATIO * config.num_experts_per_tok:
        out.pop("dense", None)
    if layer.mlp_beside:
        out["mlp (same active FLOPs)"] = config.replace(
            num_experts=1,
            num_experts_per_tok=1,
            base_moe_mlp_dim=layer.hidden * layer.top_k,
            dispatch=Dispatch.mlp,
        )
    return out


def time_layer(layer: Layer, hardware: str, devices: int, dry: bool, rounds: int) -> dict:
    import selector
    from bench.picks import plan_name
    from checks.measured import _step, interleaved

    config = selector.to_config(selector.compose(overrides(layer, hardware, devices, dry)))
    plan = selector.resolve(config)
    forced = candidates(config, layer)
    fns, failed = {}, {}
    for name, c in forced.items():
        try:
            fns[name] = _step(c, c.dispatch, c.expert_exchange)
        except Exception as exc:  # a candidate the chip cannot build is recorded, not fatal
            failed[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
    times = interleaved(fns, rounds) if fns else {}
    peak = config.hardware.matmul_tflops * 1e12
    flops = useful_flops(layer, devices)
    rows = {}
    for name, ts in times.items():
        mid = median(ts)
        est = selector.resolve(forced[name]).chosen_estimate
        rows[name] = {
            "median_s": mid,
            "times_s": ts,
            "estimated_s": est.time_s,
            "estimated_parts_s": est.time_parts.as_dict(),
            "mfu": flops / (mid * peak),
        }
    pick = plan_name(plan)
    routed = {n: r for n, r in rows.items() if not n.startswith("mlp")}
    fastest = min(routed, key=lambda n: routed[n]["median_s"]) if routed else None
    return {
        "layer": layer.__dict__,
        "pick": pick,
        "fastest": fastest,
        "regret": routed[pick]["median_s"] / routed[fastest]["median_s"]
        if pick in routed and fastest
        else None,
        "candidates": rows,
        "failed": failed,
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    parser.add_argument("--dry", action="store_true", help="CPU devices, sizes scaled down")
    parser.add_argument("--hardware", help="the preset to price with (default: the devices')")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the layers")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument(
        "--out", help="the JSON to write (default bench/results/on_device_<hw>.json)"
    )
    args = parser.parse_args(argv)
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
    start = time.perf_counter()
    results, skipped = [], []
    for layer in LAYERS:
        if time.perf_counter() - start > args.budget:
            skipped.append(layer.name)
            continue
        shape = scaled(layer) if args.dry else layer
        got = time_layer(shape, hardware, count, args.dry, args.rounds)
        results.append(got)
        print(
            f"{layer.name}: pick {got['pick']}, fastest {got['fastest']}, regret {got['regret']}",
            flush=True,
        )
    payload = {
        "machine": machine(),
        "hardware": hardware,
        "devices": count,
        "dry": args.dry,
        "rounds": args.rounds,
        "layers": results,
        "skipped_for_time": skipped,
        "gmm": gmm_alone(args.dry, args.rounds) if platform in ("gpu", "cpu") else None,
        "seconds": time.perf_counter() - start,
    }
    regrets = [r["regret"] for r in results if r["regret"] is not None]
    payload["summary"] = {
        "layers_timed": len(results),
        "picks_fastest": sum(r["pick"] == r["fastest"] for r in results),
        "worst_regret": max(regrets, default=None),
    }
    out = Path(args.out) if args.out else RESULTS / f"on_device_{hardware}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1, default=str))
    print("wrote", out, json.dumps(payload["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
