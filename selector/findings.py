"""Findings: what the validator says about a config, each with a stable code.

A finding names the setting, gives the numbers and says the fix. Errors stop
`resolve`; warnings never block.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Severity(str, enum.Enum):
    error = "error"
    warning = "warning"


@dataclass(frozen=True)
class Finding:
    code: str  # stable, e.g. "LOCAL_BATCH_INFLATION"; tests and launch scripts key on it
    severity: Severity
    setting: str  # the knob to change
    message: str  # one paragraph: what, the numbers, the fix

    def __str__(self) -> str:
        return f"[{self.severity.value}] {self.code} ({self.setting}): {self.message}"

    def as_dict(self) -> dict:
        return {
            "code": self.code,
            "severity": self.severity.value,
            "setting": self.setting,
            "message": self.message,
        }


def error(code: str, setting: str, message: str) -> Finding:
    return Finding(code, Severity.error, setting, message)


def warning(code: str, setting: str, message: str) -> Finding:
    return Finding(code, Severity.warning, setting, message)


def errors_in(findings) -> list[Finding]:
    return [f for f in findings if f.severity is Severity.error]


class ConfigError(ValueError):
    """Raised by `resolve` when a config has error findings; carries all of them."""

    def __init__(self, findings):
        self.findings = tuple(findings)
        lines = [f"{len(errors_in(self.findings))} configuration error(s):"]
        lines += [f"  {f}" for f in self.findings]
        super().__init__("\n".join(lines))
