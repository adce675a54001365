"""The static description of an MoE block that the dispatch strategies read."""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from selector.config import CapacityRounding
from selector.plan_sizes import shared_width

from .expert_parallel import ExchangeGroup
from .sharding import Layout


@dataclass(frozen=True)
class MoESpec:
    """What the dispatch strategies read of a block, fixed when it is built: the model's
    sizes and routing, the grouped matmul and the exchange (None when the weights are
    gathered), and the plan's capacity. `MoESpec.from_config(cfg, plan, layout)` makes
    it.

    Attributes:
      num_experts, top_k, emb, hidden, norm_topk_prob, score_func, routed_*,
        n_routing_groups, topk_routing_group, shared_*: the model's MoE (MaxText's keys).
      capacity_factor, capacity_rounding, capacity_per_subgroup, subgroup_len: the
        capacity path's slots, as the plan counted them.
      dtype, gmm_backend, gmm_row_tile, platform: how the grouped matmul runs.
      exchange: the expert group's exchange (None when the weights are gathered).

    Examples:
      >>> import layers, selector
      >>> plan = selector.resolve(selector.compose(["model=tiny", "mesh=cpu_8",
      ...     "ici_context_parallelism=4", "per_device_batch_size=0.25"]))
      >>> from flax import nnx
      >>> block = layers.MoEBlock(plan, mesh=layers.mesh_for_plan(plan), rngs=nnx.Rngs(0))
      >>> block.spec.num_experts, block.spec.top_k, block.spec.exchange is None
      (8, 2, True)
    """

    num_experts: int
    top_k: int
    emb: int
    hidden: int
    norm_topk_prob: bool
    capacity_factor: float  # <= 0: dropless
    dtype: str  # compute dtype name
    gmm_backend: str
    exchange: ExchangeGroup | None = None  # expert parallelism; None when weights are gathered
    score_func: str = "softmax"  # or "sigmoid"
    routed_bias: bool = False
    routed_scaling_factor: float = 1.0
    n_routing_groups: int = -1
    topk_routing_group: int = -1
    shared_experts: int = 0  # how many; their width: selector.plan_sizes.shared_width
    shared_expert_gate: bool = False
    capacity_rounding: CapacityRounding = CapacityRounding.ours
    platform: str = "cpu"  # of the mesh's devices: the grouped matmul's kernel follows it
    # The plan's per-subgroup capacity (None when dropless) and the subgroup length it
    # was computed for: the capacity path uses the plan's number, never a second formula.
    capacity_per_subgroup: int | None = None
    subgroup_len: float = 0.0
    # The grouped matmul's rows a tile, as the plan chose it (`plan.gmm_tiling.tm`;
    # None: the kernel's default, for a plan whose dispatch runs no grouped matmul).
    gmm_row_tile: int | None = None

    @classmethod
    def from_config(cls, cfg, plan, layout: Layout) -> MoESpec:
        row_tile = None if plan.gmm_tiling is None else plan.gmm_tiling.tm
        exchange = None
        if layout.group:
            exchange = ExchangeGroup(
                group_axes=layout.group,
                group_size=layout.size(layout.group),
                count_axes=layout.token_axes,
                buffer_factor=cfg.expert_buffer_factor,
                backend=plan.exchange_backend,
                gmm_backend=plan.gmm_backend,
                dtype=jnp.dtype(cfg.dtype),
                platform=layout.platform,
                row_tile=row_tile,
            )
        return cls(
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.base_emb_dim,
            cfg.base_moe_mlp_dim,
            cfg.norm_topk_prob,
            cfg.capacity_factor,
            cfg.dtype,
            plan.gmm_backend,
            exchange,
            cfg.routed_score_func.value,
            cfg.routed_bias,
            cfg.routed_scaling_factor,
            cfg.n_routing_groups,
            cfg.topk_routing_group,
            cfg.shared_experts,
            cfg.shared_expert_gate,
            cfg.capacity_rounding,
            layout.platform,
            plan.per_device.capacity_per_subgroup,
            plan.per_device.sub_seq,
            row_tile,
        )

    @property
    def shared_hidden(self) -> int:
        return int(shared_width(self.shared_experts, self.hidden, self.shared_expert_gate))

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    def capacity(self, sub_seq: int) -> int:
        """The plan's per-subgroup capacity, for a subgroup of `sub_seq` tokens: the
        length the plan was resolved for, or an error."""
        if self.capacity_per_subgroup is None:
            raise ValueError("subgroup_capacity needs capacity_factor > 0")
        if sub_seq != self.subgroup_len:
            raise ValueError(
                f"a subgroup of {sub_seq} tokens; the plan's capacity "
                f"({self.capacity_per_subgroup}) is for {self.subgroup_len:g}: resolve the "
                "plan for this input"
            )
        return self.capacity_per_subgroup
