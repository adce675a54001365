"""Read a MaxText config the way MaxText does, and map what the MoE block uses.

`from_maxtext(path, overrides)`: follows the `base_config:` chain relative to each file,
loads `models/<model_name>.yml` beside the root base file when `model_name` is set,
applies `key=value` overrides (precedence, as in MaxText: base chain < model file <
overrides), maps the keys the MoE block reads, and lists the rest as ignored.

An override must name a key of the config chain or one of ours (`num_devices`, `chip`,
`dispatch`, `mode`, `output`, `allow_local_batch_inflation`, `expert_exchange`,
`expert_group`, `expert_buffer_factor`, `optimizer_bytes_per_param`, `compile`): anything else is
an error with the closest keys, never silently ignored.

MaxText's `hardware` keeps its meaning (tpu, gpu, gpu_multiprocess, cpu); the chip the
cost model prices is `chip=` (default per platform: v5p, h100, cpu, stated in the report).
MaxText's `num_slices: -1` (detect) is taken as one slice unless the dcn knobs say more.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..compose import conf_dir as packaged_conf
from ..compose import did_you_mean
from ..config import (
    DTYPE_BYTES,
    MESH_AXES,
    CapacityRounding,
    Config,
    Dispatch,
    Exchange,
    ExpertGroup,
    Hardware,
    Mode,
    OutputFormat,
)
from ..findings import Finding, Fix, fix, render_value, warning
from ..mesh import build_mesh_view
from ..plan import analyse
from .axis_rules import axis_rules
from .facts import (
    RETIRED_KEYS,
    facts,
    ignored_that_matter,
    megablox_note,
    mode_of,
    placement_in_maxtext,
    sharding_not_modelled,
)
from .files import (
    MaxTextError,
    coerce,
    custom_mesh_and_rule,
    load_chain,
    load_yaml,
    merged_rules,
    parse_overrides,
)
from .routing import routing
from .topology import topology_target
from .torus import mesh_not_on_torus

# MaxText keys copied one to one under the same name, and those ours spells apart
# (MaxText name -> ours).
SAME_NAMED_KEYS = (
    "per_device_batch_size",
    "max_target_length",
    "base_emb_dim",
    "base_moe_mlp_dim",
    "num_experts",
    "num_experts_per_tok",
    "capacity_factor",
    "dtype",
    "context_parallel_load_balance",
    "shared_experts",
    "base_num_decoder_layers",
    "first_num_dense_layers",
    "interleave_moe_layer_step",
    # The rest of the decoder, for the whole step's parameters and memory.
    "decoder_block",
    "vocab_size",
    "logits_via_embedding",
    "base_num_query_heads",
    "base_num_kv_heads",
    "head_dim",
    "use_qk_norm",
    "base_mlp_dim",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "inhomogeneous_layer_cycle_interval",
    "gdn_conv_kernel_dim",
    "gdn_key_head_dim",
    "gdn_value_head_dim",
    "gdn_num_key_heads",
    "gdn_num_value_heads",
    "remat_policy",
    "num_vocab_tiling",
    "logits_dot_in_fp32",
    "context_parallel_strategy",
)
DIRECT_KEYS = {**{key: key for key in SAME_NAMED_KEYS}, "weight_dtype": "param_dtype"}
PARALLELISM_KEYS = tuple(
    f"{tier}_{axis}_parallelism" for tier in ("ici", "dcn") for axis in MESH_AXES
)
# Our own keys, accepted beside MaxText's (a MaxText file takes the device count from
# the machine, so a pre-launch check must be told it).
OWN_KEYS = (
    "num_devices",
    "chip",
    "dispatch",
    "mode",
    "output",
    "allow_local_batch_inflation",
    "expert_exchange",
    "expert_group",
    "expert_buffer_factor",
    "optimizer_bytes_per_param",
    "compile",
    "measure",
    "measure_rounds",
    "measure_save",
    "search",
    "search_global_batch",
    "search_global_tokens",
    "search_top",
)
# Of OWN_KEYS, those read by code of their own (the chip prices the hardware, the
# dispatch and mode have MaxText defaults, the rest are enums); every other is taken as
# it is, coerced to its setting's type.
OWN_KEYS_READ_APART = ("chip", "dispatch", "mode", "output", "expert_exchange", "expert_group")
# MaxText keys that decide the dispatch, the routing or the axis roles (read, mapped).
READ_KEYS = (
    "allow_split_physical_axes",
    "mesh_axes",
    "custom_mesh_and_rule",
    "sparse_matmul",
    "megablox",
    "model_call_mode",
    "logical_axis_rules",
    "model_name",
    "base_config",
    "hardware",
    "num_slices",
    "decoder_block",
    "norm_topk_prob",
    "routed_score_func",
    "routed_bias",
    "routed_scaling_factor",
    "n_routing_groups",
    "topk_routing_group",
    "base_mlp_dim",
    "override_logical_axis_rules",
    "compile_topology",
    "compile_topology_num_slices",
    "wi_tile_fwd_batch_seq",
)
PLATFORMS = {"tpu": "v5p", "gpu": "h100", "gpu_multiprocess": "h100", "cpu": "cpu"}


def _field_types() -> dict[str, type]:
    """Each Config field's value type (the inner type of an optional)."""
    types = {}
    for name, hint in typing.get_type_hints(Config).items():
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        types[name] = args[0] if args and typing.get_origin(hint) is not list else hint
    return types


