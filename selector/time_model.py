"""The fitted time model: the cost model's compute, HBM and network terms scaled by
constants fitted on timed programs, per (compiler family, mode, program), plus a fixed
cost per step (`python -m bench.decide --write` fits them on XLA:CPU; time_model.json
beside this module). A key without a fit keeps the terms as they are (a = b = c = 1,
d = 0): so far only XLA:CPU programs have been timed here, no TPU or GPU."""

from __future__ import annotations

import json
from pathlib import Path

TIME_MODEL_FILE = Path(__file__).with_name("time_model.json")
TIME_MODEL: dict[str, dict[str, float]] = json.loads(TIME_MODEL_FILE.read_text())


def fitted_parts(key: str, parts: tuple[float, float, float]) -> tuple[float, float, float]:
    """(compute + the fixed cost per step, HBM, network) seconds under the fit for the
    calibration `key` (`cpu train megablox`), or `parts` unchanged without one."""
    coef = TIME_MODEL.get(key)
    if coef is None:
        return parts
    compute, hbm, network = parts
    return (
        coef["compute"] * compute + coef["step"],
        coef["hbm"] * hbm,
        coef["network"] * network,
    )
