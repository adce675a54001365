"""The Hydra/OmegaConf edge: compose the packaged config, convert it to typed
dataclasses once, and read a live jax mesh without importing jax."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import enum
import functools
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from .config import AxisRules, Config, Hardware, past_max_int
from .findings import ConfigError, error, shown

SCHEMA_NAME = "base_config"


def conf_dir() -> Path:
    """The config tree: `selector/conf` in an installed wheel, `conf/` in a checkout.

    Returns:
      The folder holding config.yaml and the model, mesh and hardware groups.

    Examples:
      >>> import selector
      >>> sorted(p.name for p in selector.conf_dir().iterdir() if p.is_dir())
      ['hardware', 'mesh', 'model']
    """
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(
        f"selector's config tree (config.yaml) is neither in {here / 'conf'} nor in "
        f"{here.parent / 'conf'}; reinstall the package."
    )


def register_schema() -> None:
    """Register the typed schema so `defaults: [base_config]` type-checks overrides."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=_schema())


_FIELDS = {f.name for f in dataclasses.fields(Config)}
GROUPS = ("model", "mesh", "hardware")  # config groups: `model=tiny` picks a preset


def valid_keys() -> list[str]:
    """Every setting a user may give: the schema's fields, nested ones and the groups."""
    nested = {f"hardware.{f.name}" for f in dataclasses.fields(Hardware)}
    nested |= {f"axis_rules.{f.name}" for f in dataclasses.fields(AxisRules)}
    return sorted(_FIELDS | nested | set(GROUPS))


def close_keys(key: str, cutoff: float = 0.6, choices=None) -> list[str]:
    """Up to three of `choices` (every setting by default) spelled like `key`."""
    return difflib.get_close_matches(key, choices or valid_keys(), n=3, cutoff=cutoff)


def did_you_mean(key: str, choices=None) -> str:
    """' Did you mean a or b?' for the keys spelled like `key`, or ''."""
    close = close_keys(key, choices=choices)
    return f" Did you mean {' or '.join(close)}?" if close else ""


def unknown_setting(key: str, where: str = "") -> ConfigError:
    """ConfigError for a key the schema does not have, with the closest real keys."""
    hint = did_you_mean(key)
    return ConfigError(
        [
            error(
                "UNKNOWN_SETTING",
                key,
                f"Unknown setting {shown(repr(key), 60)}{where}: nothing would read it.{hint} "
                "Settings use MaxText's spelling; `python -m selector --cfg job` lists every "
                "key.",
            )
        ]
    )


def override_key(line: str) -> str:
    """The setting an override line names (`+a.b=1` -> `a.b`)."""
    return line.split("=", 1)[0].lstrip("+~")


def compose(overrides: Sequence[str] = ()) -> DictConfig:
    """Compose the packaged config with Hydra overrides; works from any directory.

    Args:
      overrides: Hydra override strings, as on the command line (`model=tiny`,
        `ici_context_parallelism=4`, `mesh=v5p_64`).

    Returns:
      The composed DictConfig (MaxText spelling for shared knobs); `to_config` types it.
      A key the schema does not have is a ConfigError (UNKNOWN_SETTING) with the
      closest real keys, whether it is set plainly or added with Hydra's `+`/`++`.

    Examples:
      >>> import selector
      >>> cfg = selector.compose(["model=tiny", "mesh=cpu_8", "ici_context_parallelism=4"])
      >>> cfg.num_experts, cfg.ici_context_parallelism
      (8, 4)
      >>> selector.compose(["ici_contex_parallelism=4"])
      Traceback (most recent call last):
      ...
      selector.findings.ConfigError: ... Did you mean ici_context_parallelism? ...
    """
    for line in overrides:
        key = override_key(line)
        if line.startswith("+") and key.split(".")[0] not in GROUPS:
            if key in valid_keys():
                raise ConfigError(
                    [
                        error(
                            "OVERRIDE_INVALID",
                            key,
                            f"Override {shown(repr(line))}: {key!r} is already a setting, and "
                            f"Hydra's '+' adds a new key. Write {shown(line.lstrip('+'))} "
                            "instead.",
                        )
                    ]
                )
            raise unknown_setting(key, f" (override {shown(repr(line))})")
    cfg = _with_keys_applied(tuple(overrides))
    if cfg is None:
        cfg = _hydra_compose(tuple(overrides))
    extra = sorted(set(cfg.keys()) - _FIELDS)
    if extra:
        raise unknown_setting(extra[0])
    return cfg