_FIELD_TYPES = _field_types()


@dataclass
class MaxTextImport:
    r"""A MaxText config as this project reads it (`from_maxtext` returns it).

    Attributes:
      config: the typed Config for `resolve`, `validate` and `search`.
      findings: what MaxText does differently, each read in its source or measured.
      ignored, relevant_ignored: keys nothing here reads (and those that matter).
      files, notes: the files read, in order, and what the reading noticed.
      dispatch_source, exchange_is_maxtexts, route_keys, mesh_axes: what the MaxText
        route needs to spell fixes and new meshes in MaxText's keys.

    Examples:
      >>> import pathlib, tempfile, selector
      >>> base = pathlib.Path(tempfile.mkdtemp()) / "base.yml"
      >>> _ = base.write_text("num_experts: 8\nnum_experts_per_tok: 2\n")
      >>> imported = selector.from_maxtext(base, ["num_devices=8"])
      >>> imported.config.num_experts, [p.rsplit("/", 1)[-1] for p in imported.files]
      (8, ['base.yml'])
    """

    config: Config
    ignored: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    relevant_ignored: list[str] = field(default_factory=list)
    dispatch_source: str = ""  # the MaxText setting that decides the dispatch, and where
    # Whether the exchange is MaxText's (set from its expert axis), not asked for: then
    # this project's own pick may be shown beside it as an alternative.
    exchange_is_maxtexts: bool = False
    # What a new mesh on this route needs (`for_mesh`): the raw keys it reads
    # (`ROUTE_KEYS`) and the custom mesh_axes, if a file gave them.
    route_keys: dict = field(default_factory=dict, repr=False)
    mesh_axes: tuple | None = None

    def for_mesh(self, cfg: Config) -> tuple[Config, list[Finding]]:
        """`cfg` (this import's config with other mesh knobs) as MaxText would run it:
        the exchange its expert axis implies when the files do not ask for one, and
        whether MaxText can lay the mesh on the slice's torus. What a search on this
        route checks for each mesh, without re-reading the files."""
        if self.exchange_is_maxtexts:
            cfg = as_maxtext_exchanges(cfg, self.route_keys)
        mesh, _ = build_mesh_view(cfg, None)
        return cfg, mesh_not_on_torus(self.route_keys, cfg, mesh, self.mesh_axes)

    def launch_settings(self, settings: dict) -> dict:
        """A searched layout's settings in MaxText's keys: the mesh, batch, remat and
        tiling as they are, the dispatch as sparse_matmul (with the capacity path's
        capacity_factor), and the exchange left to the expert axis, as MaxText decides
        it (an exchange this config asked for stays among its own overrides)."""
        selector_keys = ("dispatch", "expert_exchange", "expert_group")
        out = {k: v for k, v in settings.items() if k not in selector_keys}
        dispatch = settings.get("dispatch")
        out["sparse_matmul"] = "true" if dispatch is Dispatch.megablox else "false"
        if dispatch is Dispatch.subgroup_capacity:
            out["capacity_factor"] = self.config.capacity_factor
        return out

    def explain_reason(self, reason: str, plan=None) -> str:
        """The plan's reason with the dispatch's true origin (a dispatch read from
        MaxText's sparse_matmul in base.yml was not 'requested explicitly') and, given
        the plan of a grouped matmul, the MaxText settings of its expert placement."""
        prefix = "requested explicitly with dispatch="
        if reason.startswith(prefix) and self.dispatch_source:
            rest = reason[len(prefix) :].split(";", 1)
            tail = f";{rest[1]}" if len(rest) > 1 else ""
            reason = f"MaxText runs {rest[0]}: {self.dispatch_source}{tail}"
        if plan is not None and plan.strategy is Dispatch.megablox:
            reason += f"; expert placement {placement_in_maxtext(plan.placement, plan.mesh)}"
        return reason

    def alternative(self, plan, ours) -> str:
        """A note when this project's block, free to exchange, would beat the one
        MaxText runs (`plan`): `ours` is the plan with the exchange left to the
        selector."""
        if not self.exchange_is_maxtexts or plan is None or ours is None:
            return ""
        theirs, mine = plan.chosen_estimate, ours.chosen_estimate
        if mine.name == theirs.name or mine.time_s >= theirs.time_s:
            return ""
        gib = 2**30
        return (
            f"Alternative outside MaxText 0.2.5: this project's {mine.name} "
            f"({mine.time_s * 1e3:.3g} ms, {mine.device_bytes / gib:.3g} GiB a device) against "
            f"the {theirs.name} MaxText runs here ({theirs.time_s * 1e3:.3g} ms, "
            f"{theirs.device_bytes / gib:.3g} GiB); MaxText has no setting for it, "
            "layers.MoEBlock runs it (expert_exchange=auto on the native route)."
        )

    def as_dict(self) -> dict:
        return {
            "files": self.files,
            "ignored_count": len(self.ignored),
            "ignored_that_matter": self.relevant_ignored,
            "notes": self.notes,
        }

    def summary(self) -> str:
        lines = [f"MaxText config: {' <- '.join(self.files)}"]
        lines += [f"Note: {n}" for n in self.notes]
        matter = ", ".join(self.relevant_ignored) or "none"
        lines.append(
            f"Ignored {len(self.ignored)} MaxText keys the MoE block does not read; of the keys "
            f"it reads, not modelled here: {matter}"
        )
        return "\n".join(lines) + "\n"


