"""The fitted memory model: the block's temporaries as hand counts of parts, each
scaled by a coefficient fitted on compiled programs (bench.calibrate writes
memory_calibration.json beside this module)."""

from __future__ import annotations

import json
from pathlib import Path

from .config import DTYPE_BYTES, Config, Dispatch, Exchange
from .problem import Shape, buffer_rows, compute_weight_elements, rows

# Temp bytes = sum over parts of coefficient x hand count, per calibration key (the
# dispatch and exchange, and `@cpu_half` for half precision on XLA:CPU, which converts
# part of a bfloat16 program to float32; an accelerator keeps every buffer in the
# compute dtype, as a float32 program does, so it uses the float32 family at the
# dtype's own bytes). Parts, in bytes (see `memory_parts`): `tokens` (T x M: block
# input, output and their gradients), `rows_m` and `rows_h` (routed rows x M and x H:
# expert inputs, outputs, gate, up, activation and their gradients; the exchange's
# owner runs its experts one slot of B rows at a time, so its x H buffers are B rows),
# `router` (T x E logits and probabilities, float32), `choices` (T x k x E one-hots of
# the top-k, or T x k sort indices), `masks` (the capacity path's T x E x C dispatch
# and combine), `masks_k` (its k one-hot slot maps, T x k x E x C, kept for the
# backward pass), `weights` (the compute-form copy of the weights a device computes
# with), `gathered` (the same bytes again when they are gathered) and `reduced` (the
# weight gradients' bytes again when devices holding the same shard all-reduce them),
# and `expert` (one expert's three weights in float32: the grouped matmul's weight
# gradient accumulates each expert in a float32 buffer of that size, which matters when
# a device computes with one or two experts).
# Fitted by `python -m bench.calibrate --write` on XLA:CPU programs (8 simulated
# devices), which writes memory_calibration.json beside this module; mlp borrows
# dense's.
PARTS = (
    "tokens",
    "rows_m",
    "rows_h",
    "router",
    "choices",
    "masks",
    "masks_k",
    "weights",
    "gathered",
    "reduced",
    "expert",
)
CALIBRATION_FILE = Path(__file__).with_name("memory_calibration.json")
MEMORY_CALIBRATION: dict[str, dict[str, float]] = json.loads(CALIBRATION_FILE.read_text())
ROUTER_BYTES = 4  # router logits and probabilities are float32 whatever the dtype


def calibration_key(strategy: Dispatch, exchange: Exchange, cfg: Config) -> str:
    if strategy is Dispatch.mlp:
        base = "dense"
    elif strategy is Dispatch.megablox and exchange is Exchange.all_to_all:
        base = "megablox_exchanged"
    else:
        base = strategy.value
    half = cfg.hardware.platform == "cpu" and DTYPE_BYTES.get(cfg.dtype, 4) < 4
    return base + ("@cpu_half" if half else "")


def memory_parts(strategy: Dispatch, exchange: Exchange, p: Shape) -> dict[str, float]:
    """Hand counts of the temporaries, in bytes, one per way a buffer scales (see PARTS)."""
    n = rows(strategy, p)
    if strategy is Dispatch.megablox:
        n = p.T * p.k  # the grouped matmul reads rows in place: no padded copy
    hidden_rows = n
    if exchange is Exchange.all_to_all:
        n = p.group * buffer_rows(p)  # an owner's rows arrive in G slots of B
        hidden_rows = buffer_rows(p)  # and go through the experts one slot at a time
    routed = strategy is not Dispatch.mlp
    capacity_path = strategy is Dispatch.subgroup_capacity
    if strategy in (Dispatch.dense, Dispatch.subgroup_capacity):
        choices = p.T * p.k * p.E * 4  # one-hot of each choice (combine weights, queues)
    else:
        choices = p.T * p.k * 4 * (1 if routed else 0)  # sort order and its inverse
    weights = compute_weight_elements(strategy, p) * p.xb
    return {
        "tokens": p.T * p.M * p.xb,
        "rows_m": n * p.M * p.xb,
        "rows_h": (hidden_rows * p.H + p.T * p.Hs) * p.xb,  # routed rows, every token's shared
        "router": p.T * p.E * ROUTER_BYTES if routed else 0.0,
        "choices": choices,
        "masks": p.T * p.E * p.C * p.xb if capacity_path else 0.0,
        "masks_k": p.T * p.k * p.E * p.C * p.xb if capacity_path else 0.0,
        "weights": weights,
        "gathered": weights if p.gathered > 1 else 0.0,
        "reduced": weights if p.replicas > 1 and p.train else 0.0,
        "expert": 3 * p.M * p.H * 4 if strategy is Dispatch.megablox and p.train else 0.0,
    }


def temp_from_parts(key: str, parts: dict[str, float], train: bool = True) -> float:
    """Temp bytes from the hand counts and the fitted coefficients of `key`."""
    coeff = MEMORY_CALIBRATION.get(key, MEMORY_CALIBRATION.get(key.split("@")[0], {}))
    temp = sum(coeff.get(k, 1.0) * v for k, v in parts.items())
    # Nothing is kept for a backward pass outside training: about half stays live (a
    # guess; the fit covers training programs only).
    return temp if train else 0.5 * temp
