"""The static description of an MoE block that the dispatch strategies read."""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from selector.derive import capacity

from .expert_parallel import Exchange
from .sharding import Layout


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int
    emb: int
    hidden: int
    norm_topk_prob: bool
    capacity_factor: float  # <= 0: dropless
    dtype: str  # compute dtype name
    gmm_backend: str
    exchange: Exchange | None = None  # expert parallelism; None when weights are gathered

    @classmethod
    def from_config(cls, cfg, plan, layout: Layout) -> MoESpec:
        exchange = None
        if layout.group:
            exchange = Exchange(
                group_axes=layout.group,
                group_size=layout.size(layout.group),
                count_axes=layout.token_axes,
                buffer_factor=cfg.expert_buffer_factor,
                backend=plan.exchange_backend,
                gmm_backend=plan.gmm_backend,
                dtype=jnp.dtype(cfg.dtype),
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
        )

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    def capacity(self, sub_seq: int) -> int:
        """Per-subgroup capacity, the selector's formula on the actual local length."""
        cap = capacity(sub_seq, self.top_k, self.num_experts, self.capacity_factor)
        if cap is None:
            raise ValueError("subgroup_capacity needs capacity_factor > 0")
        return cap