def _dispatch(raw: dict, sparse: bool) -> Dispatch:
    """What MaxText would run: sparse_matmul picks the grouped matmul, else the einsum
    path, which drops tokens when capacity_factor > 0."""
    if "dispatch" in raw:
        return coerce("dispatch", raw["dispatch"], Dispatch)
    if sparse:
        return Dispatch.megablox
    cf = coerce("capacity_factor", raw.get("capacity_factor", -1.0), float)
    return Dispatch.subgroup_capacity if cf > 0 else Dispatch.dense


def _origin(key: str, over: dict, each: list[dict], files: list[Path]) -> str:
    """Where `key`'s value comes from: the user's override or the last file setting it."""
    if key in over:
        return "from your override"
    for data, path in zip(reversed(each), reversed(files), strict=True):
        if key in data:
            return (
                f"from {path.parent.name}/{path.name}"
                if path.parent.name != "configs"
                else f"from {path.name}"
            )
    return "MaxText's default"


# MaxText's grouped-matmul tile keys (base.yml: 512 rows, 1024 x 1024). Read in its
# layers/moe.py (0.2.5): the megablox path (sparse_matmul and megablox true, tokamax off)
# pads the routed rows to a multiple of wi_tile_fwd_batch_seq (max_utils.maybe_pad) and
# hands `mblx.gmm` nine tiles as they are, the forward's (m, k, n) for wi (and wo's own
# for wo), then the input gradient's (dlhs) and the weight gradient's (drhs); only its
# ragged_dot path clamps them to the array (min(tile, m)). So the kernel's row tile is
# wi_tile_fwd_batch_seq however few rows an expert gets.
ROW_TILE_KEY = "wi_tile_fwd_batch_seq"
OTHER_ROW_TILE_KEYS = (
    "wo_tile_fwd_batch_seq",
    "wi_tile_dlhs_batch_seq",
    "wo_tile_dlhs_batch_seq",
    "wi_tile_drhs_batch_seq",
    "wo_tile_drhs_batch_seq",
)
KN_TILE_KEYS = ("wi_tile_fwd_embed_dim", "wi_tile_fwd_mlp_dim")


def _row_tile(
    raw: dict, over: dict, each: list[dict], files: list[Path], megablox: bool, hw, notes
) -> dict:
    """{"gmm_row_tile": MaxText's wi_tile_fwd_batch_seq} where MaxText runs its Pallas
    megablox kernel (its megablox path on a TPU), with a note saying where the value
    came from and what of MaxText's tiling our layers do not take; else {}."""
    if not megablox or hw.platform != "tpu" or ROW_TILE_KEY not in raw:
        return {}
    if coerce("use_tokamax_gmm", raw.get("use_tokamax_gmm", False), bool):
        notes.append(
            "use_tokamax_gmm=true: MaxText runs tokamax's grouped matmul, whose tiles this "
            "check does not read; the row tile is priced (selector.tiling)."
        )
        return {}
    tm = coerce(ROW_TILE_KEY, raw[ROW_TILE_KEY], int)
    others = {k: raw[k] for k in OTHER_ROW_TILE_KEYS if k in raw and raw[k] != tm}
    kn = ", ".join(f"{k}={raw[k]}" for k in KN_TILE_KEYS if k in raw)
    note = (
        f"{ROW_TILE_KEY}={tm} ({_origin(ROW_TILE_KEY, over, each, files)}) is the Pallas "
        f"kernels' row tile, as MaxText's megablox path passes it (not clamped to the rows): "
        f"the rows are counted at it and the layers run it (gmm_row_tile={tm})."
    )
    if others:
        spelled = ", ".join(f"{k}={v}" for k, v in others.items())
        note += f" Our layers run one row tile for all three kernels; {spelled} not taken."
    if kn:
        note += f" Our layers' K and N tiles are 128 lanes ({kn} not taken)."
    notes.append(note)
    return {"gmm_row_tile": tm}