def _hydra_compose(overrides: tuple[str, ...]) -> DictConfig:
    """Hydra's whole compose (its errors translated): the reference `compose` follows."""
    register_schema()
    hydra_global = GlobalHydra.instance()
    outer = None
    if hydra_global.is_initialized():  # called from inside someone's Hydra app
        outer = hydra_global.hydra
        hydra_global.clear()
    try:
        with initialize_config_dir(version_base=None, config_dir=str(conf_dir())):
            try:
                cfg = hydra_compose(config_name="config", overrides=list(overrides))
            except (HydraException, OmegaConfBaseException, ValueError) as exc:
                key = _missing_key(exc, overrides)
                if key is not None:
                    raise unknown_setting(key) from None
                raise override_error(exc, overrides) from None
    finally:
        if outer is not None:
            GlobalHydra.instance().initialize(outer)
    return cfg


@functools.cache
def _override_parser() -> OverridesParser:
    return OverridesParser.create()


@functools.lru_cache(maxsize=64)
def _groups_composed(conf: str, groups: tuple[str, ...]) -> DictConfig:
    """Hydra's compose of the config-group choices alone (`conf` keys the tree). Kept:
    the preset files do not change while a process runs, and composing them is most of
    a compose's time (a tenth of a second here). Never handed out: callers copy it."""
    return _hydra_compose(groups)


def _with_keys_applied(overrides: tuple[str, ...]) -> DictConfig | None:
    """The composed config, made as Hydra makes it but with the group choices' compose
    kept: Hydra composes the defaults list (config.yaml and the chosen `model`, `mesh`
    and `hardware` presets), then applies every other override to it in order
    (`ConfigLoaderImpl._apply_overrides_to_config`, the function called here). None
    where an override needs Hydra's own path (a sweep, Hydra's node or groups) or where
    Hydra refuses one, so that the error comes from that path, translated as always."""
    try:
        parsed = _override_parser().parse_overrides(list(overrides))
    except Exception:  # whatever the parser refuses, Hydra's whole compose says how
        return None
    if any(
        o.is_sweep_override() or "/" in o.key_or_group or o.key_or_group.split(".")[0] == "hydra"
        for o in parsed
    ):
        return None
    groups = tuple(o.input_line for o in parsed if o.key_or_group in GROUPS)
    try:
        cfg = copy.deepcopy(_groups_composed(str(conf_dir()), groups))
        ConfigLoaderImpl._apply_overrides_to_config(
            [o for o in parsed if o.key_or_group not in GROUPS], cfg
        )
    except Exception:  # Hydra's whole compose refuses it, and says how
        return None
    return cfg


def _schema_field(key: str):
    """The dataclass field behind a setting (`hardware.memory_gib` included), or None."""
    schema: Any = Config
    *parents, name = key.split(".")
    for parent in parents:
        field = next((f for f in dataclasses.fields(schema) if f.name == parent), None)
        schema = field.default_factory if field and callable(field.default_factory) else None
        if schema is None or not dataclasses.is_dataclass(schema):
            return None
    return next((f for f in dataclasses.fields(schema) if f.name == name), None)


def _what_it_takes(key: str, value: str = "") -> str:
    """What a setting takes, as the fix to a value it cannot: its choices (with the
    one spelled like `value`), or its type and an example, the schema's default."""
    field = _schema_field(key)
    if field is None:
        return "Give a value of the setting's type (`python -m selector --cfg job` shows each)."
    default = field.default
    if default is dataclasses.MISSING and callable(field.default_factory):
        default = field.default_factory()
    kind = type(default)
    if isinstance(default, enum.Enum):
        choices = [c.value for c in type(default)]
        hint = did_you_mean(value, choices) if value else ""
        return f"{key} takes one of {', '.join(choices)}.{hint}"
    if isinstance(default, bool):
        return f"{key} takes true or false (default {str(default).lower()})."
    if isinstance(default, (list, tuple)):
        return f"{key} takes a list of mesh axes, e.g. {key}=[{','.join(default)}]."
    names = {int: "a whole number", float: "a number", str: "a name"}
    if "int | None" in str(field.type):
        return f"{key} takes a whole number or null (the default)."
    if kind in names:
        return f"{key} takes {names[kind]}: for example {key}={default} (the default)."
    return "Give a value of the setting's type (`python -m selector --cfg job` shows each)."


