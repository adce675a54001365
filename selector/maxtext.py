"""Read a MaxText config the way MaxText does, and map what the MoE block uses.

`from_maxtext(path, overrides)`: follows the `base_config:` chain relative to each file,
loads `models/<model_name>.yml` beside the root base file when `model_name` is set,
applies `key=value` overrides (precedence, as in MaxText: base chain < model file <
overrides), maps the keys the MoE block reads, and lists the rest as ignored.

An override must name a key of the config chain or one of ours (`num_devices`, `chip`,
`dispatch`, `mode`, `output`, `allow_local_batch_inflation`, `expert_exchange`,
`expert_group`, `expert_buffer_factor`, `optimizer_bytes_per_param`): anything else is
an error with the closest keys, never silently ignored.

MaxText's `hardware` keeps its meaning (tpu, gpu, gpu_multiprocess, cpu); the chip the
cost model prices is `chip=` (default per platform: v5p, h100, cpu, stated in the report).
MaxText's `num_slices: -1` (detect) is taken as one slice unless the dcn knobs say more.
"""

from __future__ import annotations

import difflib
import enum
import math
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .compose import conf_dir as packaged_conf
from .config import (
    MESH_AXES,
    AxisRules,
    CapacityRounding,
    Config,
    Dispatch,
    Exchange,
    ExpertGroup,
    Hardware,
    Mode,
    OutputFormat,
    ScoreFunc,
)
from .findings import Finding, fix, warning
from .maxtext_facts import facts, ignored_that_matter, mode_of
from .mesh import build_mesh_view

# MaxText keys copied one to one (MaxText name -> ours).
DIRECT_KEYS = {
    "per_device_batch_size": "per_device_batch_size",
    "max_target_length": "max_target_length",
    "base_emb_dim": "base_emb_dim",
    "base_moe_mlp_dim": "base_moe_mlp_dim",
    "num_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "capacity_factor": "capacity_factor",
    "dtype": "dtype",
    "weight_dtype": "param_dtype",
    "context_parallel_load_balance": "context_parallel_load_balance",
    "shared_experts": "shared_experts",
    "base_num_decoder_layers": "base_num_decoder_layers",
    "first_num_dense_layers": "first_num_dense_layers",
    "interleave_moe_layer_step": "interleave_moe_layer_step",
}
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
)
# MaxText keys that decide the dispatch, the routing or the axis roles (read, mapped).
READ_KEYS = (
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
)
# Our axis roles <- MaxText logical names, the MoE block's own first (MaxText 0.2.5's
# base.yml), the general ones for older configs.
LOGICAL_ROLES = {
    "batch": ("activation_batch_moe", "activation_batch"),
    "sequence": ("activation_length_moe", "activation_length"),
    "experts": ("exp",),
    "hidden": ("mlp_moe", "mlp"),
    "embed": ("embed_moe", "embed"),
}
PLATFORMS = {"tpu": "v5p", "gpu": "h100", "gpu_multiprocess": "h100", "cpu": "cpu"}
DEEPSEEK_V3_FAMILY = ("deepseek3", "deepseek4", "kimi-k2")  # MaxText's deepseek_routing
SHARED_GATE_DECODERS = ("qwen3_next", "qwen3_5")  # Qwen3NextSparseMoeBlock


def _field_types() -> dict[str, type]:
    """Each Config field's value type (the inner type of an optional)."""
    types = {}
    for name, hint in typing.get_type_hints(Config).items():
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        types[name] = args[0] if args and typing.get_origin(hint) is not list else hint
    return types


_FIELD_TYPES = _field_types()


class MaxTextError(ValueError):
    """A MaxText file or override that cannot be read: the message names it and the fix."""


@dataclass
class MaxTextImport:
    config: Config
    ignored: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    relevant_ignored: list[str] = field(default_factory=list)

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