def _dispatch_source(
    raw: dict, over: dict, each: list[dict], files: list[Path], sparse: bool
) -> str:
    if "dispatch" in raw:
        return f"dispatch={raw['dispatch']} {_origin('dispatch', over, each, files)}"
    where = _origin("sparse_matmul", over, each, files)
    if sparse:
        return f"sparse_matmul=true ({where}) runs its dropless grouped matmul"
    cf = raw.get("capacity_factor", -1.0)
    return (
        f"sparse_matmul=false ({where}) runs its einsum path with capacity_factor={cf} "
        f"({_origin('capacity_factor', over, each, files)})"
    )


def _hardware(raw: dict, conf_dir: Path, notes: list[str]) -> Hardware:
    platform = str(raw.get("hardware", "tpu"))
    if platform not in PLATFORMS:
        raise MaxTextError(
            f"hardware={platform!r} is not one of MaxText's platforms "
            f"({', '.join(PLATFORMS)}); the chip to price is chip=<preset>."
        )
    chip = raw.get("chip")
    if chip is None:
        chip = PLATFORMS[platform]
        notes.append(
            f"hardware={platform} is MaxText's platform; priced as chip={chip} (its default "
            "here). Set chip= to price another chip."
        )
    path = conf_dir / "hardware" / f"{chip}.yaml"
    if not path.is_file():
        options = ", ".join(sorted(p.stem for p in (conf_dir / "hardware").glob("*.yaml")))
        raise MaxTextError(f"chip={chip!r} is not a preset; use one of {options}.")
    hw = Hardware(**load_yaml(path))
    # The verdict's margin is the one judged on MaxText's own compiled steps.
    hw = dataclasses.replace(
        hw, step_margin=hw.maxtext_step_margin, step_margin_source=hw.maxtext_step_margin_source
    )
    if hw.platform != ("gpu" if platform.startswith("gpu") else platform):
        notes.append(f"chip={chip} is a {hw.platform} chip while hardware={platform}.")
    return hw


def _num_slices(raw: dict, notes: list[str]) -> int:
    slices = coerce("num_slices", raw.get("num_slices", 1), int)
    if slices != -1:
        return slices
    dcn = [coerce(k, raw[k], int) for k in PARALLELISM_KEYS if k.startswith("dcn_") and k in raw]
    explicit = [d for d in dcn if d > 0]
    count = math.prod(explicit) if -1 not in dcn else max(1, math.prod(explicit))
    notes.append(
        f"num_slices=-1 (MaxText detects it) taken as {count} slice(s) from the dcn knobs; "
        "set num_slices=N for a multislice job."
    )
    return count


def _topology_counts(raw: dict, values: dict, chips: int, slices: int, notes: list[str]):
    """What compile_topology overrules: MaxText takes the slices from
    compile_topology_num_slices (base.yml: num_slices is set from it), so a num_slices
    that says otherwise is noted as not read; a num_devices that disagrees with the
    topology's chips is refused, since either count could be the one meant."""
    name, total = raw["compile_topology"], chips * slices
    given = values.get("num_devices")
    if given is not None and given != total:
        raise MaxTextError(
            f"num_devices={given} disagrees with compile_topology={name} x {slices} slice(s), "
            f"which is {total} chips: MaxText's ahead-of-time compile targets the topology. "
            f"Drop num_devices, or name the topology and compile_topology_num_slices whose "
            "chips you mean."
        )
    asked = coerce("num_slices", raw.get("num_slices", -1), int)
    if asked not in (-1, slices):
        notes.append(
            f"num_slices={asked} is not read under compile_topology: MaxText sets it from "
            f"compile_topology_num_slices ({slices} here); set compile_topology_num_slices="
            f"{asked} for {asked} slices."
        )
    notes.append(
        f"compile_topology={name} x {slices} slice(s): {total} {raw['chip']} chips "
        f"({chips} a slice), as MaxText's ahead-of-time compile targets them."
    )


