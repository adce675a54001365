"""The problem one analysis prices, made once per config: the mesh as the selector sees
it, the batch a device holds, and the MoE block in the letters the kernels use (sizes,
dtypes, how the weights are split, and the rows each expert FFN processes)."""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from .config import DTYPE_BYTES, Config, Dispatch, Exchange, GmmBackend, Hardware, Mode
from .mesh import MeshView
from .per_device import PerDevice, per_device
from .placement import WeightPlacement
from .plan_sizes import GmmTiling, exchange_buffer_rows, shared_width
from .tiles import exchanged_calls, gathered_calls, kernel_rows, routed_rows
from .tiling import TileOption, TileShape
from .tiling import choose as choose_tiling
from .traits import jax_release, traits

# Row tile of each backend. The Pallas kernels and tiled_gmm are counted from their own
# tile plans (selector.tiles); ragged_dot on TPU is XLA's lowering, whose plan we have
# not read, so it is priced at half a 128-row tile per expert, as is tokamax's kernel.
GMM_TAIL_ROWS = {"pallas_megablox": 128, "ragged_dot": 128, "tiled_gmm": 64, "tokamax": 128}


def gmm_backend(cfg: Config) -> str:
    """Grouped-matmul backend for the megablox dispatch: the one asked for, else the
    platform's. On GPU not `ragged_dot`: XLA:GPU (jax 0.10.2's CUDA plugin) lowers it to
    masked dense matmuls over every group, while tiled_gmm compiles to grouped work
    there (both compiled ahead of time for 8 x H100; README, "Compiled for TPU and GPU")."""
    if cfg.gmm_backend is not GmmBackend.auto:
        return cfg.gmm_backend.value
    return traits(cfg.hardware.platform).native_gmm


@dataclass(frozen=True)
class Problem:
    """The problem one analysis prices: config and mesh in (`config_problem`), one
    frozen value out, placed per candidate (`placed`).

    Attributes:
      mesh: the mesh as the selector sees it (axis sizes and roles).
      per_device: the batch and tokens one device holds (MaxText's batch rule).
      T, G, S, E, k, C, M, H, ...: the MoE block on one device, in the letters the
        kernels use (each commented below).
    """

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
    gate_shards: int  # shards of the router kernel (and the shared experts) at rest
    replicas: int  # devices holding the same weight shard (their gradients are summed)
    xb: int  # bytes per element of the compute dtype
    pb: int  # bytes per element of the parameters
    passes: int  # 3 when training (forward plus a backward of about twice its cost)
    tile: int  # row tile of the grouped matmul (half of it priced per expert: ragged_dot)
    gmm_dense: bool  # the grouped matmul computes every group on every row
    buffer_factor: float
    ragged: bool  # the exchange sends exactly the rows (no padding to B)
    train: bool
    # Of the devices each collective spans, how many slices it crosses over DCN (1: all
    # within a slice, over ICI): the weights' gather, the exchange's group, the devices
    # that sum the same gradient shard, and the hidden axes' all-reduce of the output.
    gathered_dcn: int = 1
    gate_dcn: int = 1  # of the shared experts' and router's gather
    group_dcn: int = 1
    replicas_dcn: int = 1
    hidden_shards: int = 1
    hidden_dcn: int = 1
    kernel: str = "tiled_gmm"  # the grouped-matmul backend (gmm_backend)
    shared_gate: bool = False  # the shared experts' output scaled by a sigmoid gate
    # The dense path's activations written in another layout (Traits.dense_activation_copies)
    dense_copies: tuple[int, ...] = (0, 0, 0, 0)
    embed_gathered: int = 1  # devices the weights' embed dim is gathered from
    relayouts: tuple[str, ...] = ()  # matrices relaid around that gather (Traits)
    # The grouped matmul's tiling (megablox; `tile` is its tm) and the tiles priced.
    tiling: GmmTiling | None = None
    tile_options: tuple[TileOption, ...] = ()
    # What the config says once, read by every candidate's count (`config_problem`):
    # the experts' hidden widths before the hidden axes split them, the MoE layers, the
    # optimizer's bytes a parameter, the row tile asked for, the chip and the jax
    # release its compiler comes with.
    moe_hidden: int = 0
    shared_hidden: float = 0.0
    moe_layers: int = 1
    optimizer_bytes_per_param: float = 0.0
    row_tile_asked: int = 0
    hardware: Hardware | None = dataclasses.field(default=None, repr=False)
    release: tuple[int, int] = (0, 0)
    mesh: MeshView | None = dataclasses.field(default=None, repr=False)
    per_device: PerDevice | None = dataclasses.field(default=None, repr=False)


