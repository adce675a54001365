"""SwiGLU expert math shared by the dispatch strategies: (silu(x @ wi_0) * (x @ wi_1)) @ wo.

Legend: B batch, S sequence, T tokens, M embedding, H hidden, E experts, C capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax


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


def dense_ffn(x_TM, wi_0_MH, wi_1_MH, wo_HM):
    """One SwiGLU MLP over every token (the plain MlpBlock and the one-expert case)."""
    return swiglu(x_TM @ wi_0_MH, x_TM @ wi_1_MH) @ wo_HM
