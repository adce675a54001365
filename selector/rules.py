"""Validation rules: one small function per rule, each returning its findings.

Three stages, because later ones need what earlier ones guarantee:
settings (plain values), layout (mesh and per-device numbers), strategy (the choice).
"""

from __future__ import annotations

import math

from .config import DTYPE_BYTES, Config, Dispatch, Mode
from .cost import Estimate
from .derive import PerDevice, is_whole
from .findings import Finding, error, warning
from .mesh import MeshView

DROPLESS = (Dispatch.megablox, Dispatch.dense, Dispatch.mlp)
DROP_WARNING_FRACTION = 0.01  # warn when uniform routing alone would drop more than this


def _fmt(x: float) -> str:
    return f"{x:g}" if not is_whole(x) else f"{round(x):,}"


# --- settings: plain values, checked before anything is derived from them ---------


def positive_dims(cfg: Config) -> list[Finding]:
    names = (
        "base_emb_dim",
        "base_moe_mlp_dim",
        "num_experts",
        "num_experts_per_tok",
        "max_target_length",
        "per_device_batch_size",
        "gmm_tile_rows",
    )
    return [
        error(
            "VALUE_NOT_POSITIVE",
            n,
            f"{n}={getattr(cfg, n)} must be positive: nothing can be sized from a zero, "
            f"negative or NaN value. Set {n} to a positive number, or pick a model= "
            "preset that sets it.",
        )
        for n in names
        if not 0 < getattr(cfg, n) < math.inf  # also catches NaN
    ]


def finite_capacity_factor(cfg: Config) -> list[Finding]:
    if math.isfinite(cfg.capacity_factor):
        return []
    return [
        error(
            "CAPACITY_FACTOR_INVALID",
            "capacity_factor",
            f"capacity_factor={cfg.capacity_factor} is not a finite number. Use a value > 0 "
            "(1.0 to 1.5 is usual) for capacity-limited routing, or -1 for dropless.",
        )
    ]


def top_k_within_experts(cfg: Config) -> list[Finding]:
    if cfg.num_experts_per_tok > cfg.num_experts > 0:
        return [
            error(
                "TOPK_EXCEEDS_EXPERTS",
                "num_experts_per_tok",
                f"num_experts_per_tok={cfg.num_experts_per_tok} exceeds num_experts="
                f"{cfg.num_experts}: a token cannot pick more experts than exist. Set "
                f"num_experts_per_tok <= {cfg.num_experts}.",
            )
        ]
    return []


def known_dtype(cfg: Config) -> list[Finding]:
    if cfg.dtype not in DTYPE_BYTES:
        return [
            error(
                "DTYPE_UNKNOWN",
                "dtype",
                f"dtype={cfg.dtype!r} is not one of {', '.join(DTYPE_BYTES)}, so its "
                "bytes per element are unknown. Use one of those names.",
            )
        ]
    return []


def hardware_values(cfg: Config) -> list[Finding]:
    hw = cfg.hardware
    names = ("memory_gib", "peak_bf16_tflops", "hbm_bandwidth_gbps")
    return [
        error(
            "HARDWARE_INVALID",
            f"hardware.{n}",
            f"hardware.{n}={getattr(hw, n)} must be positive; pick a preset with "
            "hardware=<chip> or set the number.",
        )
        for n in names
        if not getattr(hw, n) > 0
    ]


def mlp_needs_one_expert(cfg: Config) -> list[Finding]:
    if cfg.dispatch is Dispatch.mlp and cfg.num_experts > 1:
        return [
            error(
                "DISPATCH_MLP_WITH_EXPERTS",
                "dispatch",
                f"dispatch=mlp runs one dense MLP, but num_experts={cfg.num_experts}: the "
                "router would be ignored. Use dispatch=dense (every expert, weighted) or "
                "dispatch=auto.",
            )
        ]
    return []


SETTINGS_RULES = (
    positive_dims,
    finite_capacity_factor,
    top_k_within_experts,
    known_dtype,
    hardware_values,
    mlp_needs_one_expert,
)


# --- layout: the mesh and the per-device numbers ------------------------------------