def config_problem(cfg: Config, mesh: MeshView) -> Problem:
    """The problem as the config sets it on `mesh`, the same for every candidate (its
    expert weights not yet placed: `placed` splits them); made once per config."""
    hw = cfg.hardware
    release = jax_release(hw.jax_version)
    compiler, kernel = traits(hw.platform, release), gmm_backend(cfg)
    dev = per_device(cfg, mesh)
    cap = dev.capacity_per_subgroup
    if cap is None:  # a dropless run priced on the capacity path: the factor-1 capacity
        cap = max(1, math.ceil(dev.expected_tokens_per_expert))
    shared = shared_width(cfg.shared_experts, cfg.base_moe_mlp_dim, cfg.shared_expert_gate)
    train = cfg.mode is Mode.train
    return Problem(
        T=dev.tokens_per_device,
        G=dev.tokens_per_device / max(dev.sub_seq, 1e-9),
        S=dev.sub_seq,
        E=cfg.num_experts,
        k=cfg.num_experts_per_tok,
        C=cap,
        M=cfg.base_emb_dim,
        H=cfg.base_moe_mlp_dim,
        Hs=shared,
        E_c=cfg.num_experts,
        group=1,
        gathered=1,
        rest_shards=1,
        gate_shards=1,
        replicas=mesh.num_devices,
        xb=DTYPE_BYTES.get(cfg.dtype, 4),
        pb=DTYPE_BYTES.get(cfg.param_dtype, 4),
        passes=3 if train else 1,
        tile=GMM_TAIL_ROWS[kernel],
        # ragged_dot off TPU lowers to masked dense matmuls over every group (measured).
        gmm_dense=kernel == "ragged_dot" and traits(hw.platform).ragged_dot_dense,
        buffer_factor=cfg.expert_buffer_factor,
        ragged=traits(hw.platform).ragged_exchange,
        train=train,
        kernel=kernel,
        shared_gate=cfg.shared_expert_gate and cfg.shared_experts > 0,
        relayouts=compiler.gather_relayouts,
        dense_copies=compiler.dense_activation_copies[train],
        moe_hidden=cfg.base_moe_mlp_dim,
        shared_hidden=shared,
        moe_layers=max(cfg.num_moe_layers, 1),
        optimizer_bytes_per_param=cfg.optimizer_bytes_per_param,
        row_tile_asked=cfg.gmm_row_tile,
        hardware=hw,
        release=release,
        mesh=mesh,
        per_device=dev,
    )


