"""A time calibration measured on a user's devices (`measure=true measure_save=PATH`):
per program (dense, megablox, megablox_exchanged, subgroup_capacity), the median of
measured over estimated time; `time_calibration=PATH` scales the estimates by it.

The file is JSON: {"hardware": name, "ratios": {program: ratio}, "measured": [...]}.
A program the file has no ratio for keeps the model's time (scale 1).
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path


class TimeCalibrationError(ValueError):
    """The file cannot be used (unreadable, not a calibration, another hardware)."""


@functools.cache
def _load(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TimeCalibrationError(f"time_calibration={path!r} cannot be read ({exc})") from None
    ratios = data.get("ratios") if isinstance(data, dict) else None
    if not isinstance(ratios, dict) or not all(
        isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in ratios.values()
    ):
        raise TimeCalibrationError(
            f"time_calibration={path!r} is not a time calibration (no positive 'ratios' per "
            "program); write one with measure=true measure_save=PATH"
        )
    return data


def load(path: str, hardware: str) -> dict[str, float]:
    """The ratios of the calibration at `path`, checked to be for `hardware`."""
    data = _load(path)
    if data.get("hardware") != hardware:
        raise TimeCalibrationError(
            f"time_calibration={path!r} was measured on hardware={data.get('hardware')!r}, "
            f"not {hardware!r}: measure on this hardware or drop time_calibration"
        )
    return {str(k): float(v) for k, v in data["ratios"].items()}


def scale(path: str, hardware: str, program: str) -> float:
    """The factor for one program's estimated time (1 without a calibration)."""
    if not path:
        return 1.0
    return load(path, hardware).get(program, 1.0)
