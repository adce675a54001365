"""What a compile or measure check found, as plain data: the API returns it and the
report prints it. The checks themselves need jax and the layers, so they live in the
`checks` package, which the selector finds by entry point (`selector.plugins`); these
types stay here so the selector can read a result without importing them.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

from .config import Dispatch, Exchange
from .cost import Estimate, Memory
from .findings import Finding
from .plan import DispatchPlan

Key = tuple[Dispatch, Exchange]


@dataclass(frozen=True)
class StepCompiled:
    """XLA's memory analysis of the whole training step (`checks.step`), bytes per
    device; params and optimizer are the parts of the arguments they take."""

    arguments: float
    outputs: float
    temp: float
    alias: float  # outputs written into donated arguments
    params: float
    optimizer: float

    @property
    def peak(self) -> float:
        return self.arguments + self.outputs + self.temp - self.alias

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "peak": self.peak}


@dataclass(frozen=True)
class CompiledCandidate:
    """One candidate as estimated and as compiled (bytes per device): its MoE block
    alone, or (`step`) the whole training step of the decoder with it.

    Attributes:
      estimate: the selector's count; as_compiled: the same with XLA's memory and the
        fit that follows.
      flops, bytes_accessed: XLA's cost analysis; seconds: the compile's time here.
      step: the whole step's memory, when the step was compiled.

    Examples (`selector.compile_check` makes them; one built by hand here):
      >>> import selector
      >>> plan = selector.resolve(selector.compose(["model=tiny", "mesh=cpu_8"]))
      >>> from selector.checked import CompiledCandidate
      >>> est = plan.chosen_estimate
      >>> c = CompiledCandidate(est, est, flops=0.0, bytes_accessed=0.0, seconds=0.0)
      >>> c.name, c.temp_error
      ('megablox/gather', 0.0)
    """

    estimate: Estimate
    as_compiled: Estimate  # the estimate with XLA's memory, and the fit that follows
    flops: float  # XLA's cost analysis
    bytes_accessed: float
    seconds: float  # compile time on this machine
    step: StepCompiled | None = None  # the whole step, when it was compiled

    @property
    def name(self) -> str:
        return self.estimate.name

    @property
    def compiled(self) -> Memory:
        """XLA's arguments, outputs and temp (of the whole step, when compiled)."""
        if self.step is not None:
            return Memory(self.step.arguments, self.step.outputs, self.step.temp)
        return self.as_compiled.memory

    @property
    def device_bytes(self) -> float:
        """The state at rest plus the compiled block's peak."""
        return self.as_compiled.device_bytes

    @property
    def fits(self) -> bool:
        return self.as_compiled.fits

    @property
    def temp_error(self) -> float:
        """Estimated temp over compiled, minus one (the block's; nan for a whole step,
        whose temporaries the estimate does not name apart)."""
        if self.step is not None:
            return float("nan")
        return self.estimate.memory.temp / max(self.compiled.temp, 1) - 1

    @property
    def device_error(self) -> float:
        """Estimated over compiled bytes a device holds, minus one."""
        return self.estimate.device_bytes / max(self.device_bytes, 1) - 1

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "estimated": dataclasses.asdict(self.estimate.memory),
            "estimated_device_bytes": self.estimate.device_bytes,
            "estimated_fits": self.estimate.fits,
            "compiled": dataclasses.asdict(self.compiled),
            "device_bytes": self.device_bytes,
            "fits": self.fits,
            "temp_error": None if self.step is not None else self.temp_error,
            "flops": self.flops,
            "estimated_flops": self.estimate.flops,
            "bytes_accessed": self.bytes_accessed,
            "estimated_hbm_bytes": self.estimate.traffic.hbm,
            "compile_seconds": self.seconds,
            "compiled_program": "block" if self.step is None else "whole step",
            "step": None if self.step is None else self.step.as_dict(),
            "estimated_breakdown": self.estimate.device_breakdown,
            "device_error": self.device_error,
        }


@dataclass(frozen=True)
class Recheck:
    """A plan chosen again after the estimate (by compiling or by timing)."""

    plan: DispatchPlan  # its choice follows what was compiled or measured
    estimated_choice: str  # the estimate's choice, before

    @property
    def findings(self) -> tuple[Finding, ...]:
        return self.plan.findings

    @property
    def changed(self) -> bool:
        return self.plan.chosen_estimate.name != self.estimated_choice


@dataclass(frozen=True)
class CompileCheck(Recheck):
    """The plan after compiling, and what was compiled (`selector.compile_check`
    returns it; its example compiles one).

    Attributes:
      plan: the plan chosen again with the compiled numbers.
      estimated_choice: what the estimate alone chose; `changed` says if that moved.
      target: the chips compiled for; compiled: each candidate, estimated and compiled.

    Examples (one built by hand, with nothing compiled):
      >>> import selector
      >>> plan = selector.resolve(selector.compose(["model=tiny", "mesh=cpu_8"]))
      >>> from selector import CompileCheck
      >>> checked = CompileCheck(plan, plan.chosen_estimate.name, target=plan.target)
      >>> checked.changed, checked.as_dict()["choice"]
      (False, 'megablox/gather')
    """

    target: str = ""
    compiled: tuple[CompiledCandidate, ...] = ()

    def as_dict(self) -> dict:
        return {
            "target": self.target,
            "estimated_choice": self.estimated_choice,
            "choice": self.plan.chosen_estimate.name,
            "changed": self.changed,
            "candidates": [c.as_dict() for c in self.compiled],
        }


@dataclass(frozen=True)
class MeasuredCandidate:
    """One candidate as estimated and as timed (seconds per step, every round)."""

    estimate: Estimate
    times: tuple[float, ...]

    @property
    def name(self) -> str:
        return self.estimate.name

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def ratio(self) -> float:
        """Measured over estimated time."""
        return self.median / max(self.estimate.time_s, 1e-12)

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "estimated_s": self.estimate.time_s,
            "estimated_parts_s": self.estimate.time_parts.as_dict(),
            "median_s": self.median,
            "times_s": list(self.times),
            "ratio": self.ratio,
        }


@dataclass(frozen=True)
class MeasureCheck(Recheck):
    """The plan after timing (its choice follows the measured medians), and what was
    timed."""

    hardware: str = ""
    devices: int = 0
    measured: tuple[MeasuredCandidate, ...] = ()

    def as_dict(self) -> dict:
        return {
            "hardware": self.hardware,
            "devices": self.devices,
            "estimated_choice": self.estimated_choice,
            "choice": self.plan.chosen_estimate.name,
            "changed": self.changed,
            "candidates": [c.as_dict() for c in self.measured],
        }
