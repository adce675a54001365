"""Rules on plain values, checked before anything is derived from them."""

from __future__ import annotations

import dataclasses
import importlib.util
import math

from ..config import COMPUTE_DTYPES, PARAM_DTYPES, Config, Dispatch, GmmBackend, Hardware
from ..findings import Finding, error, fix, warning
from ..plan_sizes import pallas_row_tile_ok, pallas_sublane_rows
from ..problem import gmm_backend as gmm_backend_of
from ..traits import traits

POSITIVE = (
    "base_emb_dim",
    "base_moe_mlp_dim",
    "base_num_decoder_layers",
    "num_experts",
    "num_experts_per_tok",
    "max_target_length",
    "per_device_batch_size",
    "expert_buffer_factor",
    "routed_scaling_factor",
)


def _finite(value) -> bool:
    return not isinstance(value, float) or math.isfinite(value)


def positive_dims(cfg: Config) -> list[Finding]:
    return [
        error(
            "VALUE_NOT_POSITIVE",
            n,
            f"{n}={getattr(cfg, n)} must be positive: nothing can be sized from a zero or "
            f"negative value. Set {n} to a positive number, or pick a model= preset that "
            "sets it.",
            [fix("the schema's default", **{n: _default(Config, n)})],
        )
        for n in POSITIVE
        if _finite(getattr(cfg, n)) and not getattr(cfg, n) > 0  # non_finite says the rest
    ]


def _default(schema, name: str):
    return next(f.default for f in dataclasses.fields(schema) if f.name == name)


def _float_settings(cfg: Config):
    """(key, value, schema default) of every float setting; capacity_factor has its own
    rule, where a non-finite value means one of two different things."""
    for f in dataclasses.fields(Config):
        if f.type == "float" and f.name != "capacity_factor":
            yield f.name, getattr(cfg, f.name), f.default
    for f in dataclasses.fields(Hardware):
        if f.type == "float":
            yield f"hardware.{f.name}", getattr(cfg.hardware, f.name), None


# A chip's number has no default to fall back on: it is the chip's, not the schema's.
_CHIP_NUMBER = (
    "No value is offered: the number belongs to the chip ({chip}); pick its preset "
    "with hardware=<chip> or give {key} the chip's own value."
)


def non_finite(cfg: Config) -> list[Finding]:
    """inf or nan in a float setting: no size, time or count can be derived from it."""
    found = []
    for key, value, default in _float_settings(cfg):
        if _finite(value):
            continue
        what = "NaN (not a number, often 0/0 in a script)" if value != value else "infinite"
        if default is None:
            found.append(
                error(
                    "VALUE_NOT_FINITE",
                    key,
                    f"{key}={value} is {what}; it must be a finite number.",
                    no_fix=_CHIP_NUMBER.format(chip=cfg.hardware.name, key=key),
                )
            )
            continue
        found.append(
            error(
                "VALUE_NOT_FINITE",
                key,
                f"{key}={value} is {what}; it must be a finite number.",
                [fix("the schema's default", **{key: default})],
                no_fix=f"Give {key} a finite value.",
            )
        )
    return found


MAX_TOKENS = 2**40  # per device per step: far beyond any machine
# The kernels' schedules are counted expert by expert (selector.tiles), so the count's
# time and memory grow with num_experts: 2**31 experts would hold every group's size in
# memory before a word is printed. 65,536 is 128 times the most routed experts of any
# model preset (Qwen3-Next's 512) and is counted in under a second.
MAX_EXPERTS = 2**16


def sizes_in_range(cfg: Config) -> list[Finding]:
    """Sizes past any machine (a typo's 1e300) would only overflow the arithmetic, and
    an expert count past MAX_EXPERTS would only exhaust the counting's memory."""
    if not all(0 < getattr(cfg, n) < math.inf for n in POSITIVE):
        return []  # positive_dims says so
    found = []
    if cfg.num_experts > MAX_EXPERTS:
        found.append(
            error(
                "VALUE_TOO_LARGE",
                "num_experts",
                f"num_experts={cfg.num_experts:,} is more than {MAX_EXPERTS:,} experts, the "
                "most the selector counts (its count of the grouped matmul's schedule goes "
                "expert by expert; the largest preset routes 512). Check the value.",
                [fix(num_experts=_default(Config, "num_experts"))],
                no_fix="The count is the model's: give num_experts the model's own value, or "
                "pick its preset with model=<name>.",
            )
        )
    if cfg.per_device_batch_size * cfg.max_target_length > MAX_TOKENS:
        found.append(
            error(
                "VALUE_TOO_LARGE",
                "per_device_batch_size",
                f"per_device_batch_size={cfg.per_device_batch_size:g} x max_target_length="
                f"{cfg.max_target_length} is more than {MAX_TOKENS:,} tokens a device, beyond "
                "any machine. Check the value.",
                [
                    fix(per_device_batch_size=_default(Config, "per_device_batch_size")),
                    fix(max_target_length=_default(Config, "max_target_length")),
                ],
            )
        )
    return found


