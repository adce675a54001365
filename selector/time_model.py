"""The fitted time model: the cost model's compute, HBM and network terms scaled by
constants per (compiler family, mode, program), plus a fixed cost per step
(time_model.json beside this module; each entry says its `source`).

- XLA:CPU: fitted on timed programs (`python -m bench.decide --write`).
- XLA:TPU and XLA:GPU: no TPU or GPU has timed a program here yet, so their constants
  come from the compilers' own counts (`python -m bench.decide --from-counts --write`):
  the HBM term scaled by XLA's bytes accessed over the model's HBM bytes, the compute
  term by XLA's FLOPs over the model's where XLA counts all the work, medians over the
  points bench.calibrate compiled. `bench.decide --live HARDWARE --write` on a machine
  with those chips replaces them with constants fitted on timed programs.

A key without an entry keeps the terms as they are (a = b = c = 1, d = 0).
"""

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