def _line_for(key: str, overrides: Sequence[str]) -> str:
    return next((ln for ln in overrides if override_key(ln) == key), key)


def override_error(exc: BaseException, overrides: Sequence[str]) -> ConfigError:
    """ConfigError for an override Hydra refused, naming the setting and the fix."""
    cause = exc.__cause__
    if isinstance(cause, ValidationError) and getattr(cause, "full_key", None):
        key = str(cause.full_key)
        line = _line_for(key, overrides)
        value = line.split("=", 1)[1] if "=" in line else ""
        reason = str(cause).strip().splitlines()[0].rstrip(".")
        return _override_finding(
            "VALUE_TYPE_INVALID",
            key,
            f"Setting {key!r} cannot take the value in {shown(repr(line))}: {shown(reason)}. "
            + _what_it_takes(key, value),
        )
    if isinstance(exc, MissingConfigException):
        m = re.search(r"Could not find '([^/']+)/([^']+)'", str(exc))
        if m:
            group, option = m.groups()
            options = sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))
            hint = did_you_mean(option, options)
            return _override_finding(
                "PRESET_UNKNOWN",
                group,
                f"Unknown option {shown(option, 60)!r} for {group}= (override "
                f"{shown(repr(_line_for(group, overrides)))}). Available {group} presets: "
                f"{', '.join(options) or 'none'}.{hint}",
            )
    bad = [ln for ln in overrides if _parses_badly(ln)]
    if isinstance(exc, ValueError) and "digits" in str(exc) and bad:
        return _override_finding(
            "VALUE_TOO_LARGE",
            override_key(bad[0]),
            f"The override {shown(repr(bad[0]))} holds a whole number past 4,300 digits, "
            f"far past any size a setting can take (2**63). "
            + _what_it_takes(override_key(bad[0])),
        )
    if isinstance(exc, (OverrideParseException, ValueError)) and bad:
        detail = str(exc).strip().splitlines()
        reason = shown(detail[1] if len(detail) > 1 else detail[0] if detail else "")
        return _override_finding(
            "OVERRIDE_INVALID",
            override_key(bad[0]),
            f"Cannot parse the override {shown(repr(bad[0]))} ({reason}). Overrides take the "
            "form key=value (for example ici_context_parallelism=4); quote values with "
            "spaces or special characters.",
        )
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "Ambiguous value" in text:
        line = next((ln for ln in overrides if ln in text), overrides[0] if overrides else "")
        return _override_finding(
            "OVERRIDE_INVALID",
            override_key(line),
            f"The override {shown(repr(line))} lists several values; add -m to run one check "
            "per value (python -m selector -m ...), or give one value.",
        )
    return _override_finding(
        "OVERRIDE_INVALID",
        override_key(overrides[0]) if overrides else "overrides",
        f"Cannot apply the overrides {shown(repr(' '.join(overrides)))}: {shown(text)}. "
        "Check each is key=value with a setting `python -m selector --cfg job` lists.",
    )


def _override_finding(code: str, key: str, message: str) -> ConfigError:
    return ConfigError([error(code, key, message)])


def _parses_badly(line: str) -> bool:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        OverridesParser.create().parse_overrides([line])
        return False
    except (OverrideParseException, ValueError):
        return True


def _missing_key(exc: BaseException, overrides: Sequence[str]) -> str | None:
    """The override key Hydra could not find in the schema, if that is the failure."""
    text = str(exc) + " " + str(getattr(exc, "__cause__", "") or "")
    if "not in struct" not in text and "Could not override" not in text:
        return None
    for line in overrides:
        key = override_key(line)
        if f"'{key}'" in text or key in text.split():
            return key
    return None


