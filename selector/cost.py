"""A small cost model: per-device FLOPs, activation bytes and a time estimate per strategy.

Memory counts the buffers one MoE layer keeps between its forward and backward pass
(temp memory in XLA's terms), plus the expert weights the block gathers. The
per-strategy coefficients in `MEMORY_CALIBRATION` are fitted to XLA's compiled
`memory_analysis()` by `bench/memory.py` (see the README), so the estimate tracks
what XLA actually allocates rather than a hand count.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .config import DTYPE_BYTES, Config, Dispatch, Mode
from .derive import PerDevice
from .mesh import MeshView

# Per strategy, temp bytes = sum over parts of coefficient * hand count, the parts
# being `activation_parts` (rows, masks) and the expert-weight bytes (weights: their
# gradients live as temp before the reduction). Fitted on XLA's compiled fwd+bwd
# programs by `python -m bench.memory` (float32, CPU), which prints these values and
# checks them on a held-out shape. mlp has no fit of its own and borrows dense's (the
# same buffers with E = 1).
MEMORY_CALIBRATION: dict[Dispatch, dict[str, float]] = {
    Dispatch.mlp: {"rows": 1.714, "masks": 0.0, "weights": 0.725},
    Dispatch.dense: {"rows": 1.714, "masks": 0.0, "weights": 0.725},
    Dispatch.subgroup_capacity: {"rows": 0.579, "masks": 2.183, "weights": 0.0},
    Dispatch.megablox: {"rows": 1.734, "masks": 0.0, "weights": 0.0},
}

ROUTER_BYTES = 4  # router logits and probabilities are float32 whatever the dtype


@dataclass(frozen=True)
class Estimate:
    strategy: Dispatch
    flops: float  # per device per step (fwd, or fwd+bwd when training)
    activation_bytes: float
    weight_bytes: float  # expert weights gathered into the block (and their grads)
    memory_bytes: float
    time_s: float
    fits: bool

    def as_dict(self) -> dict:
        d = asdict(self)
        d["strategy"] = self.strategy.value
        return d


@dataclass(frozen=True)
class Shape:
    """The per-device problem in the letters the kernels use."""

    T: float  # tokens per device
    G: float  # subgroups per device (sequences x sequence shards held)
    S: float  # tokens per subgroup (sub-sequence)
    E: int
    k: int
    C: int  # per-subgroup capacity (capacity path only)
    M: int
    H: float  # hidden per device (sharded over the hidden axes)
    bytes: int
    passes: int  # 3 when training (forward plus a backward of about twice its cost)
    tile: int


def problem_shape(cfg: Config, mesh: MeshView, dev: PerDevice) -> Shape:
    hidden_shards = mesh.product(mesh.hidden_axes)
    cap = dev.capacity_per_subgroup
    if cap is None:  # a dropless run priced on the capacity path: the factor-1 capacity
        cap = max(1, math.ceil(dev.expected_tokens_per_expert))
    return Shape(
        T=dev.tokens_per_device,
        G=dev.tokens_per_device / max(dev.sub_seq, 1e-9),
        S=dev.sub_seq,
        E=cfg.num_experts,
        k=cfg.num_experts_per_tok,
        C=cap,
        M=cfg.base_emb_dim,
        H=cfg.base_moe_mlp_dim / hidden_shards,
        bytes=DTYPE_BYTES.get(cfg.dtype, 4),
        passes=3 if cfg.mode is Mode.train else 1,
        tile=cfg.gmm_tile_rows,
    )


def _rows(strategy: Dispatch, p: Shape) -> float:
    """Rows each expert FFN processes per device, summed over experts."""
    if strategy is Dispatch.mlp:
        return p.T
    if strategy is Dispatch.megablox:
        # Each expert's group is padded to a whole tile: on average half a tile each.
        return p.T * p.k + min(p.E, p.T * p.k) * p.tile / 2
    if strategy is Dispatch.dense:
        return p.T * p.E
    return p.G * p.E * p.C  # subgroup_capacity


def forward_flops(strategy: Dispatch, p: Shape) -> float:
    ffn = 6 * _rows(strategy, p) * p.M * p.H  # three matmuls of 2*M*H each
    router = 0 if strategy is Dispatch.mlp else 2 * p.T * p.M * p.E
    # Dispatch and combine einsums over the (S, E, C) mask.
    einsums = 4 * p.T * p.E * p.C * p.M if strategy is Dispatch.subgroup_capacity else 0
    return ffn + router + einsums


def activation_parts(strategy: Dispatch, p: Shape) -> dict[str, float]:
    """Hand count of the buffers kept for the backward pass, in two parts that scale
    differently with cp: per-row buffers (tokens, router, expert rows, sort indices;
    ~1/cp) and the capacity path's (S, E, C) dispatch/combine masks (~1/cp^2)."""
    rows = _rows(strategy, p)
    per_row = 2 * p.T * p.M * p.bytes  # block input and output
    per_row += rows * (2 * p.M + 3 * p.H) * p.bytes  # expert input/output, gate, up, act
    masks = 0.0
    if strategy is not Dispatch.mlp:
        per_row += 2 * p.T * p.E * ROUTER_BYTES
    if strategy is Dispatch.subgroup_capacity:
        masks = 2 * p.T * p.E * p.C * p.bytes
    elif strategy is Dispatch.megablox:
        per_row += 3 * p.T * p.k * 4  # sort order, inverse and group ids (int32)
    return {"rows": per_row, "masks": masks}


def activation_bytes(strategy: Dispatch, p: Shape) -> float:
    return sum(activation_parts(strategy, p).values())


def weight_bytes(strategy: Dispatch, p: Shape) -> float:
    """One copy of the expert weights a device uses (hidden sharded over the hidden axes)."""
    experts = 1 if strategy is Dispatch.mlp else p.E
    return experts * 3 * p.M * p.H * p.bytes


def estimate(strategy: Dispatch, cfg: Config, mesh: MeshView, dev: PerDevice) -> Estimate:
    p = problem_shape(cfg, mesh, dev)
    flops = forward_flops(strategy, p) * p.passes
    coeff = MEMORY_CALIBRATION[strategy]
    train = cfg.mode is Mode.train
    # Nothing is kept for a backward pass when not training; about half stays live
    # (an uncalibrated guess: the fit covers training only).
    parts = activation_parts(strategy, p)
    act = sum(coeff[k] * v for k, v in parts.items()) * (1 if train else 0.5)
    w = weight_bytes(strategy, p)
    sharded_at_rest = mesh.product(mesh.expert_axes + mesh.embed_axes) > 1
    # Weights sharded at rest are gathered into the block: one more full copy.
    weights = w * (coeff["weights"] if train else 0) + (w if sharded_at_rest else 0)
    memory = act + weights
    hw = cfg.hardware
    time_s = flops / (hw.peak_bf16_tflops * 1e12) + 2 * act * p.passes / (
        hw.hbm_bandwidth_gbps * 1e9
    )
    fits = memory <= hw.memory_gib * 2**30
    return Estimate(strategy, flops, act, weights, memory, time_s, fits)