def _load_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError as exc:
        raise MaxTextError(
            f"MaxText config {str(path)!r} does not exist; check the path given to "
            "maxtext_config= (or its base_config:)."
        ) from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).strip().splitlines()[0]
        raise MaxTextError(
            f"MaxText config {str(path)!r} is not readable YAML{where} ({problem}); fix the file."
        ) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise MaxTextError(f"MaxText config {str(path)!r} cannot be read ({exc}).") from exc
    if data is None:
        raise MaxTextError(f"MaxText config {str(path)!r} is empty; give a config with its keys.")
    if not isinstance(data, dict):
        raise MaxTextError(
            f"MaxText config {str(path)!r} holds a {type(data).__name__}, not a mapping of "
            "key: value; fix the file."
        )
    return data


def _load_chain(path: Path, seen: tuple[Path, ...] = ()) -> tuple[dict, list[Path]]:
    """The file merged over its base_config chain; and the files, root base first."""
    path = path.resolve()
    if path in seen:
        raise MaxTextError(f"base_config loop through {str(path)!r}; break the cycle.")
    data = _load_yaml(path)
    base = data.get("base_config")
    if not base:
        return data, [path]
    parent, files = _load_chain(path.parent / str(base), (*seen, path))
    return {**parent, **data}, [*files, path]


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """MaxText-style `key=value` strings, values typed as YAML scalars."""
    parsed = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or not key.replace("_", "a").replace(".", "a").isalnum():
            raise MaxTextError(
                f"Cannot read the override {item!r}: MaxText overrides take the form key=value "
                "(for example ici_context_parallelism=4)."
            )
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        parsed[key] = value
    return parsed


def _coerce(key: str, value: Any, kind: type) -> Any:
    """Type-check one value the way the schema would, with a message naming the key."""
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("true", "false"):
                return str(value).lower() == "true"
            raise ValueError
        if kind is int:
            if isinstance(value, bool) or float(value) != int(float(value)):
                raise ValueError
            return int(float(value))
        if kind is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            return kind(str(value))
        return str(value)
    except (TypeError, ValueError, OverflowError):
        expected = (
            f"one of {', '.join(m.value for m in kind)}"
            if isinstance(kind, type) and issubclass(kind, enum.Enum)
            else kind.__name__
        )
        raise MaxTextError(
            f"{key}={value!r} is not a valid {expected}; give {key} a value of that type."
        ) from None


def _merged_rules(files: list[Path], over: dict, raw: dict) -> list | None:
    """logical_axis_rules as MaxText builds them: each later file's (and an override's)
    entries merged in front of the earlier ones, unless override_logical_axis_rules."""
    layers = [_load_yaml(f).get("logical_axis_rules") for f in files]
    if "logical_axis_rules" in over:
        layers.append(over["logical_axis_rules"])
    layers = [rules for rules in layers if rules is not None]
    if not layers:
        return None
    if _coerce("override_logical_axis_rules", raw.get("override_logical_axis_rules", False), bool):
        return layers[-1]
    merged: list = []
    for rules in reversed(layers):
        if not isinstance(rules, list):
            raise MaxTextError(
                "logical_axis_rules must be a list of [logical_name, mesh_axes] pairs; fix the file."
            )
        merged += rules
    return merged


def _assign(dims: tuple[str, ...], rules: list) -> tuple[list[list[str]], list[str]]:
    """Mesh axes per dim as flax's logical_to_mesh_axes assigns them: walk the rules in
    order; a rule for one of the dims applies when that dim is still unassigned and
    none of its mesh axes is already used by another dim. Also returns the rules that
    were skipped because an axis was taken (the axis a user meant for two dims)."""
    result: list[list[str] | None] = [None] * len(dims)
    skipped = []
    for entry in rules:
        if not isinstance(entry, (list, tuple)) or len(entry) != 2:
            raise MaxTextError(
                f"logical_axis_rules entry {entry!r} is not a [logical_name, mesh_axes] pair; "
                "fix the file."
            )
        name, axes = entry
        if name not in dims:
            continue
        axes = [axes] if isinstance(axes, str) else list(axes or [])
        pos = dims.index(name)
        used = {a for r in result if r for a in r}
        if result[pos] is None and not used & set(axes):
            result[pos] = axes
        elif result[pos] is None:
            skipped.append((pos, f"{name} -> {axes} ({', '.join(sorted(used & set(axes)))} taken)"))
    # A skipped rule matters only when no later rule gave its dim any axes: duplicate
    # entries are MaxText's own fallbacks (base.yml lists embed_moe twice on purpose).
    lost = [text for pos, text in skipped if result[pos] is None]
    return [r or [] for r in result], lost