def to_config(cfg: Any, *, others: str = "error") -> Config:
    """A typed Config from a Config, a DictConfig or a plain mapping.

    Args:
      cfg: a Config (returned as it is), a DictConfig from `compose` or a user's Hydra
        app, or a plain mapping of settings.
      others: "error" (default): a key that is not a setting raises ConfigError
        (UNKNOWN_SETTING) with a did-you-mean; "misspellings", for a node that also
        holds an app's own keys (the root of a training config): only keys that look
        like a misspelled setting are errors.

    Returns:
      The frozen, typed `selector.Config`: what the selector's core reads.

    Examples:
      >>> import selector
      >>> config = selector.to_config({"num_experts": 16, "num_experts_per_tok": 2})
      >>> config.num_experts, config.mode.value
      (16, 'train')
    """
    if isinstance(cfg, Config):
        return cfg
    if not isinstance(cfg, (DictConfig, Mapping)):
        raise TypeError(f"expected a Config, DictConfig or mapping, got {type(cfg).__name__}")
    if not isinstance(cfg, DictConfig):
        for key in cfg.keys():
            _check_plain(str(key), cfg[key])
    for key in cfg.keys():
        if key in _FIELDS or key in GROUPS:
            continue
        if others == "error" or _misspelled(str(key), cfg[key] if not _lazy(cfg, key) else None):
            raise unknown_setting(str(key))
    # Read only our keys: resolving the whole node would also resolve a
    # `${moe_dispatch:}` that sits in it and asks for this very conversion.
    # A group named by a string picks a preset (`hardware` is also the nested settings
    # node, a mapping, in a composed config).
    presets = {
        k: cfg[k]
        for k in cfg.keys()
        if k in GROUPS and not (k in _FIELDS and isinstance(cfg[k], (Mapping, DictConfig)))
    }
    try:
        if _typed_by_schema(cfg) and not presets:
            # Composed against the schema: each value was validated as it was set, and
            # the merge below (20x the conversion's time) would only check them again.
            return OmegaConf.to_object(cfg)
        known = {k: cfg[k] for k in cfg.keys() if k in _FIELDS and k not in presets}
        merged = OmegaConf.merge(_preset_base(presets, complete=set(known) >= _FIELDS), known)
        return OmegaConf.to_object(merged)
    except ValidationError as exc:
        key = str(getattr(exc, "full_key", "") or "config")
        reason = shown(str(exc).strip().splitlines()[0].rstrip("."))
        raise ConfigError(
            [
                error(
                    "VALUE_TYPE_INVALID",
                    key,
                    f"{key} cannot take the value given: {reason}. "
                    + _what_it_takes(key, str(cfg.get(key, "") if key not in presets else "")),
                )
            ]
        ) from None


# The settings that hold a node of their own; every other setting holds a value.
_NODE_SETTINGS = ("hardware", "axis_rules")


def _misspelled(key: str, value: Any) -> bool:
    """Whether an app's own key looks like a misspelled setting: spelled like one, and
    a node only where it is spelled like a node setting (an app's `moe:` node is not
    `mode` or `model` misspelled)."""
    if isinstance(value, (Mapping, DictConfig)):
        return bool(close_keys(key, cutoff=0.85, choices=_NODE_SETTINGS))
    return bool(close_keys(key, cutoff=0.85))


def _lazy(cfg: Any, key: Any) -> bool:
    """Whether reading `cfg[key]` would resolve an interpolation (a `${moe_dispatch:}`
    beside the settings would ask for this very conversion)."""
    return isinstance(cfg, DictConfig) and OmegaConf.is_interpolation(cfg, key)


def _typed_by_schema(cfg: Any) -> bool:
    """Whether `cfg` is a DictConfig typed by the schema, holding every setting (a key
    deleted with `~` takes the default preset's value), with no interpolation in it (one
    could be a `${moe_dispatch:}` asking for this very conversion)."""
    return (
        isinstance(cfg, DictConfig)
        and OmegaConf.get_type(cfg) is Config
        and set(cfg.keys()) >= _FIELDS
        and not any(OmegaConf.is_interpolation(cfg, k) for k in cfg.keys())
    )


