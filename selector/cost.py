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

# Multiplier on the hand-counted activation bytes, per strategy, fitted on the
# compiled programs (bench/memory.py). 1.0 means "the hand count".
MEMORY_CALIBRATION: dict[Dispatch, float] = {
    Dispatch.mlp: 1.0,
    Dispatch.dense: 1.0,
    Dispatch.subgroup_capacity: 1.0,
    Dispatch.megablox: 1.0,
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


def activation_bytes(strategy: Dispatch, p: Shape) -> float:
    """Hand count of the buffers kept for the backward pass (forward only: one copy)."""
    rows = _rows(strategy, p)
    tokens_io = 2 * p.T * p.M * p.bytes  # block input and output
    ffn = rows * (2 * p.M + 3 * p.H) * p.bytes  # expert input/output, gate, up, act
    if strategy is Dispatch.mlp:
        return tokens_io + ffn
    router = 2 * p.T * p.E * ROUTER_BYTES
    extra = 0.0
    if strategy is Dispatch.subgroup_capacity:
        extra = 2 * p.T * p.E * p.C * p.bytes  # dispatch and combine masks
    elif strategy is Dispatch.megablox:
        extra = 3 * p.T * p.k * 4  # sort order, inverse and group ids (int32)
    return tokens_io + ffn + router + extra


def estimate(strategy: Dispatch, cfg: Config, mesh: MeshView, dev: PerDevice) -> Estimate:
    p = problem_shape(cfg, mesh, dev)
    flops = forward_flops(strategy, p) * p.passes
    act = activation_bytes(strategy, p) * MEMORY_CALIBRATION[strategy]
    if cfg.mode is not Mode.train:
        act /= 2  # nothing is kept for a backward pass; roughly half stays live
    experts = 1 if strategy is Dispatch.mlp else p.E
    weights = experts * 3 * p.M * p.H * p.bytes * (2 if cfg.mode is Mode.train else 1)
    memory = act + weights
    hw = cfg.hardware
    time_s = flops / (hw.peak_bf16_tflops * 1e12) + 2 * act * p.passes / (
        hw.hbm_bandwidth_gbps * 1e9
    )
    fits = memory <= hw.memory_gib * 2**30
    return Estimate(strategy, flops, act, weights, memory, time_s, fits)
