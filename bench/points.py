"""One benchmark point: build a block (abstractly, so the real models' sizes need no
memory), compile it for the point's chips (XLA:CPU on simulated devices, or XLA:TPU /
XLA:GPU ahead of time: `checks.compiled`), and set XLA's memory figures and cost
analysis beside the selector's."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import jax

import selector
from checks.compiled import compile_plan, read, target_of
from selector.api import analyse_any
from selector.memory_model import held_buffers, program_key
from selector.problem import problem_shape
from selector.traits import jax_release


@dataclass(frozen=True)
class Point:
    strategy: str  # dispatch
    mesh: dict  # axis sizes
    seq: int
    emb: int
    hidden: int
    experts: int
    top_k: int
    exchange: str = "gather"
    dtype: str = "float32"
    param_dtype: str = "float32"
    capacity_factor: float = 1.25
    model: str = "tiny"  # preset the dims override
    extra: tuple = field(default_factory=tuple)
    hardware: str = "cpu"  # hardware preset: the compiler (cpu, v5p, h100, ...)
    mode: str = "train"  # train (fwd+bwd), prefill or decode (forward)
    sequences: int = 1  # sequences per batch shard (decode batches many)

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.values())

    def batch(self) -> int:
        """`sequences` per batch shard (one avoids inflation)."""
        shards = math.prod(self.mesh.get(a, 1) for a in ("data", "fsdp", "expert"))
        return shards * self.sequences

    def overrides(self) -> list[str]:
        cf = self.capacity_factor if self.strategy == "subgroup_capacity" else -1
        return [
            f"model={self.model}",
            "mesh=cpu_8",
            f"hardware={self.hardware}",
            f"mode={self.mode}",
            f"dispatch={self.strategy}",
            f"expert_exchange={self.exchange}",
            f"capacity_factor={cf}",
            f"base_emb_dim={self.emb}",
            f"base_moe_mlp_dim={self.hidden}",
            f"num_experts={self.experts}",
            f"num_experts_per_tok={self.top_k}",
            f"max_target_length={self.seq}",
            f"per_device_batch_size={self.batch() / self.devices}",
            f"dtype={self.dtype}",
            f"param_dtype={self.param_dtype}",
            "context_parallel_load_balance=false",
            "hardware.memory_gib=1000000",
            # Decode batches many sequences a shard on purpose.
            f"allow_local_batch_inflation={str(self.sequences > 1).lower()}",
            *self.extra,
        ]

    def label(self) -> str:
        mesh = ",".join(f"{a}={s}" for a, s in self.mesh.items() if s > 1) or "1 device"
        name = self.strategy + ("/all_to_all" if self.exchange == "all_to_all" else "")
        where = (
            ""
            if (self.hardware, self.mode) == ("cpu", "train")
            else f"{self.hardware} {self.mode} "
        )
        batch = f" x{self.sequences}" if self.sequences > 1 else ""
        return (
            f"{where}{name} [{mesh}] seq={self.seq}{batch} M={self.emb} H={self.hidden} "
            f"E={self.experts} k={self.top_k} {self.dtype}/{self.param_dtype}"
        )


def planned(point: Point):
    """(typed config, plan) for the point on its mesh, errors allowed."""
    cfg = selector.to_config(selector.compose(point.overrides()))
    plan, findings = analyse_any(cfg, point.mesh)
    if plan is None:
        raise selector.ConfigError(findings)
    return cfg, plan


def predicted(point: Point) -> dict:
    """The selector's numbers for the point, from its config and mesh shape alone (no
    jax): arguments, outputs, temp, FLOPs and HBM bytes, and the count of what it holds."""
    return predicted_from(*planned(point))


def predicted_from(cfg, plan) -> dict:
    """`predicted` for a point's typed config and plan, already made."""
    est = plan.chosen_estimate
    shape = problem_shape(cfg, plan.mesh, plan.placement)
    return {
        "name": est.name,
        "key": program_key(plan.strategy, plan.placement.exchange, cfg),
        "tokens_per_device": plan.per_device.tokens_per_device,
        "predicted_arguments": est.memory.arguments,
        "predicted_outputs": est.memory.outputs,
        "predicted_temp": est.memory.temp,
        "predicted_flops": est.flops,
        "predicted_hbm": est.traffic.hbm,
        "held": dataclasses.asdict(
            held_buffers(
                plan.strategy,
                plan.placement.exchange,
                shape,
                cfg.hardware.platform,
                jax_release(cfg.hardware.jax_version),
            )
        ),
    }


def measure(point: Point) -> dict:
    """Compile the point for its chips and return XLA's numbers next to the selector's."""
    cfg, plan = planned(point)
    _, program, target, seconds = compile_plan(cfg, plan, target_of(cfg, point.devices))
    compiled = read(program, plan.chosen_estimate.name, target, seconds)
    return {
        "point": point.label(),
        "strategy": point.strategy,
        "exchange": point.exchange,
        "hardware": point.hardware,
        "mode": point.mode,
        "arguments": compiled.arguments,
        "outputs": compiled.outputs,
        "temp": compiled.temp,
        "flops": compiled.flops,
        "bytes_accessed": compiled.bytes_accessed,
        "compile_s": compiled.seconds,
        **predicted_from(cfg, plan),
    }


def device_count() -> int:
    return jax.device_count()
