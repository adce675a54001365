"""The cost model: per device, one MoE layer, one step (fwd, or fwd+bwd when training).

Memory is split the way XLA reports a compiled program, so every term can be checked
against `memory_analysis()`:

- arguments: the expert weights at rest (param_dtype, split by the placement) and the
  block's input;
- outputs: the weight gradients at rest and the input gradient (training), or the
  block's output;
- temp: activation buffers, the compute-form copy of the weights (gathered, or cast
  to the compute dtype), gradient accumulators and exchange buffers. Hand counts of
  these parts are scaled by coefficients fitted to XLA's compiled programs
  (`python -m bench.calibrate`, which prints `MEMORY_CALIBRATION` and its held-out
  error per strategy).

Beside the one block, `state_bytes` is what every MoE layer of the model holds at rest
on a device: weights, gradients and optimizer state (`optimizer_bytes_per_param`).

Time = FLOPs / peak + HBM bytes / HBM bandwidth + network bytes / link bandwidth.
HBM bytes count the activations and the weights each pass reads (decode is bound by
them: a grouped matmul reads only the experts its tokens chose, dense reads all);
network bytes count the weight all-gather and gradient reduce-scatter (gathered), or
the routed rows there and back (exchanged), and the gradient all-reduce over devices
that hold the same weight shard.

XLA:CPU converts part of a bfloat16 program to float32 (seen in the compiled programs:
bf16 weights are all-gathered and multiplied as f32, while many activations stay bf16),
so half precision on `platform=cpu` has its own fitted coefficients.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from .config import DTYPE_BYTES, MESH_AXES, Config, Dispatch, Exchange, Mode
from .derive import PerDevice
from .mesh import MeshView
from .placement import WeightPlacement

# Temp bytes = sum over parts of coefficient x hand count, per calibration key (the
# dispatch and exchange, and `@cpu_half` for half precision on XLA:CPU, which converts
# part of a bfloat16 program to float32; an accelerator keeps every buffer in the
# compute dtype, as a float32 program does, so it uses the float32 family at the
# dtype's own bytes). Parts, in bytes (see `memory_parts`): `tokens` (T x M: block input,
# output and their gradients), `rows_m` and `rows_h` (routed rows x M and x H: expert
# inputs, outputs, gate, up, activation and their gradients), `router` (T x E logits and
# probabilities, float32), `choices` (T x k x E one-hots of the top-k, or T x k sort
# indices), `masks` (the capacity path's T x E x C dispatch and combine), `masks_k` (its
# k one-hot slot maps, T x k x E x C, kept for the backward pass), `weights` (the
# compute-form copy of the weights a device computes with) and `gathered` (the same
# bytes again when they are gathered). Fitted by `python -m bench.calibrate --write` on
# XLA:CPU programs (8 simulated devices), which writes memory_calibration.json beside
# this module; mlp borrows dense's.
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
)
CALIBRATION_FILE = Path(__file__).with_name("memory_calibration.json")
MEMORY_CALIBRATION: dict[str, dict[str, float]] = json.loads(CALIBRATION_FILE.read_text())
ROUTER_BYTES = 4  # router logits and probabilities are float32 whatever the dtype
ROUND_ALIGN = 8  # exchange buffers hold a multiple of 8 rows per owner (as the layers)


def calibration_key(strategy: Dispatch, exchange: Exchange, cfg: Config) -> str:
    if strategy is Dispatch.mlp:
        base = "dense"
    elif strategy is Dispatch.megablox and exchange is Exchange.all_to_all:
        base = "megablox_exchanged"
    else:
        base = strategy.value
    half = cfg.hardware.platform == "cpu" and DTYPE_BYTES.get(cfg.dtype, 4) < 4
    return base + ("@cpu_half" if half else "")


@dataclass(frozen=True)
class Memory:
    """Bytes one device holds for the block's program (XLA's categories)."""

    arguments: float
    outputs: float
    temp: float

    @property
    def peak(self) -> float:
        return self.arguments + self.outputs + self.temp


@dataclass(frozen=True)
class Traffic:
    """Bytes one device moves per step."""

    hbm: float  # activations and weight reads
    weight_gather: float  # all-gather of weights in, reduce-scatter of gradients out
    exchange: float  # routed rows to the experts' owners and back
    grad_reduce: float  # all-reduce of gradients over devices holding the same shard

    @property
    def network(self) -> float:
        return self.weight_gather + self.exchange + self.grad_reduce


@dataclass(frozen=True)
class Estimate:
    strategy: Dispatch
    exchange: Exchange
    flops: float  # per device per step (fwd, or fwd+bwd when training)
    memory: Memory  # the block's program
    state_bytes: float  # every MoE layer's weights, gradients and optimizer state at rest
    traffic: Traffic
    rounds: int  # expected exchange rounds (1 when gathered)
    time_s: float
    time_parts: tuple[float, float, float]  # compute, HBM, network seconds
    fits: bool

    input_bytes: float  # the block's input (and its gradient) per device

    @property
    def device_bytes(self) -> float:
        """What a device holds at the block's peak: the model's state at rest plus this
        block's input, output and temporaries (its weights and gradients are part of
        the state, so they are not counted twice)."""
        weights = self.memory.arguments - self.input_bytes
        at_rest_in_block = weights + (self.memory.outputs - self.input_bytes)
        return self.state_bytes + self.memory.peak - at_rest_in_block

    @property
    def name(self) -> str:
        if self.strategy is Dispatch.megablox:
            return f"megablox/{self.exchange.value}"
        return self.strategy.value

    def as_dict(self) -> dict:
        d = asdict(self)
        d["strategy"] = self.strategy.value
        d["exchange"] = self.exchange.value
        d["name"] = self.name
        d["device_bytes"] = self.device_bytes
        d["memory"]["peak"] = self.memory.peak
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
    H: float  # hidden per device (split over the hidden axes)
    Hs: float  # shared experts' hidden per device (shared_experts x H)
    E_c: int  # experts a device computes with (E gathered; E / group exchanged)
    group: int  # expert-group size (1 when gathered)
    gathered: int  # devices the weights are gathered from (1: nothing gathered)
    rest_shards: int  # shards of the expert weights at rest
    gate_shards: int  # shards of the router kernel at rest
    replicas: int  # devices holding the same weight shard (their gradients are summed)
    xb: int  # bytes per element of the compute dtype
    pb: int  # bytes per element of the parameters
    passes: int  # 3 when training (forward plus a backward of about twice its cost)
    tile: int
    buffer_factor: float
    ragged: bool  # the exchange sends exactly the rows (no padding to B)
    train: bool


def problem_shape(cfg: Config, mesh: MeshView, dev: PerDevice, place: WeightPlacement) -> Shape:
    cap = dev.capacity_per_subgroup
    if cap is None:  # a dropless run priced on the capacity path: the factor-1 capacity
        cap = max(1, math.ceil(dev.expected_tokens_per_expert))
    xb = DTYPE_BYTES.get(cfg.dtype, 4)
    exchanged = place.exchange is Exchange.all_to_all
    group = mesh.product(place.group_axes) if exchanged else 1
    rest = mesh.product(place.experts_axes + place.embed_axes + place.hidden_axes)
    # Exchanged weights keep their expert split; only the embed split is gathered.
    gathered = mesh.product(place.embed_axes + (() if exchanged else place.experts_axes))
    return Shape(
        T=dev.tokens_per_device,
        G=dev.tokens_per_device / max(dev.sub_seq, 1e-9),
        S=dev.sub_seq,
        E=cfg.num_experts,
        k=cfg.num_experts_per_tok,
        C=cap,
        M=cfg.base_emb_dim,
        H=cfg.base_moe_mlp_dim / mesh.product(place.hidden_axes),
        Hs=cfg.shared_experts * cfg.base_moe_mlp_dim / mesh.product(place.hidden_axes),
        E_c=cfg.num_experts // group if exchanged else cfg.num_experts,
        group=group,
        gathered=gathered,
        rest_shards=rest,
        gate_shards=mesh.product(place.embed_axes),
        replicas=max(1, mesh.num_devices // rest),
        xb=xb,
        pb=DTYPE_BYTES.get(cfg.param_dtype, 4),
        passes=3 if cfg.mode is Mode.train else 1,
        tile=cfg.gmm_tile_rows,
        buffer_factor=cfg.expert_buffer_factor,
        ragged=cfg.hardware.platform != "cpu",
        train=cfg.mode is Mode.train,
    )


def buffer_rows(p: Shape) -> float:
    """B: rows a device may send each owner per round (the layers' formula)."""
    share = p.buffer_factor * p.T * p.k / p.group
    return max(ROUND_ALIGN, ROUND_ALIGN * math.ceil(share / ROUND_ALIGN - 1e-9))


def expected_rounds(p: Shape, num_devices: int) -> int:
    """Exchange rounds under uniform routing: the most rows any device sends any owner
    (mean T k / G, binomial spread, the largest of every device-owner pair) over B."""
    if p.group <= 1:
        return 1
    mean = p.T * p.k / p.group
    sigma = math.sqrt(max(mean * (1 - 1 / p.group), 0.0))
    z = math.sqrt(2 * math.log(max(num_devices * p.group, 2)))
    return max(1, math.ceil((mean + z * sigma) / buffer_rows(p) - 1e-9))


def rows(strategy: Dispatch, p: Shape) -> float:
    """Rows each expert FFN processes per device, summed over experts."""
    if strategy is Dispatch.mlp:
        return p.T
    if strategy is Dispatch.megablox:
        # Each expert's group is padded to a whole tile: on average half a tile each.
        return p.T * p.k + min(p.E_c, p.T * p.k) * p.tile / 2
    if strategy is Dispatch.dense:
        return p.T * p.E
    return p.G * p.E * p.C  # subgroup_capacity


def forward_flops(strategy: Dispatch, p: Shape) -> float:
    ffn = 6 * rows(strategy, p) * p.M * p.H  # three matmuls of 2*M*H each
    router = 0 if strategy is Dispatch.mlp else 2 * p.T * p.M * p.E
    # Dispatch and combine einsums over the (S, E, C) mask.
    einsums = 4 * p.T * p.E * p.C * p.M if strategy is Dispatch.subgroup_capacity else 0
    shared = 6 * p.T * p.M * p.Hs  # every token through the shared experts
    return ffn + router + einsums + shared


def compute_weight_elements(strategy: Dispatch, p: Shape) -> float:
    """Elements of the expert weights a device computes with (its hidden slice),
    shared experts included."""
    experts = 1 if strategy is Dispatch.mlp else p.E_c
    return experts * 3 * p.M * p.H + 3 * p.M * p.Hs


def memory_parts(strategy: Dispatch, exchange: Exchange, p: Shape) -> dict[str, float]:
    """Hand counts of the temporaries, in bytes, one per way a buffer scales (see PARTS)."""
    n = rows(strategy, p)
    if strategy is Dispatch.megablox:
        n = p.T * p.k  # the grouped matmul reads rows in place: no padded copy
    if exchange is Exchange.all_to_all:
        n = p.group * buffer_rows(p)  # an owner's rows arrive in G slots of B
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
        "rows_h": (n * p.H + p.T * p.Hs) * p.xb,  # routed rows and every token's shared
        "router": p.T * p.E * ROUTER_BYTES if routed else 0.0,
        "choices": choices,
        "masks": p.T * p.E * p.C * p.xb if capacity_path else 0.0,
        "masks_k": p.T * p.k * p.E * p.C * p.xb if capacity_path else 0.0,
        "weights": weights,
        "gathered": weights if p.gathered > 1 else 0.0,
    }