def _axis_rules(rules: Any, dropped: list[str] | None = None) -> AxisRules:
    """Axis roles as MaxText 0.2.5's RoutedMoE resolves its tensors' logical names
    (activations: activation_batch_moe, activation_length_moe, activation_embed_moe;
    expert weights: exp, embed_moe, mlp_moe; the general names when a config has no
    MoE-specific ones). Mesh axes this check does not model (fsdp_transpose, ...) are
    left out; MAXTEXT_AXIS_NOT_MODELLED reports one whose parallelism is > 1."""
    if rules is None:
        return AxisRules()
    names = {str(e[0]) for e in rules if isinstance(e, (list, tuple)) and e}
    act = ("activation_batch_moe", "activation_length_moe", "activation_embed_moe")
    if "activation_batch_moe" not in names:
        act = ("activation_batch", "activation_length", "activation_embed")
    weight = ("exp", "embed_moe", "mlp_moe") if "embed_moe" in names else ("exp", "embed", "mlp")
    (batch, sequence, _), _ = _assign(act, rules)
    (experts, embed, hidden), skipped = _assign(weight, rules)
    if dropped is not None:
        dropped += skipped

    def ours(axes):
        return [a for a in axes if a in MESH_AXES]

    return AxisRules(
        batch=ours(batch),
        sequence=ours(sequence),
        experts=ours(experts),
        hidden=ours(hidden),
        embed=ours(embed),
    )


def _dispatch(raw: dict, sparse: bool) -> Dispatch:
    """What MaxText would run: sparse_matmul picks the grouped matmul, else the einsum
    path, which drops tokens when capacity_factor > 0."""
    if "dispatch" in raw:
        return _coerce("dispatch", raw["dispatch"], Dispatch)
    if sparse:
        return Dispatch.megablox
    cf = _coerce("capacity_factor", raw.get("capacity_factor", -1.0), float)
    return Dispatch.subgroup_capacity if cf > 0 else Dispatch.dense


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
    hw = Hardware(**_load_yaml(path))
    if hw.platform != ("gpu" if platform.startswith("gpu") else platform):
        notes.append(f"chip={chip} is a {hw.platform} chip while hardware={platform}.")
    return hw


def _num_slices(raw: dict, notes: list[str]) -> int:
    slices = _coerce("num_slices", raw.get("num_slices", 1), int)
    if slices != -1:
        return slices
    dcn = [_coerce(k, raw[k], int) for k in PARALLELISM_KEYS if k.startswith("dcn_") and k in raw]
    explicit = [d for d in dcn if d > 0]
    count = math.prod(explicit) if -1 not in dcn else max(1, math.prod(explicit))
    notes.append(
        f"num_slices=-1 (MaxText detects it) taken as {count} slice(s) from the dcn knobs; "
        "set num_slices=N for a multislice job."
    )
    return count


