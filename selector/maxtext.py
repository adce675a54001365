"""Read a MaxText config the way MaxText does, and map what the MoE block uses.

`from_maxtext(path, overrides)`: follows the `base_config:` chain relative to each file,
loads `models/<model_name>.yml` beside the root base file when `model_name` is set (in
a file or an override), applies `key=value` overrides (MaxText's, plus our own
`num_devices`, `hardware`, `dispatch`, `mode`, `output`, `allow_local_batch_inflation`),
maps the keys we understand, and lists the rest as ignored. Precedence, as in MaxText:
base chain < model file < overrides.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .compose import conf_dir as packaged_conf
from .config import MESH_AXES, AxisRules, Config, Dispatch, Hardware, Mode, OutputFormat
from .findings import Finding, warning

# MaxText keys copied one to one.
DIRECT_KEYS = (
    "per_device_batch_size",
    "max_target_length",
    "base_emb_dim",
    "base_moe_mlp_dim",
    "num_experts",
    "num_experts_per_tok",
    "capacity_factor",
    "norm_topk_prob",
    "dtype",
    "context_parallel_load_balance",
    "num_slices",
)
PARALLELISM_KEYS = tuple(
    f"{tier}_{axis}_parallelism" for tier in ("ici", "dcn") for axis in MESH_AXES
)
# Our own keys, accepted beside MaxText's (a MaxText file takes the device count from
# the machine, so a pre-launch check must be told it).
OWN_KEYS = ("num_devices", "hardware", "dispatch", "mode", "output", "allow_local_batch_inflation")
# Keys that decide the dispatch or the axis roles (read, not copied).
ROUTING_KEYS = (
    "sparse_matmul",
    "megablox",
    "model_call_mode",
    "logical_axis_rules",
    "model_name",
    "base_config",
)
# MaxText logical axis names -> our axis-role names.
LOGICAL_ROLES = {
    "activation_batch": "batch",
    "activation_length": "sequence",
    "exp": "experts",
    "mlp": "hidden",
    "embed": "embed",
}


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


def _load_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError as exc:
        raise MaxTextError(
            f"MaxText config {str(path)!r} does not exist; check the path "
            "given to maxtext_config= (or its base_config:)."
        ) from exc
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise MaxTextError(
            f"MaxText config {str(path)!r} is not readable YAML ({first}); fix the file."
        ) from exc
    if not isinstance(data, dict):
        raise MaxTextError(
            f"MaxText config {str(path)!r} holds a {type(data).__name__}, not "
            "a mapping of key: value; fix the file."
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
                f"Cannot read the override {item!r}: MaxText overrides take "
                "the form key=value (for example ici_context_parallelism=4)."
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


def _axis_rules(rules: Any) -> AxisRules:
    """Axis roles from MaxText's logical_axis_rules (first entry per logical name).

    Mesh axes this check does not model (fsdp_transpose, sequence, ...) are left out;
    one with parallelism > 1 is reported by MAXTEXT_AXIS_NOT_MODELLED."""
    roles = dataclasses.asdict(AxisRules())
    if rules is None:
        return AxisRules(**roles)
    if not isinstance(rules, list):
        raise MaxTextError(
            "logical_axis_rules must be a list of [logical_name, mesh_axes] pairs; fix the file."
        )
    seen = set()
    for entry in rules:
        if not isinstance(entry, (list, tuple)) or len(entry) != 2:
            raise MaxTextError(
                f"logical_axis_rules entry {entry!r} is not a "
                "[logical_name, mesh_axes] pair; fix the file."
            )
        name, axes = entry
        role = LOGICAL_ROLES.get(name)
        if role is None or role in seen:
            continue
        seen.add(role)
        axes = [axes] if isinstance(axes, str) else list(axes or [])
        roles[role] = [a for a in axes if a in MESH_AXES]
    return AxisRules(**roles)


def _dispatch(raw: dict) -> Dispatch:
    """What MaxText would run: sparse_matmul picks the grouped matmul, else the einsum
    path, which drops tokens when capacity_factor > 0."""
    if "dispatch" in raw:
        return _coerce("dispatch", raw["dispatch"], Dispatch)
    if _coerce("sparse_matmul", raw.get("sparse_matmul", True), bool):
        return Dispatch.megablox
    cf = _coerce("capacity_factor", raw.get("capacity_factor", -1.0), float)
    return Dispatch.subgroup_capacity if cf > 0 else Dispatch.dense


def _hardware(name: Any, conf_dir: Path) -> Hardware:
    path = conf_dir / "hardware" / f"{name}.yaml"
    if not path.is_file():
        options = ", ".join(sorted(p.stem for p in (conf_dir / "hardware").glob("*.yaml")))
        raise MaxTextError(f"hardware={name!r} is not a preset; use one of {options}.")
    return Hardware(**_load_yaml(path))


def maxtext_findings(raw: dict, cfg: Config, cp_axes: dict[str, int]) -> list[Finding]:
    """MaxText behaviours that lose the sequence sharding or silently change results."""
    findings = []
    context = cp_axes.get("context", 1) * cp_axes.get("context_usp_ulysses", 1)
    cp = context * cp_axes.get("context_autoregressive", 1)
    sparse = _coerce("sparse_matmul", raw.get("sparse_matmul", True), bool)
    train = cfg.mode is Mode.train
    if sparse and cfg.capacity_factor > 0:
        findings.append(
            warning(
                "MAXTEXT_SPARSE_IGNORES_CAPACITY",
                "capacity_factor",
                f"sparse_matmul=true runs MaxText's dropless grouped matmul, which does not apply "
                f"capacity_factor={cfg.capacity_factor:g}. Set capacity_factor=-1 to say so, or "
                "sparse_matmul=false for capacity-limited routing.",
            )
        )
    if sparse and cp > 1:
        findings.append(
            warning(
                "MAXTEXT_FLATTEN_GATHERS_SEQUENCE",
                "sparse_matmul",
                f"sparse_matmul=true with cp={cp}: MaxText's RoutedMoE flattens (batch, sequence) "
                "and sorts tokens globally, so XLA gathers the whole sequence onto every device "
                "and the MoE block saves no memory from context parallelism. layers.MoEBlock "
                "with dispatch=megablox keeps the sequence sharded.",
            )
        )
    if not sparse and cfg.capacity_factor > 0 and train and context > 1:
        findings.append(
            warning(
                "MAXTEXT_CAPACITY_OVER_FULL_SEQUENCE",
                "sparse_matmul",
                f"sparse_matmul=false with capacity_factor={cfg.capacity_factor:g} under "
                f"context parallelism ({context} over context/context_usp_ulysses): MaxText's "
                "subgroup split reads only the context_autoregressive axis, so it falls back to "
                "one subgroup per sequence and loses the sequence sharding. layers.MoEBlock with "
                "dispatch=subgroup_capacity splits per sequence shard.",
            )
        )
    return findings


def from_maxtext(
    path: str | Path, overrides: Sequence[str] = (), conf_dir: Path | None = None
) -> MaxTextImport:
    """Read a MaxText config (and overrides) into a typed Config, with what was ignored
    and the MaxText-specific findings. Raises MaxTextError for unreadable input."""
    conf_dir = conf_dir or packaged_conf()
    over = parse_overrides(overrides)
    raw, files = _load_chain(Path(path))
    model_name = over.get("model_name", raw.get("model_name"))
    if model_name not in (None, "", "default"):
        model_file = files[0].parent / "models" / f"{model_name}.yml"
        if not model_file.is_file():
            raise MaxTextError(
                f"model_name={model_name!r}: no {str(model_file)!r} beside the "
                "base config; check the name or the models/ folder."
            )
        raw = {**raw, **_load_yaml(model_file)}
        files.append(model_file)
    raw = {**raw, **over}

    findings: list[Finding] = []
    values: dict[str, Any] = {}
    for key in DIRECT_KEYS + PARALLELISM_KEYS + ("num_devices", "allow_local_batch_inflation"):
        if key in raw and raw[key] is not None:
            values[key] = _coerce(key, raw[key], _FIELD_TYPES[key])
    values["dispatch"] = _dispatch(raw)
    if "mode" in raw:
        values["mode"] = _coerce("mode", raw["mode"], Mode)
    elif str(raw.get("model_call_mode", "")).lower() == "inference":
        values["mode"] = Mode.prefill
    values["model_name"] = str(model_name or "maxtext")
    values["axis_rules"] = _axis_rules(raw.get("logical_axis_rules"))
    if "hardware" in raw:
        values["hardware"] = _hardware(raw["hardware"], conf_dir)
    if "output" in raw:
        values["output"] = _coerce("output", raw["output"], OutputFormat)
    cfg = Config(**values)

    used = set(DIRECT_KEYS + PARALLELISM_KEYS + OWN_KEYS + ROUTING_KEYS)
    ignored = sorted(k for k in raw if k not in used)
    for key in ignored:
        if key.endswith("_parallelism") and raw[key] not in (1, "1", None):
            findings.append(
                warning(
                    "MAXTEXT_AXIS_NOT_MODELLED",
                    key,
                    f"{key}={raw[key]} shards a mesh axis this check does not model; the "
                    "per-device numbers assume it is 1. Set it to 1 (moving its devices to a "
                    "modelled axis) for this check to be exact.",
                )
            )
    cp_axes = {a: cfg.parallelism("ici", a) * cfg.parallelism("dcn", a) for a in MESH_AXES}
    findings += maxtext_findings(raw, cfg, cp_axes)
    return MaxTextImport(cfg, ignored, findings, [str(f) for f in files])
