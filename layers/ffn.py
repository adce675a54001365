"""SwiGLU expert math shared by the dispatch strategies: (silu(x @ wi_0) * (x @ wi_1)) @ wo.

Legend: B batch, S sequence, T tokens, M embedding, H hidden, E experts, C capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class ExpertWeights:
    """Router and expert weights as the strategies see them (a pytree)."""

    gate_ME: jax.Array
    wi_0_EMH: jax.Array
    wi_1_EMH: jax.Array
    wo_EHM: jax.Array


jax.tree_util.register_dataclass(
    ExpertWeights, data_fields=["gate_ME", "wi_0_EMH", "wi_1_EMH", "wo_EHM"], meta_fields=[]
)


def swiglu(gate_h, up_h):
    return jax.nn.silu(gate_h) * up_h


def expert_swiglu(x, w: ExpertWeights, dtype, x_dims: str, h_dims: str):
    """Every expert's SwiGLU over `x` with einsum labels: x is `{x_dims}m`, the hidden and
    output are `{h_dims}h` / `{h_dims}m` (h_dims names the expert dim e)."""
    wi_0, wi_1, wo = (a.astype(dtype) for a in (w.wi_0_EMH, w.wi_1_EMH, w.wo_EHM))
    xd = x.astype(dtype)
    h = swiglu(
        jnp.einsum(f"{x_dims}m,emh->{h_dims}h", xd, wi_0),
        jnp.einsum(f"{x_dims}m,emh->{h_dims}h", xd, wi_1),
    )
    return jnp.einsum(f"{h_dims}h,ehm->{h_dims}m", h, wo)


def dense_ffn(x_TM, wi_0_MH, wi_1_MH, wo_HM):
    """One SwiGLU MLP over every token (the plain MlpBlock and the one-expert case)."""
    return swiglu(x_TM @ wi_0_MH, x_TM @ wi_1_MH) @ wo_HM