def placed(base: Problem, place: WeightPlacement) -> Problem:
    """`base` (`config_problem`) with its expert weights at `place`: how they are split
    at rest, gathered or exchanged, and the grouped matmul's tile for the rows that
    follow."""
    mesh = base.mesh
    exchanged = place.exchange is Exchange.all_to_all
    group = mesh.product(place.group_axes) if exchanged else 1
    rest_axes = place.experts_axes + place.embed_axes + place.hidden_axes
    rest = mesh.product(rest_axes)
    # Exchanged weights keep their expert split; only the embed split is gathered.
    gathered_axes = place.embed_axes + (() if exchanged else place.experts_axes)
    replica_axes = tuple(a for a, n in mesh.sizes if n > 1 and a not in rest_axes)
    hidden = mesh.product(place.hidden_axes)
    p = dataclasses.replace(
        base,
        H=base.moe_hidden / hidden,
        Hs=base.shared_hidden / hidden,
        E_c=base.E // group if exchanged else base.E,
        group=group,
        gathered=mesh.product(gathered_axes),
        rest_shards=rest,
        gate_shards=mesh.product(place.shared_embed_axes),
        gate_dcn=mesh.dcn_product(place.shared_embed_axes),
        replicas=max(1, mesh.num_devices // rest),
        gathered_dcn=mesh.dcn_product(gathered_axes),
        group_dcn=mesh.dcn_product(place.group_axes) if exchanged else 1,
        replicas_dcn=mesh.dcn_product(replica_axes),
        hidden_shards=hidden,
        hidden_dcn=mesh.dcn_product(place.hidden_axes),
        embed_gathered=mesh.product(place.embed_axes),
    )
    return with_tiling(p)


def problem_shape(cfg: Config, mesh: MeshView, place: WeightPlacement) -> Problem:
    """One candidate's problem from the config: `placed(config_problem(...), place)`."""
    return placed(config_problem(cfg, mesh), place)


def with_tiling(p: Problem) -> Problem:
    """`p` with the grouped matmul's row tile chosen for its rows (selector.tiling):
    the Pallas kernels' `tm` becomes `p.tile`, which the rows are counted at."""
    shape = TileShape(
        routed=routed_rows(p.T, p.k),
        experts=p.E,
        group=p.group,
        buffer=int(buffer_rows(p)),
        emb=p.M,
        hidden=max(1, round(p.H)),
        itemsize=p.xb,
        train=p.train,
    )
    hw = p.hardware
    tiling, options = choose_tiling(
        p.kernel, shape, p.row_tile_asked, hw.matmul_tflops * 1e12, hw.hbm_bandwidth_gbps * 1e9
    )
    tile = tiling.tm if p.kernel == "pallas_megablox" else p.tile
    return dataclasses.replace(p, tile=tile, tiling=tiling, tile_options=options)


def link_split(total: float, devices: int, slices: int) -> tuple[float, float]:
    """(ICI bytes, DCN bytes) a device moves in a collective over `devices` that cross
    `slices` slices, run hierarchically as XLA runs them: `total` is what a flat
    collective would move, total x (1 - 1/devices); of it, the share among the slices,
    total / (devices / slices) x (1 - 1/slices) / (1 - 1/devices), crosses DCN."""
    if devices <= 1 or total <= 0:
        return 0.0, 0.0
    per_slice = devices / slices
    whole = total / (1 - 1 / devices)  # the bytes of the collected array
    dcn = whole * (1 - 1 / slices) / per_slice
    return total - dcn, dcn


def exchange_split(rows_bytes: float, group: int, slices: int) -> tuple[float, float]:
    """(ICI bytes, DCN bytes) of an all-to-all in which a device's `rows_bytes` go to
    the `group` members evenly: rows for members in other slices cross DCN directly."""
    if group <= 1:
        return 0.0, 0.0
    dcn = rows_bytes * (1 - 1 / slices)
    ici = rows_bytes / slices * (1 - slices / group)
    return ici, dcn


def buffer_rows(p: Problem) -> float:
    """B for the per-device problem (routed rows T x k over the expert group)."""
    return exchange_buffer_rows(p.T * p.k, p.group, p.buffer_factor)


def round_buffer_bytes(p: Problem) -> float:
    """Bytes of one of the exchange's (G, B, M) round buffers in the compute dtype."""
    return p.group * buffer_rows(p) * p.M * p.xb


@functools.lru_cache(maxsize=1024)
def kernel_rows_uniform(
    kernel: str, routed: int, experts: int, group: int, buffer: int, tm: int = 128
) -> float:
    """Rows `kernel` computes on a device under uniform routing: one call over the
    device's `routed` rows (group 1, gathered), or one call per exchange slot of
    `buffer` rows (`group` > 1); `tm`: the Pallas kernels' row tile, their tiles
    counted on average over where groups start (`pallas_expected_tiles`). Cached:
    every candidate and every fix prices it."""
    if group > 1:
        calls = exchanged_calls(routed, experts, group, buffer)
    else:
        calls = gathered_calls(routed, experts)
    return kernel_rows(kernel, calls, tm, expected=True)


def rows(strategy: Dispatch, p: Problem) -> float:
    """Rows each expert matmul computes per device, summed over experts, padding
    included (the grouped matmuls' tiles, counted from their tile plans)."""
    if strategy is Dispatch.mlp:
        return p.T
    if strategy is Dispatch.megablox:
        if p.gmm_dense:
            return p.T * p.k * p.E_c
        if p.kernel in ("pallas_megablox", "tiled_gmm"):
            routed = routed_rows(p.T, p.k)
            buffer = int(buffer_rows(p))
            return float(kernel_rows_uniform(p.kernel, routed, p.E, p.group, buffer, p.tile))
        # Each expert's last tile is computed whole: on average half a tile each.
        return p.T * p.k + min(p.E_c, p.T * p.k) * p.tile / 2
    if strategy is Dispatch.dense:
        return p.T * p.E
    return p.G * p.E * p.C  # subgroup_capacity