def global_batch_whole(cfg: Config, mesh: MeshView, dev: PerDevice) -> list[Finding]:
    if is_whole(dev.global_batch):
        return []
    return [
        error(
            "GLOBAL_BATCH_FRACTIONAL",
            "per_device_batch_size",
            f"per_device_batch_size={cfg.per_device_batch_size:g} x {dev.num_devices} devices "
            f"= {dev.global_batch:g} sequences, not a whole number. Choose "
            f"per_device_batch_size as a multiple of 1/{dev.num_devices}.",
        )
    ]


def batch_divides_shards(cfg: Config, mesh: MeshView, dev: PerDevice) -> list[Finding]:
    if not is_whole(dev.global_batch) or is_whole(dev.local_batch):
        return []
    gb = round(dev.global_batch)
    shards = dev.batch_shards
    good = math.lcm(gb, shards) if gb else shards
    return [
        error(
            "BATCH_NOT_DIVISIBLE",
            "per_device_batch_size",
            f"The global batch of {gb} sequences does not divide over the {shards} batch "
            f"shards ({' x '.join(f'{a}={mesh.size(a)}' for a in mesh.batch_axes)}): "
            f"{dev.local_batch:g} sequences each, so XLA pads or replicates without a word. "
            f"Make the global batch a multiple of {shards}, e.g. per_device_batch_size="
            f"{good / dev.num_devices:g} (global batch {good}).",
        )
    ]


def local_batch_inflation(cfg: Config, mesh: MeshView, dev: PerDevice) -> list[Finding]:
    if cfg.mode is Mode.decode or dev.cp <= 1 or dev.local_batch <= 1 + 1e-9:
        return []
    if not is_whole(dev.local_batch):
        return []  # reported by batch_divides_shards
    fix = cfg.per_device_batch_size / dev.local_batch
    knobs = " x ".join(f"{a}={mesh.size(a)}" for a in mesh.sequence_axes if mesh.size(a) > 1)
    f = error if not cfg.allow_local_batch_inflation else warning
    return [
        f(
            "LOCAL_BATCH_INFLATION",
            "per_device_batch_size",
            f"Context parallelism cp={dev.cp} ({knobs}) with per_device_batch_size="
            f"{cfg.per_device_batch_size:g}: the global batch of {_fmt(dev.global_batch)} "
            f"sequences over {dev.batch_shards} batch shards puts "
            f"{_fmt(dev.local_batch)} sequences on each shard, so every device holds "
            f"{_fmt(dev.tokens_per_device)} tokens, the same as with cp=1. The local batch "
            f"grew with cp and the sequence sharding saves nothing. Fix: "
            f"per_device_batch_size={fix:g} (one sequence per batch shard, "
            f"{_fmt(dev.sub_seq)} tokens per device); or accept it knowingly with "
            "allow_local_batch_inflation=true.",
        )
    ]


def sequence_divides_cp(cfg: Config, mesh: MeshView, dev: PerDevice) -> list[Finding]:
    if cfg.mode is Mode.decode or dev.cp <= 1:
        return []
    seq = cfg.max_target_length
    if seq % dev.cp:
        return [
            error(
                "SEQUENCE_NOT_DIVISIBLE",
                "max_target_length",
                f"max_target_length={seq} is not divisible by cp={dev.cp}; frameworks that "
                "meet this silently fall back to cp=1 in the MoE block. Use a multiple of "
                f"{dev.cp} (e.g. {seq - seq % dev.cp or dev.cp}).",
            )
        ]
    if cfg.context_parallel_load_balance and seq % (2 * dev.cp):
        return [
            error(
                "SEQUENCE_NOT_DIVISIBLE_LOAD_BALANCE",
                "max_target_length",
                f"context_parallel_load_balance=true splits each sequence into 2 x cp = "
                f"{2 * dev.cp} chunks, but max_target_length={seq} is not divisible by "
                f"{2 * dev.cp}. Use a multiple of {2 * dev.cp} or set "
                "context_parallel_load_balance=false.",
            )
        ]
    return []


# (finding code, dimension setting, mesh-view role, knob that sizes the role, fix hint)
WEIGHT_DIVISIBILITY = (
    (
        "EXPERTS_NOT_DIVISIBLE",
        "num_experts",
        "expert_axes",
        "ici_expert_parallelism",
        "Use an expert parallelism that divides it.",
    ),
    (
        "HIDDEN_NOT_DIVISIBLE",
        "base_moe_mlp_dim",
        "hidden_axes",
        "ici_tensor_parallelism",
        "Use a tensor parallelism that divides it.",
    ),
    (
        "EMBED_NOT_DIVISIBLE",
        "base_emb_dim",
        "embed_axes",
        "ici_fsdp_parallelism",
        "Use an fsdp size that divides it, or move devices to data.",
    ),
)