def _routing(
    raw: dict, model_name: str, base: dict, notes: list[str]
) -> tuple[dict, list[str], list[Finding]]:
    """The block's routing settings for what MaxText 0.2.5's get_topk does with this
    decoder and model, what our block cannot reproduce, and routing facts (a fact that
    only base.yml's own default triggers is a note, not a finding)."""
    decoder = str(raw.get("decoder_block", "llama2"))
    score = str(raw.get("routed_score_func", "") or "")
    bias = _coerce("routed_bias", raw.get("routed_bias", False), bool)
    scale = _coerce("routed_scaling_factor", raw.get("routed_scaling_factor", 1.0), float)
    norm = _coerce("norm_topk_prob", raw.get("norm_topk_prob", False), bool)
    groups = _coerce("n_routing_groups", raw.get("n_routing_groups", -1), int)
    top_groups = _coerce("topk_routing_group", raw.get("topk_routing_group", -1), int)
    shared = _coerce("shared_experts", raw.get("shared_experts", 0), int)
    out: dict = {"shared_expert_gate": decoder in SHARED_GATE_DECODERS and shared > 0}
    unsupported, found = [], []
    out["routed_score_func"] = ScoreFunc.sigmoid if score == "sigmoid" else ScoreFunc.softmax
    if score not in ("", "softmax", "sigmoid"):
        unsupported.append(f"routed_score_func={score}")
    if decoder in ("deepseek", "deepseek4"):
        if score == "":
            unsupported.append("decoder_block=deepseek with routed_score_func='' (raw logits)")
        out["norm_topk_prob"] = score == "sigmoid"  # deepseek_scale_weights
        out["routed_scaling_factor"] = scale
        if model_name.startswith(DEEPSEEK_V3_FAMILY):
            out["routed_bias"] = bias
            out["n_routing_groups"], out["topk_routing_group"] = groups, top_groups
        elif bias:
            unsupported.append("routed_bias outside the DeepSeek-V3 family (bias weighs too)")
    elif decoder in ("llama4", "gemma4"):
        unsupported.append(f"decoder_block={decoder} routing")
        out["norm_topk_prob"] = norm
    else:
        # Softmax over the top-k logits: renormalised whatever norm_topk_prob says, and
        # neither routed_scaling_factor nor groups are applied.
        out["norm_topk_prob"] = True
        if score not in ("", "softmax"):
            unsupported.append(f"routed_score_func={score} then a softmax over the top-k")
        if bias:
            unsupported.append("routed_bias outside the DeepSeek-V3 family (bias weighs too)")
        if not norm:
            text = (
                f"norm_topk_prob=false with decoder_block={decoder}: MaxText still normalises "
                "the top-k weights (a softmax over the top-k logits; read from its source and "
                "measured), so the block runs norm_topk_prob=true to match. Only "
                "decoder_block=deepseek with routed_score_func=softmax leaves them unnormalised."
            )
            if base.get("norm_topk_prob") == raw.get("norm_topk_prob"):
                notes.append(text)
            else:
                found.append(warning("MAXTEXT_NORM_TOPK_PROB_IGNORED", "norm_topk_prob", text))
    acts = raw.get("mlp_activations", ["silu", "linear"])
    if list(acts or []) != ["silu", "linear"]:
        unsupported.append(f"mlp_activations={acts}")
    for key in ("mlp_activations_limit", "first_num_hash_layers"):
        if float(raw.get(key, 0) or 0) > 0:
            unsupported.append(f"{key}={raw[key]}")
    for key in ("mlp_bias", "use_random_routing"):
        if _coerce(key, raw.get(key, False), bool):
            unsupported.append(f"{key}=true")
    if unsupported:
        found.append(
            warning(
                "MAXTEXT_ROUTING_NOT_IN_BLOCK",
                "decoder_block",
                f"layers.MoEBlock does not compute what MaxText does for "
                f"{', '.join(unsupported)}: its plan (memory, time, sharding) still holds, "
                "but its outputs would differ from MaxText's.",
            )
        )
    return out, unsupported, found


def _unknown_override(key: str, allowed: set[str]) -> MaxTextError:
    close = difflib.get_close_matches(key, sorted(allowed), n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(close)}?" if close else ""
    return MaxTextError(
        f"Unknown setting {key!r}: it is in neither the MaxText config chain nor this "
        f"check's own keys ({', '.join(OWN_KEYS)}), so nothing would read it.{hint}"
    )