def finite_capacity_factor(cfg: Config) -> list[Finding]:
    if math.isfinite(cfg.capacity_factor):
        return []
    return [
        error(
            "CAPACITY_FACTOR_INVALID",
            "capacity_factor",
            f"capacity_factor={cfg.capacity_factor} is not a finite number: use a value > 0 "
            "(1.0 to 1.5 is usual) for capacity-limited routing, or -1 for dropless.",
            [fix(capacity_factor=-1.0), fix(capacity_factor=1.25)],
        )
    ]


def top_k_within_experts(cfg: Config) -> list[Finding]:
    if cfg.num_experts_per_tok > cfg.num_experts > 0:
        return [
            error(
                "TOPK_EXCEEDS_EXPERTS",
                "num_experts_per_tok",
                f"num_experts_per_tok={cfg.num_experts_per_tok} exceeds num_experts="
                f"{cfg.num_experts}: a token cannot pick more experts than exist.",
                [fix(num_experts_per_tok=cfg.num_experts)],
            )
        ]
    return []


def known_dtypes(cfg: Config) -> list[Finding]:
    found = []
    if cfg.dtype not in COMPUTE_DTYPES:
        found.append(
            error(
                "DTYPE_UNKNOWN",
                "dtype",
                f"dtype={cfg.dtype!r} is not a compute dtype the layers run in "
                f"({', '.join(COMPUTE_DTYPES)}).",
                [fix(dtype="bfloat16"), fix(dtype="float32")],
            )
        )
    if cfg.param_dtype not in PARAM_DTYPES:
        found.append(
            error(
                "PARAM_DTYPE_UNKNOWN",
                "param_dtype",
                f"param_dtype={cfg.param_dtype!r} is not a dtype the layers can store weights "
                f"in ({', '.join(PARAM_DTYPES)}).",
                [fix(param_dtype="float32"), fix(param_dtype="bfloat16")],
            )
        )
    return found


def hardware_values(cfg: Config) -> list[Finding]:
    hw = cfg.hardware
    names = (
        "memory_gib",
        "matmul_tflops",
        "hbm_bandwidth_gbps",
        "ici_bandwidth_gbps",
        "dcn_bandwidth_gbps",
    )
    return [
        error(
            "HARDWARE_INVALID",
            f"hardware.{n}",
            f"hardware.{n}={getattr(hw, n)} must be positive.",
            no_fix=_CHIP_NUMBER.format(chip=hw.name, key=f"hardware.{n}"),
        )
        for n in names
        if _finite(getattr(hw, n)) and not getattr(hw, n) > 0  # non_finite says the rest
    ]


def jax_version_readable(cfg: Config) -> list[Finding]:
    """hardware.jax_version names the compiler the memory count follows."""
    from ..traits import jax_release

    try:
        jax_release(cfg.hardware.jax_version)
    except ValueError as exc:
        return [
            error(
                "VALUE_TYPE_INVALID",
                "hardware.jax_version",
                str(exc) + ".",
                [fix("the jax installed here", **{"hardware.jax_version": "auto"})],
            )
        ]
    return []


def mlp_needs_one_expert(cfg: Config) -> list[Finding]:
    if cfg.dispatch is Dispatch.mlp and cfg.num_experts > 1:
        return [
            error(
                "DISPATCH_MLP_WITH_EXPERTS",
                "dispatch",
                f"dispatch=mlp runs one dense MLP, but num_experts={cfg.num_experts}: the "
                "router would be ignored.",
                [fix(dispatch=Dispatch.auto), fix(dispatch=Dispatch.dense)],
            )
        ]
    return []


def routing_groups(cfg: Config) -> list[Finding]:
    """Group-limited routing must split the experts evenly and leave a token enough
    experts in its allowed groups."""
    groups, top = cfg.n_routing_groups, cfg.topk_routing_group
    if groups <= 0 or cfg.num_experts <= 0:
        return []
    per_group = cfg.num_experts // groups if cfg.num_experts % groups == 0 else 0
    if per_group and 1 <= top <= groups and top * per_group >= cfg.num_experts_per_tok:
        return []
    return [
        error(
            "ROUTING_GROUPS_INVALID",
            "n_routing_groups",
            f"n_routing_groups={groups} with topk_routing_group={top}: the groups must split "
            f"num_experts={cfg.num_experts} evenly, 1 <= topk_routing_group <= "
            f"n_routing_groups, and the chosen groups must hold at least num_experts_per_tok="
            f"{cfg.num_experts_per_tok} experts.",
            [fix("no group limit", n_routing_groups=-1, topk_routing_group=-1)],
        )
    ]


