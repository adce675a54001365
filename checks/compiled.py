"""One candidate of a plan compiled for the chips its config names, ahead of time on this
machine (XLA:TPU through libtpu, XLA:GPU through JAX's CUDA plugin, XLA:CPU on simulated
devices), and what the compiler says about it: memory by XLA's categories, FLOPs and
bytes accessed by XLA's cost analysis.

Nothing here runs: the block is built abstractly (`nnx.eval_shape`, so the real models'
sizes need no memory) and its program lowered from abstract inputs at the config's
shape: fwd+bwd when training, the forward when prefilling or decoding.
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass
from typing import Any

import jax

import selector
from layers import MoEBlock
from layers.programs import compile_forward, compile_fwd_bwd
from layers.sharding import mesh_for_plan
from selector import targets
from selector.api import analyse_any

from .targets import devices


@dataclass(frozen=True)
class CompiledBlock:
    """XLA's numbers for one compiled block program, per device."""

    name: str  # the candidate: dispatch (and megablox's exchange)
    target: str  # the chips compiled for, in words
    arguments: int  # bytes, XLA's memory analysis
    outputs: int
    temp: int
    alias: int  # outputs that share an argument's buffer
    flops: float  # XLA's cost analysis (0 where the compiler reports none)
    bytes_accessed: float
    seconds: float  # lowering and compiling, wall time on this machine

    @property
    def peak(self) -> int:
        return self.arguments + self.outputs + self.temp - self.alias

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "peak": self.peak}


def target_of(config: selector.Config, num_devices: int) -> targets.Target:
    """The chips a config describes: its hardware preset, device count and slices."""
    return targets.Target.from_hardware(config.hardware.name, num_devices, config.num_slices)


def compile_plan(cfg: Any, plan: selector.DispatchPlan, target: targets.Target | None = None):
    """(abstract block, compiled program, target, seconds) of `plan`'s block for `cfg`
    on `target` (default: the chips the config names), at the plan's global batch and
    sequence. The plan may carry errors (a candidate the estimate says does not fit is
    compiled all the same: that is what the check is for)."""
    from flax import nnx

    config = selector.to_config(cfg)
    target = target or target_of(config, plan.mesh.num_devices)
    mesh = mesh_for_plan(plan, devices(target))
    block = nnx.eval_shape(lambda: MoEBlock(config, mesh=mesh, plan=plan, rngs=nnx.Rngs(0)))
    dev = plan.per_device
    batch = round(dev.global_batch)
    options = target.compile_options()
    start = time.perf_counter()
    if config.mode is selector.Mode.train:
        program = compile_fwd_bwd(block, batch, dev.seq_len, compiler_options=options)
    else:
        program = compile_forward(block, batch, dev.seq_len, compiler_options=options)
    seconds = time.perf_counter() - start
    return block, program, target, seconds


def read(program, name: str, target: targets.Target, seconds: float) -> CompiledBlock:
    """XLA's memory and cost analyses of a compiled program."""
    m = program.memory_analysis()
    cost = cost_analysis(program)
    return CompiledBlock(
        name=name,
        target=target.describe(),
        arguments=m.argument_size_in_bytes,
        outputs=m.output_size_in_bytes,
        temp=m.temp_size_in_bytes,
        alias=m.alias_size_in_bytes,
        flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        seconds=seconds,
    )


def cost_analysis(program) -> dict:
    """XLA's cost analysis of a compiled program. XLA:GPU's compile-only client reports
    none, so there XLA's generic analysis (HloCostAnalysis, through the CPU client) is
    run on the GPU's optimized HLO; a loop body counts once, whatever its trip count."""
    try:
        cost = program.cost_analysis()
    except Exception:  # noqa: BLE001 - a compiler without a cost analysis reports nothing
        cost = {}
    if isinstance(cost, list | tuple):  # older jax: one dict per program
        cost = cost[0] if cost else {}
    if cost and cost.get("flops"):
        return dict(cost)
    from jax._src.lib import _jax  # the analysis has no public spelling (jax 0.10)
    from jaxlib import _hlo

    # jax 0.12.0.1's XLA:GPU prints collectives with an attribute its own HLO parser
    # rejects (output_to_operand_aliasing on all-reduce-start); it names buffer reuse,
    # which the cost analysis does not read.
    text = _OPERAND_ALIASING.sub("", program.as_text())
    try:
        module = _hlo.hlo_module_from_text(text)
    except Exception:  # noqa: BLE001 - text this jaxlib cannot read: no cost, not a crash
        return {}
    return dict(_jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module))


_OPERAND_ALIASING = re.compile(
    r", output_to_operand_aliasing=\{(?:\{[^{}]*\}: \(\d+, \{[^{}]*\}\)(?:, )?)*\}"
)


def candidate_plan(
    plan: selector.DispatchPlan, strategy: selector.Dispatch, exchange: selector.Exchange
) -> selector.DispatchPlan:
    """`plan` with one of its candidates chosen: the block `dispatch=` and
    `expert_exchange=` would force. Mesh, per-device numbers and backends do not depend
    on the choice; the candidate carries its own placement."""
    chosen = plan.candidate(strategy, exchange)
    return dataclasses.replace(
        plan,
        strategy=strategy,
        placement=chosen.placement,
        candidates=tuple(dataclasses.replace(c, chosen=c is chosen) for c in plan.candidates),
    )


def compile_candidate(
    cfg: Any,
    strategy: selector.Dispatch,
    exchange: selector.Exchange = selector.Exchange.gather,
    target: targets.Target | None = None,
    *,
    plan: selector.DispatchPlan | None = None,
) -> CompiledBlock:
    """Compile one (dispatch, exchange) candidate of `cfg` for its chips (or `target`)
    and return XLA's numbers. The candidate is taken from `plan`, the config's plan,
    when given; otherwise the config is analysed with it forced, as `dispatch=` and
    `expert_exchange=` would force it."""
    config = selector.to_config(cfg).replace(dispatch=strategy, expert_exchange=exchange)
    if plan is not None:
        plan = candidate_plan(plan, strategy, exchange)
    else:
        plan, findings = analyse_any(config)
        if plan is None:
            raise selector.ConfigError(findings)
    _, program, target, seconds = compile_plan(config, plan, target)
    return read(program, plan.chosen_estimate.name, target, seconds)
