"""One benchmark point: build a block (abstractly, so the real models' sizes need no
memory), compile its fwd+bwd, and set XLA's memory figures beside the selector's."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import jax
from flax import nnx

import layers
import selector
from layers.programs import compile_fwd_bwd
from selector.cost import calibration_key, memory_parts, problem_shape


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

    @property
    def devices(self) -> int:
        return math.prod(self.mesh.values())

    def batch(self) -> int:
        """One sequence per batch shard: the global batch that avoids inflation."""
        shards = math.prod(self.mesh.get(a, 1) for a in ("data", "fsdp", "expert"))
        return shards

    def overrides(self) -> list[str]:
        cf = self.capacity_factor if self.strategy == "subgroup_capacity" else -1
        return [
            f"model={self.model}",
            "mesh=cpu_8",
            "hardware=cpu",
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
            *self.extra,
        ]

    def label(self) -> str:
        mesh = ",".join(f"{a}={s}" for a, s in self.mesh.items() if s > 1) or "1 device"
        name = self.strategy + ("/all_to_all" if self.exchange == "all_to_all" else "")
        return (
            f"{name} [{mesh}] seq={self.seq} M={self.emb} H={self.hidden} E={self.experts} "
            f"k={self.top_k} {self.dtype}/{self.param_dtype}"
        )


def predicted(point: Point) -> dict:
    """The selector's numbers for the point, from its config and mesh shape alone (no
    jax): arguments, outputs, temp and the hand counts behind temp."""
    cfg = selector.to_config(selector.compose(point.overrides()))
    plan = selector.resolve(cfg, point.mesh)
    est = plan.chosen_estimate
    shape = problem_shape(cfg, plan.mesh, plan.per_device, plan.placement)
    return {
        "name": est.name,
        "key": calibration_key(plan.strategy, plan.placement.exchange, cfg),
        "tokens_per_device": plan.per_device.tokens_per_device,
        "predicted_arguments": est.memory.arguments,
        "predicted_outputs": est.memory.outputs,
        "predicted_temp": est.memory.temp,
        "parts": memory_parts(plan.strategy, plan.placement.exchange, shape),
    }


def measure(point: Point) -> dict:
    """Compile the point's fwd+bwd and return XLA's bytes next to the selector's."""
    mesh = layers.make_mesh(point.mesh)
    cfg = selector.compose(point.overrides())
    block = nnx.eval_shape(lambda: layers.MoEBlock(cfg, mesh=mesh, rngs=nnx.Rngs(0)))
    m = compile_fwd_bwd(block, point.batch(), point.seq).memory_analysis()
    return {
        "point": point.label(),
        "strategy": point.strategy,
        "exchange": point.exchange,
        "arguments": m.argument_size_in_bytes,
        "outputs": m.output_size_in_bytes,
        "temp": m.temp_size_in_bytes,
        **predicted(point),
    }


def device_count() -> int:
    return jax.device_count()