def shared_gate_needs_experts(cfg: Config) -> list[Finding]:
    if cfg.shared_expert_gate and cfg.shared_experts <= 0:
        return [
            error(
                "SHARED_GATE_WITHOUT_EXPERTS",
                "shared_expert_gate",
                f"shared_expert_gate=true scales the shared experts' output, but "
                f"shared_experts={cfg.shared_experts}.",
                [fix(shared_experts=1), fix(shared_expert_gate=False)],
            )
        ]
    return []


def gmm_backend_on_platform(cfg: Config) -> list[Finding]:
    """A grouped-matmul backend the chip cannot run, or runs as dense work."""
    backend, platform = cfg.gmm_backend, cfg.hardware.platform
    compiler = traits(platform)
    if backend is GmmBackend.pallas_megablox and not compiler.runs_pallas_megablox:
        return [
            error(
                "GMM_BACKEND_PLATFORM",
                "gmm_backend",
                f"gmm_backend=pallas_megablox is JAX's Pallas kernel for TPUs; "
                f"hardware={cfg.hardware.name} is a GPU, which cannot run it.",
                [fix(gmm_backend=GmmBackend.tiled_gmm), fix(gmm_backend=GmmBackend.auto)],
            )
        ]
    if backend is GmmBackend.tokamax and importlib.util.find_spec("tokamax") is None:
        return [
            error(
                "GMM_BACKEND_MISSING",
                "gmm_backend",
                "gmm_backend=tokamax runs tokamax's ragged_dot, but the tokamax package is not "
                "installed here (it needs Python >= 3.12 and jax >= 0.11.1): run "
                "`pip install tokamax`, or leave the grouped matmul to the selector.",
                [fix(gmm_backend=GmmBackend.auto)],
            )
        ]
    if backend is GmmBackend.ragged_dot and compiler.ragged_dot_dense:
        return [
            warning(
                "GMM_BACKEND_DENSE_WORK",
                "gmm_backend",
                f"gmm_backend=ragged_dot on {platform} lowers to masked dense matmuls over "
                f"every expert's group (XLA:GPU and XLA:CPU, jax 0.10.2, compiled here): "
                f"about num_experts={cfg.num_experts} times the routed rows' FLOPs. "
                "tiled_gmm computes only the routed rows' tiles.",
                [fix(gmm_backend=GmmBackend.tiled_gmm)],
            )
        ]
    return []


def gmm_row_tile_supported(cfg: Config) -> list[Finding]:
    """A row tile the Pallas kernels cannot take, or one no kernel of this config reads."""
    tm = cfg.gmm_row_tile
    if tm == 0:
        return []
    itemsize = COMPUTE_DTYPES.get(cfg.dtype, 4)
    sublane = pallas_sublane_rows(itemsize)
    if not pallas_row_tile_ok(tm, itemsize):
        return [
            error(
                "GMM_ROW_TILE_UNSUPPORTED",
                "gmm_row_tile",
                f"gmm_row_tile={tm}: the Pallas megablox kernels take a positive multiple of "
                f"{sublane} rows a tile in {cfg.dtype} (whole sublanes: 8 rows of a 32-bit "
                "dtype, 16 of a 16-bit one); 0 lets the selector price the tiles.",
                [fix(gmm_row_tile=0), fix(gmm_row_tile=sublane * -(-max(tm, 1) // sublane))],
            )
        ]
    if gmm_backend_of(cfg) != GmmBackend.pallas_megablox.value:
        return [
            warning(
                "GMM_ROW_TILE_UNUSED",
                "gmm_row_tile",
                f"gmm_row_tile={tm} sets the Pallas megablox kernels' row tile, but the grouped "
                f"matmul here is {gmm_backend_of(cfg)}, which walks its own tiles: the setting "
                "changes nothing.",
                [fix(gmm_row_tile=0)],
            )
        ]
    return []


SETTINGS_RULES = (
    non_finite,
    sizes_in_range,
    routing_groups,
    shared_gate_needs_experts,
    positive_dims,
    finite_capacity_factor,
    top_k_within_experts,
    known_dtypes,
    hardware_values,
    jax_version_readable,
    mlp_needs_one_expert,
    gmm_backend_on_platform,
    gmm_row_tile_supported,
)