def _unknown_override(key: str, allowed: set[str]) -> MaxTextError:
    if key in RETIRED_KEYS:
        return MaxTextError(f"Unknown setting {key!r}: {RETIRED_KEYS[key]}")
    hint = did_you_mean(key, sorted(allowed))
    return MaxTextError(
        f"Unknown setting {key!r}: it is in neither the MaxText config chain nor this "
        f"check's own keys ({', '.join(OWN_KEYS)}), so nothing would read it.{hint}"
    )


def from_maxtext(
    path: str | Path, overrides: Sequence[str] = (), conf_dir: Path | None = None
) -> MaxTextImport:
    r"""Read a MaxText config (and overrides) as MaxText 0.2.5 reads it.

    Args:
      path: a MaxText YAML (its `base_config:` chain is followed as MaxText does).
      overrides: `key=value` strings in MaxText's keys (`model_name=...`,
        `ici_context_parallelism=4`) or this check's own (`num_devices=8`, `chip=v5p`).
      conf_dir: the selector's config tree (default: the packaged one).

    Returns:
      A MaxTextImport: `.config` (a typed Config for `resolve`), `.findings` (what
      MaxText does differently, measured or read in its source), `.ignored` keys,
      `.notes`. Raises MaxTextError for unusable input (a key nothing reads, a missing
      file, unreadable YAML).

    Example (a two-key file on top of MaxText-like defaults, written here):
      >>> import pathlib, tempfile, selector
      >>> base = pathlib.Path(tempfile.mkdtemp()) / "base.yml"
      >>> _ = base.write_text("base_emb_dim: 256\nbase_moe_mlp_dim: 512\nnum_experts: 8\n"
      ...                     "num_experts_per_tok: 2\nper_device_batch_size: 1\n"
      ...                     "max_target_length: 1024\nici_fsdp_parallelism: -1\n")
      >>> imported = selector.from_maxtext(base, ["num_devices=8", "ici_context_parallelism=4"])
      >>> imported.config.num_experts, imported.config.ici_context_parallelism
      (8, 4)
      >>> [f.code for f in selector.validate(imported.config)]
      ['LOCAL_BATCH_INFLATION']
    """
    conf_dir = conf_dir or packaged_conf()
    path, overrides, read_as = model_file_as_config(Path(path), list(overrides))
    over = parse_overrides(overrides)
    raw, files, each = load_chain(Path(path))
    model_name = over.get("model_name", raw.get("model_name"))
    if model_name not in (None, "", "default"):
        model_file = files[0].parent / "models" / f"{model_name}.yml"
        if not model_file.is_file():
            raise MaxTextError(
                f"model_name={model_name!r}: no {str(model_file)!r} beside the base config; "
                "check the name or the models/ folder."
            )
        model = load_yaml(model_file)
        raw = {**raw, **model}
        files.append(model_file)
        each.append(model)
    allowed = set(raw) | set(OWN_KEYS) | set(READ_KEYS) | set(DIRECT_KEYS) | set(PARALLELISM_KEYS)
    for key in over:
        if key not in allowed:
            raise _unknown_override(key, allowed)
    raw = {**raw, **over}

    notes: list[str] = [read_as] if read_as else []
    values: dict[str, Any] = {}
    for theirs, ours in DIRECT_KEYS.items():
        if theirs in raw and raw[theirs] is not None:
            values[ours] = coerce(theirs, raw[theirs], _FIELD_TYPES[ours])
    for key in (*PARALLELISM_KEYS, *(k for k in OWN_KEYS if k not in OWN_KEYS_READ_APART)):
        if key in raw and raw[key] is not None:
            values[key] = coerce(key, raw[key], _FIELD_TYPES[key])
    if "optimizer_bytes_per_param" not in values:
        values["optimizer_bytes_per_param"] = adamw_bytes_per_param(raw)
    if values.get("num_experts", 1) <= 1 and values.get("base_moe_mlp_dim", -1) <= 0:
        # A dense MaxText config has no MoE layer: its MLP is base_mlp_dim wide.
        values["base_moe_mlp_dim"] = coerce("base_mlp_dim", raw.get("base_mlp_dim", 7168), int)
        notes.append(
            f"num_experts={values.get('num_experts', 1)}: a dense model; the block is checked as "
            f"one MLP of base_mlp_dim={values['base_moe_mlp_dim']}."
        )
    target = topology_target(raw)
    if target is None:
        values["num_slices"] = _num_slices(raw, notes)
    else:  # MaxText's train_compile target names the chips
        chip, chips, slices = target
        raw = {"chip": chip, **raw}
        _topology_counts(raw, values, chips, slices, notes)
        values["num_slices"] = slices
        values["num_devices"] = chips * slices
    values["attention_type"] = _attention_type(raw, notes)
    sparse = coerce("sparse_matmul", raw.get("sparse_matmul", True), bool)
    megablox = coerce("megablox", raw.get("megablox", True), bool)
    values["dispatch"] = _dispatch(raw, sparse)
    dispatch_source = _dispatch_source(raw, over, each, files, sparse)
    values["mode"] = mode_of(raw) or Mode.train
    if "mode" in raw:
        values["mode"] = coerce("mode", raw["mode"], Mode)
    for key, kind in (
        ("expert_exchange", Exchange),
        ("expert_group", ExpertGroup),
        ("output", OutputFormat),
    ):
        if key in raw:
            values[key] = coerce(key, raw[key], kind)
    values["model_name"] = str(model_name or "maxtext")
    dropped: list[str] = []
    custom, custom_path = custom_mesh_and_rule(raw, files)
    if custom_path is not None:  # MaxText replaces the rules wholesale with the file's
        notes.append(
            f"custom_mesh_and_rule={raw['custom_mesh_and_rule']}: mesh axes and "
            f"logical_axis_rules read from {custom_path.parent.name}/{custom_path.name}."
        )
    rules = custom["logical_axis_rules"] if "logical_axis_rules" in custom else None
    values["axis_rules"] = axis_rules(
        rules if rules is not None else merged_rules(each, over, raw), dropped
    )
    values["hardware"] = _hardware(raw, conf_dir, notes)
    values["capacity_rounding"] = CapacityRounding.maxtext
    values["moe_checkpoint_names"] = True  # its RoutedMoE tags mlpwi_0 and mlpwo
    base = each[0]  # MaxText's own defaults (the root of the chain)
    routed, _, routing_findings = routing(raw, str(model_name or ""), base, notes)
    values.update(routed)
    values.update(_row_tile(raw, over, each, files, sparse and megablox, values["hardware"], notes))
    cfg = Config(**values)
    maxtext_exchange = "expert_exchange" not in raw and sparse
    route_keys = {k: raw[k] for k in ROUTE_KEYS if k in raw}
    placement_found = []
    if maxtext_exchange:
        cfg = as_maxtext_exchanges(cfg, route_keys)
    elif sparse:
        placement_found = placement_not_maxtexts(cfg, route_keys)
        if not placement_found:  # MaxText's own placement, given: with its receive buffer
            cfg = as_maxtext_exchanges(cfg, route_keys)
    mesh, _ = build_mesh_view(cfg, None)
    found = placement_found + routing_findings + facts(raw, cfg, mesh, sparse, megablox)
    found += sharding_not_modelled(raw, base)
    found += mesh_not_on_torus(raw, cfg, mesh, custom.get("mesh_axes"))
    note = megablox_note(mesh, sparse)
    if note:
        notes.append(note)
    if dropped:
        found.append(
            warning(
                "MAXTEXT_AXIS_USED_TWICE",
                "logical_axis_rules",
                f"The logical_axis_rules give one mesh axis to two dims of the expert weights; "
                f"flax skips a rule whose axis another dim took: {'; '.join(dropped)}. MaxText "
                "then shards those dims by a later rule or not at all, without a word, and "
                "this check follows it. List each axis under one dim.",
            )
        )
    used = set(DIRECT_KEYS) | set(PARALLELISM_KEYS) | set(OWN_KEYS) | set(READ_KEYS)
    ignored = sorted(k for k in raw if k not in used)
    relevant = ignored_that_matter(raw, used, base)
    return MaxTextImport(
        cfg,
        ignored,
        found,
        [str(f) for f in files],
        notes,
        relevant,
        dispatch_source,
        maxtext_exchange,
        route_keys,
        custom.get("mesh_axes"),
    )