def weight_rest_bytes(p: Shape, hidden_shards: int) -> float:
    """Expert weights (routed and shared) and router kernel one device holds at rest
    (param_dtype); the shared experts rest split over the embed and hidden axes."""
    experts = 3 * p.E * p.M * p.H * hidden_shards * p.pb / p.rest_shards
    shared = 3 * p.M * p.Hs * p.pb / p.gate_shards
    return experts + shared + p.M * p.E * p.pb / p.gate_shards


def temp_from_parts(key: str, parts: dict[str, float], train: bool = True) -> float:
    """Temp bytes from the hand counts and the fitted coefficients of `key`."""
    coeff = MEMORY_CALIBRATION.get(key, MEMORY_CALIBRATION.get(key.split("@")[0], {}))
    temp = sum(coeff.get(k, 1.0) * v for k, v in parts.items())
    # Nothing is kept for a backward pass outside training: about half stays live (a
    # guess; the fit covers training programs only).
    return temp if train else 0.5 * temp


def block_memory(
    strategy: Dispatch, exchange: Exchange, p: Shape, weights_rest: float, key: str
) -> Memory:
    temp = temp_from_parts(key, memory_parts(strategy, exchange, p), p.train)
    x = p.T * p.M * p.xb
    outputs = weights_rest + x if p.train else x
    return Memory(arguments=weights_rest + x, outputs=outputs, temp=temp)


