"""`python -m selector [overrides]`: a Hydra app that prints the plan and its findings.

Exit status: 0 no errors (warnings allowed), 1 validation errors, 2 unusable input
(unknown key, wrong type, unparsable override). Never a Python traceback: overrides
are composed once up front, so a bad one is explained in one paragraph before Hydra
starts, and the job itself catches what it raises.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import OverrideType
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from .api import analyse_any
from .compose import _FIELDS, compose, conf_dir, register_schema, to_config
from .config import AxisRules, Hardware, OutputFormat
from .findings import errors_in
from .maxtext import MaxTextError, from_maxtext
from .report import render_json, render_text

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2

# Hydra flags that change what is composed; with them we leave checking to Hydra.
_HYDRA_VALUE_FLAGS = {
    "--config-name",
    "-cn",
    "--config-path",
    "-cp",
    "--config-dir",
    "-cd",
    "--experimental-rerun",
    "--info",
    "-i",
    "--shell-completion",
    "-sc",
}
_PREFIX = {OverrideType.CHANGE: "", OverrideType.ADD: "+", OverrideType.FORCE_ADD: "++"}


def _first_line(text: str) -> str:
    return str(text).strip().splitlines()[0] if str(text).strip() else ""


def _valid_keys() -> list[str]:
    nested = {f"hardware.{f.name}" for f in dataclasses.fields(Hardware)}
    nested |= {f"axis_rules.{f.name}" for f in dataclasses.fields(AxisRules)}
    return sorted(_FIELDS | nested | {"model", "mesh", "hardware"})


def _unknown_key(key: str, line: str, why: str = "") -> str:
    """The message for a key the schema does not have, with the closest real keys."""
    close = difflib.get_close_matches(key, _valid_keys(), n=3, cutoff=0.6)
    hint = f" Did you mean {' or '.join(close)}?" if close else ""
    return (
        f"Unknown setting {key!r} (override {line!r}){why}.{hint} Settings use MaxText's "
        "spelling; `python -m selector --cfg job` lists every key and its value."
    )


def explain(exc: BaseException, line: str) -> str:
    """One paragraph naming the setting and the fix, for a failed override."""
    cause = exc.__cause__ if isinstance(exc.__cause__, OmegaConfBaseException) else None
    key = line.split("=", 1)[0].lstrip("+~")
    if isinstance(exc, OverrideParseException):
        detail = str(exc).strip().splitlines()
        reason = detail[1] if len(detail) > 1 else _first_line(exc)
        return (
            f"Cannot parse the override {line!r} ({reason}). Overrides take the "
            "form key=value (for example ici_context_parallelism=4); quote values with "
            "spaces or special characters."
        )
    if isinstance(exc, MissingConfigException):
        m = re.search(r"Could not find '([^/']+)/([^']+)'", str(exc))
        if m:
            group, option = m.groups()
            options = re.findall(r"^\t(\S+)$", str(exc), flags=re.M)
            return (
                f"Unknown option {option!r} for {group}= (override {line!r}). Available "
                f"{group} presets: {', '.join(options) or 'none'}."
            )
        return f"Cannot load the config for override {line!r}: {_first_line(exc)}."
    if (
        isinstance(cause, ConfigKeyError)
        or "not in struct" in str(cause)
        or (cause is not None and "not in" in str(cause) and "Key" in str(cause))
    ):
        return _unknown_key(key, line)
    if isinstance(cause, ValidationError):
        return (
            f"Setting {key!r} cannot take the value in {line!r}: "
            f"{_first_line(cause)}. Give a value of the setting's type."
        )
    return f"Cannot apply the override {line!r}: {_first_line(exc)}."


def _single_overrides(args: list[str]):
    """Each override line as composed alone: sweep values are expanded one by one."""
    parsed = OverridesParser.create().parse_overrides(args)
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    yield fixed, None
    for o in parsed:
        if o.is_sweep_override():
            for value in o.sweep_string_iterator():
                line = f"{_PREFIX.get(o.type, '')}{o.get_key_element()}={value}"
                yield fixed + [line], line


def precheck(argv: list[str]) -> str | None:
    """A one-paragraph message when the overrides cannot be composed, else None."""
    if any(a.split("=", 1)[0] in _HYDRA_VALUE_FLAGS for a in argv):
        return None
    args = [a for a in argv if not a.startswith("-") and not a.lstrip("+~").startswith("hydra")]
    try:
        combos = list(_single_overrides(args))
    except OverrideParseException as exc:
        bad = next((a for a in args if _parses_badly(a)), " ".join(args))
        return explain(exc, bad)
    except HydraException as exc:
        return f"Cannot expand the sweep in {' '.join(args)!r}: {_first_line(exc)}."
    for lines, line in combos:
        try:
            cfg = compose(lines)
        except Exception as exc:  # noqa: BLE001 - any failure here is a bad override
            culprit = line or _culprit(lines)
            return explain(exc, culprit)
        extra = sorted(set(cfg.keys()) - _FIELDS)
        if extra:  # added with `+key=...`: composes, but nothing would read it
            key = extra[0]
            line = next((ln for ln in lines if ln.lstrip("+").split("=", 1)[0] == key), key)
            return _unknown_key(key, line, ": the selector would ignore it")
    return None


def _parses_badly(arg: str) -> bool:
    try:
        OverridesParser.create().parse_overrides([arg])
        return False
    except OverrideParseException:
        return True


def _culprit(lines: list[str]) -> str:
    """The first override that fails when composed alone (for the error message)."""
    for line in lines:
        try:
            compose([line])
        except Exception:  # noqa: BLE001 - we only look for the line that fails
            return line
    return " ".join(lines)


def _job_overrides() -> list[str] | None:
    """This job's overrides in a multirun (to tell the reports apart), else None."""
    hc = HydraConfig.get()
    if hc.mode is not RunMode.MULTIRUN:
        return None
    return list(hc.overrides.task)


