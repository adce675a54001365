"""The fitted memory model: the block's temporaries as hand counts of parts, each
scaled by a coefficient fitted on compiled programs (bench.calibrate writes
memory_calibration.json beside this module)."""

from __future__ import annotations

import json
from pathlib import Path

from .config import DTYPE_BYTES, Config, Dispatch, Exchange
from .problem import DeviceProblem, buffer_rows, compute_weight_elements, rows

# Temp bytes = sum over parts of coefficient x hand count, per calibration key: the
# compiler family, the mode and the dispatch and exchange (`tpu train megablox`). Each
# compiler has its own coefficients, fitted on its own compiled programs: XLA:TPU
# (`tpu`) and XLA:GPU (`gpu`) keep every buffer in the compute dtype, so one family
# serves each dtype at its own bytes; XLA:CPU converts part of a bfloat16 program to
# float32, so half precision there is a family of its own (`cpu_half`). Training
# (fwd+bwd), prefill and decode (forward programs) are fitted apart. Parts, in bytes
# (see `memory_parts`): `tokens` (T x M: block
PARTS = (
    "tokens",
    "rows_m",
    "rows_h",
    "router",
    "choices",
    "masks",
    "masks_k",
    "weights",
    "cast",
    "gathered",
    "reduced",
    "expert",
)
CALIBRATION_FILE = Path(__file__).with_name("memory_calibration.json")
MEMORY_CALIBRATION: dict[str, dict[str, float]] = json.loads(CALIBRATION_FILE.read_text())
ROUTER_BYTES = 4  # router logits and probabilities are float32 whatever the dtype


FAMILIES = ("cpu", "cpu_half", "gpu", "tpu")


def calibration_family(cfg: Config) -> str:
    """The compiler whose coefficients price `cfg`: its platform, and half precision on
    XLA:CPU apart."""
    platform = cfg.hardware.platform
    if platform == "cpu" and DTYPE_BYTES.get(cfg.dtype, 4) < 4:
        return "cpu_half"
    return platform


def calibration_key(strategy: Dispatch, exchange: Exchange, cfg: Config) -> str:
    """`{family} {mode} {program}`, for example `tpu train megablox_exchanged`."""
    if strategy is Dispatch.mlp:
        base = "dense"
    elif strategy is Dispatch.megablox and exchange is Exchange.all_to_all:
        base = "megablox_exchanged"
    else:
        base = strategy.value
    return f"{calibration_family(cfg)} {cfg.mode.value} {base}"


def memory_parts(strategy: Dispatch, exchange: Exchange, p: DeviceProblem) -> dict[str, float]:
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
    # A cast to the compute dtype makes a copy of its own; in their own dtype the
    # matmuls may read the parameters where they rest (a layout change aside).
    cast = weights if p.pb != p.xb else 0.0
    return {
        "tokens": p.T * p.M * p.xb,
        "rows_m": n * p.M * p.xb,
        "rows_h": (hidden_rows * p.H + p.T * p.Hs) * p.xb,  # routed rows, every token's shared
        "router": p.T * p.E * ROUTER_BYTES if routed else 0.0,
        "choices": choices,
        "masks": p.T * p.E * p.C * p.xb if capacity_path else 0.0,
        "masks_k": p.T * p.k * p.E * p.C * p.xb if capacity_path else 0.0,
        "weights": weights,
        "cast": cast,
        "gathered": weights if p.gathered > 1 else 0.0,
        "reduced": weights if p.replicas > 1 and p.train else 0.0,
        "expert": expert_accumulators(strategy, exchange, p),
    }


def expert_accumulators(strategy: Dispatch, exchange: Exchange, p: DeviceProblem) -> float:
    """Float32 weight-gradient accumulators of the grouped matmul's backward: one
    expert's at a time when gathered (the tiled weight gradient writes each expert
    once); every local expert's when exchanged (the exchange's backward adds each slot
    of each round into them, layers.expert_parallel)."""
    if strategy is not Dispatch.megablox or not p.train:
        return 0.0
    experts = p.E_c if exchange is Exchange.all_to_all else 1
    return experts * 3 * p.M * p.H * 4


WEIGHT_PARTS = ("weights", "cast", "gathered", "reduced", "expert")


def activation_parts(parts: dict[str, float]) -> dict[str, float]:
    """Of `memory_parts`, those that are activations (not copies of weights or their
    gradients): the fitted coefficients on these price the activations' HBM traffic."""
    return {k: (0.0 if k in WEIGHT_PARTS else v) for k, v in parts.items()}


class CalibrationMissing(KeyError):
    """No fitted coefficients for a calibration key."""


def temp_from_parts(key: str, parts: dict[str, float]) -> float:
    """Temp bytes from the hand counts and the fitted coefficients of `key`."""
    coeff = MEMORY_CALIBRATION.get(key)
    if coeff is None:
        family = key.split()[0]
        raise CalibrationMissing(
            f"{CALIBRATION_FILE.name} has no coefficients for {key!r}: fit them with "
            f"python -m bench.calibrate --target {family.split('_')[0]} --write"
        )
    missing = set(parts) - set(coeff)
    if missing:
        raise CalibrationMissing(
            f"{CALIBRATION_FILE.name} entry {key!r} lacks the parts {sorted(missing)}: "
            "fit it again with python -m bench.calibrate --write"
        )
    return sum(coeff[k] * v for k, v in parts.items())