def adamw_bytes_per_param(raw: dict) -> float:
    """AdamW's two moments a parameter, as MaxText 0.2.5 stores them (configs/pyconfig.py):
    mu in mu_dtype, which inherits weight_dtype when unset; nu always in weight_dtype (8
    bytes with base.yml's float32 weights, 4 with weight_dtype=bfloat16). A dtype the
    selector does not know counts 4 bytes here; param_dtype's own check names it."""
    weight = str(raw.get("weight_dtype") or "float32")
    mu = str(raw.get("mu_dtype") or "") or weight
    return float(DTYPE_BYTES.get(mu, 4) + DTYPE_BYTES.get(weight, 4))


def model_file_as_config(path: Path, overrides: list[str]) -> tuple[Path, list[str], str]:
    """A model file (configs/models/NAME.yml, no base_config of its own) given as the
    config: read as MaxText reads `model_name=NAME`, with base.yml beneath it."""
    base = path.parent.parent / "base.yml"
    if path.parent.name != "models" or not path.is_file() or not base.is_file():
        return path, overrides, ""
    if load_yaml(path).get("base_config"):
        return path, overrides, ""
    if any(o.split("=", 1)[0] == "model_name" for o in overrides):
        raise MaxTextError(
            f"{path.name} is a MaxText model file and model_name= names another; give "
            f"the base config: maxtext_config={base} model_name=..."
        )
    note = (
        f"{path.name} is a model file: read as MaxText reads model_name={path.stem}, with "
        f"{base.name} beneath it (maxtext_config={base} model_name={path.stem})."
    )
    return base, [f"model_name={path.stem}", *overrides], note