def _emit(text: str) -> None:
    """Print to stdout; a reader that went away (`| head`) is not an error of ours."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Point stdout at /dev/null so the interpreter's final flush stays quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _report(config, plan, findings, *, overrides=None, maxtext=None) -> int:
    """Print one report (text or JSON) and return its exit status."""
    if config.output is OutputFormat.json:
        payload = json.loads(render_json(config, plan, findings, overrides))
        if maxtext is not None:
            payload["maxtext"] = {"files": maxtext.files, "ignored": maxtext.ignored}
        _emit(json.dumps(payload, sort_keys=True))
    else:
        lines = []
        if overrides is not None:
            lines.append(f"=== job: {' '.join(overrides) or '(defaults)'}")
        if maxtext is not None:
            ignored = maxtext.ignored
            more = f", ... ({len(ignored) - 12} more)" if len(ignored) > 12 else ""
            lines.append(f"MaxText config: {' <- '.join(maxtext.files)}")
            lines.append(
                f"Ignored {len(ignored)} MaxText keys the MoE block does not use: "
                f"{', '.join(ignored[:12]) or '-'}{more}\n"
            )
        lines.append(render_text(config, plan, findings))
        _emit("\n".join(lines))
    return EXIT_INVALID if errors_in(findings) else EXIT_OK


class _Job:
    """The Hydra task: reports one composed config and remembers the worst status."""

    def __init__(self) -> None:
        self.status = EXIT_OK

    def __call__(self, cfg: DictConfig) -> None:
        try:
            config = to_config(cfg)
            plan, findings = analyse_any(config)
            status = _report(config, plan, findings, overrides=_job_overrides())
        except (OmegaConfBaseException, ValueError, TypeError) as exc:
            print(f"error: cannot use this config: {_first_line(exc)}", file=sys.stderr)
            status = EXIT_USAGE
        self.status = max(self.status, status)


def maxtext_main(argv: list[str]) -> int:
    """`maxtext_config=PATH [key=value ...]`: check a MaxText config as it is."""
    flags = [a for a in argv if a.startswith("-")]
    if flags:
        print(
            f"error: {' '.join(flags)} cannot be combined with maxtext_config=; the MaxText "
            "route takes key=value overrides only (run one check per setting).",
            file=sys.stderr,
        )
        return EXIT_USAGE
    path = next(a for a in argv if a.startswith("maxtext_config=")).split("=", 1)[1]
    overrides = [a for a in argv if not a.startswith("maxtext_config=")]
    try:
        imported = from_maxtext(path, overrides)
        plan, findings = analyse_any(imported.config)
    except (MaxTextError, ValueError, TypeError) as exc:
        print(f"error: {_first_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    return _report(imported.config, plan, imported.findings + findings, maxtext=imported)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a.startswith("maxtext_config=") for a in argv):
        return maxtext_main(argv)
    message = precheck(argv)
    if message:
        print(f"error: {message}", file=sys.stderr)
        return EXIT_USAGE
    register_schema()
    job = _Job()
    app = hydra.main(version_base=None, config_path=str(conf_dir()), config_name="config")(job)
    saved = sys.argv
    sys.argv = [saved[0] if saved else "selector", *argv]
    try:
        app()
    except SystemExit as exc:  # Hydra's own failures (after our precheck) and --help
        if exc.code not in (0, None):
            return EXIT_USAGE
    finally:
        sys.argv = saved
    return job.status


def entry() -> None:
    """Console script `moe-selector`: same as `python -m selector`."""
    sys.exit(main())