MAX_DEPTH = 16  # a setting's value nests lists or mappings at most this deep


def _check_plain(key: str, value: Any) -> None:
    """Refuse, naming the key, what would only overflow or recurse further in: a whole
    number past 2**63 (Python will not even print one past 4300 digits) or a value
    nested past MAX_DEPTH."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ConfigError(
                [
                    error(
                        "VALUE_TYPE_INVALID",
                        key,
                        f"{key} holds a value nested more than {MAX_DEPTH} levels deep; "
                        "settings take numbers, names and short lists.",
                    )
                ]
            )
        if past_max_int(item):
            digits = int(item.bit_length() * 0.30103) + 1
            raise ConfigError(
                [
                    error(
                        "VALUE_TOO_LARGE",
                        key,
                        f"{key} holds a whole number of about {digits:,} digits, past any "
                        "size a setting can take (2**63). Check the value.",
                    )
                ]
            )
        if isinstance(item, Mapping):
            stack += [(v, depth + 1) for v in item.values()]
        elif isinstance(item, list | tuple):
            stack += [(v, depth + 1) for v in item]


def _preset_base(presets: Mapping[str, Any], complete: bool = False):
    """The config the command line composes, from the presets the mapping names
    (`model`, `mesh`, `hardware`) or else config.yaml's defaults list: a mapping and the
    command line default alike. The schema alone where every setting is given anyway."""
    if complete and not presets:
        return _schema()
    for group, name in presets.items():
        if not isinstance(name, str) or not (conf_dir() / group / f"{name}.yaml").is_file():
            options = sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))
            raise ConfigError(
                [
                    error(
                        "PRESET_UNKNOWN",
                        group,
                        f"{group}={name!r} names no preset. Available {group} presets: "
                        f"{', '.join(options)}.",
                    )
                ]
            )
    return _composed(tuple(f"{group}={name}" for group, name in presets.items()))


@functools.cache
def _schema() -> DictConfig:
    # Cached as _composed is (building it costs ~10 ms; merges copy it).
    return schema_node(Config)


def schema_node(schema: type) -> DictConfig:
    """The Hydra schema node of a frozen config dataclass (Config, or a script's
    subclass of it), writable: OmegaConf marks a frozen dataclass's node read-only,
    which would refuse every override merged into it. What `to_config` builds from the
    node is frozen again.

    Args:
      schema: the dataclass (`selector.Config` or a frozen subclass).

    Returns:
      Its structured DictConfig, for `ConfigStore.instance().store(node=...)`.

    Examples:
      >>> from selector.compose import schema_node
      >>> from selector.config import Config
      >>> node = schema_node(Config)
      >>> node.num_experts = 16  # overrides merge into it
      >>> node.num_experts
      16
    """
    return _writable(OmegaConf.structured(schema))


def _writable(node: DictConfig) -> DictConfig:
    OmegaConf.set_readonly(node, None)
    for key in node.keys():
        if OmegaConf.is_dict(child := node._get_node(key)):
            _writable(child)
    return node


@functools.lru_cache(maxsize=32)
def _composed(overrides: tuple[str, ...]) -> DictConfig:
    # Cached: a training script converts mappings often, and a compose costs ~0.3 s;
    # merges copy, so the cached node is never changed.
    return compose(list(overrides))


def live_mesh_shape(mesh: Any) -> Mapping[str, int] | None:
    """Axis sizes of a `jax.sharding.Mesh` (or any object with a `.shape` mapping)."""
    if mesh is None:
        return None
    if isinstance(mesh, Mapping):
        return dict(mesh)
    return dict(mesh.shape)


def live_platform(mesh: Any) -> str | None:
    """'cpu', 'gpu' or 'tpu' for a live jax mesh; None for a plain mapping."""
    devices = getattr(mesh, "devices", None)
    if devices is None:
        return None
    first = devices.flat[0] if hasattr(devices, "flat") else devices[0]
    platform = getattr(first, "platform", None)
    return {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