def weights_divide_axes(cfg: Config, mesh: MeshView, dev: PerDevice) -> list[Finding]:
    """Each weight dimension must split evenly over the axes it rests sharded on."""
    findings = []
    for code, dim, role, knob, fix in WEIGHT_DIVISIBILITY:
        axes = getattr(mesh, role)
        shards, size = mesh.product(axes), getattr(cfg, dim)
        if size % shards:
            findings.append(
                error(
                    code,
                    knob,
                    f"{dim}={size} is not divisible by the {shards} shards "
                    f"({' x '.join(f'{a}={mesh.size(a)}' for a in axes)}) the weights rest on. "
                    f"{fix}",
                )
            )
    return findings


def tokens_replicated(cfg: Config, mesh: MeshView, dev: PerDevice) -> list[Finding]:
    axes = mesh.replicating_axes
    if not axes:
        return []
    shown = ", ".join(f"{a}={mesh.size(a)}" for a in axes)
    return [
        warning(
            "TOKENS_REPLICATED",
            "axis_rules.sequence",
            f"{shown} shards neither the batch nor the sequence of the MoE block's tokens, "
            f"so {dev.replication} devices hold the same {_fmt(dev.tokens_per_device)} "
            "tokens and repeat their routing and dispatch (a hidden axis still splits the "
            "expert matmuls). To split the tokens too, add the axis to axis_rules.sequence "
            "(sequence parallelism) or move those devices to data or fsdp.",
        )
    ]


def decode_context(cfg: Config, mesh: MeshView, dev: PerDevice) -> list[Finding]:
    if cfg.mode is Mode.decode and dev.cp > 1:
        return [
            warning(
                "DECODE_CONTEXT_PARALLEL",
                "ici_context_parallelism",
                f"mode=decode feeds one token per sequence, which cp={dev.cp} cannot split: "
                f"each of the {dev.cp} sequence shards routes the same token. Use cp=1 for "
                "decode meshes.",
            )
        ]
    return []


LAYOUT_RULES = (
    global_batch_whole,
    batch_divides_shards,
    local_batch_inflation,
    sequence_divides_cp,
    weights_divide_axes,
    tokens_replicated,
    decode_context,
)


# --- strategy: what the chosen dispatch does with these settings ---------------------


def poisson_drop_fraction(mean: float, cap: int) -> float:
    """Expected fraction of tokens over capacity when each expert's load is Poisson(mean)."""
    if mean <= 0:
        return 0.0
    if cap > mean + 12 * math.sqrt(mean) + 12:
        return 0.0
    if mean > 1000:  # normal approximation: the exact sum would loop `cap` times
        sigma = math.sqrt(mean)
        z = (cap - mean) / sigma
        pdf = math.exp(-z * z / 2) / math.sqrt(2 * math.pi)
        tail = 0.5 * math.erfc(z / math.sqrt(2))
        return max(0.0, sigma * (pdf - z * tail)) / mean
    # E[max(X - C, 0)] = mean - C + sum_{x <= C} (C - x) p(x)
    log_p = -mean
    below = 0.0
    for x in range(cap + 1):
        below += (cap - x) * math.exp(log_p)
        log_p += math.log(mean) - math.log(x + 1)
    return max(0.0, mean - cap + below) / mean


def capacity_settings(cfg: Config, dev: PerDevice, strategy: Dispatch) -> list[Finding]:
    cf = cfg.capacity_factor
    if strategy is Dispatch.subgroup_capacity and cf <= 0:
        return [
            error(
                "CAPACITY_REQUIRED",
                "capacity_factor",
                f"dispatch=subgroup_capacity drops tokens beyond each expert's capacity, but "
                f"capacity_factor={cf:g} asks for dropless routing. Set capacity_factor > 0 "
                "(1.0 to 1.5 is usual) or use dispatch=megablox.",
            )
        ]
    if strategy in DROPLESS and cf > 0:
        return [
            warning(
                "CAPACITY_IGNORED",
                "capacity_factor",
                f"capacity_factor={cf:g} has no effect: dispatch={strategy.value} is dropless "
                "and routes every token. Set capacity_factor=-1 to say so, or "
                "dispatch=subgroup_capacity to cap expert loads.",
            )
        ]
    return []


