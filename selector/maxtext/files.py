"""Reading MaxText's YAML files the way MaxText reads them: the base_config chain,
`key=value` overrides typed as YAML scalars, and logical_axis_rules merged across the
chain; every unreadable input is a MaxTextError naming the file, line or key."""

from __future__ import annotations

import copy
import enum
import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from ..findings import shown


class MaxTextError(ValueError):
    """A MaxText file or override that cannot be read: the message names it and the fix.

    Examples:
      >>> import selector
      >>> try:
      ...     selector.from_maxtext("missing.yml")
      ... except selector.MaxTextError as error:
      ...     print(str(error).split(";")[1].strip())
      check the path given to maxtext_config= (or its base_config:).
    """


# libyaml's parser where PyYAML was built with it (its wheels are): in pure Python,
# MaxText's base.yml takes about 50 ms to parse, and every config chains onto it.
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@functools.lru_cache(maxsize=32)
def _parsed(text: str) -> Any:
    """A file's YAML, parsed once per text (a process reading several MaxText configs
    parses base.yml once); callers get a copy."""
    return yaml.load(text, Loader=SAFE_LOADER)


# MaxText's own configs are tens of KiB (base.yml: about 50); anything past this is not
# a config, and a special file (a FIFO, /dev/zero) is never one.
MAX_CONFIG_BYTES = 4 * 2**20


def load_yaml(path: Path) -> dict:
    name = shown(repr(str(path)))
    try:
        info = path.stat()
    except FileNotFoundError as exc:
        raise MaxTextError(
            f"MaxText config {name} does not exist; check the path given to "
            "maxtext_config= (or its base_config:)."
        ) from exc
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__  # str(exc) repeats the whole path
        raise MaxTextError(f"MaxText config {name} cannot be read ({reason}).") from exc
    if not path.is_file():
        raise MaxTextError(
            f"MaxText config {name} is not a regular file (a folder, pipe or device); "
            "give the path of a YAML file."
        )
    if info.st_size > MAX_CONFIG_BYTES:
        raise MaxTextError(
            f"MaxText config {name} holds {info.st_size:,} bytes, more than the "
            f"{MAX_CONFIG_BYTES:,} a config may (MaxText's own are tens of KiB); give the "
            "config file itself."
        )
    try:
        with path.open(encoding="utf-8") as f:
            text = f.read(MAX_CONFIG_BYTES + 1)
        if len(text) > MAX_CONFIG_BYTES:
            raise MaxTextError(f"MaxText config {name} is longer than {MAX_CONFIG_BYTES:,} bytes.")
        data = copy.deepcopy(_parsed(text))
    except RecursionError as exc:
        raise MaxTextError(
            f"MaxText config {name} nests its values deeper than this reader follows; a "
            "MaxText config is a flat mapping of settings: fix the file."
        ) from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).strip().splitlines()[0]
        raise MaxTextError(
            f"MaxText config {name} is not readable YAML{where} ({shown(problem)}); fix the file."
        ) from exc
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror or type(exc).__name__  # str(exc) repeats the whole path
        raise MaxTextError(f"MaxText config {name} cannot be read ({reason}).") from exc
    if data is None:
        raise MaxTextError(f"MaxText config {name} is empty; give a config with its keys.")
    if not isinstance(data, dict):
        raise MaxTextError(
            f"MaxText config {name} holds a {type(data).__name__}, not a mapping of "
            "key: value; fix the file."
        )
    return data


def configs_dir(path: Path) -> Path | None:
    """MaxText's configs folder for a file in its tree: the nearest folder at or above
    the file's that holds base.yml (MaxText 0.2.5 resolves a relative base_config there
    when it is not beside the file, and reads custom_mesh_and_rule/ from it)."""
    for folder in path.resolve().parents:
        if (folder / "base.yml").is_file():
            return folder
    return None


def load_chain(path: Path, seen: tuple[Path, ...] = ()) -> tuple[dict, list[Path], list[dict]]:
    """The file merged over its base_config chain; the files, root base first; and each
    file's own keys, in the same order (each file is parsed once: MaxText's base.yml
    takes about 55 ms to parse here). A relative base_config is looked for beside the
    file, then in MaxText's configs folder, as MaxText 0.2.5's pyconfig does."""
    path = path.resolve()
    if path in seen:
        raise MaxTextError(f"base_config loop through {shown(repr(str(path)))}; break the cycle.")
    data = load_yaml(path)
    base = data.get("base_config")
    if not base:
        return data, [path], [data]
    parent_path = path.parent / str(base)
    folder = configs_dir(path)
    if not parent_path.is_file() and not Path(str(base)).is_absolute() and folder is not None:
        if (folder / str(base)).is_file():
            parent_path = folder / str(base)
    parent, files, each = load_chain(parent_path, (*seen, path))
    return {**parent, **data}, [*files, path], [*each, data]


def custom_mesh_and_rule(raw: dict, files: list[Path]) -> tuple[dict, Path | None]:
    """MaxText 0.2.5's custom_mesh_and_rule=NAME: configs/custom_mesh_and_rule/NAME.yml
    replaces mesh_axes, logical_axis_rules and data_sharding (read in its
    configs/types.py, not run). Returns the replaced keys and the file read (none when
    the switch is off)."""
    name = str(raw.get("custom_mesh_and_rule") or "")
    if not name:
        return {}, None
    folder = configs_dir(files[0])
    choices = (
        sorted(p.stem for p in (folder / "custom_mesh_and_rule").glob("*.yml")) if folder else []
    )
    if name not in choices:
        raise MaxTextError(
            f"custom_mesh_and_rule={shown(repr(name))} names no file in MaxText's "
            f"custom_mesh_and_rule/ folder ({', '.join(choices) or 'not found beside base.yml'}); "
            "give one of those names."
        )
    path = folder / "custom_mesh_and_rule" / f"{name}.yml"
    data = load_yaml(path)
    keys = ("mesh_axes", "logical_axis_rules", "data_sharding")
    return {k: data[k] for k in keys if k in data}, path


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """MaxText-style `key=value` strings, values typed as YAML scalars."""
    parsed = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or not key.replace("_", "a").replace(".", "a").isalnum():
            raise MaxTextError(
                f"Cannot read the override {shown(repr(item))}: MaxText overrides take the "
                "form key=value (for example ici_context_parallelism=4)."
            )
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        except RecursionError as exc:
            raise MaxTextError(
                f"The override {shown(repr(item))} nests its value deeper than this reader "
                "follows; give a plain value."
            ) from exc
        parsed[key] = value
    return parsed


def coerce(key: str, value: Any, kind: type) -> Any:
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


def merged_rules(each: list[dict], over: dict, raw: dict) -> list | None:
    """logical_axis_rules as MaxText builds them: each later file's (and an override's)
    entries merged in front of the earlier ones, unless override_logical_axis_rules.
    `each` holds every file's own keys, root base first."""
    layers = [data.get("logical_axis_rules") for data in each]
    if "logical_axis_rules" in over:
        layers.append(over["logical_axis_rules"])
    layers = [rules for rules in layers if rules is not None]
    if not layers:
        return None
    if coerce("override_logical_axis_rules", raw.get("override_logical_axis_rules", False), bool):
        return layers[-1]
    merged: list = []
    for rules in reversed(layers):
        if not isinstance(rules, list):
            raise MaxTextError(
                "logical_axis_rules must be a list of [logical_name, mesh_axes] pairs; fix the file."
            )
        merged += rules
    return merged
