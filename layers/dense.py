"""Dense dispatch: every local token through every expert, combined with the
top-k-masked router weights. E/k times the routed work: the reference, and cheap for
decode-sized inputs. Runs per device inside shard_map: no token leaves its device.

Legend: B batch, S sequence, T tokens, M embedding, H hidden, E experts, K top-k.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .ffn import ExpertWeights, einsum, expert_swiglu
from .router import partial_stats, route
from .spec import MoESpec
from .vma import varying_like


def local_forward(x_BSM, w: ExpertWeights, spec: MoESpec):
    batch, seq, emb = x_BSM.shape
    x_TM = x_BSM.reshape(batch * seq, emb)
    with jax.named_scope("route"):
        weights_TK, ids_TK, probs_TE = route(x_TM, w, spec)
        combine_TE = jnp.einsum(
            "tk,tke->te", weights_TK, jax.nn.one_hot(ids_TK, spec.num_experts, dtype=jnp.float32)
        )
    dt = spec.compute_dtype
    with jax.named_scope("expert_compute"):
        # Marked varying over the weights' axes first, so the input gradient's partial
        # sums over the axes that split the hidden dim (tensor) are added before they are
        # summed over the mesh: once, not once per matrix that reads the tokens.
        x_TM = varying_like(x_TM, w.wi_0_EMH, w.wi_1_EMH, w.wo_EHM)
        y_TEM = expert_swiglu(x_TM, w, dt, x_dims="t", h_dims="te", platform=spec.platform)
    with jax.named_scope("combine"):
        y_TM = einsum("tem,te->tm", y_TEM, combine_TE.astype(dt), platform=spec.platform)
    return y_TM.reshape(batch, seq, emb).astype(x_BSM.dtype), partial_stats(probs_TE, ids_TK, 0)