def capacity_too_small(cfg: Config, dev: PerDevice, strategy: Dispatch) -> list[Finding]:
    if strategy is not Dispatch.subgroup_capacity or dev.capacity_per_subgroup is None:
        return []
    raw = dev.expected_tokens_per_expert * cfg.capacity_factor
    cap = dev.capacity_per_subgroup
    if raw < 1:
        return [
            warning(
                "CAPACITY_BELOW_ONE",
                "capacity_factor",
                f"Per-subgroup capacity is sub_seq x k / E x capacity_factor = "
                f"{_fmt(dev.sub_seq)} x {cfg.num_experts_per_tok} / {cfg.num_experts} x "
                f"{cfg.capacity_factor:g} = {raw:.3g}, under one token per expert (rounded up "
                "to 1). Raise capacity_factor, lower cp, or use dispatch=megablox.",
            )
        ]
    dropped = poisson_drop_fraction(dev.expected_tokens_per_expert, cap)
    if dropped > DROP_WARNING_FRACTION:
        return [
            warning(
                "DROPS_LIKELY",
                "capacity_factor",
                f"Each subgroup of {_fmt(dev.sub_seq)} tokens expects "
                f"{dev.expected_tokens_per_expert:.3g} tokens per expert against a capacity "
                f"of {cap}; even perfectly uniform routing would drop about {dropped:.1%} "
                "of assignments. Raise capacity_factor, use longer sub-sequences (lower cp), "
                "or dispatch=megablox.",
            )
        ]
    return []


def memory_fits(cfg: Config, dev: PerDevice, strategy: Dispatch, est: Estimate) -> list[Finding]:
    if est.fits:
        return []
    gib = est.memory_bytes / 2**30
    return [
        error(
            "MEMORY_EXCEEDED",
            "dispatch",
            f"dispatch={strategy.value} needs about {gib:.1f} GiB per device in the MoE block "
            f"({est.activation_bytes / 2**30:.1f} GiB activations, "
            f"{est.weight_bytes / 2**30:.1f} GiB gathered expert weights), more than the "
            f"{cfg.hardware.memory_gib:g} GiB of a {cfg.hardware.name}. Raise cp or the batch "
            "shards, lower per_device_batch_size, or pick a lighter dispatch.",
        )
    ]


def exchange_settings(cfg: Config, mesh: MeshView, strategy: Dispatch, options) -> list[Finding]:
    """An explicit expert_exchange=all_to_all the block cannot honour, and expert groups
    that do not split num_experts evenly."""
    from .config import Exchange  # noqa: PLC0415 - keeps this module's imports light

    if cfg.expert_exchange is not Exchange.all_to_all:
        return []
    placed = options.get(Exchange.all_to_all)
    if strategy is not Dispatch.megablox:
        return [
            error(
                "EXCHANGE_NEEDS_MEGABLOX",
                "expert_exchange",
                f"expert_exchange=all_to_all sends routed rows to their experts' owners, which "
                f"only the megablox dispatch does; dispatch={strategy.value} computes every "
                "expert on every device. Use dispatch=megablox, or expert_exchange=gather.",
            )
        ]
    if placed is None:
        return [
            error(
                "EXPERT_GROUP_EMPTY",
                "expert_exchange",
                "expert_exchange=all_to_all needs an expert group: an expert axis or a "
                "sequence axis of size > 1 that splits the tokens (the mesh has none). Set "
                "ici_expert_parallelism or a context axis > 1, or expert_exchange=gather.",
            )
        ]
    group = mesh.product(placed.group_axes)
    if cfg.num_experts % group:
        shown = " x ".join(f"{a}={mesh.size(a)}" for a in placed.group_axes)
        return [
            error(
                "EXPERTS_NOT_DIVISIBLE_BY_GROUP",
                "expert_group",
                f"num_experts={cfg.num_experts} does not split over the expert group ({shown} "
                f"= {group} devices). Use expert_group=expert (leave the sequence axes out), "
                f"a group size that divides {cfg.num_experts}, or expert_exchange=gather.",
            )
        ]
    return []