def from_maxtext(
    path: str | Path, overrides: Sequence[str] = (), conf_dir: Path | None = None
) -> MaxTextImport:
    """Read a MaxText config (and overrides) into a typed Config, with what was ignored
    and the MaxText-specific findings. Raises MaxTextError for unusable input."""
    conf_dir = conf_dir or packaged_conf()
    over = parse_overrides(overrides)
    raw, files = _load_chain(Path(path))
    model_name = over.get("model_name", raw.get("model_name"))
    if model_name not in (None, "", "default"):
        model_file = files[0].parent / "models" / f"{model_name}.yml"
        if not model_file.is_file():
            raise MaxTextError(
                f"model_name={model_name!r}: no {str(model_file)!r} beside the base config; "
                "check the name or the models/ folder."
            )
        raw = {**raw, **_load_yaml(model_file)}
        files.append(model_file)
    allowed = set(raw) | set(OWN_KEYS) | set(READ_KEYS) | set(DIRECT_KEYS) | set(PARALLELISM_KEYS)
    for key in over:
        if key not in allowed:
            raise _unknown_override(key, allowed)
    raw = {**raw, **over}

    notes: list[str] = []
    values: dict[str, Any] = {}
    for theirs, ours in DIRECT_KEYS.items():
        if theirs in raw and raw[theirs] is not None:
            values[ours] = _coerce(theirs, raw[theirs], _FIELD_TYPES[ours])
    for key in (
        *PARALLELISM_KEYS,
        "num_devices",
        "allow_local_batch_inflation",
        "expert_buffer_factor",
        "optimizer_bytes_per_param",
    ):
        if key in raw and raw[key] is not None:
            values[key] = _coerce(key, raw[key], _FIELD_TYPES[key])
    if values.get("num_experts", 1) <= 1 and values.get("base_moe_mlp_dim", -1) <= 0:
        # A dense MaxText config has no MoE layer: its MLP is base_mlp_dim wide.
        values["base_moe_mlp_dim"] = _coerce("base_mlp_dim", raw.get("base_mlp_dim", 7168), int)
        notes.append(
            f"num_experts={values.get('num_experts', 1)}: a dense model; the block is checked as "
            f"one MLP of base_mlp_dim={values['base_moe_mlp_dim']}."
        )
    values["num_slices"] = _num_slices(raw, notes)
    sparse = _coerce("sparse_matmul", raw.get("sparse_matmul", True), bool)
    megablox = _coerce("megablox", raw.get("megablox", True), bool)
    values["dispatch"] = _dispatch(raw, sparse)
    values["mode"] = mode_of(raw) or Mode.train
    if "mode" in raw:
        values["mode"] = _coerce("mode", raw["mode"], Mode)
    for key, kind in (
        ("expert_exchange", Exchange),
        ("expert_group", ExpertGroup),
        ("output", OutputFormat),
    ):
        if key in raw:
            values[key] = _coerce(key, raw[key], kind)
    values["model_name"] = str(model_name or "maxtext")
    dropped: list[str] = []
    values["axis_rules"] = _axis_rules(_merged_rules(files, over, raw), dropped)
    values["hardware"] = _hardware(raw, conf_dir, notes)
    values["capacity_rounding"] = CapacityRounding.maxtext
    base = _load_yaml(files[0])  # MaxText's own defaults (the root of the chain)
    routing, _, routing_findings = _routing(raw, str(model_name or ""), base, notes)
    values.update(routing)
    cfg = Config(**values)
    if "expert_exchange" not in raw and sparse and _expert_axis(cfg) > 1:
        # MaxText's grouped matmul exchanges rows over its expert axis (ragged all-to-all).
        cfg = cfg.replace(expert_exchange=Exchange.all_to_all, expert_group=ExpertGroup.expert)
    mesh, _ = build_mesh_view(cfg, None)
    found = routing_findings + facts(raw, cfg, mesh, sparse, megablox)
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
    return MaxTextImport(cfg, ignored, found, [str(f) for f in files], notes, relevant)


def _expert_axis(cfg: Config) -> int:
    return cfg.ici_expert_parallelism * max(cfg.dcn_expert_parallelism, 1)


__all__ = ["MaxTextError", "MaxTextImport", "fix", "from_maxtext", "parse_overrides"]