def _attention_type(raw: dict, notes: list[str]) -> str:
    """MaxText's attention_type as the parameter count sees it: MLA has its own
    projections; sliding-window, chunked and full attention hold the same weights and,
    under a flash kernel, about the same memory as global attention."""
    kind = str(raw.get("attention_type", "global"))
    if kind in ("global", "mla"):
        return kind
    notes.append(f"attention_type={kind}: counted as global attention (the same weights).")
    return "global"


def _expert_axis(cfg: Config) -> int:
    return cfg.ici_expert_parallelism * max(cfg.dcn_expert_parallelism, 1)


def placement_not_maxtexts(cfg: Config, raw: dict) -> list[Finding]:
    """A warning when expert_exchange= or expert_group= (this project's keys) ask for
    another expert placement than the one MaxText 0.2.5 runs on this mesh: the numbers
    are then layers.MoEBlock's, which a MaxText launch does not run."""
    theirs = as_maxtext_exchanges(cfg, raw)
    asked = (cfg.expert_exchange, cfg.expert_group)
    if asked == (theirs.expert_exchange, theirs.expert_group):
        return []
    return [
        warning(
            "MAXTEXT_PLACEMENT_NOT_MAXTEXTS",
            "expert_exchange",
            f"expert_exchange={cfg.expert_exchange.value} expert_group="
            f"{cfg.expert_group.value} are this project's settings (layers.MoEBlock): "
            "MaxText 0.2.5 has no keys for them and runs "
            f"expert_exchange={theirs.expert_exchange.value} expert_group="
            f"{theirs.expert_group.value} here (it exchanges over ici_expert_parallelism "
            "alone, else all-gathers the expert weights: read in its base.yml and "
            "layers/moe.py, not run). The plan and memory below are "
            "layers.MoEBlock's, not what this MaxText launch runs.",
            [
                fix(
                    "what MaxText runs",
                    expert_exchange=theirs.expert_exchange,
                    expert_group=theirs.expert_group,
                )
            ],
        )
    ]


# Raw keys a route keeps for checking other meshes (`MaxTextImport.for_mesh`).
ROUTE_KEYS = (
    "allow_split_physical_axes",
    "mesh_axes",
    "ragged_buffer_factor",
    "expert_buffer_factor",
)


def as_maxtext_exchanges(cfg: Config, raw: dict) -> Config:
    """`cfg` with the exchange MaxText runs for its expert axis. With one, its grouped
    matmul exchanges rows over it by ragged all-to-all, in one round, into a receive
    buffer of the rows a device sends times min(EP, experts / k) (the worst case), or
    times ragged_buffer_factor when that is set (MaxText 0.2.5's layers/moe.py,
    get_ragged_buffer_size; read, not run): counted as this project's exchange with
    expert_buffer_factor at that multiple, unless expert_buffer_factor is given.
    Without an expert axis it all-gathers the expert weights, and this project's
    exchange is shown beside it."""
    ep = _expert_axis(cfg)
    if ep <= 1:
        return cfg.replace(expert_exchange=Exchange.gather, expert_group=ExpertGroup.auto)
    cfg = cfg.replace(expert_exchange=Exchange.all_to_all, expert_group=ExpertGroup.expert)
    if "expert_buffer_factor" in raw:
        return cfg
    factor = coerce("ragged_buffer_factor", raw.get("ragged_buffer_factor", -1.0), float)
    if factor <= 0:
        factor = min(ep, cfg.num_experts / max(cfg.num_experts_per_tok, 1))
    return cfg.replace(expert_buffer_factor=float(factor))


__all__ = ["MaxTextError", "MaxTextImport", "fix", "from_maxtext", "parse_overrides"]


# Our setting -> MaxText's key, for fixes offered on the MaxText route.
MAXTEXT_SPELLING = {ours: theirs for theirs, ours in DIRECT_KEYS.items()}
MAXTEXT_SPELLING["gmm_row_tile"] = ROW_TILE_KEY
# Keys a fix may set that are spelled the same on both routes, or MaxText's alone.
MAXTEXT_ONLY_FIX_KEYS = ("num_slices", "allow_split_physical_axes")
# Our axis roles -> the logical name of MaxText's rule that gives them (RoutedMoE's
# names; see axis_rules.py).
MAXTEXT_RULE_NAMES = {
    "batch": "activation_batch_moe",
    "sequence": "activation_length_moe",
    "experts": "exp",
    "embed": "embed_moe",
    "hidden": "mlp_moe",
}


