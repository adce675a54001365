"""Findings: what the validator says about a config, each with a stable code.

A finding names the setting, gives the numbers and says the fix. Errors stop
`resolve`; warnings never block.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any


class Severity(str, enum.Enum):
    """How much a finding weighs: an `error` stops `resolve` (and the command exits 1),
    a `warning` never blocks.

    Examples:
      >>> import selector
      >>> cfg = selector.compose(["model=tiny", "mesh=cpu_8", "ici_context_parallelism=4",
      ...                         "per_device_batch_size=1"])
      >>> (found,) = [f for f in selector.validate(cfg) if f.code == "LOCAL_BATCH_INFLATION"]
      >>> found.severity
      <Severity.error: 'error'>
    """

    error = "error"
    warning = "warning"


def render_value(value: Any) -> str:
    """A value as a command-line override spells it (None as Hydra's `null`)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, float):
        # Short where that is exact; otherwise every digit, so that the rendered fix is
        # the fix that was checked (0.01171875 as 0.0117188 made 256 devices' global
        # batch 3.0000128, a fractional batch).
        short = f"{value:g}"
        return short if float(short) == value else repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(render_value(v) for v in value) + "]"
    return str(value)


@dataclass(frozen=True)
class Fix:
    """Overrides that, applied together, make a finding go away (checked before it is
    offered: the selector re-analyses the fixed config).

    Attributes:
      overrides: (key, value) pairs, in the selector's keys.
      note: what the fix changes besides the finding (e.g. the global batch).
      held_bytes, fits: what a device then holds for the whole step, and whether that
        fits the chip (None when not estimated).
      joint: one fix per error merged, offered first on each error it clears.

    Examples:
      >>> import selector
      >>> cfg = selector.compose(["model=tiny", "mesh=cpu_8", "ici_context_parallelism=4",
      ...                         "per_device_batch_size=1"])
      >>> (found,) = [f for f in selector.validate(cfg) if f.code == "LOCAL_BATCH_INFLATION"]
      >>> found.fixes[0].render()
      'per_device_batch_size=0.25'
    """

    overrides: tuple[tuple[str, Any], ...]
    note: str = ""  # what the fix changes besides the finding (e.g. the global batch)
    # What a device then holds (bytes, the whole step) and whether that fits the chip,
    # from the analysis of the fixed config; None when it was not estimated.
    held_bytes: float | None = None
    fits: bool | None = None
    joint: bool = False  # one fix per error merged, offered first on each it clears
    # The fixed config's memory verdict ("yes", "no", "margin": within the estimate's
    # margin, compile to be sure); None when it was not estimated.
    verdict: str | None = None

    def render(self) -> str:
        return " ".join(f"{k}={render_value(v)}" for k, v in self.overrides)

    def text(self) -> str:
        notes = [self.note] if self.note else []
        if self.held_bytes is not None:
            held = f"a device then holds {self.held_bytes / 2**30:.3g} GiB"
            if self.verdict == "margin":
                held += ", within the memory margin"
            notes.append(held)
        return f"{self.render()} ({'; '.join(notes)})" if notes else self.render()


def ranked_fixes(fixes: list[Fix]) -> tuple[Fix, ...]:
    """Fixes lightest first by what a device then holds; once one fits the chip, those
    that leave it over are dropped. A joint fix ("clears A and B together") stays first."""
    if any(f.fits for f in fixes):
        fixes = [f for f in fixes if f.fits is not False]
    joint = [f for f in fixes if f.joint]
    single = [f for f in fixes if not f.joint]
    single.sort(key=lambda f: f.held_bytes if f.held_bytes is not None else float("inf"))
    return (*joint, *single)


# Of a finding's fixes that all failed, how many its message names.
TRIED_SHOWN = 3


def fix(note: str = "", **overrides: Any) -> Fix:
    """A Fix from keyword overrides; nested keys use '__' (axis_rules__sequence)."""
    return Fix(tuple((k.replace("__", "."), v) for k, v in overrides.items()), note)


@dataclass(frozen=True)
class Finding:
    """What the validator says about one setting: a stable code, the severity, the
    setting to change, a one-paragraph message with the numbers, and the fixes that
    were checked to clear it.

    Attributes:
      code: stable (e.g. "LOCAL_BATCH_INFLATION"); tests and launch scripts key on it.
      severity, setting, message, fixes: as named; the comment beside each field says
        more, and beside the others (tail, base, no_fix, tried).

    Examples:
      >>> import selector
      >>> cfg = selector.compose(["model=tiny", "mesh=cpu_8", "ici_context_parallelism=4",
      ...                         "per_device_batch_size=1"])
      >>> (found,) = [f for f in selector.validate(cfg) if f.code == "LOCAL_BATCH_INFLATION"]
      >>> found.setting, found.fixes[0].render()
      ('per_device_batch_size', 'per_device_batch_size=0.25')
    """

    code: str  # stable, e.g. "LOCAL_BATCH_INFLATION"; tests and launch scripts key on it
    severity: Severity
    setting: str  # the knob to change
    message: str  # one paragraph: what, the numbers, the fix
    fixes: tuple[Fix, ...] = ()  # verified overrides, each removing this finding
    tail: str = ""  # advice after the fixes (appended to the message once verified)
    base: str = ""  # the message before its fixes were spelled into it
    # Why no override can clear it (said when no fix survives the check): every error
    # offers a fix that works or says why there is none.
    no_fix: str = ""
    # Every fix proposed before the check kept those in `fixes`: another route (MaxText's
    # keys move more than ours) checks them again by its own re-run.
    tried: tuple[Fix, ...] = ()

    def __str__(self) -> str:
        return f"[{self.severity.value}] {self.code} ({self.setting}): {self.message}"

    def as_dict(self) -> dict:
        return {
            "code": self.code,
            "severity": self.severity.value,
            "setting": self.setting,
            "message": self.message,
            "fixes": [f.render() for f in self.fixes],
            # The same fixes for a script: what each sets, what a device then holds, and
            # the memory verdict then (yes, no, or margin: compile to be sure).
            "fix_details": [
                {
                    "overrides": {k: render_value(v) for k, v in f.overrides},
                    "note": f.note,
                    "device_gib": None if f.held_bytes is None else f.held_bytes / 2**30,
                    "verdict": f.verdict,
                }
                for f in self.fixes
            ],
            **({"no_fix": self.no_fix} if self.no_fix and not self.fixes else {}),
        }

    def with_fixes(self, verified: tuple[Fix, ...], failed: tuple[Fix, ...] = ()) -> Finding:
        """The finding with only the verified fixes, spelled out in its message (a
        finding whose fixes were spelled already is spelled again from its base). With
        none verified, its reason (`no_fix`), else the fixes run that did not hold (`failed`),
        named: a finding never loses its way out without a word."""
        base = self.base or self.message
        text = base
        no_fix = self.no_fix
        if not verified and not no_fix and failed:
            # A fix run and dropped says, as its note, what it left (the fix search's).
            said = all(f.note for f in failed)
            parts = [f"{f.render()} {f.note}" if said else f.render() for f in failed]
            shown = "; ".join(parts[:TRIED_SHOWN])
            if len(failed) > TRIED_SHOWN:
                shown += f"; and {len(failed) - TRIED_SHOWN} more"
            no_fix = (
                f"No fix was found: {shown}."
                if said
                else f"No fix was found: each one checked ({shown}) leaves it standing or "
                "adds an error."
            )
        if verified:
            text += " Fix: " + "; or ".join(f.text() for f in verified) + "."
        elif no_fix:
            text += " " + no_fix
        if self.tail:
            text += " " + self.tail
        return dataclasses.replace(self, message=text, fixes=verified, base=base, no_fix=no_fix)


def shown(text, limit: int = 120) -> str:
    """`text` as a message may quote it: one line, at most `limit` characters (a
    100,000-digit value is not echoed back whole)."""
    text = str(text).replace("\n", " ")
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def error(
    code: str, setting: str, message: str, fixes=(), tail: str = "", no_fix: str = ""
) -> Finding:
    """An error finding: `fixes` to try, or `no_fix` saying why no override can help."""
    return Finding(code, Severity.error, setting, message, tuple(fixes), tail, "", no_fix)


def warning(
    code: str, setting: str, message: str, fixes=(), tail: str = "", no_fix: str = ""
) -> Finding:
    """A warning finding: `fixes` to try, or `no_fix` saying why no override can help."""
    return Finding(code, Severity.warning, setting, message, tuple(fixes), tail, "", no_fix)


def errors_in(findings) -> list[Finding]:
    return [f for f in findings if f.severity is Severity.error]


class ConfigError(ValueError):
    """Raised by `resolve` when a config has error findings; carries all of them
    (`findings`), and its message lists each.

    Examples:
      >>> import selector
      >>> cfg = selector.compose(["model=tiny", "mesh=cpu_8", "ici_context_parallelism=4",
      ...                         "per_device_batch_size=1"])
      >>> try:
      ...     selector.resolve(cfg)
      ... except selector.ConfigError as error:
      ...     print([f.code for f in error.findings])
      ['LOCAL_BATCH_INFLATION']
    """

    def __init__(self, findings):
        self.findings = tuple(findings)
        lines = [f"{len(errors_in(self.findings))} configuration error(s):"]
        lines += [f"  {f}" for f in self.findings]
        super().__init__("\n".join(lines))