def weights_read(strategy: Dispatch, p: Shape) -> float:
    """Expert-weight bytes one step reads from HBM: every expert for dense; for the
    routed paths only the experts that receive a row (expected, uniform routing)."""
    per_expert = 3 * p.M * p.H * p.xb
    shared = 3 * p.M * p.Hs * p.xb * p.passes
    if strategy is Dispatch.dense:
        hit = p.E_c
    elif strategy is Dispatch.mlp:
        hit = 1
    else:
        tokens = p.T * p.group  # an owner serves the rows of its whole group
        hit = p.E_c * (1 - (1 - p.k / p.E) ** tokens)
    return hit * per_expert * p.passes + shared


def traffic(strategy: Dispatch, exchange: Exchange, p: Shape, memory: Memory, rounds: int):
    act = memory.temp - sum(
        v for k, v in memory_parts(strategy, exchange, p).items() if k in ("weights", "gathered")
    )
    hbm = 2 * max(act, 0.0) * p.passes + weights_read(strategy, p)
    w_compute = compute_weight_elements(strategy, p) * p.xb
    trips = 2 if p.train else 1  # gather in; reduce-scatter the gradient out
    gather = w_compute * (1 - 1 / p.gathered) * trips
    exchange_bytes = 0.0
    if exchange is Exchange.all_to_all:
        sent = p.T * p.k if p.ragged else p.group * buffer_rows(p) * rounds
        # Forward: rows there, results back; backward: rows and their cotangents there,
        # input cotangents back (5 row-widths in all).
        widths = 5 if p.train else 2
        exchange_bytes = sent * p.M * p.xb * widths * (1 - 1 / p.group)
    weights = memory.arguments - p.T * p.M * p.xb
    grad = 2 * weights * (1 - 1 / p.replicas) if p.train else 0.0
    return Traffic(hbm, gather, exchange_bytes, grad)