def maxtext_setting(setting: str) -> str:
    """The knob a finding names, in MaxText's spelling (`weight_dtype`;
    `logical_axis_rules.embed_moe` for our `axis_rules.embed`)."""
    if setting.startswith("axis_rules."):
        role = setting.split(".", 1)[1]
        return f"logical_axis_rules.{MAXTEXT_RULE_NAMES.get(role, role)}"
    return MAXTEXT_SPELLING.get(setting, setting)


def spelled_for_maxtext(fix_: Fix) -> Fix | None:
    """A fix in MaxText's keys (`weight_dtype`, not `param_dtype`), or None when one of
    its settings has no MaxText key (axis_rules.*: MaxText spells those as
    logical_axis_rules, which a one-line override cannot change safely)."""
    spelled = []
    for key, value in fix_.overrides:
        if key in MAXTEXT_SPELLING:
            spelled.append((MAXTEXT_SPELLING[key], value))
        elif key in OWN_KEYS or key in PARALLELISM_KEYS or key in MAXTEXT_ONLY_FIX_KEYS:
            spelled.append((key, value))
        else:
            return None
    return dataclasses.replace(fix_, overrides=tuple(spelled))


def _as_topology_slices(fix_: Fix) -> Fix:
    """A fix's slices as MaxText's ahead-of-time target counts them: with
    compile_topology the chips a slice are the topology's, and the slices are
    compile_topology_num_slices (num_devices and num_slices are not read there)."""
    spelled = []
    for key, value in fix_.overrides:
        if key == "num_slices":
            spelled.append(("compile_topology_num_slices", value))
        elif key != "num_devices":
            spelled.append((key, value))
    return dataclasses.replace(fix_, overrides=tuple(spelled))


# This project's keys for the expert placement: MaxText 0.2.5 decides its own from
# ici_expert_parallelism (`as_maxtext_exchanges`).
PLACEMENT_KEYS = ("expert_exchange", "expert_group")


def maxtext_route(path: str | Path, overrides: Sequence[str]):
    """The MaxText route for `plan.analyse`'s fix search: a fix is spelled in MaxText's
    keys and the files re-read with it as one more `key=value` (MaxText's keys move more
    than ours: its optimizer state follows weight_dtype), so what a device then holds is
    the re-run's number. A fix with no MaxText spelling, or one the files refuse, is not
    run (None)."""

    given = {o.split("=", 1)[0].strip() for o in overrides}

    def run(fix_: Fix):
        spelled = spelled_for_maxtext(fix_)
        if spelled is None:
            return None
        if "compile_topology" in given:
            spelled = _as_topology_slices(spelled)
        extra = [f"{k}={render_value(v)}" for k, v in spelled.overrides]
        try:
            imported = from_maxtext(path, [*overrides, *extra])
        except (MaxTextError, ValueError, TypeError):
            return None
        # An expert placement MaxText has no keys for is layers.MoEBlock's, not
        # MaxText's: a fix that sets one is not a fix of a MaxText launch.
        placed = any(k in PLACEMENT_KEYS for k, _ in spelled.overrides)
        if placed and "MAXTEXT_PLACEMENT_NOT_MAXTEXTS" in {f.code for f in imported.findings}:
            return None
        return spelled, imported.config, imported.findings

    return run


def analyse_on_route(
    imported: MaxTextImport, path: str | Path, overrides: Sequence[str], config=None
):
    """(plan, findings) of an imported config (`config`: it with other settings) by the
    one fix search on the MaxText route: the importer's findings first, checked with the
    analysis' (a fix must clear its finding without adding an error to either), each fix
    re-read with the files in MaxText's keys, every knob named in MaxText's spelling."""
    plan, findings = analyse(
        config or imported.config, route=maxtext_route(path, overrides), given=imported.findings
    )
    return plan, _in_maxtext_keys(findings)


def _in_maxtext_keys(findings: Sequence[Finding]) -> list[Finding]:
    """The findings naming their knob in MaxText's spelling (`chip=` for the chip:
    `hardware` is MaxText's platform key)."""
    return [
        dataclasses.replace(
            f,
            setting=maxtext_setting(f.setting),
            no_fix=f.no_fix.replace("(hardware=)", "(chip=)"),
            message=f.message.replace("(hardware=)", "(chip=)"),
        )
        for f in findings
    ]