def state_bytes(cfg: Config, p: Shape, weights_rest: float) -> float:
    """Weights, gradients and optimizer state of every MoE layer, at rest, per device."""
    per_layer = weights_rest
    if p.train:
        per_layer += weights_rest  # gradients
        per_layer += weights_rest / p.pb * cfg.optimizer_bytes_per_param
    return per_layer * max(cfg.num_moe_layers, 1)


def estimate(
    strategy: Dispatch,
    place: WeightPlacement,
    cfg: Config,
    mesh: MeshView,
    dev: PerDevice,
) -> Estimate:
    p = problem_shape(cfg, mesh, dev, place)
    rest = weight_rest_bytes(p, mesh.product(place.hidden_axes))
    rounds = expected_rounds(p, mesh.num_devices) if place.exchange is Exchange.all_to_all else 1
    memory = block_memory(
        strategy, place.exchange, p, rest, calibration_key(strategy, place.exchange, cfg)
    )
    moved = traffic(strategy, place.exchange, p, memory, rounds)
    hw = cfg.hardware
    link = hw.dcn_bandwidth_gbps if _crosses_slices(cfg, mesh, place) else hw.ici_bandwidth_gbps
    parts = (
        forward_flops(strategy, p) * p.passes / (hw.peak_bf16_tflops * 1e12),
        moved.hbm / (hw.hbm_bandwidth_gbps * 1e9),
        moved.network / (link * 1e9),
    )
    state = state_bytes(cfg, p, rest)
    est = Estimate(
        strategy=strategy,
        exchange=place.exchange,
        flops=forward_flops(strategy, p) * p.passes,
        memory=memory,
        state_bytes=state,
        traffic=moved,
        rounds=rounds,
        time_s=sum(parts),
        time_parts=parts,
        fits=True,
        input_bytes=p.T * p.M * p.xb,
    )
    return dataclasses.replace(est, fits=est.device_bytes <= hw.memory_gib * 2**30)


def _crosses_slices(cfg: Config, mesh: MeshView, place: WeightPlacement) -> bool:
    """Whether the weights' gather or the rows' exchange spans a DCN axis."""
    if place.exchange is Exchange.all_to_all:
        axes = place.group_axes
    else:
        axes = place.experts_axes + place.embed_axes
    return any(cfg.parallelism("dcn", a) > 1 for a in axes if a in MESH_AXES)
